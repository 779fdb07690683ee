"""Sweep throughput: configurations evaluated per second on this machine's cores for a 4k-token multi-layer trace.

Target: all registered policies x 8 budgets in under a minute on 2 cores. Also measured side by side: the
same sweep on one worker process, so the parallel speed-up is a ratio from the same run.
Run: python -m benchmarks.sweep   (writes benchmarks/results/sweep.json)
"""
from __future__ import annotations

import tempfile
import time

from benchmarks._util import machine, write_result
from policies import list_policies
from sim.experiments.executors import TraceRef, default_workers
from sim.experiments.store import ResultStore
from sim.experiments.sweep import parse_policy_grid, plan, run_sweep

BUDGETS = [16, 32, 64, 128, 256, 512, 1024, 2048]


def timed_sweep(workers: int) -> tuple[float, int]:
    ref = TraceRef("synthetic:mixed", n_tokens=4096, n_prompt=512, n_layers=4, seed=0)
    policies = parse_policy_grid("all")
    with tempfile.TemporaryDirectory() as tmp:
        store = ResultStore(tmp)
        n = sum(len(j.budgets) for j in plan([ref], policies, BUDGETS))
        t0 = time.perf_counter()
        run_sweep([ref], policies, BUDGETS, store, workers=workers, progress=False)
        return time.perf_counter() - t0, n


def main() -> None:
    workers = default_workers()
    timed_sweep(workers)                 # warm numba caches in every worker
    t_par, n = timed_sweep(workers)
    t_one, _ = timed_sweep(1)
    payload = dict(benchmark="sweep", machine=machine(), trace=dict(kind="mixed", n_tokens=4096, n_prompt=512,
                   n_layers=4, n_q_heads=4, n_kv_heads=2, head_dim=32), policies=list_policies(), budgets=BUDGETS,
                   configurations=n, workers=workers, seconds=t_par, configs_per_s=n / t_par,
                   seconds_one_worker=t_one, configs_per_s_one_worker=n / t_one, parallel_speedup=t_one / t_par,
                   target_seconds=60.0, meets_target=t_par < 60.0)
    print(f"{n} configurations in {t_par:.1f}s on {workers} workers ({n / t_par:.2f}/s; one worker {t_one:.1f}s)")
    print(f"wrote {write_result('sweep', payload)}")


if __name__ == "__main__":
    main()
