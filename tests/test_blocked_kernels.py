"""The blocked/vectorised kernels compute the numbers of their scalar definitions (up to rounding) and
the oracle's kept sets are exactly a stable argsort's prefixes."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.core.shared_kernels import causal_attention_scores, causal_row, group_score, softmax_rows_inplace
from sim.replay.oracle_kernels import keep_smallest, kth_smallest


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), spread=st.sampled_from([0.1, 1.0, 30.0, 1e4]), seed=st.integers(0, 1000))
def test_softmax_rows_inplace_matches_numpy(n, spread, seed):
    x = np.random.default_rng(seed).standard_normal(n) * spread
    ref = np.exp(0.3 * x - (0.3 * x).max())
    ref /= ref.sum()
    got = x.copy()
    softmax_rows_inplace(got, n, 0.3, np.empty(n, np.int64))
    big = ref > 1e-300
    np.testing.assert_allclose(got[big], ref[big], rtol=5e-15)
    assert np.all(got[~big] < 1e-300)


@settings(max_examples=20, deadline=None)
@given(P=st.integers(1, 300), r0=st.integers(0, 299), mode=st.integers(0, 2), seed=st.integers(0, 100))
def test_causal_attention_scores_match_causal_rows(P, r0, mode, seed):
    r0 = min(r0, P - 1)
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((P, 6, 16)) * 3).astype(np.float32)
    k = (rng.standard_normal((P, 2, 16)) * 3).astype(np.float32)
    for h in range(2):
        ref = np.zeros(P)
        ref_ring = np.zeros((P, 5))
        rows = np.zeros((1, 3, P))
        for r in range(r0, P):
            for g in range(3):
                causal_row(q, k, 0.25, 3 * h + g, h, r, rows[0, g])
            for i in range(r + 1):
                s = group_score(rows, 0, i, mode)
                ref[i] += s
                ref_ring[i, 1 + r % 4] = s
        got = np.zeros(P)
        ring = np.zeros((P, 5))
        causal_attention_scores(q, k, 0.25, 3 * h, 3, h, r0, P, mode, got, ring, 4)
        # float32 logits summed in the GEMM's order, not the row loop's: ~1e-7 relative, times |logit| ~ 30
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-300)
        # single rows, not sums: a probability of ~5e-5 from a logit of |l| ~ 30 moves by ~1e-5 relative
        np.testing.assert_allclose(ring, ref_ring, rtol=5e-5, atol=1e-300)


_TIED_VALUES = st.lists(st.sampled_from([-3.0, -1.0, -0.5, 0.0, -2.5]) | st.floats(-5, 0), min_size=0, max_size=80)


@settings(max_examples=100, deadline=None)
@given(vals=_TIED_VALUES, k=st.integers(0, 90), seed=st.integers(0, 1000))
def test_kept_sets_are_a_stable_argsort_prefix(vals, k, seed):
    """The k smallest by (value, position), from all positions or from a subset of them (the next larger budget's
    set), ascending: what the first k of a stable argsort hold, ties to the lower position."""
    v = np.array(vals, np.float64)
    n = v.size
    idx = np.arange(n, dtype=np.int64)
    m = keep_smallest(v, idx, n, k, np.empty(n), True)
    np.testing.assert_array_equal(idx[:m], np.sort(np.argsort(v, kind="mergesort")[:k]))
    sub = np.sort(np.random.default_rng(seed).choice(n, size=n // 2, replace=False)).astype(np.int64) if n else idx
    cand = sub.copy()
    m = keep_smallest(v, cand, sub.size, k, np.empty(n), False)
    np.testing.assert_array_equal(cand[:m], np.sort(sub[np.argsort(v[sub], kind="mergesort")[:k]]))


@settings(max_examples=100, deadline=None)
@given(vals=_TIED_VALUES.filter(len), data=st.data())
def test_kth_smallest_is_the_sorted_value(vals, data):
    v = np.array(vals, np.float64)
    k = data.draw(st.integers(0, v.size - 1))
    assert kth_smallest(v.copy(), v.size, k) == np.sort(v)[k]
