"""The engine's attention kernels (explicit SIMD q.k and p.v, numba loops for other head sizes and the last keys) and
CriticalKV's selection and norm table against plain numpy."""
from __future__ import annotations

import numpy as np
import pytest

from sim.replay.attention_kernels import qk_dots, weighted_sums
from sim.replay.engine import _attention_scratch


@pytest.mark.parametrize("g_n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("d", [8, 16, 48, 64, 80, 128])
@pytest.mark.parametrize("n", [1, 7, 8, 17, 129])
def test_dots_and_weighted_sums_match_numpy(g_n, d, n):
    rng = np.random.default_rng(g_n * 1000 + d + n)
    hkv, cap, b = 2, n + 5, 3
    q = rng.standard_normal((3, hkv * g_n, d)).astype(np.float32)
    ck = rng.standard_normal((hkv, b + cap, d)).astype(np.float32)
    cv = rng.standard_normal((hkv, b + cap, d)).astype(np.float32)
    dots, dmax, ebuf, ibuf, fbuf, oacc, oacc32, inv, lse_caches = _attention_scratch(g_n, d, cap)
    t, h = 1, 1
    qk_dots(q, t, h, g_n, ck, b, n, dots, dmax)
    ref = q[t, h * g_n:(h + 1) * g_n].astype(np.float64) @ ck[h, b:b + n].T.astype(np.float64)
    np.testing.assert_allclose(dots[:, :n], ref, rtol=1e-5, atol=1e-4 * np.sqrt(d))
    np.testing.assert_array_equal(dmax, dots[:, :n].max(axis=1))
    e = rng.random((g_n, cap)).astype(np.float32)
    norm = 1.0 / rng.uniform(1.0, 2.0, g_n)
    weighted_sums(e, norm, h, g_n, cv, b, n, oacc, oacc32)
    ref = (e[:, :n].astype(np.float64) @ cv[h, b:b + n].astype(np.float64)) * norm[:, None]
    np.testing.assert_allclose(oacc, ref, rtol=1e-5, atol=1e-5 * np.sqrt(n))
    # the row base moves the rows read, nothing else: bit for bit the kernels over the rows copied to row 0
    dots0, dmax0, _, _, _, oacc0, oacc320, _, _ = _attention_scratch(g_n, d, cap)
    ck0, cv0 = np.ascontiguousarray(ck[:, b:]), np.ascontiguousarray(cv[:, b:])
    qk_dots(q, t, h, g_n, ck0, 0, n, dots0, dmax0)
    weighted_sums(e, norm, h, g_n, cv0, 0, n, oacc0, oacc320)
    np.testing.assert_array_equal(dots0[:, :n], dots[:, :n])
    np.testing.assert_array_equal(oacc0, oacc)


def _stages_by_sort(eps, ratio, size, lo, hi, positions, n, scores, norms):
    """CriticalKV's two stages as first written: candidates newest first, a stable sort by score, the top n1."""
    cand = [i for i in range(n - 1, -1, -1) if lo <= positions[i] < hi]
    n1 = int(max(size - (n - len(cand)), 0) * ratio)
    order = np.argsort([-scores[i] for i in cand], kind="mergesort")
    first = set(cand[j] for j in order[:n1])
    out = scores.copy()
    for i in cand:
        out[i] = np.inf if i in first or scores[i] == np.inf else (scores[i] + eps) * norms[i]
    return out


def test_critical_selection_equals_the_sort_it_replaces():
    from policies.core.stage_critical import critical_stages, kth_largest

    rng = np.random.default_rng(0)
    for it in range(400):
        m = int(rng.integers(1, 700))
        vals = [rng.random(m), rng.integers(0, 4, m).astype(float), np.exp(4 * rng.standard_normal(m))][it % 3]
        if it % 5 == 0:
            vals[rng.integers(0, m, 3)] = np.inf
        k = int(rng.integers(1, m + 1))
        assert kth_largest(vals.copy(), m, k, np.empty(m), np.empty(32)) == np.sort(vals)[::-1][k - 1]
    for it in range(400):
        n = int(rng.integers(1, 300))
        scores = rng.integers(-3, 4, (1, n)).astype(float) if it % 2 else rng.standard_normal((1, n))
        if it % 3 == 0:
            scores[0, rng.integers(0, n)] = np.inf
        positions = np.arange(n) + int(rng.integers(0, 5))
        lo, size = int(rng.integers(0, 5)), int(rng.integers(0, n + 2))
        hi = int(rng.integers(lo, n + 6))
        ratio = float(rng.choice([0.0, 0.3, 0.5, 1.0]))
        norms = rng.random(n) + 0.1
        expect = _stages_by_sort(1e-4, ratio, size, lo, hi, positions, n, scores[0], norms)
        critical_stages(1e-4, ratio, size, lo, hi, positions, 0, n, scores, norms)
        np.testing.assert_array_equal(scores[0], expect)


def test_critical_norm_table_is_what_the_steps_compute():
    """A replay reads every position's projected value norm from the table (computed once per prepared layer); the
    closed loop and the numpy reference project each new value: the same numbers bit for bit, so the same run."""
    from policies import get_policy
    from policies.core.stage_critical import projected_norms, wo_l1
    from sim.replay.layer_inputs import load_layers
    from sim.replay.policy_replay import replay
    from traces.synthetic import make_synthetic_trace

    trace = make_synthetic_trace("mixed", n_layers=1, n_q_heads=6, n_kv_heads=2, head_dim=32, n_tokens=90,
                                 n_prompt=50, seed=4)
    li = load_layers(trace)[0]
    pol = get_policy("critical(h2o)")
    off = pol.head_offsets["critical"]
    head = pol.head_state_init(2, 32, li.wo)
    table = projected_norms(head, off, li.v)
    for h in range(2):
        np.testing.assert_array_equal(wo_l1(head, off, h, np.ascontiguousarray(li.v[:, h])), table[h])
        np.testing.assert_array_equal([wo_l1(head, off, h, li.v[t:t + 1, h])[0] for t in range(90)], table[h])
    memo: dict = {}
    full = pol.replay_head_state(2, 32, li, memo)
    assert full.shape[1] == head.shape[1] + 90 and len(memo) == 1
    np.testing.assert_array_equal(full[:, head.shape[1]:], table)
    assert pol.replay_head_state(2, 32, li, memo) is not full                    # a fresh array, the same table
    inputs = load_layers(trace)
    a = replay(trace, pol, 20, inputs=inputs, record_kept=(50, 40))
    b = replay(trace, pol, 20, inputs=inputs, record_kept=(50, 40))               # the memoised table
    np.testing.assert_array_equal(a.kept, b.kept)
    np.testing.assert_array_equal(a.metrics, b.metrics)
