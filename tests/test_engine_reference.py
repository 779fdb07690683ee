"""The numba engine equals the plain-numpy reference replay for every registered policy."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from policies import get_policy, list_policies
from sim.replay.numpy_reference import reference_head_state, reference_replay_layer
from sim.replay.layer_inputs import load_layers
from sim.replay.policy_replay import replay
from tests.short_schedules import short_policy
from traces.synthetic import make_synthetic_trace

POLICIES = [n for n in list_policies() if not get_policy(n).is_oracle]


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=6)
@given(seed=st.integers(0, 10_000), T=st.integers(12, 48), geometry=st.sampled_from([(2, 1), (4, 2), (3, 3)]),
       frac=st.floats(0.1, 1.0), prompt_frac=st.floats(0.0, 0.6))
def test_engine_matches_numpy_reference(name, seed, T, geometry, frac, prompt_frac):
    hq, hkv = geometry
    trace = make_synthetic_trace("mixed", n_layers=2, n_q_heads=hq, n_kv_heads=hkv, head_dim=16, n_tokens=T,
                                 n_prompt=int(T * prompt_frac), seed=seed, recall_every=4, recall_window=4,
                                 segment=8, passkey_pos=0, n_needle_queries=2)
    policy = short_policy(name)
    budget = max(policy.min_budget(), int(T * frac))
    assume(budget <= T)
    P = trace.meta.n_prompt
    res = replay(trace, policy, budget, record_kept=(P, T - P))
    inputs = load_layers(trace)
    for layer, li in enumerate(inputs):
        head = reference_head_state(policy, trace, inputs, list(range(trace.n_layers)), layer)
        metrics, slots, kept = reference_replay_layer(policy, layer, li, res.budgets[layer], P,
                                                      trace.meta.softmax_scale, head_state=head)
        # float32 dot products in both; the L1 bound 2(1 - mass) max||v||_1 magnifies mass rounding by max||v||_1
        np.testing.assert_allclose(res.metrics[layer][..., :4], metrics[..., :4], rtol=1e-4, atol=5e-5)
        np.testing.assert_allclose(res.metrics[layer][..., 4], metrics[..., 4], rtol=1e-4,
                                   atol=1e-4 * li.vmax1.max())
        np.testing.assert_array_equal(res.slots[layer], slots)
        offset = len(kept) - (T - P)
        for r in range(T - P):
            for h in range(hkv):
                row = res.kept[layer, r, h]
                np.testing.assert_array_equal(row[row >= 0], kept[offset + r][h])


@pytest.mark.parametrize("name", [n for n in POLICIES if not get_policy(n).reads_attention])
def test_skipping_unread_attention_changes_nothing(name):
    """A policy that declares ``reads_attention = False`` replays bit for bit as when the engine computes the
    attention of every step (it only skips the unmeasured prompt steps' attention)."""
    trace = make_synthetic_trace("mixed", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=64,
                                 n_prompt=40, seed=3)
    policy = short_policy(name)
    eager = type(policy.name + "_eager", (type(policy),), {"reads_attention": True})(**policy.params)
    budget = max(12, policy.min_budget())
    a, b = replay(trace, policy, budget, record_kept=(40, 24)), replay(trace, eager, budget, record_kept=(40, 24))
    np.testing.assert_array_equal(a.metrics, b.metrics)
    np.testing.assert_array_equal(a.kept, b.kept)


@pytest.mark.parametrize("name", [n for n in POLICIES
                                  if not (get_policy(n).reads_keys and get_policy(n).reads_values)])
def test_deferred_keys_and_values_change_nothing(name):
    """A streamed prompt's steps leave the cached keys / values a policy declares it does not read unwritten and
    unmoved, and fill them from the trace before the first measured step or merge (``_deferred_rows``); where it
    reads neither, their rows start anywhere in a buffer with room past the capacity and close up to whichever side
    moves fewer (``_compact``; 24 decode steps at budget 12 run into its end and move back to row 0). Bit for bit
    the replay of the same policy declaring it reads both (D2O merges while its values are deferred)."""
    trace = make_synthetic_trace("mixed", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=64,
                                 n_prompt=40, seed=5)
    policy = short_policy(name)
    eager = type(policy.name + "_eager", (type(policy),), {"reads_keys": True, "reads_values": True})(**policy.params)
    budget = max(12, policy.min_budget())
    a, b = replay(trace, policy, budget, record_kept=(40, 24)), replay(trace, eager, budget, record_kept=(40, 24))
    np.testing.assert_array_equal(a.metrics, b.metrics)
    np.testing.assert_array_equal(a.kept, b.kept)


def test_profiling_hooks_time_the_engine_parts():
    """benchmarks/replay.py times the engine through these public hooks; they run the engine's own kernels."""
    from sim.replay.engine import profile_attention, profile_parts
    from sim.replay.metrics import N_METRICS
    from sim.replay.layer_inputs import load_layers

    trace = make_synthetic_trace("mixed", n_tokens=80, n_prompt=40, n_layers=1, head_dim=16)
    li = load_layers(trace)[0]
    hq, hkv = li.q.shape[1], li.k.shape[1]
    secs = np.zeros(4)
    profile_parts(li.q, li.k, li.v, li.lse, li.o, li.vmax1, float(trace.meta.softmax_scale), 60, 17, 3, 8, secs)
    assert (secs[[0, 1, 3]] > 0).all()
    probs = np.zeros((hkv, hq // hkv, 17))
    row = np.zeros((hq, N_METRICS))
    out = np.zeros(1)
    profile_attention(li.q, li.k, li.v, li.lse, li.o, li.vmax1, float(trace.meta.softmax_scale), 60, 64, 17, probs,
                      row, out)
    assert out[0] > 0 and np.allclose(probs.sum(axis=2), 1.0)
