"""Where sweep configurations run: in this process, in local worker processes, or on a Ray cluster.

Work travels as plain specs (trace spec + size arguments, policy name + params, budgets) so that every
executor computes exactly the same rows; workers cache loaded traces per process.
"""
from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from policies import get_policy

_TRACE_CACHE: dict[tuple, Any] = {}


@dataclass(frozen=True)
class TraceRef:
    """How to (re)open a trace in any process: a directory or ``synthetic:KIND`` plus generator sizes, and
    whether to verify the files' checksums and finiteness (``--no-verify`` travels with the work)."""

    spec: str
    n_tokens: int = 1024
    n_prompt: int = 128
    n_layers: int = 2
    seed: int = 0
    verify: bool = True

    def open(self):
        from sim.replay import load_layers
        from sim.specs import open_trace

        key = (self.spec, self.n_tokens, self.n_prompt, self.n_layers, self.seed, self.verify)
        if key not in _TRACE_CACHE:
            _TRACE_CACHE.clear()             # one trace per worker at a time bounds memory
            trace = open_trace(self.spec, n_tokens=self.n_tokens, n_prompt=self.n_prompt, n_layers=self.n_layers,
                               seed=self.seed, verify=self.verify)
            _TRACE_CACHE[key] = (trace, load_layers(trace))
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

    from sim.replay import replay_budgets
    from sim.specs import trace_id, trace_name

    trace, inputs = job.trace.open()
    policy = get_policy(job.policy, **dict(job.params))
    t0 = time.perf_counter()
    threads = int(os.environ.get("KVSIM_THREADS", "1"))
    results = replay_budgets(trace, policy, job.budgets, inputs=inputs, threads=threads)
    per = (time.perf_counter() - t0) / len(results)
    rows = []
    for key, budget, res in zip(job.keys, job.budgets, results):
        row = res.summary()
        row.update(key=key, trace=trace_name(trace), trace_id=trace_id(trace), policy=policy.name,
                   label=policy.label(), params=dict(policy.params), budget=budget, n_tokens=trace.meta.n_tokens,
                   elapsed_s=per, **job.meta)
        rows.append(row)
    return rows


def _init_worker() -> None:
    os.environ.setdefault("KVSIM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore", message="First-class function type feature is experimental")


def execute(jobs: list[Job], *, workers: int = 1, ray_address: str | None = None) -> Iterator[list[dict[str, Any]]]:
    """Yield each job's rows as soon as it finishes (order not guaranteed)."""
    if ray_address:
        yield from _execute_ray(jobs, ray_address)
    elif workers <= 1:
        _init_worker()
        for job in jobs:
            yield run_job(job)
    else:
        with ProcessPoolExecutor(max_workers=workers, initializer=_init_worker) as pool:
            pending: set[Future] = set()
            queue = list(reversed(jobs))
            while queue or pending:
                while queue and len(pending) < 2 * workers:
                    pending.add(pool.submit(run_job, queue.pop()))
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    yield fut.result()


def _execute_ray(jobs: list[Job], address: str) -> Iterator[list[dict[str, Any]]]:
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'kvsim[ray]'") from None
    if not ray.is_initialized():
        if address == "local":
            ray.init(include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"KVSIM_THREADS": "1"}})
        else:
            ray.init(address=address, log_to_driver=False)
    remote = ray.remote(run_job)
    refs = [remote.remote(job) for job in jobs]
    while refs:
        done, refs = ray.wait(refs, num_returns=1)
        yield ray.get(done[0])


def default_workers() -> int:
    """Local worker processes: one per core."""
    return max(1, os.cpu_count() or 1)


def consume(rows_iter: Iterable[list[dict[str, Any]]], sink: Callable[[list[dict[str, Any]]], Any],
            on_progress: Callable[[int], Any]) -> None:
    """Store each finished job's rows at once (nothing finished is lost on interruption)."""
    for rows in rows_iter:
        sink(rows)
        on_progress(len(rows))
