"""Thread budgets: every unit of work caps numba, BLAS and torch at the share its executor promised."""
from __future__ import annotations

import pytest

from sim.experiments.executors import Executor, Job, TraceRef
from sim.replay.threads import ThreadPlan, plan_threads, thread_counts

JOB = Job(TraceRef("synthetic:mixed", n_tokens=64, n_prompt=16, n_layers=1), "window", (), (8,), ("k",))


def worker_thread_counts(job: Job) -> dict[str, int]:
    """What a unit of work sees, torch included (loaded here if the worker has not loaded it yet)."""
    import torch

    assert job is JOB or job == JOB
    return {**thread_counts(), "torch": int(torch.get_num_threads())}


def assert_capped(counts: dict[str, int], n: int) -> None:
    assert counts["blas"] == n, counts
    assert counts["numba"] == n, counts
    assert counts["torch"] == n, counts
    assert counts["kvsim"] == n, counts
    assert counts.get("openmp", n) <= n, counts


def test_plan_shares_the_cores():
    assert plan_threads(2, cores=2) == ThreadPlan(2, 1)
    assert plan_threads(1, cores=8) == ThreadPlan(1, 8)
    assert plan_threads(3, cores=8) == ThreadPlan(3, 2)
    assert plan_threads(4, cores=2) == ThreadPlan(4, 1)           # never fewer than one thread
    assert plan_threads(2, 3, cores=2) == ThreadPlan(2, 3)        # an explicit share is the user's call
    assert plan_threads(8, ray=True, cores=2) == ThreadPlan(8, 1)  # Ray tasks: 1 thread, num_cpus=1
    with pytest.raises(ValueError, match="threads per worker"):
        plan_threads(2, 0)


@pytest.mark.parametrize("threads", [1, 2])
def test_local_workers_cap_their_pools(threads):
    with Executor(workers=2, threads=threads) as ex:
        assert ex.plan == ThreadPlan(2, threads)
        counts = list(ex.run([JOB, JOB, JOB, JOB], fn=worker_thread_counts))
    assert len(counts) == 4
    for c in counts:
        assert_capped(c, threads)


def test_workers_keep_running_jobs_after_the_probe():
    with Executor(workers=2, threads=1) as ex:
        list(ex.run([JOB], fn=worker_thread_counts))
        rows = [r for rows in ex.run([JOB]) for r in rows]      # the same warm pool runs real jobs
    assert rows[0]["budget"] == 8 and rows[0]["slots_mean"] <= 8


def test_ray_tasks_declare_and_cap_their_threads(monkeypatch, ray_local):
    ray = ray_local
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])   # Ray workers cannot import this test module
    declared: list[dict] = []
    real_remote = ray.remote

    def spy(**options):
        declared.append(options)
        return real_remote(**options)

    monkeypatch.setattr(ray, "remote", spy)
    with Executor(ray_address="local") as ex:
        assert ex.plan == ThreadPlan(1, 1)
        counts = list(ex.run([JOB, JOB], fn=worker_thread_counts))
    ours = [d for d in declared if "runtime_env" in d]             # Ray's own calls declare no environment
    assert [(d["num_cpus"], d["num_gpus"]) for d in ours] == [(1, 0)]
    assert ours[0]["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "1"
    for c in counts:
        assert_capped(c, 1)
