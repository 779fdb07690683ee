"""Ada-KV, SnapKV and PyramidKV: worked examples with exact allocations and kept sets, and the paper's
theorems (1, 2, 4) as hypothesis properties."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import get_policy
from policies.snapkv import pyramid_layer_budgets
from policies.core.stage_ada import ada_allocate, ada_prompt, allocation_bound, evict_flat
from sim.replay.policy_replay import replay
from traces.synthetic import make_synthetic_trace


def _prefill_kept(name: str, probs: np.ndarray, budget: int, **params) -> tuple[list[set[int]], list[int]]:
    """Run a policy's prefill kernel on a prompt whose last query has the given attention rows [Hkv, P]
    (one-hot keys, logits = log probs); returns the kept positions and target size per KV head."""
    hkv, P = probs.shape
    k = np.zeros((P, hkv, P), np.float32)
    for h in range(hkv):
        k[:, h, :] = np.eye(P, dtype=np.float32)
    q = np.zeros((P, hkv, P), np.float32)
    q[-1] = np.log(probs).astype(np.float32)
    policy = get_policy(name, **params)
    keep = np.ones((hkv, P), np.uint8)
    slot_state = np.zeros((hkv, P, policy.slot_fields), np.float64)
    head_state = np.zeros((hkv, policy.head_fields), np.float64)
    type(policy).prefill_fn(policy.param_vector(), 0, np.full(hkv, budget, np.int64), q, k, k.copy(), 1.0, keep,
                            slot_state, head_state)
    kept = [set(np.flatnonzero(keep[h]).tolist()) for h in range(hkv)]
    off = type(policy).head_offsets.get("ada")         # Ada-KV's slice: [set, size]
    return kept, head_state[:, off + 1].astype(int).tolist() if off is not None else [budget] * hkv


# head 0 is concentrated on its own (newest) token, head 1 spreads over the candidates
PROBS = np.array([[0.05, 0.01, 0.01, 0.01, 0.01, 0.91],
                  [0.20, 0.19, 0.18, 0.17, 0.16, 0.10]])
ONE_ROW = dict(window_size=1, kernel_size=1)


def test_ada_snapkv_worked_example_exact_allocation_and_kept_sets():
    # budget 3 per head: window 1 (position 5) + 2 candidates per head, 4 for the layer; the top 4 of the
    # flattened candidate scores all belong to head 1 -> adaptive counts (0, 4)
    kept, sizes = _prefill_kept("ada_snapkv", PROBS, 3, floor_alpha=0.0, **ONE_ROW)
    assert sizes == [1, 5] and kept == [{5}, {0, 1, 2, 3, 5}]
    # safeguard 0.5: (0.5 * 0 + 0.5 * 2, 0.5 * 4 + 0.5 * 2) = (1, 3); floor int(0.5 * 2) = 1 slot for head 0
    kept, sizes = _prefill_kept("ada_snapkv", PROBS, 3, **ONE_ROW)
    assert sizes == [2, 4] and kept == [{0, 5}, {0, 1, 2, 5}]
    # uniform SnapKV: 2 candidates each; head 0's ties (0.01) evict the older tokens
    kept, sizes = _prefill_kept("snapkv", PROBS, 3, **ONE_ROW)
    assert sizes == [3, 3] and kept == [{0, 4, 5}, {0, 1, 5}]


def test_snapkv_max_pooling_keeps_neighbours_of_a_peak():
    probs = np.array([[0.02, 0.02, 0.60, 0.02, 0.02, 0.02, 0.10, 0.20]])
    # kernel 3: pooled candidates (0..6) = .02 .60 .60 .60 .02 .10 .10 -> top 3 are positions 1, 2, 3
    kept, _ = _prefill_kept("snapkv", probs, 4, window_size=1, kernel_size=3)
    assert kept == [{1, 2, 3, 7}]
    kept, _ = _prefill_kept("snapkv", probs, 4, window_size=1, kernel_size=1)
    assert kept == [{2, 5, 6, 7}]          # ties at .02 keep the newest (position 5)


def test_ada_allocate_hand_example_and_safeguard_rounding():
    scores = np.array([[0.2, 0.2, 0.2, 0.2, 0.2],          # diffuse
                       [0.9, 0.05, 0.03, 0.01, 0.01],      # concentrated
                       [0.6, 0.3, 0.05, 0.03, 0.02]])
    base = np.array([4, 4, 4])
    # flattened top 12: .9 .6 .3 .2x5 .05 .05 .03 .03 -> counts (5, 3, 4)
    assert ada_allocate(scores, base, 0.0).tolist() == [5, 3, 4]
    # 0.75: 0.25 * (5, 3, 4) + 3 = (4.25, 3.75, 4) -> largest remainder gives head 1 the missing slot
    assert ada_allocate(scores, base, 0.75).tolist() == [4, 4, 4]
    assert ada_allocate(scores, base, 1.0).tolist() == [4, 4, 4]


def test_window_decode_step_uses_sliding_observation_window():
    # window 2, budget 3: step t=10 holds positions 2, 5, 9, 10; the ring has the rows of queries 8 and 9
    policy = get_policy("snapkv", window_size=2, kernel_size=1)
    positions = np.array([[2, 5, 9, 10]], np.int64)
    slot_state = np.zeros((1, 4, 3))
    slot_state[0, :, 1] = [0.5, 0.0, 0.0, 0.0]      # query 8 (t % 2 == 0 -> overwritten now)
    slot_state[0, :, 2] = [0.1, 0.1, 0.8, 0.0]      # query 9
    slot_state[0, :, 0] = slot_state[0, :, 1] + slot_state[0, :, 2]
    probs = np.array([[[0.1, 0.3, 0.2, 0.4]]])
    keep = np.ones((1, 4), np.uint8)
    type(policy).step_fn(policy.param_vector(), 0, 10, np.array([3]), np.array([4]), probs,
                         np.zeros((1, 4, 1), np.float32), np.zeros((1, 4, 1), np.float32), positions, slot_state,
                         np.zeros((1, 0)), keep, np.full((1, 4), -1, np.int64), np.ones((1, 4)))
    # window scores now (0.2, 0.4, 1.0, 0.4); positions 9 and 10 are protected -> position 2 goes, although
    # query 8 (now out of the window) liked it
    assert keep[0].tolist() == [0, 1, 1, 1]
    np.testing.assert_allclose(slot_state[0, :, 0], [0.2, 0.4, 1.0, 0.4])


def test_pyramid_layer_budgets_hand_example():
    # base 32 -> min 32 // 20 = 1, max 63; linear 63, 42.33, 21.67, 1 -> largest remainder -> 63, 42, 22, 1
    assert pyramid_layer_budgets(64, 4, 1000, 32, 20).tolist() == [95, 74, 54, 33]
    # short prompt: max capped at P - window = 48, min = 64 - 48 = 16
    assert pyramid_layer_budgets(64, 4, 80, 32, 20).tolist() == [80, 69, 59, 48]
    assert pyramid_layer_budgets(64, 1, 1000, 32, 20).tolist() == [64]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 12), st.integers(2, 3000), st.integers(1, 64), st.floats(1, 50))
def test_pyramid_budgets_preserve_total_and_decrease(budget, n_layers, n_prompt, window, beta):
    b = pyramid_layer_budgets(budget, n_layers, n_prompt, window, beta)
    assert b.sum() == budget * n_layers and (b >= 1).all() and (np.diff(b) <= 0).all()
    if n_prompt > budget:
        assert b.max() <= n_prompt


@st.composite
def observed_weights(draw):
    h = draw(st.integers(1, 5))
    n = draw(st.integers(1, 12))
    logits = np.array(draw(st.lists(st.floats(-6, 6), min_size=h * n, max_size=h * n))).reshape(h, n)
    w = np.exp(logits)
    return w / w.sum(axis=1, keepdims=True)


@settings(max_examples=200, deadline=None)
@given(observed_weights(), st.data(), st.floats(0, 1))
def test_allocation_sums_respects_floor_and_theorem_4(weights, data, alpha):
    h, n = weights.shape
    b = data.draw(st.integers(0, n))
    base = np.full(h, b, np.int64)
    alloc = ada_allocate(weights, base, alpha)
    assert alloc.sum() == b * h
    assert (alloc >= int(alpha * b)).all() and (alloc <= n).all()
    counts = ada_allocate(weights, base, 0.0)
    assert (np.minimum(counts, b) <= alloc).all() and (alloc <= np.maximum(counts, b)).all()
    # Theorem 4: the adaptive bound is never above the uniform one; alpha = 0 is the global top-k optimum
    assert allocation_bound(weights, alloc, 1.5) <= allocation_bound(weights, base, 1.5) + 1e-12
    top = np.sort(weights.ravel())[::-1][: b * h].sum()
    assert allocation_bound(weights, counts) == pytest.approx(2 * (h - top), abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_theorems_1_and_2_in_the_papers_form(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    h, n, d, dm = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 10)), 3, 5
    logits = rng.normal(0, data.draw(st.floats(0.1, 5)), (h, n))
    v = rng.normal(size=(h, n, d))
    wo = rng.normal(size=(h, d, dm))
    keep = rng.random((h, n)) < data.draw(st.floats(0.1, 1))
    keep[:, -1] = True
    a = np.exp(logits - logits.max(axis=1, keepdims=True))
    a /= a.sum(axis=1, keepdims=True)
    # Theorem 1: softmax over the kept logits == renormalised full weights
    kept_logits = np.where(keep, logits, -np.inf)
    post = np.exp(kept_logits - kept_logits.max(axis=1, keepdims=True))
    post /= post.sum(axis=1, keepdims=True)
    retained = (a * keep).sum(axis=1)
    np.testing.assert_allclose(post, a * keep / retained[:, None], atol=1e-12)
    # Theorem 2 after W^O, summed over heads, C = max row L1 norm of all V^i W^O_i
    y = np.einsum("hn,hnd,hdm->m", a, v, wo)
    y_post = np.einsum("hn,hnd,hdm->m", post, v, wo)
    c = max(np.abs(v[i] @ wo[i]).sum(axis=1).max() for i in range(h))
    assert np.abs(y - y_post).sum() <= 2 * h * c - 2 * c * retained.sum() + 1e-9
    # the engine's per-head, W^O-free form is tighter and holds head by head
    for i in range(h):
        loss = np.abs(a[i] @ v[i] - post[i] @ v[i]).sum()
        assert loss <= 2 * (1 - retained[i]) * np.abs(v[i]).sum(axis=1).max() + 1e-9


REPLAYED = ["snapkv", "pyramidkv", "ada_snapkv", "ada_pyramidkv", "ada_h2o", "h2o"]


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(REPLAYED), st.sampled_from(["mixed", "zipf", "recall", "random"]), st.integers(0, 2**16),
       st.integers(2, 40))
def test_theorem_2_measured_loss_below_bound_on_replays(name, kind, seed, budget):
    trace = make_synthetic_trace(kind, n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=64,
                                 n_prompt=40, seed=seed)
    res = replay(trace, get_policy(name, **({"window_size": 8} if "kv" in name else {})), budget)
    l1, bound = res.metric("l1"), res.metric("l1_bound")
    assert (l1 <= bound + 1e-4 * (1.0 + bound)).all()


@pytest.mark.parametrize("ada,uniform", [("ada_snapkv", "snapkv"), ("ada_pyramidkv", "pyramidkv")])
def test_safeguard_one_is_exactly_the_uniform_policy(ada, uniform):
    trace = make_synthetic_trace("mixed", n_layers=3, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=96,
                                 n_prompt=64, seed=3)
    a = replay(trace, get_policy(ada, floor_alpha=1.0, window_size=8), 20)
    u = replay(trace, get_policy(uniform, window_size=8), 20)
    np.testing.assert_array_equal(a.metrics, u.metrics)
    np.testing.assert_array_equal(a.slots, u.slots)


def test_heads_hold_variable_lengths_and_memory_is_what_they_hold():
    trace = make_synthetic_trace("mixed", n_layers=2, n_q_heads=8, n_kv_heads=4, head_dim=16, n_tokens=160,
                                 n_prompt=128, seed=0)
    res = replay(trace, get_policy("ada_snapkv", window_size=8), 24)
    assert (res.slots.sum(axis=2) == 24 * 4).all()                 # the layer's budget, always used in full
    assert len(set(res.slots[0, 0].tolist())) > 1                  # heads differ
    assert (res.slots == res.slots[:, :1]).all()                   # each head keeps its allocated size
    s = res.summary()
    assert s["kv_bytes_mean"] == res.slots.sum(axis=(0, 2)).mean() * 2 * 16 * 2


def test_ada_prompt_keeps_everything_when_the_prompt_fits():
    head_state = np.zeros((2, 3))
    sizes = np.zeros(2, np.int64)
    lo, hi = np.zeros(2, np.int64), np.full(2, 3, np.int64)
    ada_prompt(np.random.default_rng(0).random((2, 5)), np.array([5, 6]), 2, 0.5, False, lo, hi, head_state, 1, sizes)
    assert sizes.tolist() == [5, 5] and head_state[:, 2].tolist() == [5, 6] and head_state[:, 0].tolist() == [0, 0]


def test_bad_kernel_size_is_named():
    with pytest.raises(ValueError, match="kernel_size"):
        get_policy("snapkv", kernel_size=4)


def test_evict_flat_hand_example():
    # two heads of 4 slots, targets 3 + 3: two slots go, the lowest candidates of either head above its floor
    scores = np.array([[0.5, 0.1, 0.2, 0.9], [0.05, 0.3, 0.01, 0.8]])
    positions = np.array([[0, 3, 5, 9], [1, 2, 4, 9]], np.int64)
    keep = np.ones((2, 4), np.uint8)
    head_state = np.array([[1.0, 3.0], [1.0, 3.0]])
    # position 9 is protected in both heads; head 1 may shrink to 2 slots, head 0 to 3
    evict_flat(scores, positions, np.array([4, 4]), np.zeros(2, np.int64), np.array([9, 9]), np.array([3, 2]),
               head_state, 0, keep)
    assert keep.tolist() == [[1, 1, 1, 1], [0, 1, 0, 1]] and head_state[:, 1].tolist() == [4, 2]


@pytest.mark.parametrize("name", ["ada_snapkv", "ada_h2o"])
def test_flat_decode_reallocates_within_the_layer_budget(name):
    trace = make_synthetic_trace("mixed", n_layers=2, n_q_heads=8, n_kv_heads=4, head_dim=16, n_tokens=192,
                                 n_prompt=128, seed=1)
    par = {"window_size": 8} if name == "ada_snapkv" else {}
    res = replay(trace, get_policy(name, decode_alloc="flat", **par), 24)
    assert (res.slots.sum(axis=2) == 24 * 4).all()
    assert (res.slots != res.slots[:, :1]).any()                   # head sizes move during decode
    w_e = 8 if name == "ada_snapkv" else 12
    assert (res.slots >= w_e + int(0.5 * (24 - w_e))).all()       # the safeguard floor holds at decode too
    l1, bound = res.metric("l1"), res.metric("l1_bound")
    assert (l1 <= bound + 1e-4 * (1.0 + bound)).all()
    same = replay(trace, get_policy(name, decode_alloc="flat", floor_alpha=1.0, **par), 24)
    fixed = replay(trace, get_policy(name, floor_alpha=1.0, **par), 24)
    np.testing.assert_array_equal(same.metrics, fixed.metrics)     # floor 1: flat decode is uniform


# --- the released code (FFY0/AdaKV, GQA path): group max, rounding, window-only budgets ---

def _gqa_prefill_kept(name: str, rows: np.ndarray, budget: int, **params) -> list[set[int]]:
    """Prefill of one KV head whose G query heads give the last W prompt queries the attention rows
    rows[g, w, :] (one-hot keys, logits = log probs; row w of the window sees positions <= P - W + w)."""
    g_n, w_n, P = rows.shape
    k = np.eye(P, dtype=np.float32)[:, None, :].copy()
    q = np.zeros((P, g_n, P), np.float32)
    for g in range(g_n):
        for w in range(w_n):
            r = P - w_n + w
            q[r, g, :r + 1] = np.log(rows[g, w, :r + 1])
    policy = get_policy(name, window_size=w_n, kernel_size=1, **params)
    keep = np.ones((1, P), np.uint8)
    type(policy).prefill_fn(policy.param_vector(), 0, np.array([budget], np.int64), q, k, k.copy(), 1.0, keep,
                            np.zeros((1, P, policy.slot_fields)), np.zeros((1, policy.head_fields)))
    return [set(np.flatnonzero(keep[0]).tolist())]


# two query heads sharing one KV head, window 2 (positions 4, 5), candidates 0..3
GQA_ROWS = np.array([
    [[.40, .45, .05, .05, .05, 0.0], [.40, .02, .02, .02, .02, .52]],     # head 0: window sums .80 .47 .07 .07
    [[.02, .02, .02, .02, .92, 0.0], [.02, .45, .02, .02, .02, .47]],     # head 1: window sums .04 .47 .04 .04
])


@pytest.mark.parametrize("name", ["snapkv", "ada_snapkv"])
def test_group_max_is_the_released_max_of_window_sums(name):
    # released max: max over heads of the window sums = .80 .47 .07 .07 -> position 0
    assert _gqa_prefill_kept(name, GQA_ROWS, 3, group_reduce="max") == [{0, 4, 5}]
    # rowmax (sum over rows of the max over heads) = .80 .90 .07 .07 -> position 1; mean = .42 .47 -> 1
    assert _gqa_prefill_kept(name, GQA_ROWS, 3, group_reduce="rowmax") == [{1, 4, 5}]
    assert _gqa_prefill_kept(name, GQA_ROWS, 3, group_reduce="mean") == [{1, 4, 5}]


def test_released_rounding_floor_half_even_no_correction():
    # three heads, base 5 each (15 for the layer), top-15 flattened counts (2, 5, 8), alpha 0.3
    scores = np.zeros((3, 10))
    for h, c in enumerate((2, 5, 8)):
        scores[h, :c] = 1.0
    base = np.array([5, 5, 5])
    # released: int(0.3 * 5) = 1; round_half_even(0.7 * n + 1) = round(2.4, 4.5, 6.6) = (2, 4, 7): 13, left short
    assert ada_allocate(scores, base, 0.3, True).tolist() == [2, 4, 7]
    # kvsim default: 0.7 n + 0.3 * 5 = (2.9, 5.0, 7.1) -> largest remainder -> (3, 5, 7), exactly 15
    assert ada_allocate(scores, base, 0.3).tolist() == [3, 5, 7]
    # the released rounding can exceed the layer total: counts (3, 3, 6), base 4, alpha .5 -> (3.5, 3.5, 5)
    # rounds to (4, 4, 5) = 13 > 12; the excess comes back from the higher of the heads that rounded up most
    scores = np.zeros((3, 8))
    for h, c in enumerate((3, 3, 6)):
        scores[h, :c] = 1.0
    assert ada_allocate(scores, np.array([4, 4, 4]), 0.5, True).tolist() == [4, 3, 5]
    kept, sizes = _prefill_kept("ada_snapkv", PROBS, 3, rounding="released", **ONE_ROW)
    assert sizes == [2, 4]                          # the worked example above is unchanged: no .5 cases


def test_window_only_at_budget_equal_to_window():
    rows = np.array([[[.2, .2, .2, .2, .2, 0.0], [.50, .10, .10, .10, .10, .10]]])
    # budget 2 = window 2: the released code keeps only the window
    assert _gqa_prefill_kept("snapkv", rows, 2, window_only=True) == [{4, 5}]
    assert _gqa_prefill_kept("ada_snapkv", rows, 2, window_only=True) == [{4, 5}]
    # kvsim's default keeps one selected slot: window 1 (position 5) + the top candidate (position 0)
    assert _gqa_prefill_kept("snapkv", rows, 2) == [{0, 5}]
