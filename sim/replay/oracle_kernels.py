"""Exact replay of the future-attention oracle for many budgets in one pass over the full attention rows."""
from __future__ import annotations

import numpy as np
from numba import njit

from policies.core.shared_kernels import ATTN_BLOCK, key_tiles, softmax_rows_inplace
from sim.replay.metrics import N_METRICS, measure


@njit(cache=True, nogil=True)
def kth_smallest(a, n, k):
    """The k-th smallest (0-based) of a[:n], reordering a[:n] in place: quickselect (Hoare partition, median-of-three
    pivot), O(n) expected, no allocation (``np.partition`` copies its input on every call)."""
    lo = 0
    hi = n - 1
    while hi > lo:
        x, y, z = a[lo], a[(lo + hi) >> 1], a[hi]
        if x > y:
            x, y = y, x
        if y > z:
            y = max(x, z)
        i = lo
        j = hi
        while i <= j:
            while a[i] < y:
                i += 1
            while a[j] > y:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:
            break
    return a[k]


@njit(cache=True, nogil=True)
def keep_smallest(vals, idx, n, k, work, identity):
    """Compact ``idx[:n]`` (positions into ``vals``, ascending) to the ``k`` smallest of ``vals[idx[:n]]`` by
    (value, position), still ascending, and return how many that is (``min(k, n)``): the set of a stable
    argsort's first k, found by one selection and two passes, without sorting. ``identity``: ``idx[:n]`` is
    0..n-1 (read ``vals`` directly). ``work``: float64 scratch of >= n."""
    if k >= n:
        return n
    if k <= 0:
        return 0
    for j in range(n):
        work[j] = vals[j] if identity else vals[idx[j]]
    thr = kth_smallest(work, n, k - 1)
    less = 0
    for j in range(k):              # every value below the k-th smallest now lies in work[:k]
        if work[j] < thr:
            less += 1
    ties = k - less                 # how many values equal to it are kept: the lowest positions
    m = 0
    for j in range(n):
        i = j if identity else idx[j]
        x = vals[i]
        if x < thr or (x == thr and ties > 0):
            if x == thr:
                ties -= 1
            idx[m] = i
            m += 1
    return m


@njit(cache=True, nogil=True)
def _nested_tops(vals_all, off, n, budgets, per_budget, col, work, levels, n_level):
    """The nested top sets of ``vals_all[off:off + n]`` (smallest first, ties to the lower position), one per budget
    (ascending; budget j keeps ``budgets[j] * per_budget``): ``levels[j, off:off + n_level[j, col]]`` its positions
    (relative to ``off``), ascending. Each set is selected from the next larger one, so the work is
    O(n + the largest budget * the number of budgets)."""
    nb = budgets.shape[0]
    vals = vals_all[off:off + n]
    idx = levels[nb - 1, off:off + n]
    for i in range(n):
        idx[i] = i
    m = keep_smallest(vals, idx, n, budgets[nb - 1] * per_budget, work, True)
    n_level[nb - 1, col] = m
    for j in range(nb - 2, -1, -1):
        cur = levels[j, off:off + m]
        cur[:] = levels[j + 1, off:off + m]
        m = keep_smallest(vals, cur, m, budgets[j] * per_budget, work, False)
        n_level[j, col] = m


@njit(cache=True, nogil=True)
def oracle_layer(q, k, v, o, vmax1, scale, budgets, metric_start, layer_scope, window, metrics_out, slots_out):
    """For every step t >= metric_start and every budget B in ``budgets`` (ascending), keep the newest token plus
    the top-B past tokens per KV head (or top B*Hkv across the layer's heads when ``layer_scope``) ranked by
    the summed full-attention probability of the head's query heads; ties keep the older token. On a sliding
    layer (``window`` > 0) the full attention is the windowed one: tokens the step cannot see have probability 0.

    metrics_out: [n_budgets, T - metric_start, Hq, N_METRICS]; slots_out: [n_budgets, T - metric_start, Hkv].
    The full attention rows are float64: logits from GEMM tiles of ``ATTN_BLOCK`` steps (BLAS), the softmax
    of ``softmax_rows_inplace``. Nothing is sorted: each budget's kept set is selected from the next larger one
    (`_nested_tops`), and its probability-weighted values are summed in ascending position (the values read in
    memory order; each budget's own sums, so that a curve's numbers are those of each budget replayed alone, bit
    for bit). Cost O(t * (Hq * d + 1) + sum(budgets) * Hq / Hkv * d) per step and head, all budgets at once.
    """
    T, hq_n, d = q.shape
    hkv = k.shape[1]
    g_n = hq_n // hkv
    nb = budgets.shape[0]
    blk = ATTN_BLOCK
    p = np.zeros((hq_n, T), np.float64)
    gsum = np.zeros(hkv * T, np.float64)
    work = np.empty(hkv * T, np.float64)
    levels = np.empty((nb, hkv * T), np.int64)
    n_level = np.zeros((nb, hkv), np.int64)
    mass = np.zeros(hq_n, np.float64)
    oacc = np.zeros((hq_n, d), np.float64)
    count = np.zeros(hkv, np.int64)
    ibuf = np.empty(T, np.int64)
    kts = [key_tiles(k, h, T, np.float64) for h in range(hkv)]
    n_tiles = kts[0].shape[0]
    qbuf = np.empty((g_n * blk, d), np.float64)
    tiles = np.empty((hkv, n_tiles, g_n * blk, blk), np.float64)
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
            if layer_scope:                       # entry h * t + i: ties to the lower head, then the older token
                _nested_tops(gsum, 0, hkv * t, budgets, hkv, 0, work, levels, n_level)
            else:
                for h in range(hkv):
                    _nested_tops(gsum, h * t, t, budgets, 1, h, work, levels, n_level)
            _oracle_metrics_at(t, r, hkv, g_n, d, nb, budgets, layer_scope, levels, n_level, p, v, o, vmax1, mass,
                               oacc, count, metrics_out, slots_out)


@njit(cache=True, nogil=True)
def _oracle_metrics_at(t, r, hkv, g_n, d, nb, budgets, layer_scope, levels, n_level, p, v, o, vmax1, mass, oacc,
                       count, metrics_out, slots_out):
    """The kept sets of step t, one per budget (`_nested_tops`' sets plus the newest token): sum each one's
    attention mass and output in ascending position and write its metrics."""
    hq_n = hkv * g_n
    for b in range(nb):
        for hq in range(hq_n):      # start from the newest token, which every policy holds
            h = hq // g_n
            mass[hq] = p[hq, t]
            for x in range(d):
                oacc[hq, x] = p[hq, t] * v[t, h, x]
        count[:] = 0
        if layer_scope:
            for j in range(n_level[b, 0]):
                h = levels[b, j] // t
                _take(h, levels[b, j] - h * t, g_n, d, p, v, mass, oacc)
                count[h] += 1
        else:
            for h in range(hkv):
                for j in range(n_level[b, h]):
                    _take(h, levels[b, h * t + j], g_n, d, p, v, mass, oacc)
                count[h] = n_level[b, h]
        _write_oracle_metrics(b, r, t, hkv, g_n, d, mass, oacc, o, vmax1, count, metrics_out)
        if layer_scope:
            # held after the step: the kept past tokens plus the new ones, within budget * Hkv in total
            spare = budgets[b] * hkv - n_level[b, 0]
            for h in range(hkv):
                slots_out[b, r, h] = count[h] + (1 if h < spare else 0)
        else:
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
