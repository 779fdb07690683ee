"""D2O: worked examples of eviction and merging, layer allocation (eq. 4-5), merge weights (eq. 12), reductions."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import get_policy
from policies.d2o import _step, allocate_layers, layer_variances, merge_weights, split_budget
from sim.replay.policy_replay import replay
from traces.synthetic import make_synthetic_trace


def _run_step(policy, keys, scores, budget, head_state=None, t=None):
    """Call the jitted step on one KV head with one query head whose probabilities are all zero."""
    n, d = keys.shape
    cap = n
    ks = np.ascontiguousarray(keys[None], np.float32)
    probs = np.zeros((1, 1, cap))
    pos = np.arange(n, dtype=np.int64)[None].copy()
    st_ = np.zeros((1, cap, policy.slot_fields))           # the scores, then the cached key norms (0: unknown)
    st_[0, :, 0] = scores
    hs = np.zeros((1, 2)) if head_state is None else np.array([head_state], np.float64)
    keep = np.ones((1, cap), np.uint8)
    mt = np.full((1, cap), -1, np.int64)
    mw = np.ones((1, cap))
    _step(policy.param_vector(), 0, n - 1 if t is None else t, np.array([budget], np.int64),
          np.array([n], np.int64), probs, ks, ks.copy(), pos, st_, hs, keep, mt, mw)
    return keep[0], mt[0], mw[0], hs[0]


# five slots, budget 4, one sink, N:M = 3:1 -> T=1, N=2, M=1; slot 2 has the lowest score among slots 1..3
KEYS = np.array([[0.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, -1.0], [3.0, 0.5]])
SCORES = np.array([0.0, 2.0, 1.0, 3.0, 0.0])


def test_split_budget_paper_ratio():
    assert split_budget(4, 1, 0.25) == (1, 2, 1)
    assert split_budget(104, 4, 0.25) == (4, 75, 25)          # N:M = 3:1
    assert split_budget(2, 4, 0.25) == (1, 0, 1)              # sinks never crowd out the newest token


def test_worked_example_eviction_and_first_merge():
    pol = get_policy("d2o", n_sinks=1)
    keep, mt, mw, hs = _run_step(pol, KEYS, SCORES, 4)
    assert keep.tolist() == [1, 1, 0, 1, 1]
    # nearest kept key of [1, 0] by cosine: [3, 0.5] (0.9864) beats [1, 1] and [1, -1] (0.7071)
    u = 3.0 / math.sqrt(9.25)
    assert mt.tolist() == [-1, -1, 4, -1, -1]
    assert hs[0] == pytest.approx(u) and hs[1] == 1.0               # tau initialised to the mean best similarity
    assert mw[2] == pytest.approx(math.exp(u) / (math.e + math.exp(u)))
    assert mw[4] == pytest.approx(math.e / (math.e + math.exp(u)))
    merged = mw[4] * KEYS[4] + mw[2] * KEYS[2]
    np.testing.assert_allclose(merged, [(3 * math.e + math.exp(u)) / (math.e + math.exp(u)),
                                        0.5 * math.e / (math.e + math.exp(u))], rtol=1e-12)


def test_ema_threshold_drops_dissimilar_token():
    pol = get_policy("d2o", n_sinks=1, beta=0.7)
    u = 3.0 / math.sqrt(9.25)
    keep, mt, mw, hs = _run_step(pol, KEYS, SCORES, 4, head_state=[0.999, 1.0])
    assert keep.tolist() == [1, 1, 0, 1, 1]
    assert hs[0] == pytest.approx(0.7 * u + 0.3 * 0.999)
    assert (mt == -1).all()                                         # u < tau: dropped, not merged
    keep2, mt2, _, _ = _run_step(get_policy("d2o", n_sinks=1, ema_threshold=False), KEYS, SCORES, 4,
                                 head_state=[0.999, 1.0])
    assert mt2.tolist() == [-1, -1, 4, -1, -1]                      # without the threshold every token merges


def test_several_evicted_tokens_share_a_receiver():
    keys = np.array([[0.0, 1.0], [1.0, 0.1], [1.0, -0.1], [1.0, 0.0], [0.0, -1.0]])
    scores = np.array([0.0, 0.1, 0.2, 5.0, 0.0])
    pol = get_policy("d2o", n_sinks=1, recent_ratio=0.5)            # budget 3: T=1, N=1, M=1
    keep, mt, mw, hs = _run_step(pol, keys, scores, 3)
    assert keep.tolist() == [1, 0, 0, 1, 1]
    u = 1.0 / math.sqrt(1.01)
    assert mt.tolist() == [-1, 3, 3, -1, -1]
    den = math.e + 2 * math.exp(u)
    np.testing.assert_allclose([mw[1], mw[2], mw[3]], [math.exp(u) / den, math.exp(u) / den, math.e / den])
    assert hs[0] == pytest.approx(u)
    _, mt_avg, mw_avg, _ = _run_step(get_policy("d2o", n_sinks=1, recent_ratio=0.5, merge_weights="average"),
                                     keys, scores, 3)
    assert mt_avg.tolist() == [-1, 3, 3, -1, -1]
    np.testing.assert_allclose([mw_avg[1], mw_avg[2], mw_avg[3]], [1 / 3] * 3)


def test_layer_allocation_eq5():
    # alpha proportional to exp(-F_v): [1, 1/3] -> 16 slots split 12 / 4
    np.testing.assert_array_equal(allocate_layers(8, np.array([0.0, math.log(3.0)]), 1), [12, 4])
    # clamped layers get min_budget, the rest keeps its proportions
    np.testing.assert_array_equal(allocate_layers(4, np.array([0.0, 50.0, 50.0]), 3), [6, 3, 3])


def test_layer_variances_match_numpy():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((9, 4, 8)).astype(np.float32)
    k = rng.standard_normal((9, 2, 8)).astype(np.float32)
    s = 8 ** -0.5
    vs = []
    for j in range(4):
        logits = (q[:, j] @ k[:, j // 2].T).astype(np.float64) * s
        logits[np.triu_indices(9, 1)] = -np.inf
        a = np.exp(logits - logits.max(1, keepdims=True))
        a /= a.sum(1, keepdims=True)
        vs.append(a.sum(0).var())
    assert layer_variances([(q, k)], s)[0] == pytest.approx(np.mean(vs), rel=1e-6)



@pytest.mark.parametrize("mode", ["normalized", "literal"])
def test_layer_variances_threaded_equal_serial(monkeypatch, mode):
    """Long prompts over enough layers (here 9 on 2 threads) run the layers side by side on BLAS's thread share;
    every layer's F_l is the serial one, bit for bit, in layer order."""
    import policies.d2o as d2o_module

    rng = np.random.default_rng(1)
    layers = [(rng.standard_normal((40, 4, 8)).astype(np.float32), rng.standard_normal((40, 2, 8)).astype(np.float32))
              for _ in range(9)]
    serial = layer_variances(layers, 0.3, mode)
    assert d2o_module._blas_threads() >= 1
    threads_used = []
    monkeypatch.setattr(d2o_module, "_THREADED_FROM", 1)
    monkeypatch.setattr(d2o_module, "_blas_threads", lambda: threads_used.append(2) or 2)
    threaded = layer_variances(layers, 0.3, mode)
    assert threads_used, "the threaded path did not run"
    np.testing.assert_array_equal(threaded, serial)

def test_layer_allocation_cap():
    # literal eq. 5 would give [12, 4]; capped at 10 the excess 2 goes to the other layer
    np.testing.assert_array_equal(allocate_layers(8, np.array([0.0, math.log(3.0)]), 1, max_budget=10), [10, 6])


@settings(max_examples=80, deadline=None)
@given(budget=st.integers(1, 300), var=st.lists(st.floats(0, 30), min_size=1, max_size=12),
       min_b=st.integers(1, 8), scale=st.floats(0.01, 10), cap=st.none() | st.integers(1, 600))
def test_layer_budgets_sum_to_total(budget, var, min_b, scale, cap):
    budget = max(budget, min_b)
    out = allocate_layers(budget, np.array(var), min_b, scale, cap)
    assert out.sum() == budget * len(var)
    assert (out >= min_b).all()
    if cap is not None:
        assert (out <= max(cap, budget)).all()
    order = np.argsort(var, kind="stable")
    assert (np.diff(out[order]) <= 1).all()          # more variance never gets more (up to rounding)


@settings(max_examples=60, deadline=None)
@given(sims=st.lists(st.floats(-1, 1), min_size=1, max_size=8), weighted=st.booleans())
def test_merge_weights_as_defined(sims, weighted):
    wc, we = merge_weights(np.array(sims), weighted)
    assert wc + we.sum() == pytest.approx(1.0)
    if weighted:
        assert wc == pytest.approx(math.e / (math.e + np.exp(sims).sum()))
        assert (we <= wc + 1e-12).all()                # self-similarity 1 is the largest weight
    else:
        assert np.allclose(we, wc)


TRACE = make_synthetic_trace("mixed", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=96,
                             n_prompt=32, seed=3)


@settings(max_examples=8, deadline=None)
@given(budget=st.integers(6, 40), beta=st.floats(0.5, 0.9), n_sinks=st.integers(0, 4))
def test_merging_never_adds_slots_and_keeps_eviction_decisions(budget, beta, n_sinks):
    on = replay(TRACE, get_policy("d2o", beta=beta, n_sinks=n_sinks), budget)
    off = replay(TRACE, get_policy("d2o", beta=beta, n_sinks=n_sinks, merge=False), budget)
    np.testing.assert_array_equal(on.slots, off.slots)
    np.testing.assert_array_equal(on.budgets, off.budgets)
    assert (on.slots <= on.budgets[:, None, :]).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(3, 12), d=st.integers(1, 4), data=st.data())
def test_merge_flag_only_adds_merges(seed, n, d, data):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n, d))
    scores = rng.random(n)
    budget = data.draw(st.integers(1, n - 1))
    pol_on = get_policy("d2o", n_sinks=1)
    k_on, mt_on, mw_on, _ = _run_step(pol_on, keys, scores, budget)
    k_off, mt_off, mw_off, hs_off = _run_step(get_policy("d2o", n_sinks=1, merge=False), keys, scores, budget)
    np.testing.assert_array_equal(k_on, k_off)
    assert (mt_off == -1).all() and (mw_off == 1).all() and (hs_off == 0).all()
    for i in np.flatnonzero(mt_on >= 0):
        assert k_on[i] == 0 and k_on[mt_on[i]] == 1
    for j in set(mt_on[mt_on >= 0].tolist()):             # weights of each receiver and its sources sum to 1
        assert mw_on[j] + mw_on[mt_on == j].sum() == pytest.approx(1.0)


def test_eviction_only_reduces_to_h2o():
    pol = get_policy("d2o", n_sinks=0, recent_ratio=0.5, merge=False, layer_alloc=False)
    for budget in (5, 12, 33):
        a = replay(TRACE, pol, budget)
        b = replay(TRACE, get_policy("h2o"), budget)
        np.testing.assert_array_equal(a.metrics, b.metrics)


def test_allocation_uses_prompt_and_is_exact():
    pol = get_policy("d2o")
    res = replay(TRACE, pol, 10)
    assert res.budgets.sum() == 10 * 2 * 2 and (res.budgets >= pol.min_budget()).all()
    assert (replay(TRACE, get_policy("d2o", layer_alloc=False), 10).budgets == 10).all()
    assert (replay(TRACE, pol, 32).budgets == 32).all()   # rho >= 1: no compression, no re-allocation
    assert (replay(TRACE, pol, 20).budgets <= 32).all()   # capped at the prompt length


# --- the released code (AIoT-MLSys-Lab/D2O) as ``preset=reference`` and the normalised layer allocation ---

def _run_layer(policy, keys, scores, budget, head_state=None):
    """One step of the jitted kernel on H KV heads (one query head each, zero probabilities), t = n - 1."""
    h, n, d = keys.shape
    ks = np.ascontiguousarray(keys, np.float32)
    st_ = np.zeros((h, n, policy.slot_fields))            # the scores, then the cached key norms (0: unknown)
    st_[:, :, 0] = scores
    hs = np.zeros((h, 2)) if head_state is None else np.asarray(head_state, np.float64).copy()
    keep = np.ones((h, n), np.uint8)
    mt = np.full((h, n), -1, np.int64)
    mw = np.ones((h, n))
    _step(policy.param_vector(), 0, n - 1, np.full(h, budget, np.int64), np.full(h, n, np.int64),
          np.zeros((h, 1, n)), ks, ks.copy(), np.tile(np.arange(n, dtype=np.int64), (h, 1)), st_, hs, keep, mt, mw)
    return keep, mt, mw, hs


# two KV heads, six slots, budget 4 with one sink: recent = 4 * 0.5 = 2 slots (4, 5), sink 0, one heavy hitter
REF_KEYS = np.array([
    [[1, 0], [0, 1], [3, 4], [4, 3], [-1, 0], [0, -1]],     # head 0 evicts 2 (u .8 -> 1) and 3 (u .8 -> 0)
    [[1, 0], [-3, 4], [0, 1], [5, 12], [-1, 0], [0, -1]],   # head 1 evicts 1 (u .8 -> 2) and 3 (u 12/13 -> 2)
], np.float64)
REF_SCORES = np.array([[0, 5, 1, 2, 0, 0], [0, 1, 5, 2, 0, 0]], np.float64)


def test_reference_preset_values():
    pol = get_policy("d2o", preset="reference", n_sinks=1)
    p = pol.params
    assert (p["prompt"], p["sinks_in_hh"], p["recent_ratio"], p["beta"], p["ema_scope"], p["merge_weights"],
            p["alloc"], p["exempt_layers"]) == ("once", True, 0.5, 0.5, "layer", "released", "normalized", True)
    assert p["n_sinks"] == 1 and pol.has_prefill                    # explicit values win over the preset
    assert get_policy("d2o", preset="reference", beta=0.3).params["beta"] == 0.3
    assert split_budget(10, 4, 0.5, sinks_in_hh=True) == (4, 1, 5)  # sinks inside the heavy-hitter half
    assert split_budget(10, 4, 0.5) == (4, 3, 3)                    # paper reading: sinks first


def test_reference_layer_threshold_and_head_mean_merge():
    pol = get_policy("d2o", preset="reference", n_sinks=1)
    keep, mt, mw, hs = _run_layer(pol, REF_KEYS, REF_SCORES, 4)
    assert keep.tolist() == [[1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 1, 1]]
    u13 = 12 / 13
    tau = (0.8 + 0.8 + 0.8 + u13) / 4                               # one scalar: mean u* over heads and tokens
    assert hs[0, 0] == pytest.approx(tau) and hs[0, 1] == 1.0 and (hs[1] == 0).all()
    # rank 0 (head 0 slot 2, head 1 slot 1): head mean .8 < tau -> both dropped;
    # rank 1 (head 0 slot 3, head 1 slot 3): head mean (.8 + 12/13) / 2 >= tau -> both merged
    assert mt.tolist() == [[-1, -1, -1, 0, -1, -1], [-1, -1, -1, 2, -1, -1]]
    # released merge: scatter-mean of u-scaled keys, (k_c + u k_e) / 2
    np.testing.assert_allclose([mw[0, 0], mw[0, 3], mw[1, 2], mw[1, 3]], [0.5, 0.4, 0.5, u13 / 2])
    # the EMA keeps half of the old threshold: from tau_prev = .9 the rank-1 mean falls below it, nothing merges
    state = np.array([[0.9, 1.0], [0.0, 0.0]])
    _, mt2, _, hs2 = _run_layer(pol, REF_KEYS, REF_SCORES, 4, head_state=state)
    assert hs2[0, 0] == pytest.approx(0.5 * 0.9 + 0.5 * tau) and (mt2 == -1).all()


def test_reference_several_merges_into_one_slot():
    keys = REF_KEYS.copy()
    keys[0, 3] = [0, 5]                                             # head 0 rank 1 now also goes to slot 1, u = 1
    pol = get_policy("d2o", preset="reference", n_sinks=1, ema_threshold=False)
    _, mt, mw, _ = _run_layer(pol, keys, REF_SCORES, 4)
    assert mt.tolist() == [[-1, -1, 1, 1, -1, -1], [-1, 2, -1, 2, -1, -1]]
    # (k_c + sum u_i k_i) / (1 + n) with n = 2
    np.testing.assert_allclose([mw[0, 1], mw[0, 2], mw[0, 3]], [1 / 3, 0.8 / 3, 1 / 3])
    np.testing.assert_allclose([mw[1, 2], mw[1, 1], mw[1, 3]], [1 / 3, 0.8 / 3, 12 / 13 / 3])


def test_prompt_column_sums_blocked_matches_rows():
    from policies.core.shared_kernels import causal_column_sums
    from policies.d2o import prompt_column_sums
    rng = np.random.default_rng(3)
    q = rng.normal(size=(45, 4, 8)).astype(np.float32)
    k = rng.normal(size=(45, 2, 8)).astype(np.float32)
    got = prompt_column_sums(q, k, 0.4, tile=16)
    want = np.stack([causal_column_sums(q, k, 0.4, j, j // 2, 0, 45) for j in range(4)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)     # float32 blocks, float64 sums
    np.testing.assert_allclose(got.sum(axis=1), np.full(4, 45.0))   # every row sums to 1


def test_normalized_variance_is_released_statistic():
    rng = np.random.default_rng(4)
    q = rng.normal(size=(30, 4, 8)).astype(np.float32)
    k = rng.normal(size=(30, 2, 8)).astype(np.float32)
    # the released statistic written out: full causal softmax, column sums, unbiased variance per head,
    # min-max across heads (+1e-6), mean
    rows = np.arange(30)
    var = []
    for j in range(4):
        a = (q[:, j].astype(np.float64) @ k[:, j // 2].astype(np.float64).T) * 0.3
        a[rows[None, :] > rows[:, None]] = -np.inf
        a = np.exp(a - a.max(axis=1, keepdims=True))
        a /= a.sum(axis=1, keepdims=True)
        var.append(a.sum(axis=0).var(ddof=1))
    var = np.array(var)
    want = ((var - var.min()) / (var.max() - var.min() + 1e-6)).mean()
    assert layer_variances([(q, k)], 0.3, "normalized")[0] == pytest.approx(want, rel=1e-5)
    assert 0.0 <= want < 1.0


def test_normalized_allocation_and_exempt_layers():
    from policies.d2o import UNCOMPRESSED
    # F = [0, .5] at budget 10: softmax(-F) * 2 * 10 = [12.45, 7.55] -> [12, 8]
    np.testing.assert_array_equal(allocate_layers(10, np.array([0.0, 0.5]), 1), [12, 8])
    tr = make_synthetic_trace("mixed", n_layers=5, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=60,
                              n_prompt=40, seed=2)
    res = replay(tr, get_policy("d2o"), 12)
    per = res.budgets[:, 0]
    assert res.budgets.sum() == 12 * 5 * 2 and per.min() >= 5 and per.max() <= 40
    assert per.max() / per.min() <= math.e + 0.5                   # F in [0, 1): at most a factor e (plus rounding)
    ref = replay(tr, get_policy("d2o", exempt_layers=True), 12).budgets[:, 0]
    assert (ref[[0, 1, 4]] == UNCOMPRESSED).all() and (ref[2:4] == per[2:4]).all()


def test_prompt_once_selects_by_full_column_sums():
    from policies.d2o import _prefill_once, prompt_column_sums
    rng = np.random.default_rng(5)
    s, d = 24, 8
    q = rng.normal(size=(s, 4, d)).astype(np.float32)
    k = rng.normal(size=(s, 2, d)).astype(np.float32)
    pol = get_policy("d2o", preset="reference", n_sinks=2)
    keep = np.ones((2, s), np.uint8)
    st_ = np.zeros((2, s, pol.slot_fields))
    _prefill_once(pol.param_vector(), 0, np.array([10, 10], np.int64), q, k, k.copy(), 0.5, keep, st_,
                  np.zeros((2, 2)))
    sums = prompt_column_sums(q, k, 0.5).reshape(2, 2, s).mean(axis=1)     # group mean per KV head
    np.testing.assert_allclose(st_[:, :, 0], sums, rtol=1e-5)
    for h in range(2):
        # budget 10: recent 5 (19..23), sinks 0, 1 and the 3 heaviest of 2..18
        heavy = 2 + np.argsort(-sums[h, 2:19], kind="stable")[:3]
        want = sorted({0, 1, *heavy.tolist(), *range(19, 24)})
        assert np.flatnonzero(keep[h]).tolist() == want


def test_reference_preset_replays_within_budget():
    tr = make_synthetic_trace("mixed", n_layers=4, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=80,
                              n_prompt=48, seed=1)
    res = replay(tr, get_policy("d2o", preset="reference"), 16)
    assert np.isfinite(res.metrics).all()
    assert res.slots[2].max() <= res.budgets[2, 0]                  # the one compressed layer keeps its budget
    assert (res.slots[[0, 1, 3], -1] == 80).all()                   # layers 0, 1 and L-1 keep every token


def test_layer_variances_are_computed_once_per_prepared_inputs(monkeypatch):
    """D2O's prompt statistics do not depend on the budget: the replays of several budgets (and a sweep worker's
    jobs) on the same prepared inputs compute them once, with the same results as computing them each time."""
    import policies.d2o as d2o_module
    from sim.replay.layer_inputs import load_layers
    from sim.replay.policy_replay import replay_budgets
    from traces.synthetic import make_synthetic_trace

    trace = make_synthetic_trace("mixed", n_layers=3, n_tokens=96, n_prompt=64, seed=2)
    calls = []
    real = d2o_module.layer_variances
    monkeypatch.setattr(d2o_module, "layer_variances", lambda *a: calls.append(1) or real(*a))
    inputs = load_layers(trace)
    shared = replay_budgets(trace, get_policy("d2o"), [16, 24, 32], inputs=inputs)
    assert len(calls) == 1
    fresh = [replay_budgets(trace, get_policy("d2o"), [b])[0] for b in (16, 24, 32)]
    assert len(calls) == 4
    for a, b in zip(shared, fresh):
        np.testing.assert_array_equal(a.budgets, b.budgets)
        np.testing.assert_array_equal(a.metrics, b.metrics)
