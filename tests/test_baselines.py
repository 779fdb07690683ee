"""Worked examples for the baseline policies: exact kept sets on tiny hand-made inputs."""
from __future__ import annotations

import numpy as np
import pytest

from policies import PolicyError, get_policy
from sim.replay.policy_replay import replay
from sim.replay.plan import BudgetError
from traces.synthetic import make_synthetic_trace


def run_step(name, probs, positions, budget, t=None, slot_state=None, **params):
    """Call a policy's jitted step once on explicit arrays; returns (keep, slot_state)."""
    pol = get_policy(name, **params)
    probs = np.ascontiguousarray(probs, np.float64)
    hkv, g, n = probs.shape
    positions = np.ascontiguousarray(positions, np.int64)
    t = int(positions.max()) if t is None else t
    st = np.zeros((hkv, n, pol.slot_fields)) if slot_state is None else np.ascontiguousarray(slot_state, np.float64)
    keep = np.ones((hkv, n), np.uint8)
    step = pol.kernels()[0]
    step(pol.param_vector(), 0, t, np.full(hkv, budget, np.int64), np.full(hkv, n, np.int64), probs,
         np.zeros((hkv, n, 4), np.float32), np.zeros((hkv, n, 4), np.float32), positions, st,
         np.zeros((hkv, pol.head_fields)), keep, np.full((hkv, n), -1, np.int64), np.ones((hkv, n)))
    return keep, st


def test_window_drops_oldest():
    keep, _ = run_step("window", np.full((1, 1, 5), 0.2), [[3, 4, 5, 6, 7]], budget=3)
    assert keep.tolist() == [[0, 0, 1, 1, 1]]


def test_streaming_llm_keeps_sinks_and_drops_oldest_non_sink():
    keep, _ = run_step("streaming_llm", np.full((1, 1, 5), 0.2), [[0, 1, 5, 6, 7]], budget=4, n_sinks=2)
    assert keep.tolist() == [[1, 1, 0, 1, 1]]


def test_h2o_accumulates_then_evicts_lowest_outside_recent():
    # accumulated before: [0.3, 0.0, 0.1, 0.0]; this step adds [0.1, 0.5, 0.2, 0.2] -> [0.4, 0.5, 0.3, 0.2]
    # recent = round(3 * 0.34) = 1 protects position 9 (slot 3); the lowest of slots 0..2 is slot 2 (0.3)
    st = np.array([[[0.3], [0.0], [0.1], [0.0]]])
    keep, st = run_step("h2o", [[[0.1, 0.5, 0.2, 0.2]]], [[2, 5, 7, 9]], budget=3, slot_state=st,
                        recent_ratio=0.34)
    assert keep.tolist() == [[1, 1, 0, 1]]
    np.testing.assert_allclose(st[0, :, 0], [0.4, 0.5, 0.3, 0.2])


def test_h2o_gqa_group_reduce():
    probs = [[[0.5, 0.3, 0.2], [0.0, 0.3, 0.7]]]            # two query heads share the KV head
    # the newest token (slot 2) is the protected recent window; slots 0 and 1 compete
    mean_keep, _ = run_step("h2o", probs, [[0, 1, 2]], budget=2, recent_ratio=0.0, group_reduce="mean")
    max_keep, _ = run_step("h2o", probs, [[0, 1, 2]], budget=2, recent_ratio=0.0, group_reduce="max")
    assert mean_keep.tolist() == [[0, 1, 1]]                # means 0.25 < 0.3
    assert max_keep.tolist() == [[1, 0, 1]]                 # maxima 0.5 > 0.3


def test_tova_per_head_and_per_layer():
    probs = np.array([[[0.3, 0.1, 0.4, 0.2]], [[0.1, 0.5, 0.1, 0.3]]])
    keep, _ = run_step("tova", probs, [[0, 1, 2, 3]] * 2, budget=3, scope="head")
    assert keep.tolist() == [[1, 0, 1, 1], [0, 1, 1, 1]]
    keep, _ = run_step("tova", probs, [[0, 1, 2, 3]] * 2, budget=3, scope="layer")
    # layer means: [0.2, 0.3, 0.25, 0.25] -> slot 0 leaves every head
    assert keep.tolist() == [[0, 1, 1, 1], [0, 1, 1, 1]]


def test_random_is_seeded_and_protects_recent():
    a, _ = run_step("random", np.full((1, 1, 6), 1 / 6), [[0, 1, 2, 3, 4, 5]], budget=3, seed=7, protect_recent=2)
    b, _ = run_step("random", np.full((1, 1, 6), 1 / 6), [[0, 1, 2, 3, 4, 5]], budget=3, seed=7, protect_recent=2)
    assert a.tolist() == b.tolist() and a.sum() == 3 and a[0, 4] == a[0, 5] == 1
    seen = {tuple(run_step("random", np.full((1, 1, 6), 1 / 6), [[0, 1, 2, 3, 4, 5]], budget=3, seed=s)[0][0])
            for s in range(20)}
    assert len(seen) > 3


def test_window_replay_kept_sets_step_by_step():
    tr = make_synthetic_trace("random", n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=16, n_tokens=8, n_prompt=0)
    res = replay(tr, get_policy("window"), 3, record_kept=(0, 8))
    kept = [sorted(x for x in res.kept[0, r, 0] if x >= 0) for r in range(8)]
    assert kept == [[0], [0, 1], [0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, 6], [5, 6, 7]]


def test_oracle_matches_brute_force_top_k():
    tr = make_synthetic_trace("zipf", n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=16, n_tokens=20, n_prompt=10)
    res = replay(tr, get_policy("oracle"), 4)
    la = tr.layer(0)
    for r, t in enumerate(range(10, 20)):
        p = np.exp(tr.meta.softmax_scale * np.einsum("gd,td->gt", la.q[t].astype(np.float64),
                                                      la.k[: t + 1, 0].astype(np.float64)) - la.lse[t][:, None])
        top = np.argsort(-p[:, :t].sum(0), kind="stable")[:4]
        keep = np.append(top, t)
        np.testing.assert_allclose(res.metric("mass")[0, r], p[:, keep].sum(1), rtol=1e-6)


def test_bad_budgets_and_params_are_named():
    tr = make_synthetic_trace("zipf", n_layers=1, n_tokens=20, n_prompt=4, head_dim=16)
    with pytest.raises(BudgetError, match="larger than the trace's 20 tokens"):
        replay(tr, get_policy("h2o"), 21)
    with pytest.raises(PolicyError, match="below its minimum 5"):
        replay(tr, get_policy("streaming_llm"), 3)
    with pytest.raises(PolicyError, match="unknown policy 'nope'"):
        get_policy("nope")
    with pytest.raises(PolicyError, match=r"unknown parameter\(s\) \['ratio'\]"):
        get_policy("h2o", ratio=0.2)
    with pytest.raises(PolicyError, match="h2o.recent_ratio: 2.0 is above the maximum 1.0"):
        get_policy("h2o", recent_ratio=2)
    with pytest.raises(PolicyError, match="not one of"):
        get_policy("tova", scope="global")
