"""BUZZ: Algorithms 1-2 step by step, Remark 2 prefill, the count model vs the kernel, Theorem 3.1's recurrence."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies._buzz_model import (CountRule, held_trajectory, old_sequence, paper_recurrence, predicted_ratio,
                                  steady_old_fraction, theorem_ratio)
from policies.buzz import _logn_scale, _prefill, _sample
from policies.core.shared_kernels import prompt_attention
from policies.core.base import PolicyError
from policies.core.registry import get_policy
from sim.replay.policy_replay import replay
from traces.synthetic import make_synthetic_trace

# per-position attention credited once, when the token is created: accumulated score of position p == U[p]
U = [0.0, 0.1, 0.5, 0.2, 0.9, 0.3, 0.4, 0.05, 0.3, 0.1, 0.3, 0.0, 0.2, 0.6, 0.1, 0.7, 0.2, 0.8, 0.1, 0.3, 0.5]


def drive(policy, budget: int, n_steps: int) -> list[set[int]]:
    """Run the jitted step the way the engine does (append, step, compact) on one KV head; kept sets per step."""
    step = type(policy).step_fn
    params = policy.param_vector()
    cap = budget + 1
    probs = np.zeros((1, 1, cap))
    keys = np.zeros((1, cap, 1), np.float32)
    values = np.zeros((1, cap, 1), np.float32)
    positions = np.full((1, cap), -1, np.int64)
    slot_state = np.zeros((1, cap, type(policy).slot_fields))
    head_state = np.zeros((1, type(policy).head_fields))
    keep = np.ones((1, cap), np.uint8)
    merge_to = np.full((1, cap), -1, np.int64)
    merge_w = np.ones((1, cap))
    lengths = np.zeros(1, np.int64)
    budgets = np.array([budget], np.int64)
    out = []
    for t in range(n_steps):
        n = lengths[0]
        positions[0, n] = t
        slot_state[0, n] = 0.0
        lengths[0] = n + 1
        probs[:] = 0.0
        probs[0, 0, n] = U[t]
        step(params, 0, t, budgets, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
             merge_w)
        m = keep[0, : n + 1] == 1
        kept_pos, kept_state = positions[0, : n + 1][m].copy(), slot_state[0, : n + 1][m].copy()
        lengths[0] = len(kept_pos)
        positions[0, : len(kept_pos)] = kept_pos
        slot_state[0, : len(kept_pos)] = kept_state
        keep[:] = 1
        assert len(kept_pos) <= budget
        out.append(set(int(p) for p in kept_pos))
    return out


def test_algorithm2_local_max_hives():
    # Scores 0.1 0.5 0.2 | 0.9 0.3 0.4 | 0.05, stride 3, hives from the oldest slot: maxima 0.5, 0.9 and the
    # partial hive's only slot 0.05 -> slots 1, 3, 6 survive ("keep"); "drop" evicts the partial hive.
    scores = np.array([0.1, 0.5, 0.2, 0.9, 0.3, 0.4, 0.05])
    for drop, want in ((False, [1, 3, 6]), (True, [1, 3])):
        idx = np.arange(7)
        keep = np.ones(7, np.uint8)
        m = _sample(idx, 7, 3, True, scores, drop, False, keep)
        assert list(idx[:m]) == want and list(np.flatnonzero(keep)) == want
    # right-aligned hives [4,5,6] (0.3, 0.4, 0.05), [1,2,3] (0.5, 0.2, 0.9), [0]: maxima at slots 5, 3, 0
    idx = np.arange(7)
    keep = np.ones(7, np.uint8)
    m = _sample(idx, 7, 3, True, scores, False, True, keep)
    assert list(idx[:m]) == [0, 3, 5]
    # ties go to the older slot
    idx = np.arange(3)
    keep = np.ones(3, np.uint8)
    assert _sample(idx, 3, 3, True, np.array([0.3, 0.1, 0.3]), False, False, keep) == 1 and idx[0] == 0


def _reference_sample(scores, stride, by_score, drop, right):
    """Algorithm 2 / interval sampling written plainly: hive boundaries, then one pick per hive."""
    m = len(scores)
    if right:
        hives = [(max(0, e - stride), e) for e in range(m, 0, -stride)]
    else:
        hives = [(b, min(m, b + stride)) for b in range(0, m, stride)]
    picks = []
    for g0, g1 in hives:
        if g1 - g0 < stride and drop:
            continue
        if by_score:
            picks.append(g0 + int(np.argmax(scores[g0:g1])))   # first maximum: the older token on ties
        else:
            picks.append(g1 - 1 if right else g0)
    return sorted(picks)


@settings(max_examples=150, deadline=None)
@given(scores=st.lists(st.integers(0, 4), min_size=0, max_size=40), stride=st.integers(1, 7), by_score=st.booleans(),
       drop=st.booleans(), right=st.booleans())
def test_sampling_matches_plain_reference(scores, stride, by_score, drop, right):
    arr = np.array(scores, np.float64)
    idx = np.arange(len(arr))
    keep = np.ones(len(arr), np.uint8)
    m = _sample(idx, len(arr), stride, by_score, arr, drop, right, keep)
    want = _reference_sample(arr, stride, by_score, drop, right)
    assert list(idx[:m]) == want and list(np.flatnonzero(keep)) == want


def test_algorithm1_total_counting_keep_tail():
    # k=1, w=2, T=6, s=3 (s_hat=2), old+new counted, pass when the count exceeds T (7 tokens).
    pol = get_policy("buzz", n_sinks=1, stride=3, window=2, threshold=6)
    kept = drive(pol, 9, 17)
    # Nothing evicted while the middle (positions 1..t-2) holds <= 6 tokens: t = 0..8 keep everything.
    for t in range(9):
        assert kept[t] == set(range(t + 1))
    # t=9: middle 1..7 (7 new, 0 old) -> pass. Hives [1,2,3] [4,5,6] [7]: U maxima 2 (0.5), 4 (0.9), 7 (only).
    assert kept[9] == {0, 2, 4, 7, 8, 9}
    # t=10..12 buffer new tokens 8..10 (old 3 + new <= 6): no eviction.
    assert kept[12] == {0, 2, 4, 7} | set(range(8, 13))
    # t=13: old {2,4,7} + new 8..11 = 7 -> pass. Old, interval s_hat=2 from the oldest: [2,4] [7] -> 2, 7.
    # New hives [8,9,10] (0.3, 0.1, 0.3: tie -> older 8) and [11] -> 8, 11. Window 12, 13.
    assert kept[13] == {0, 2, 7, 8, 11, 12, 13}
    # t=16: old {2,7,8,11} + new 12..14 = 7 -> pass. Old [2,7] [8,11] -> 2, 8; new [12,13,14] -> 13 (0.6).
    assert kept[16] == {0, 2, 8, 13, 15, 16}
    assert max(len(s) for s in kept) == 1 + 2 + 6   # k + w + T, the budget


def test_algorithm1_drop_tail_and_right_alignment():
    # Same trace, partial hives evicted: t=9 keeps 2, 4 (7 dropped); the next pass needs 2 + 5 new tokens
    # (8..12) at t=14: old [2,4] -> 2; new [8,9,10] -> 8, partial [11,12] dropped.
    kept = drive(get_policy("buzz", n_sinks=1, stride=3, window=2, threshold=6, hive_tail="drop"), 9, 15)
    assert kept[9] == {0, 2, 4, 8, 9}
    assert kept[13] == {0, 2, 4} | set(range(8, 14))
    assert kept[14] == {0, 2, 8, 13, 14}
    # Hives anchored at the newest token. t=9: [5,6,7] -> 6 (0.4), [2,3,4] -> 4, [1] -> 1.
    # t=13: old [4,6] -> newest 6, partial [1] -> 1; new [9,10,11] -> 10 (0.3), [8] -> 8.
    kept = drive(get_policy("buzz", n_sinks=1, stride=3, window=2, threshold=6, hive_align="right"), 9, 14)
    assert kept[9] == {0, 1, 4, 6, 8, 9}
    assert kept[13] == {0, 1, 6, 8, 10, 12, 13}


def test_algorithm1_new_counting_and_strict_bounds():
    # Algorithm 1 literally: T=4 new tokens buffered (`while m <= T` appends T+1 = 5) per pass, k=1, w=2, s=3.
    # Peak = k + w + T + max(T, old steady state): old a -> ceil(a/2) + ceil(5/3) has fixed point 4 -> 11.
    pol = get_policy("buzz", n_sinks=1, stride=3, window=2, threshold=4, threshold_on="new")
    assert pol.peak(11) == 11 and pol.min_budget() == 11
    kept = drive(pol, 11, 13)
    # t=7: new 1..5 -> hives [1,2,3] -> 2, [4,5] -> 4.
    assert kept[7] == {0, 2, 4, 6, 7}
    # t=12: 5 more new (6..10): old [2,4] -> 2; new [6,7,8] -> 6 (0.4), [9,10] -> 10 (0.3).
    assert kept[11] == {0, 2, 4} | set(range(6, 12))
    assert kept[12] == {0, 2, 6, 10, 11, 12}
    # Strict bounds: the pass fires when old+new reaches T=6 (not 7): first at t=8 over 1..6 -> 2, 4.
    kept = drive(get_policy("buzz", n_sinks=1, stride=3, window=2, threshold=6, inclusive_bounds=False), 8, 9)
    assert kept[7] == set(range(8)) and kept[8] == {0, 2, 4, 7, 8}


def test_prefill_remark2_samples_until_it_fits():
    # P=20, k=1, w=2, T=4, s=3. All queries q = c*e0, keys k_i = b_i*e0 with a bump at positions 5 and 15:
    # every other key has the same logit, so its accumulated score sum_{r>=i} 1/Z_r decreases with i and the
    # oldest wins its hive unless the hive holds a bump. Middle 1..17 (17 > T): local max, s=3:
    # [1-3]->1 [4-6]->5 [7-9]->7 [10-12]->10 [13-15]->15 [16,17]->16 (6 > 4), then interval s_hat=2:
    # [1,5]->1 [7,10]->7 [15,16]->15 (3 <= 4). Kept: sink 0, old 1, 7, 15, window 18, 19.
    P = 20
    q = np.zeros((P, 1, 2), np.float32)
    k = np.zeros((P, 1, 2), np.float32)
    q[:, 0, 0] = 1.0
    k[[5, 15], 0, 0] = 6.0
    pol = get_policy("buzz", n_sinks=1, stride=3, window=2, threshold=4)
    keep = np.ones((1, P), np.uint8)
    slot_state = np.zeros((1, P, 2))
    head_state = np.zeros((1, 3))
    _prefill(pol.param_vector(), 0, np.array([7], np.int64), q, k, k.copy(), 1.0, keep, slot_state, head_state)
    assert set(np.flatnonzero(keep[0])) == {0, 1, 7, 15, 18, 19}
    assert set(np.flatnonzero(slot_state[0, :, 1])) == {1, 7, 15}        # survivors are old tokens
    # a middle that already fits (P = k + w + T = 7) is kept whole, as unsampled new tokens
    keep = np.ones((1, 7), np.uint8)
    _prefill(pol.param_vector(), 0, np.array([7], np.int64), q[:7], k[:7], k[:7].copy(), 1.0, keep,
             np.zeros((1, 7, 2)), np.zeros((1, 3)))
    assert keep.all()


def test_prompt_scores_match_numpy():
    # Accumulated prompt attention (the prefill's hive scores): column sums of causal softmax rows, with the
    # query heads of a KV head reduced by mean / sum / max row by row. 70 rows span two row blocks.
    rng = np.random.default_rng(0)
    q = rng.standard_normal((70, 4, 8)).astype(np.float32)
    k = rng.standard_normal((70, 2, 8)).astype(np.float32)
    logits = np.einsum("rhgd,thd->hgrt", q.reshape(70, 2, 2, 8).astype(np.float64), k.astype(np.float64)) * 0.3
    logits = np.where(np.tri(70, dtype=bool), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)                                          # [Hkv, G, r, t]
    for mode, red in enumerate((p.mean(1), p.sum(1), p.max(1))):       # the kernel's logits are float32 dots
        np.testing.assert_allclose(prompt_attention(q, k, 0.3, mode), red.sum(1), rtol=1e-6, atol=1e-12)


CONFIGS = st.fixed_dictionaries({
    "stride": st.integers(3, 7),
    "threshold_on": st.sampled_from(["total", "new"]),
    "inclusive_bounds": st.booleans(),
    "hive_tail": st.sampled_from(["keep", "drop"]),
    "hive_align": st.sampled_from(["left", "right"]),
    "score_scope": st.sampled_from(["head", "layer"]),
})


@settings(max_examples=25, deadline=None)
@given(cfg=CONFIGS, budget=st.integers(24, 90), n_prompt=st.sampled_from([0, 40, 150]), seed=st.integers(0, 3))
def test_kernel_slot_counts_follow_count_model(cfg, budget, n_prompt, seed):
    # The engine's held slots after every measured step equal the plain-Python count model (prefill included),
    # never exceed the budget, and the sinks and the window are always held.
    trace = make_synthetic_trace("mixed", n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=260,
                                 n_prompt=n_prompt, seed=seed)
    pol = get_policy("buzz", n_sinks=2, **cfg)
    if budget < pol.min_budget():
        budget = pol.min_budget()
    res = replay(trace, pol, budget, record_kept=(n_prompt, 260 - n_prompt))
    w, T = pol.window_threshold(budget)
    model = held_trajectory(pol.rule(w, T), 260, n_prompt)[n_prompt:]
    assert (res.slots[0] == np.array(model)[:, None]).all()
    assert res.slots.max() <= budget and max(model) <= pol.peak(budget) <= budget
    for r, t in enumerate(res.kept_steps):
        for h in range(2):
            held = set(res.kept[0, r, h][res.kept[0, r, h] >= 0].tolist())
            assert set(range(min(2, t + 1))) <= held and set(range(max(0, t - w + 1), t + 1)) <= held


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(16, 4000), k=st.integers(0, 8), s=st.integers(3, 12), on=st.sampled_from(["total", "new"]),
       incl=st.booleans(), tail=st.sampled_from(["keep", "drop"]), ratio=st.sampled_from([0.0, 1.5, 4.5]))
def test_budget_mapping_peak_fits(budget, k, s, on, incl, tail, ratio):
    # Derived (w, T): w >= 1, T >= s, and the most slots ever held (any prompt length) stays within the budget;
    # with "total" counting and inclusive bounds the peak is exactly k + w + T = budget.
    pol = get_policy("buzz", n_sinks=k, stride=s, threshold_on=on, inclusive_bounds=incl, hive_tail=tail,
                     t_over_w=ratio)
    if budget < pol.min_budget():
        with pytest.raises(ValueError, match="below its minimum"):
            pol.check_budget(budget)
        return
    w, T = pol.window_threshold(budget)
    assert w >= 1 and T >= s and pol.peak(budget) <= budget
    if on == "total" and incl:
        assert k + w + T == budget
    rule = pol.rule(w, T)
    for p in (0, k + w + T, 3 * budget):
        assert max(held_trajectory(rule, 3 * budget + 50, p)) <= pol.peak(budget)
    assert pol.footprint(budget, 3 * budget) <= budget
    # streamed from the first token: k + w + T + (old tokens' supremum over passes), the issue's bound
    assert max(held_trajectory(rule, 3 * budget + 50)) <= k + w + rule.limit + max(old_sequence(rule, 60))


@settings(max_examples=200, deadline=None)
@given(s=st.integers(3, 16), T=st.integers(3, 3000), incl=st.booleans(), drop=st.booleans())
def test_threshold_at_least_stride_never_overfills(s, T, incl, drop):
    # With old+new counting a pass over a old and fire-a new tokens keeps at most `limit` for every a: T >= s is
    # all Buzz.validate needs to guarantee k + w + T.
    rule = CountRule(0, 1, max(T, s), s, False, incl, drop)
    assert all(rule.after_pass(a, rule.fire - a) <= rule.limit for a in range(rule.limit + 1))


@settings(max_examples=200, deadline=None)
@given(s=st.integers(3, 25), T=st.integers(3, 5000))
def test_recurrence_eq10_matches_implementation(s, T):
    # Appendix D.1 eq. 10 with a/s_hat (not the printed 2a/s_hat) is exactly the old-token sequence of
    # "total" counting, strict bounds (a_1 = floor(T/s): the first pass sees T new tokens) and dropped tails.
    T = max(T, s)
    assert old_sequence(CountRule(0, 1, T, s, False, False, True), 30) == paper_recurrence(s, T, 30)


def test_recurrence_eq10_as_printed_does_not_match():
    # The printed 2a/s_hat doubles the surviving old tokens: s=5, T=100 settles at 36 instead of 22.
    rule = CountRule(0, 1, 100, 5, False, False, True)
    assert old_sequence(rule, 10)[-1] == 22 and paper_recurrence(5, 100, 10, literal=True)[-1] == 36


def _tail_bounds(rule: CountRule) -> tuple[int, int]:
    seq = old_sequence(rule, 120)
    return min(seq[60:]), max(seq[60:])


@settings(max_examples=200, deadline=None)
@given(s=st.integers(3, 25), T=st.integers(3, 5000), on_new=st.booleans(), incl=st.booleans(), drop=st.booleans())
def test_steady_state_bounded_and_converges(s, T, on_new, incl, drop):
    # Old tokens settle within a few passes to a fixed point or a 2-cycle of adjacent values, inside the
    # bracket eq. 11-12 gives once the floors (or ceilings) are removed: with F tokens firing a pass and
    # c = lim a_n / T from steady_old_fraction, c*F - 2 < lim a_n <= c*F + 2 (exact form below).
    T = max(T, s)
    rule = CountRule(0, 1, T, s, on_new, incl, drop)
    seq = old_sequence(rule, 120)
    assert seq[40:-2] == seq[42:]
    lo, hi = _tail_bounds(rule)
    assert hi - lo <= 1
    if not on_new:
        assert hi <= rule.limit
    sh = (s + 1) // 2
    coef = (1 - 1 / sh) if on_new else (1 - 1 / sh + 1 / s)   # a (1 - 1/s_hat [+ 1/s]) = F/s + rounding
    for a in (lo, hi):
        if drop:
            assert rule.fire / s - 2 < coef * a <= rule.fire / s + 1e-9
        else:
            assert rule.fire / s - 1e-9 <= coef * a < rule.fire / s + 2


@settings(max_examples=100, deadline=None)
@given(s=st.integers(3, 41), T=st.integers(50, 6000))
def test_theorem31_parity_cases(s, T):
    # Eq. 12, (s^2+1)/(s^2+s) * lim a_n in (T/s - 2, T/s], uses 2a/(s+1) = a/s_hat, exact for odd s only.
    # For even s, s_hat = s/2 gives (s-1)/s * lim a_n in (T/s - 2, T/s] instead. Setting lim a_n = w:
    # odd s -> T/w = (s^2+1)/(s+1), even s -> T/w = s-1: the theorem statement (eq. 6/9); the proof's
    # labels (eq. 13 "s even", eq. 14 "s odd") are swapped.
    lo, hi = _tail_bounds(CountRule(0, 1, T, s, False, False, True))
    coef = (s * s + 1) / (s * s + s) if s % 2 else (s - 1) / s
    assert all(T / s - 2 < coef * a <= T / s + 1e-9 for a in (lo, hi))
    assert predicted_ratio(s) == pytest.approx(theorem_ratio(s))


def test_theorem31_even_stride_contradicts_eq12():
    # s=4, T=400: a_n ends alternating 132, 133 ~ T/(s-1); eq. 12's coefficient 17/20 puts it at > 112,
    # above eq. 12's upper bound T/s = 100.
    lo, hi = _tail_bounds(CountRule(0, 1, 400, 4, False, False, True))
    assert (lo, hi) == (132, 133) and (17 / 20) * lo > 400 / 4


def test_predictions_for_stride5():
    # Paper: predicted 4.33 at s=5. Algorithm 1's "new" counting predicts s(s_hat-1)/s_hat = 10/3 instead.
    assert predicted_ratio(5) == pytest.approx(13 / 3)
    assert predicted_ratio(5, True) == pytest.approx(10 / 3)
    assert steady_old_fraction(4, True) == pytest.approx(1 / 2)     # even s: T/w = s - 2


def test_full_budget_is_full_cache_and_log_n_changes_attention():
    trace = make_synthetic_trace("zipf", n_layers=1, n_tokens=120, n_prompt=30, seed=2)
    full = replay(trace, get_policy("full"), 120).metric("err")
    plain = replay(trace, get_policy("buzz"), 120)
    assert np.allclose(plain.metric("err"), full) and (plain.slots[0, -1] == 120).all()
    logn = replay(trace, get_policy("buzz_logn"), 120)
    assert (logn.slots == plain.slots).all() and logn.metric("err").mean() > full.mean() + 1e-3


def test_log_n_multiplier():
    pol = get_policy("buzz_logn")
    p = pol.param_vector()
    assert _logn_scale(p, 512) == pytest.approx(1.0) and _logn_scale(p, 512 ** 2) == pytest.approx(2.0)
    assert _logn_scale(p, 64) == pytest.approx(2 / 3) and _logn_scale(p, 1) > 0
    assert _logn_scale(get_policy("buzz_logn", logn_clamp=True).param_vector(), 64) == 1.0


def test_deterministic_and_bad_parameters():
    trace = make_synthetic_trace("recall", n_layers=1, n_tokens=200, n_prompt=50, seed=3)
    a = replay(trace, get_policy("buzz", score_scope="layer"), 60, record_kept=(50, 150))
    b = replay(trace, get_policy("buzz", score_scope="layer"), 60, record_kept=(50, 150))
    assert (a.kept == b.kept).all() and np.array_equal(a.metrics, b.metrics)
    assert (a.kept[0, :, 0] == a.kept[0, :, 1]).all()      # layer scope: every head keeps the same positions
    with pytest.raises(ValueError, match="below the stride"):
        get_policy("buzz", stride=5, threshold=4)
    with pytest.raises(ValueError, match="minimum"):
        get_policy("buzz", stride=2)
    with pytest.raises(ValueError, match="below its minimum 104"):
        get_policy("buzz", window=50, threshold=50).check_budget(80)


def test_footprint_matches_trajectory_and_tabulates_fast():
    # footprint(n) is the count model's trajectory at n, for every n (memoised: a serving table of 20k lengths
    # costs one trajectory), with a prompt shorter or longer than n.
    pol = get_policy("buzz")
    rule = pol.rule(*pol.window_threshold(96))
    traj = held_trajectory(rule, 3000, 500)
    assert [pol.footprint(96, n, n_prompt=500) for n in range(501, 3001)] == traj[500:]
    assert pol.footprint(96, 300, n_prompt=500) == held_trajectory(rule, 300, 300)[-1]
    table = [pol.footprint(96, n) for n in range(1, 20001)]
    assert max(table) == 96 and table[:10] == list(range(1, 11))


# --- the released code (danielfang001/buzz-llm, BuzzKVCacheWithAccumulation): one pass per forward call ---

def test_one_pass_prefill_then_decode_thins_like_the_released_code():
    # the Remark 2 example above with prefill=one_pass: only the local-max pass runs on the prompt, leaving
    # 6 > T = 4 old tokens: kept 0 | 1 5 7 10 15 16 | 18 19
    P = 20
    q = np.zeros((P + 1, 1, 2), np.float32)
    k = np.zeros((P + 1, 1, 2), np.float32)
    q[:, 0, 0] = 1.0
    k[[5, 15], 0, 0] = 6.0
    pol = get_policy("buzz", n_sinks=1, stride=3, window=2, threshold=4, prefill="one_pass")
    keep = np.ones((1, P), np.uint8)
    slot_state = np.zeros((1, P, 2))
    head_state = np.zeros((1, 3))
    budget = np.array([10], np.int64)
    _prefill(pol.param_vector(), 0, budget, q[:P], k[:P], k[:P].copy(), 1.0, keep, slot_state, head_state)
    kept = np.flatnonzero(keep[0])
    assert kept.tolist() == [0, 1, 5, 7, 10, 15, 16, 18, 19]
    assert set(np.flatnonzero(slot_state[0, :, 1])) == {1, 5, 7, 10, 15, 16}
    # first decode step (token 20): 18 leaves the window; old + new = 7 > T, so one pass: old tokens thinned
    # with s_hat = 2 from the first ([1 5] [7 10] [15 16] -> 1 7 15), the new hive [18] keeps 18
    n = len(kept) + 1
    positions = np.append(kept, 20)[None].astype(np.int64)
    st = np.zeros((1, n, 2))
    st[0, :-1] = slot_state[0, kept]
    keep2 = np.ones((1, n), np.uint8)
    type(pol).step_fn(pol.param_vector(), 0, 20, budget, np.array([n], np.int64), np.zeros((1, 1, n)),
                      np.zeros((1, n, 2), np.float32), np.zeros((1, n, 2), np.float32), positions, st, head_state,
                      keep2, np.full((1, n), -1, np.int64), np.ones((1, n)))
    assert positions[0, keep2[0] == 1].tolist() == [0, 1, 7, 15, 18, 19, 20]


def test_one_pass_prefill_counts_and_budget():
    from policies._buzz_model import CountRule, held_after_prefill
    # the example: P = 700, k = 4, w = 16, T = 40, s = 5: 4 + 16 + ceil(680 / 5) = 156 against 36
    assert held_after_prefill(CountRule(4, 16, 40, 5, one_pass_prefill=True), 700) == 156
    assert held_after_prefill(CountRule(4, 16, 40, 5), 700) == 36
    with pytest.raises(PolicyError, match="explicit window and threshold"):
        get_policy("buzz", prefill="one_pass")
    tr = make_synthetic_trace("mixed", n_layers=2, n_q_heads=2, n_kv_heads=1, head_dim=16, n_tokens=160,
                              n_prompt=120, seed=0)
    one = get_policy("buzz", window=8, threshold=12, prefill="one_pass")
    res = replay(tr, one, 24)
    assert (res.budgets == 4 + 8 + 108 // 5 + 1).all()                # what the one prompt pass leaves: 34 > 24
    # first decode step: the 22 old tokens thin to ceil(22 / 3) = 8, token 111 leaves the window as a new one:
    # 4 + 8 + 1 + 8 = 21 held after it, within the nominal budget from then on
    assert (res.slots[:, 0] == 21).all() and res.slots.max() <= 24
    # when one pass fits (ceil((P - k - w) / s) <= T) both modes keep the same sets at every step
    fit_kw = dict(window=8, threshold=30)
    a = replay(tr, get_policy("buzz", prefill="one_pass", **fit_kw), 42)
    b = replay(tr, get_policy("buzz", **fit_kw), 42)
    np.testing.assert_array_equal(a.metrics, b.metrics)


def test_replay_reads_the_prompt_attention_table_and_changes_nothing(monkeypatch):
    """A replay hands BUZZ's prefill the trace's prompt attention (``replay_head_state``, shared with BumbleBee
    under one key); the prefill computing it itself gives the same kept sets and metrics."""
    from policies.core.base import Policy
    from sim.replay.layer_inputs import load_layers
    from sim.replay.policy_replay import replay
    from traces.synthetic import make_synthetic_trace

    trace = make_synthetic_trace("mixed", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=120,
                                 n_prompt=90, seed=4)
    pol = get_policy("buzz")
    inputs = load_layers(trace)
    head = pol.replay_head_state(2, 16, inputs[0], {}, n_prompt=90)
    assert head.shape == (2, 3 + 90)
    np.testing.assert_array_equal(head[:, 3:], prompt_attention(inputs[0].q[:90], inputs[0].k[:90],
                                                                inputs[0].attention.scale, 1))
    tabled = [replay(trace, pol, b, inputs=inputs, record_kept=(90, 30)) for b in (24, 40)]
    assert any(k[0] == "prompt_attention" for k in inputs.stats[("layer_memo", 0)])
    monkeypatch.setattr(type(pol), "replay_head_state", Policy.replay_head_state)
    plain = [replay(trace, pol, b, inputs=inputs, record_kept=(90, 30)) for b in (24, 40)]
    for a, b in zip(tabled, plain):
        np.testing.assert_array_equal(a.kept, b.kept)
        np.testing.assert_array_equal(a.metrics, b.metrics)
