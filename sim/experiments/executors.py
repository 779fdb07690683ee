"""Where sweep configurations run: in this process, in local worker processes, or on a Ray cluster.

Work travels as plain specs (trace spec + size arguments, policy name + params, budgets) so that every
executor computes exactly the same rows; workers cache loaded traces per process. Each worker process or Ray
task runs with its share of the cores (``sim.replay.threads``).

A configuration may also run as several jobs, one per group of its layers (``Executor.run_split``,
``--split-layers N``): the policy's allocation over all layers is computed once in the process that splits it
and travels with each group (``sim.replay.layer_groups.LayerGroup``); the groups' results are merged back into one result,
identical to the unsplit run.
"""
from __future__ import annotations

import time
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Sequence

from policies import Policy, get_policy
from sim.experiments.specs import open_trace, trace_id, trace_name
from sim.replay.layer_groups import LayerGroup, layer_groups, merge_layer_groups
from sim.replay.layer_inputs import layer_inputs
from sim.replay.plan import check_chunk, effective_chunk
from sim.replay.policy_replay import replay_budgets
from sim.replay.result import ReplayResult
from sim.replay.threads import ThreadPlan, available_cores, limit_threads, plan_threads, thread_env

_TRACE_CACHE: dict[tuple, Any] = {}


@dataclass(frozen=True)
class TraceRef:
    """How to (re)open a trace in any process: a directory or ``synthetic:KIND`` plus generator sizes, whether
    to verify the files' checksums and finiteness (``--no-verify`` travels with the work), and what a policy
    does on a hybrid model's sliding-window layers (``sim.replay.plan.SLIDING_MODES``) and the prompt chunk of
    chunked prefill (``sim.replay.plan.effective_chunk``)."""

    spec: str
    n_tokens: int = 1024
    n_prompt: int = 128
    n_layers: int = 2
    seed: int = 0
    verify: bool = True
    sliding: str = "keep"
    chunk: int = 1

    def open(self):
        key = (self.spec, self.n_tokens, self.n_prompt, self.n_layers, self.seed, self.verify)
        if key not in _TRACE_CACHE:
            _TRACE_CACHE.clear()             # one trace per worker at a time bounds memory
            trace = open_trace(self.spec, n_tokens=self.n_tokens, n_prompt=self.n_prompt, n_layers=self.n_layers,
                               seed=self.seed, verify=self.verify)
            _TRACE_CACHE[key] = (trace, layer_inputs(trace))
        return _TRACE_CACHE[key]


@dataclass(frozen=True)
class Job:
    """One unit of work: a policy at one or more budgets (several for one-pass strategies such as the oracle's),
    over every layer it compresses or, with ``group``, one group of them (``split_job``). The group is left out
    of comparisons: a group's job is the same configuration as the job it was split from."""

    trace: TraceRef
    policy: str
    params: tuple[tuple[str, Any], ...]
    budgets: tuple[int, ...]
    keys: tuple[str, ...]
    meta: dict = field(default_factory=dict, hash=False, compare=False)
    group: LayerGroup | None = field(default=None, compare=False)

    def make_policy(self) -> Policy:
        """The job's policy, built from its name and parameters."""
        return get_policy(self.policy, **dict(self.params))


def replay_job(job: Job) -> tuple[list[ReplayResult], float]:
    """Replay a job's configuration (its layer group only, when it has one): one result per budget, in order,
    and the seconds the replay took."""
    trace, inputs = job.trace.open()
    policy = job.make_policy()
    t0 = time.perf_counter()
    results = replay_budgets(trace, policy, job.budgets, inputs=inputs, sliding=job.trace.sliding,
                             chunk=effective_chunk(policy, job.trace.chunk), group=job.group)
    return results, time.perf_counter() - t0


def job_rows(job: Job, results: Sequence[ReplayResult], seconds: float) -> list[dict[str, Any]]:
    """The job's result rows, one per budget: each result's summary plus what identifies the configuration, and
    ``elapsed_s``, the replay's seconds per budget (summed over the layer groups of a split configuration)."""
    trace, _ = job.trace.open()
    policy = job.make_policy()
    chunk = effective_chunk(policy, job.trace.chunk)
    rows = []
    for key, budget, res in zip(job.keys, job.budgets, results):
        row = res.summary()
        row.update(key=key, trace=trace_name(trace), trace_id=trace_id(trace), policy=policy.name,
                   label=policy.label(), params=dict(policy.params), budget=budget, n_tokens=trace.meta.n_tokens,
                   sliding=job.trace.sliding, prefill_chunk=chunk, elapsed_s=seconds / len(results), **job.meta)
        rows.append(row)
    return rows


def run_job(job: Job) -> list[dict[str, Any]]:
    """Evaluate a job and return one result row per budget (pure function of the job)."""
    return job_rows(job, *replay_job(job))


def run_group(job: Job) -> tuple[Job, list[ReplayResult], float]:
    """A layer group's job, run where the executor puts it: the job (to match it to its configuration), its
    per-budget results for the group's layers and the seconds they took."""
    return (job, *replay_job(job))


def split_job(job: Job, n_groups: int) -> list[Job]:
    """``job`` as ``n_groups`` jobs of consecutive layers (``sim.replay.layer_groups.layer_groups``): the allocation over all
    its layers is computed here, once, and each job carries its group's rows of it."""
    trace, inputs = job.trace.open()
    groups = layer_groups(trace, job.make_policy(), job.budgets, n_groups, inputs=inputs, sliding=job.trace.sliding)
    return [replace(job, group=g) for g in groups]


def _init_worker(threads: int) -> None:
    """A worker process (or the in-process executor) starts by capping its thread pools at its share."""
    limit_threads(threads)
    warnings.filterwarnings("ignore", message="First-class function type feature is experimental")


def _run_ray_task(fn: Callable[[Job], Any], job: Job, threads: int) -> Any:
    """A Ray task: the process Ray gave it may have run other work, so the cap is applied per task."""
    _init_worker(threads)
    return fn(job)


class Executor:
    """Runs jobs where the user asked: in this process (``workers=1``), in local worker processes kept alive
    across ``run`` calls (so a search's batches reuse warm workers), or on a Ray cluster.

    Threads are budgeted here and only here (``sim.replay.threads``): each local worker gets ``threads`` (default:
    the cores divided among the workers) and caps its numba, BLAS and torch pools at that; each Ray task
    declares ``num_cpus=threads`` (default 1) so Ray's scheduler never puts more threads on a node than it has
    cores, and caps its pools the same way. Use as a context manager.
    """

    def __init__(self, *, workers: int = 1, ray_address: str | None = None, threads: int | None = None) -> None:
        self.ray_address = ray_address
        self.plan: ThreadPlan = plan_threads(max(1, workers), threads, ray=bool(ray_address))
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "Executor":
        return self

    @property
    def in_process(self) -> bool:
        """Whether jobs run in this process (one worker, no Ray)."""
        return not self.ray_address and self.plan.workers <= 1

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def run(self, jobs: list[Job], fn: Callable[[Job], Any] = run_job) -> Iterator[Any]:
        """Yield ``fn(job)`` (by default the job's rows) for each job as soon as it finishes (order not
        guaranteed). ``fn`` must be a picklable module-level function."""
        if self.ray_address:
            yield from self._run_ray(jobs, fn)
        elif self.plan.workers <= 1:
            _init_worker(self.plan.threads)
            for job in jobs:
                yield fn(job)
        else:
            yield from self._run_pool(jobs, fn)

    def run_split(self, jobs: list[Job], n_groups: int) -> Iterator[tuple[Job, list[ReplayResult], float]]:
        """Run each job's configuration as ``n_groups`` jobs of consecutive layers (``split_job``, all split
        here before any runs, so a bad ``n_groups`` fails at once) and yield (job, its results in budget order,
        the replay seconds summed over its groups) as soon as the job's last group is back."""
        groups = {job: split_job(job, n_groups) for job in jobs}
        parts: dict[Job, list[list[ReplayResult]]] = {job: [] for job in jobs}
        seconds = dict.fromkeys(jobs, 0.0)
        for done, results, secs in self.run([g for gs in groups.values() for g in gs], fn=run_group):
            job = replace(done, group=None)          # equal to the job it was split from
            parts[job].append(results)
            seconds[job] += secs
            if len(parts[job]) == len(groups[job]):
                trace, _ = job.trace.open()
                yield job, [merge_layer_groups(trace, by_budget) for by_budget in zip(*parts.pop(job))], seconds[job]

    def _run_pool(self, jobs: list[Job], fn: Callable[[Job], Any]) -> Iterator[Any]:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.plan.workers, initializer=_init_worker,
                                             initargs=(self.plan.threads,))
        pending: set[Future] = set()
        queue = list(reversed(jobs))
        while queue or pending:
            while queue and len(pending) < 2 * self.plan.workers:
                pending.add(self._pool.submit(fn, queue.pop()))
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                yield fut.result()

    def _run_ray(self, jobs: list[Job], fn: Callable[[Job], Any]) -> Iterator[Any]:
        yield from ray_map(fn, jobs, address=self.ray_address, threads=self.plan.threads)


def ray_map(fn: Callable[[Any], Any], items: Sequence[Any], *, address: str, threads: int = 1,
            gpus: float = 0) -> Iterator[Any]:
    """``fn(item)`` for every item as a Ray task on the cluster at ``address`` (``local`` starts one here),
    results in the order they finish. Each task declares ``num_cpus=threads`` and ``num_gpus=gpus`` to Ray's
    scheduler and caps its thread pools at ``threads`` (``_run_ray_task``); ``fn`` must be importable there."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'kvsim[ray]'") from None
    if not ray.is_initialized():
        if address == "local":
            ray.init(include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    remote = ray.remote(num_cpus=threads, num_gpus=gpus, runtime_env={"env_vars": thread_env(threads)})(_run_ray_task)
    refs = [remote.remote(fn, item, threads) for item in items]
    while refs:
        done, refs = ray.wait(refs, num_returns=1)
        yield ray.get(done[0])


def execute(jobs: list[Job], *, workers: int = 1, ray_address: str | None = None, threads: int | None = None,
            split_layers: int = 1) -> Iterator[list[dict[str, Any]]]:
    """Run ``jobs`` once on a fresh ``Executor`` (see there) and yield each job's rows as it finishes; with
    ``split_layers`` > 1, each job's configuration runs as that many layer groups (``Executor.run_split``)."""
    with Executor(workers=workers, ray_address=ray_address, threads=threads) as ex:
        if split_layers == 1:
            yield from ex.run(coalesce(jobs) if ex.in_process else jobs)
            return
        for job, results, seconds in ex.run_split(jobs, split_layers):
            yield job_rows(job, results, seconds)


def coalesce(jobs: Sequence[Job]) -> list[Job]:
    """The jobs with every budget of one (trace, policy with its parameters) in one job, in first-seen order: in
    one process, `sim.replay.policy_replay.replay_budgets` replays a policy's budgets in one pass over the layers, where separate
    jobs would walk the trace once each. (Worker processes and Ray keep one job per budget: the parallelism.)"""
    merged: dict[tuple, Job] = {}
    for job in jobs:
        key = (job.trace, job.policy, job.params, job.group)
        if key in merged:
            prev = merged[key]
            merged[key] = replace(prev, budgets=prev.budgets + job.budgets, keys=prev.keys + job.keys)
        else:
            merged[key] = job
    return list(merged.values())


def replay_split(ref: TraceRef, policy: Policy, budget: int, n_groups: int, *, workers: int = 1,
                 ray_address: str | None = None, threads: int | None = None) -> ReplayResult:
    """``sim.replay.policy_replay.replay`` of one configuration with its layers run as ``n_groups`` jobs on an ``Executor``
    (at most ``n_groups`` local workers, or Ray): the same result. It refuses a prompt chunk the policy cannot
    take, as ``replay`` does (a sweep instead runs such a policy token by token)."""
    check_chunk(policy, ref.chunk)
    job = Job(ref, policy.name, tuple(sorted(policy.params.items())), (int(budget),), ("",))   # "": no store
    with Executor(workers=min(workers, n_groups), ray_address=ray_address, threads=threads) as ex:
        [(_, [result], _)] = ex.run_split([job], n_groups)
    return result


def default_workers() -> int:
    """Local worker processes: one per core this process may use."""
    return available_cores()


def consume(rows_iter: Iterable[list[dict[str, Any]]], sink: Callable[[list[dict[str, Any]]], Any],
            on_progress: Callable[[int], Any]) -> None:
    """Store each finished job's rows at once (nothing finished is lost on interruption)."""
    for rows in rows_iter:
        sink(rows)
        on_progress(len(rows))
