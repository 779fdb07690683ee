"""Thread budgets: how many threads each unit of kvsim work may use, decided and enforced in one place.

kvsim's replay kernels are single-threaded numba code; parallelism comes from running several layers of one
replay side by side (threads) or several configurations of a sweep or search side by side (worker processes,
Ray tasks). The native pools that come along with the libraries (OpenBLAS inside numpy and inside scipy, which
numba's ``np.dot`` calls; numba's own threading layer; torch's OpenMP pool) are each sized to *every* core
when they load. Two sweep workers on two cores that each let OpenBLAS use both cores run four or more busy
threads on two cores: measured on the SmolLM2 trace, 79 s against 26 s with ``OPENBLAS_NUM_THREADS=1``.

The rule: a unit of work that runs next to others gets its share of the cores, ``workers x threads <= cores``
by default (``plan_threads``), and the unit caps every pool in its process at that share (``limit_threads``):
the already-loaded BLAS/OpenMP libraries through threadpoolctl (environment variables only work before a
library loads), numba's threading layer, torch if it is loaded, and the environment variables for whatever
loads later or is started from the process. Inside one replay that runs layers on several threads, BLAS is
held to one thread per layer thread (``blas_per_layer_thread``), so a single ``kvsim replay`` uses the cores it
has without oversubscribing them either.
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Iterator

#: environment variables the native thread pools read when they load (BLAS flavours, OpenMP, numexpr)
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                   "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")

#: kvsim's own variable: how many layers one replay runs side by side (``sim.replay.policy_replay``)
KVSIM_THREADS = "KVSIM_THREADS"


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:            # macOS, Windows
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ThreadPlan:
    """``workers`` units of work side by side, each allowed ``threads`` threads."""

    workers: int
    threads: int

    @property
    def total(self) -> int:
        return self.workers * self.threads

    def describe(self) -> str:
        return f"{self.workers} worker(s) x {self.threads} thread(s)"


def plan_threads(workers: int, threads: int | None = None, *, ray: bool = False,
                 cores: int | None = None) -> ThreadPlan:
    """The thread share of each of ``workers`` units: ``threads`` if given, else one per Ray task (Ray schedules
    tasks by the CPUs they declare), else the local cores divided among the workers (at least one)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads per worker must be >= 1, got {threads}")
    if threads is None:
        threads = 1 if ray else max(1, (cores or available_cores()) // workers)
    return ThreadPlan(workers, threads)


def thread_env(n: int) -> dict[str, str]:
    """The environment that caps pools loaded later (and child processes) at ``n`` threads."""
    return {**{var: str(n) for var in THREAD_ENV_VARS}, KVSIM_THREADS: str(n)}


def limit_threads(n: int) -> None:
    """Cap every thread pool of this process at ``n`` threads: BLAS and OpenMP libraries already loaded
    (threadpoolctl), numba's threading layer, torch when it is loaded, and through the environment the
    libraries loaded later and the processes started from here. Idempotent; cheap enough to call per task."""
    if n < 1:
        raise ValueError(f"thread limit must be >= 1, got {n}")
    from threadpoolctl import threadpool_limits

    os.environ.update(thread_env(n))
    threadpool_limits(limits=n)
    import numba   # after the environment is set (a first import sizes numba's pool from it); not at `kvsim --help`

    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)


def thread_counts() -> dict[str, int]:
    """What this process's pools are allowed now: ``blas`` and ``openmp`` (the largest over loaded libraries),
    ``numba``, ``torch`` (when loaded) and ``kvsim`` (layers per replay). For tests and benchmark records."""
    from threadpoolctl import threadpool_info

    import numba

    out: dict[str, int] = {"numba": int(numba.get_num_threads()),
                           "kvsim": int(os.environ.get(KVSIM_THREADS, available_cores()))}
    for lib in threadpool_info():
        api = lib["user_api"]
        out[api] = max(out.get(api, 0), int(lib["num_threads"]))
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = int(torch.get_num_threads())
    return out


@contextlib.contextmanager
def blas_per_layer_thread(layer_threads: int) -> Iterator[None]:
    """While ``layer_threads`` > 1 threads each replay a layer, hold BLAS to one thread per layer thread (the
    layers are the parallelism); with one layer thread, BLAS keeps what the process allows."""
    if layer_threads <= 1:
        yield
        return
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield


def environment_record() -> dict[str, object]:
    """The thread-relevant environment, for benchmark JSON: the variables as set, cores, and pool sizes."""
    return {"cores": available_cores(), "cpu_count": os.cpu_count(),
            "env": {var: os.environ.get(var) for var in (*THREAD_ENV_VARS, "NUMBA_NUM_THREADS", KVSIM_THREADS)},
            "pools": thread_counts()}
