"""Exact replay of the future-attention oracle for many budgets in one pass over the full attention rows."""
from __future__ import annotations

import numpy as np
from numba import njit

from policies.core.shared_kernels import ATTN_BLOCK, key_tiles, softmax_rows_inplace
from sim.replay.metrics import N_METRICS, measure


@njit(cache=True, nogil=True)
def stable_smallest(vals, k):
    """Indices of the ``k`` smallest of ``vals``, ties to the lower index, in that (value, index) order: the first
    ``k`` entries of a stable argsort, in O(n + k log k) instead of O(n log n)."""
    n = vals.shape[0]
    if k >= n:
        return np.argsort(vals, kind="mergesort")
    if k <= 0:
        return np.empty(0, np.int64)
    thr = np.partition(vals.copy(), k - 1)[k - 1]     # the k-th smallest value
    idx = np.empty(k, np.int64)
    m = 0
    for i in range(n):
        if vals[i] < thr:
            idx[m] = i
            m += 1
    for i in range(n):
        if m == k:
            break
        if vals[i] == thr:
            idx[m] = i
            m += 1
    sel = np.empty(k, np.float64)
    for j in range(k):
        sel[j] = vals[idx[j]]
    return idx[np.argsort(sel, kind="mergesort")]


@njit(cache=True, nogil=True)
def oracle_layer(q, k, v, o, vmax1, scale, budgets, metric_start, layer_scope, window, metrics_out, slots_out):
    """For every step t >= metric_start and every budget B in ``budgets`` (ascending), keep the newest token plus
    the top-B past tokens per KV head (or top B*Hkv across the layer's heads when ``layer_scope``) ranked by
    the summed full-attention probability of the head's query heads; ties keep the older token. On a sliding
    layer (``window`` > 0) the full attention is the windowed one: tokens the step cannot see have probability 0.

    metrics_out: [n_budgets, T - metric_start, Hq, N_METRICS]; slots_out: [n_budgets, T - metric_start, Hkv].
    The full attention rows are float64: logits from GEMM tiles of ``ATTN_BLOCK`` steps (BLAS), the softmax
    of ``softmax_rows_inplace``; only the top max(budgets) of each ranking are ordered. Cost
    O(t * (Hq * d + 1) + B_max log B_max) per step and head, for all budgets at once.
    """
    T, hq_n, d = q.shape
    hkv = k.shape[1]
    g_n = hq_n // hkv
    nb = budgets.shape[0]
    blk = ATTN_BLOCK
    p = np.zeros((hq_n, T), np.float64)
    gsum = np.zeros(hkv * T, np.float64)
    head_of = np.zeros(hkv * T, np.int64)
    pos_of = np.zeros(hkv * T, np.int64)
    mass = np.zeros(hq_n, np.float64)
    oacc = np.zeros((hq_n, d), np.float64)
    count = np.zeros(hkv, np.int64)
    ibuf = np.empty(T, np.int64)
    kts = [key_tiles(k, h, T, np.float64) for h in range(hkv)]
    n_tiles = kts[0].shape[0]
    qbuf = np.empty((g_n * blk, d), np.float64)
    tiles = np.empty((hkv, n_tiles, g_n * blk, blk), np.float64)
    b_max = budgets[nb - 1]
    for t0 in range(metric_start, T, blk):
        t1 = min(T, t0 + blk)
        rows = t1 - t0
        for h in range(hkv):
            for g in range(g_n):
                for r in range(rows):
                    for x in range(d):
                        qbuf[g * rows + r, x] = q[t0 + r, h * g_n + g, x]
            for c in range((t1 + blk - 1) // blk):
                np.dot(qbuf[:g_n * rows], kts[h][c], tiles[h, c, :g_n * rows])
        for t in range(t0, t1):
            r = t - metric_start
            for h in range(hkv):
                for g in range(g_n):
                    hq = h * g_n + g
                    row = g * rows + t - t0
                    for c in range(t // blk + 1):
                        for j in range(min(blk, t + 1 - c * blk)):
                            p[hq, c * blk + j] = tiles[h, c, row, j]
                    if window > 0:
                        for j in range(max(0, t + 1 - window)):
                            p[hq, j] = -np.inf
                    # normalised by this row's own float64 log-sum-exp: exact even where the stored float32 lse
                    # cannot resolve the logits (|logit| ~ 1e30)
                    softmax_rows_inplace(p[hq], t + 1, scale, ibuf)
                for i in range(t):
                    s = 0.0
                    for g in range(g_n):
                        s += p[h * g_n + g, i]
                    gsum[h * t + i] = -s          # ascending order of -s = descending by mass
                    head_of[h * t + i] = h
                    pos_of[h * t + i] = i
            m = hkv * t
            if layer_scope:
                orders = stable_smallest(gsum[:m], b_max * hkv)
            else:
                orders = np.empty(hkv * min(b_max, t), np.int64)
                kh = min(b_max, t)
                for h in range(hkv):
                    orders[h * kh:(h + 1) * kh] = h * t + stable_smallest(gsum[h * t:(h + 1) * t], kh)
            _oracle_metrics_at(t, r, hkv, g_n, d, nb, budgets, layer_scope, m, orders, head_of, pos_of, p, v, o,
                               vmax1, mass, oacc, count, metrics_out, slots_out)


@njit(cache=True, nogil=True)
def _oracle_metrics_at(t, r, hkv, g_n, d, nb, budgets, layer_scope, m, orders, head_of, pos_of, p, v, o, vmax1, mass,
                       oacc, count, metrics_out, slots_out):
    """Grow the kept sets of step t budget by budget along the ranking ``orders`` and write each one's metrics."""
    hq_n = hkv * g_n
    kh = orders.shape[0] // hkv if not layer_scope else 0
    # start from the newest token, which every policy holds
    for hq in range(hq_n):
        h = hq // g_n
        mass[hq] = p[hq, t]
        for x in range(d):
            oacc[hq, x] = p[hq, t] * v[t, h, x]
    count[:] = 0
    if layer_scope:
        taken = 0
        for b in range(nb):
            target = min(budgets[b] * hkv, m)
            while taken < target:
                e = orders[taken]
                _take(head_of[e], pos_of[e], g_n, d, p, v, mass, oacc)
                count[head_of[e]] += 1
                taken += 1
            _write_oracle_metrics(b, r, t, hkv, g_n, d, mass, oacc, o, vmax1, count, metrics_out)
            # held after the step: the kept past tokens plus the new ones, within budget * Hkv in total
            spare = budgets[b] * hkv - taken
            for h in range(hkv):
                slots_out[b, r, h] = count[h] + (1 if h < spare else 0)
    else:
        for b in range(nb):
            target = min(budgets[b], t)
            for h in range(hkv):
                while count[h] < target:
                    _take(h, pos_of[orders[h * kh + count[h]]], g_n, d, p, v, mass, oacc)
                    count[h] += 1
            _write_oracle_metrics(b, r, t, hkv, g_n, d, mass, oacc, o, vmax1, count, metrics_out)
            for h in range(hkv):
                slots_out[b, r, h] = min(count[h] + 1, budgets[b])   # held after the step


@njit(cache=True, nogil=True)
def _take(h, i, g_n, d, p, v, mass, oacc):
    """Add token i of KV head h to the kept set of each of its query heads."""
    for g in range(g_n):
        hq = h * g_n + g
        mass[hq] += p[hq, i]
        for x in range(d):
            oacc[hq, x] += p[hq, i] * v[i, h, x]


@njit(cache=True, nogil=True)
def _write_oracle_metrics(b, r, t, hkv, g_n, d, mass, oacc, o, vmax1, count, metrics_out):
    """The metrics of budget b's kept sets at step t: a subset of the full row renormalised, so KL = −log mass."""
    for h in range(hkv):
        for g in range(g_n):
            hq = h * g_n + g
            m = mass[hq]
            # kept mass can underflow to 0 with |logits| ~ 1e30; the output is then reported as zero
            inv = 1.0 / m if m > 0.0 else 0.0
            kl = min(-np.log(max(m, 1e-300)), 690.8)
            measure(m, kl, o[t, hq], oacc[hq], inv, vmax1[t, h], metrics_out[b, r, hq])
