"""Where sweep configurations run: in this process, in local worker processes, or on a Ray cluster.

Work travels as plain specs (trace spec + size arguments, policy name + params, budgets) so that every
executor computes exactly the same rows; workers cache loaded traces per process. Each worker process or Ray
task runs with its share of the cores (``sim.threads``).
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from policies import get_policy
from sim.threads import ThreadPlan, available_cores, limit_threads, plan_threads, thread_env

_TRACE_CACHE: dict[tuple, Any] = {}


@dataclass(frozen=True)
class TraceRef:
    """How to (re)open a trace in any process: a directory or ``synthetic:KIND`` plus generator sizes, whether
    to verify the files' checksums and finiteness (``--no-verify`` travels with the work), and what a policy
    does on a hybrid model's sliding-window layers (``sim.replay.SLIDING_MODES``) and the prompt chunk of
    chunked prefill (``sim.replay.effective_chunk``)."""

    spec: str
    n_tokens: int = 1024
    n_prompt: int = 128
    n_layers: int = 2
    seed: int = 0
    verify: bool = True
    sliding: str = "keep"
    chunk: int = 1

    def open(self):
        from sim.replay import layer_inputs
        from sim.specs import open_trace

        key = (self.spec, self.n_tokens, self.n_prompt, self.n_layers, self.seed, self.verify)
        if key not in _TRACE_CACHE:
            _TRACE_CACHE.clear()             # one trace per worker at a time bounds memory
            trace = open_trace(self.spec, n_tokens=self.n_tokens, n_prompt=self.n_prompt, n_layers=self.n_layers,
                               seed=self.seed, verify=self.verify)
            _TRACE_CACHE[key] = (trace, layer_inputs(trace))
        return _TRACE_CACHE[key]


@dataclass(frozen=True)
class Job:
    """One unit of work: a policy at one or more budgets (several for one-pass strategies such as the oracle's)."""

    trace: TraceRef
    policy: str
    params: tuple[tuple[str, Any], ...]
    budgets: tuple[int, ...]
    keys: tuple[str, ...]
    meta: dict = field(default_factory=dict, hash=False, compare=False)


def run_job(job: Job) -> list[dict[str, Any]]:
    """Evaluate a job and return one result row per budget (pure function of the job)."""
    import time

    from sim.replay import effective_chunk, replay_budgets
    from sim.specs import trace_id, trace_name

    trace, inputs = job.trace.open()
    policy = get_policy(job.policy, **dict(job.params))
    t0 = time.perf_counter()
    chunk = effective_chunk(policy, job.trace.chunk)
    results = replay_budgets(trace, policy, job.budgets, inputs=inputs, sliding=job.trace.sliding, chunk=chunk)
    per = (time.perf_counter() - t0) / len(results)
    rows = []
    for key, budget, res in zip(job.keys, job.budgets, results):
        row = res.summary()
        row.update(key=key, trace=trace_name(trace), trace_id=trace_id(trace), policy=policy.name,
                   label=policy.label(), params=dict(policy.params), budget=budget, n_tokens=trace.meta.n_tokens,
                   sliding=job.trace.sliding, prefill_chunk=chunk, elapsed_s=per, **job.meta)
        rows.append(row)
    return rows


def _init_worker(threads: int) -> None:
    """A worker process (or the in-process executor) starts by capping its thread pools at its share."""
    import warnings

    limit_threads(threads)
    warnings.filterwarnings("ignore", message="First-class function type feature is experimental")


def _run_ray_task(fn: Callable[[Job], Any], job: Job, threads: int) -> Any:
    """A Ray task: the process Ray gave it may have run other work, so the cap is applied per task."""
    _init_worker(threads)
    return fn(job)


class Executor:
    """Runs jobs where the user asked: in this process (``workers=1``), in local worker processes kept alive
    across ``run`` calls (so a search's batches reuse warm workers), or on a Ray cluster.

    Threads are budgeted here and only here (``sim.threads``): each local worker gets ``threads`` (default:
    the cores divided among the workers) and caps its numba, BLAS and torch pools at that; each Ray task
    declares ``num_cpus=threads`` (default 1) so Ray's scheduler never puts more threads on a node than it has
    cores, and caps its pools the same way. Use as a context manager.
    """

    def __init__(self, *, workers: int = 1, ray_address: str | None = None, threads: int | None = None) -> None:
        self.ray_address = ray_address
        self.plan: ThreadPlan = plan_threads(max(1, workers), threads, ray=bool(ray_address))
        self._pool: ProcessPoolExecutor | None = None
        self._remote = None

    def __enter__(self) -> "Executor":
        return self

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
        try:
            import ray
        except ImportError:
            raise ValueError("--ray needs Ray: pip install 'kvsim[ray]'") from None
        if not ray.is_initialized():
            if self.ray_address == "local":
                ray.init(include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=self.ray_address, log_to_driver=False)
        if self._remote is None:
            n = self.plan.threads
            self._remote = ray.remote(num_cpus=n, runtime_env={"env_vars": thread_env(n)})(_run_ray_task)
        refs = [self._remote.remote(fn, job, self.plan.threads) for job in jobs]
        while refs:
            done, refs = ray.wait(refs, num_returns=1)
            yield ray.get(done[0])


def execute(jobs: list[Job], *, workers: int = 1, ray_address: str | None = None,
            threads: int | None = None) -> Iterator[list[dict[str, Any]]]:
    """Run ``jobs`` once on a fresh ``Executor`` (see there) and yield each job's rows as it finishes."""
    with Executor(workers=workers, ray_address=ray_address, threads=threads) as ex:
        yield from ex.run(jobs)


def default_workers() -> int:
    """Local worker processes: one per core this process may use."""
    return available_cores()


def consume(rows_iter: Iterable[list[dict[str, Any]]], sink: Callable[[list[dict[str, Any]]], Any],
            on_progress: Callable[[int], Any]) -> None:
    """Store each finished job's rows at once (nothing finished is lost on interruption)."""
    for rows in rows_iter:
        sink(rows)
        on_progress(len(rows))
