"""Properties every registered policy must have, checked on hypothesis-generated synthetic traces."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from policies import get_policy, list_policies
from sim.replay.oracle_replay import replay_oracle
from sim.replay.policy_replay import replay
from traces.synthetic import KINDS, make_synthetic_trace

ALL = list_policies()
BOUNDED = [n for n in ALL if not get_policy(n).unbounded and not get_policy(n).is_oracle]
GEOMETRIES = [(2, 1), (2, 2), (4, 2)]
#: non-default readings (released-code presets and options) held to the same budget and promise properties
VARIANTS = [("d2o", {"preset": "reference"}), ("d2o", {"alloc": "literal"}), ("cascading", {"preset": "reference"}),
            ("buzz", {"prefill": "one_pass", "window": 3, "threshold": 6}),
            ("snapkv", {"window_only": True, "group_reduce": "max"}),
            ("ada_snapkv", {"rounding": "released", "group_reduce": "max", "window_only": True}),
            ("ada_h2o", {"rounding": "released"}),
            ("triattention", {"divide_length": 4}), ("triattention", {"divide_length": 2, "protect_prefill": False}),
            ("triattention", {"divide_length": 3, "n_recent": 2, "offset_agg": "max", "group_agg": "mean"})]


@st.composite
def trace_and_budget(draw, name: str, params: dict | None = None):
    """A small synthetic trace and a budget the policy accepts (min_budget..T)."""
    policy = get_policy(name, **(params or {}))
    lo = policy.min_budget()
    hq, hkv = draw(st.sampled_from(GEOMETRIES))
    # long enough for the policy's least budget (TriAttention's default schedule needs 128 slots)
    T = draw(st.integers(max(16, lo), max(72, lo + 56)))
    trace = make_synthetic_trace(
        draw(st.sampled_from(KINDS)), n_layers=draw(st.integers(1, 2)), n_q_heads=hq, n_kv_heads=hkv,
        head_dim=16, n_tokens=T, n_prompt=draw(st.integers(0, T // 2)), seed=draw(st.integers(0, 2**16)),
        recall_every=5, recall_window=6, segment=12, n_needle_queries=3, passkey_pos=1)
    budget = draw(st.integers(lo, T))
    return trace, policy, budget


def _kept_sets(result, layer, step_index, head):
    row = result.kept[layer, step_index, head]
    return set(row[row >= 0].tolist())


@pytest.mark.parametrize("name,params", [(n, {}) for n in BOUNDED] + VARIANTS)
@settings(max_examples=15)
@given(data=st.data())
def test_never_over_budget_and_keeps_promises(name, params, data):
    trace, policy, budget = data.draw(trace_and_budget(name, params))
    P, T = trace.meta.n_prompt, trace.meta.n_tokens
    res = replay(trace, policy, budget, record_kept=(P, T - P))
    if policy.head_adaptive:
        assert (res.slots.sum(axis=2) <= res.budgets.sum(axis=1)[:, None]).all()
    else:
        assert (res.slots <= res.budgets[:, None, :]).all()
    sinks, recent = policy.guarantees(budget)
    for layer in range(trace.n_layers):
        for r, t in enumerate(res.kept_steps):
            for h in range(trace.meta.model.n_kv_heads):
                kept = _kept_sets(res, layer, r, h)
                promised = set(range(min(sinks, t + 1))) | set(range(max(0, t - recent + 1), t + 1))
                assert promised <= kept, f"{name}: step {t} head {h} lost {sorted(promised - kept)}"


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=8)
@given(data=st.data())
def test_deterministic(name, data):
    trace, policy, budget = data.draw(trace_and_budget(name))
    a = replay(trace, policy, budget)
    b = replay(trace, get_policy(name, **policy.params), budget)
    np.testing.assert_array_equal(a.metrics, b.metrics)
    np.testing.assert_array_equal(a.slots, b.slots)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=8)
@given(data=st.data())
def test_full_budget_is_full_attention(name, data):
    trace, policy, _ = data.draw(trace_and_budget(name))
    T = trace.meta.n_tokens
    assume(policy.min_budget() <= T)
    if policy.compresses_below_budget:
        return   # by design (e.g. decoding(): every N steps back to a target below the budget), not a full cache
    full = replay(trace, get_policy("full"), T)
    res = replay(trace, policy, T)
    if policy.is_oracle or policy.logit_scale_fn is not None:
        # separate exact path (oracle) or changed attention (logit scaling): equal only up to rounding / by design
        if policy.is_oracle:
            # float64 oracle vs float32 engine logits; the L1 bound magnifies mass rounding by max ||v||_1
            np.testing.assert_allclose(res.metrics[..., :4], full.metrics[..., :4], rtol=1e-4, atol=1e-4)
        return
    np.testing.assert_array_equal(res.metrics, full.metrics)
    # the full cache reproduces the float64 reference up to the float32 rounding of the logits
    assert np.abs(full.metric("mass") - 1.0).max() < 1e-5
    assert full.metric("err").max() < 1e-4


@pytest.mark.parametrize("name", BOUNDED)
@settings(max_examples=10)
@given(data=st.data())
def test_oracle_retains_at_least_as_much(name, data):
    # engine logits are float32 dot products, the oracle's float64: compare up to float32 rounding
    trace, policy, budget = data.draw(trace_and_budget(name))
    res = replay(trace, policy, budget)
    per_layer_total = res.budgets.sum(axis=1)
    assume((per_layer_total == per_layer_total[0]).all())        # same memory in every layer
    hkv = trace.meta.model.n_kv_heads
    g = trace.meta.model.n_q_heads // hkv
    mass = res.metric("mass")                                    # [L, S, Hq]
    if policy.head_adaptive or not (res.budgets == res.budgets[0, 0]).all():
        assume(per_layer_total[0] % hkv == 0)
        orc = replay_oracle(trace, [int(per_layer_total[0] // hkv)], scope="layer")[0]
        assert (orc.metric("mass").sum(axis=2) >= mass.sum(axis=2) - 1e-5).all()
    else:
        orc = replay_oracle(trace, [int(res.budgets[0, 0])], scope="head")[0]
        grouped = lambda m: m.reshape(m.shape[0], m.shape[1], hkv, g).sum(axis=3)
        assert (grouped(orc.metric("mass")) >= grouped(mass) - 1e-5).all()
