"""One configuration split by layer groups (``--split-layers``): the groups' merged result is the unsplit
replay's, exactly (metrics, slots, kept sets, budgets, summary), for policies whose budgets couple layers
(PyramidKV, D2O) as for the others, on local worker processes, on Ray and from the CLI; the allocation is made
once where the configuration is split and shipped with the groups, never recomputed by a worker."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import PolicyError
from sim.cli import main
from sim.experiments.executors import Job, TraceRef, execute, replay_split
from sim.replay.layer_groups import layer_groups, merge_layer_groups
from sim.replay.layer_inputs import load_layers
from sim.replay.policy_replay import replay, replay_budgets
from sim.replay.plan import effective_chunk
from sim.experiments.specs import parse_policy
from traces.synthetic import make_synthetic_trace

#: policies with per-layer budgets (pyramidkv, d2o), head-wise ones (ada), plain ones and the oracle; small windows
#: so that the prompt is long enough for PyramidKV's schedule to differ across layers
SPECS = ("d2o", "pyramidkv:window_size=4", "h2o", "snapkv:window_size=4", "ada(snapkv:window_size=4)", "oracle",
         "tova")
FIELDS = ("metrics", "slots", "budgets", "layers", "kept", "kept_steps", "held_elsewhere", "steps")
SMALL = ["--tokens", "96", "--prompt", "64", "--layers", "3", "--seed", "1"]


def assert_same(split, whole) -> None:
    """Every array of the two results equal, and the same summary (NaN-safe: compared as JSON)."""
    for name in FIELDS:
        a, b = getattr(split, name), getattr(whole, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert json.dumps(split.summary()) == json.dumps(whole.summary())


def split_replay(trace, policy, budgets, n_groups, **kw):
    """Replay ``trace`` as ``n_groups`` layer groups in this process, merging the groups in reverse order."""
    groups = layer_groups(trace, policy, budgets, n_groups, inputs=load_layers(trace),
                          sliding=kw.get("sliding", "keep"))
    parts = [replay_budgets(trace, policy, budgets, group=g, **kw) for g in reversed(groups)]
    return [merge_layer_groups(trace, by_budget) for by_budget in zip(*parts)]


@settings(max_examples=60)
@given(spec=st.sampled_from(SPECS), seed=st.integers(0, 50), n_layers=st.integers(2, 5), data=st.data(),
       budget=st.integers(6, 40), chunk=st.sampled_from([1, 8]))
def test_split_equals_unsplit(spec, seed, n_layers, data, budget, chunk):
    trace = make_synthetic_trace("mixed", n_layers=n_layers, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=72,
                                 n_prompt=48, seed=seed)
    policy = parse_policy(spec)
    n_groups = data.draw(st.integers(1, n_layers), label="n_groups")
    kw = dict(record_kept=(40, 32), chunk=effective_chunk(policy, chunk))
    budget = max(budget, policy.min_budget())
    [whole] = replay_budgets(trace, policy, [budget], **kw)
    [split] = split_replay(trace, policy, [budget], n_groups, **kw)
    assert_same(split, whole)


def test_coupled_allocations_are_exercised_and_shipped():
    """The cases above do reach per-layer budgets, and a group replays from the rows it carries: with
    ``allocate`` broken after the split, the groups still replay and merge to the unsplit result."""
    trace = make_synthetic_trace("mixed", n_layers=4, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=72,
                                 n_prompt=48, seed=3)
    for spec in ("d2o", "pyramidkv:window_size=4"):
        policy = parse_policy(spec)
        whole = replay(trace, policy, 16)
        assert len(set(whole.budgets[:, 0].tolist())) > 1, spec
        groups = layer_groups(trace, policy, [16], 2)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(policy), "allocate", lambda *a, **k: pytest.fail("a group re-allocated"))
            parts = [replay_budgets(trace, policy, [16], group=g)[0] for g in groups]
        assert_same(merge_layer_groups(trace, parts), whole)


@pytest.mark.parametrize("sliding", ["keep", "compress"])
def test_hybrid_split_counts_memory_once(sliding):
    """Sliding layers kept at their window are no group's: every group's result counts them (and the other
    groups' layers) as held elsewhere, the merge counts each layer once."""
    trace = make_synthetic_trace("mixed", n_layers=5, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=64,
                                 n_prompt=40, seed=4, windows=[6, None, 6, None, None])
    for spec in ("h2o", "d2o", "oracle"):
        policy = parse_policy(spec)
        [whole] = replay_budgets(trace, policy, [12], sliding=sliding, record_kept=(38, 8))
        for n in (2, 3):
            [split] = split_replay(trace, policy, [12], n, sliding=sliding, record_kept=(38, 8))
            assert_same(split, whole)


def test_bad_group_counts_and_incomplete_merges_are_refused():
    trace = make_synthetic_trace("mixed", n_layers=3, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=64,
                                 n_prompt=40, seed=0, windows=[6, None, None])
    policy = parse_policy("h2o")
    with pytest.raises(ValueError, match=r"cannot split the 2 layers h2o compresses .* into 3 groups; use 1 to 2"):
        layer_groups(trace, policy, [8], 3)
    with pytest.raises(ValueError, match="into 0 groups"):
        layer_groups(trace, policy, [8], 0)
    groups = layer_groups(trace, policy, [8], 2)
    with pytest.raises(ValueError, match="carries no allocation for budget 9"):
        replay_budgets(trace, policy, [9], group=groups[0])
    with pytest.raises(ValueError, match=r"layer groups cover layers \[2\], the configuration compresses \[1, 2\]"):
        merge_layer_groups(trace, replay_budgets(trace, policy, [8], group=groups[1]))


def sweep_jobs() -> list[Job]:
    """A few configurations of a 4-layer synthetic trace, the oracle's curve as one job."""
    ref = TraceRef("synthetic:mixed", n_tokens=96, n_prompt=64, n_layers=4, seed=5, chunk=8)
    jobs = [Job(ref, p.name, tuple(sorted(p.params.items())), (16,), (spec,))
            for spec in ("d2o", "pyramidkv:window_size=4", "ada(snapkv:window_size=4)") for p in [parse_policy(spec)]]
    return [*jobs, Job(ref, "oracle", (("scope", "head"),), (8, 16), ("o8", "o16"))]


def rows_by_key(rows_iter) -> dict[str, dict]:
    """Result rows by store key, without the timing (the only field a split changes)."""
    return {r["key"]: {k: v for k, v in r.items() if k != "elapsed_s"} for rows in rows_iter for r in rows}


def test_split_sweep_on_local_workers_equals_unsplit():
    jobs = sweep_jobs()
    whole = rows_by_key(execute(jobs, workers=1))
    split = rows_by_key(execute(jobs, workers=2, threads=1, split_layers=3))
    assert json.dumps(split, sort_keys=True, default=str) == json.dumps(whole, sort_keys=True, default=str)


def test_split_sweep_on_ray_local_equals_unsplit(ray_local):
    jobs = sweep_jobs()
    whole = rows_by_key(execute(jobs, workers=1))
    split = rows_by_key(execute(jobs, ray_address="local", split_layers=2))
    assert json.dumps(split, sort_keys=True, default=str) == json.dumps(whole, sort_keys=True, default=str)


def test_replay_cli_split_json_equals_unsplit(capsys):
    args = ["replay", "synthetic:mixed", *SMALL, "--policy", "d2o", "--budget", "16", "--json"]
    assert main(args) == 0
    whole = capsys.readouterr().out
    assert main([*args, "--split-layers", "2"]) == 0
    assert capsys.readouterr().out == whole
    assert len(set(json.loads(whole)["err_by_layer"])) == 3


def test_replay_cli_refuses_bad_splits(capsys):
    args = ["replay", "synthetic:mixed", *SMALL, "--policy", "h2o", "--budget", "16", "--workers", "1"]
    assert main([*args, "--split-layers", "4"]) == 2
    assert "cannot split the 3 layers h2o compresses" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--split-layers", "0"])


def test_split_replay_refuses_chunks_as_replay_does():
    ref = TraceRef("synthetic:mixed", n_tokens=96, n_prompt=64, n_layers=2, chunk=8)
    with pytest.raises(PolicyError, match="cannot take its prompt in chunks of 8"):
        replay_split(ref, parse_policy("cascading"), 16, 2)
