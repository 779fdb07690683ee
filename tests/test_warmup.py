"""Compiling ahead of use (sim.replay.warmup): what the demo runs on spare cores while it records."""
from __future__ import annotations

from policies import get_policy
from sim.replay.warmup import background_compile, compile_policies, compiling_meanwhile, wait_all


def test_compile_policies_leaves_every_kernel_compiled():
    compile_policies(["h2o", "d2o", "oracle", "no_such_policy"], engine=True)   # an unknown name is skipped
    for name in ("h2o", "d2o"):
        step, prefill, scale = get_policy(name).kernels()
        assert step.signatures and prefill.signatures and scale.signatures


def test_background_compile_splits_the_policies_over_processes():
    procs = background_compile(["full", "window", "random"], processes=2)
    assert len(procs) == 2 and "--engine" in procs[0].args and "--engine" not in procs[1].args
    assert procs[0].args[-2:] == ["full", "random"] and procs[1].args[-1:] == ["window"]
    wait_all(procs)
    assert [p.returncode for p in procs] == [0, 0]


def test_compiling_meanwhile_takes_the_names_last_first_and_stops_its_helpers():
    with compiling_meanwhile(["full", "window", "full", "random"], processes=1) as procs:
        assert len(procs) == 1 and procs[0].args[-4:] == ["--engine", "random", "window", "full"]
    assert procs[0].returncode is not None          # finished or stopped when the block ended
    with compiling_meanwhile(["full"], processes=0) as none:
        assert none == []
