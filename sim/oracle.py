"""Exact replay of the future-attention oracle for many budgets in one pass over the full attention rows."""
from __future__ import annotations

import numpy as np
from numba import njit

from sim.engine import N_METRICS


@njit(cache=True, nogil=True)
def oracle_layer(q, k, v, o, vmax1, scale, budgets, metric_start, layer_scope, metrics_out, slots_out):
    """For every step t >= metric_start and every budget B in ``budgets`` (ascending), keep the newest token plus
    the top-B past tokens per KV head (or top B*Hkv across the layer's heads when ``layer_scope``) ranked by
    the summed full-attention probability of the head's query heads; ties keep the older token.

    metrics_out: [n_budgets, T - metric_start, Hq, N_METRICS]; slots_out: [n_budgets, T - metric_start, Hkv].
    Cost O(t * (Hq * d + log t)) per step and head, for all budgets at once.
    """
    T, hq_n, d = q.shape
    hkv = k.shape[1]
    g_n = hq_n // hkv
    nb = budgets.shape[0]
    p = np.zeros((hq_n, T), np.float64)
    gsum = np.zeros(hkv * T, np.float64)
    head_of = np.zeros(hkv * T, np.int64)
    pos_of = np.zeros(hkv * T, np.int64)
    mass = np.zeros(hq_n, np.float64)
    oacc = np.zeros((hq_n, d), np.float64)
    count = np.zeros(hkv, np.int64)
    for t in range(metric_start, T):
        r = t - metric_start
        for h in range(hkv):
            for g in range(g_n):
                hq = h * g_n + g
                # normalise by this row's own float64 log-sum-exp: exact even where the stored float32 lse
                # cannot resolve the logits (|logit| ~ 1e30)
                mx = -np.inf
                for i in range(t + 1):
                    acc = 0.0
                    for x in range(d):
                        acc += np.float64(q[t, hq, x]) * np.float64(k[i, h, x])
                    p[hq, i] = acc * scale
                    mx = max(mx, p[hq, i])
                tot = 0.0
                for i in range(t + 1):
                    p[hq, i] = np.exp(p[hq, i] - mx)
                    tot += p[hq, i]
                for i in range(t + 1):
                    p[hq, i] /= tot
            for i in range(t):
                s = 0.0
                for g in range(g_n):
                    s += p[h * g_n + g, i]
                gsum[h * t + i] = -s          # ascending sort of -s = descending by mass
                head_of[h * t + i] = h
                pos_of[h * t + i] = i
        m = hkv * t
        if layer_scope:
            orders = np.argsort(gsum[:m], kind="mergesort")
        else:
            orders = np.empty(m, np.int64)
            for h in range(hkv):
                orders[h * t:(h + 1) * t] = h * t + np.argsort(gsum[h * t:(h + 1) * t], kind="mergesort")
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
                        _take(h, pos_of[orders[h * t + count[h]]], g_n, d, p, v, mass, oacc)
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
    for h in range(hkv):
        for g in range(g_n):
            hq = h * g_n + g
            m = mass[hq]
            # kept mass can underflow to 0 with |logits| ~ 1e30; the output is then reported as zero
            inv = 1.0 / m if m > 0.0 else 0.0
            num = 0.0
            den = 0.0
            l1 = 0.0
            for x in range(d):
                ref = np.float64(o[t, hq, x])
                diff = ref - oacc[hq, x] * inv
                num += diff * diff
                den += ref * ref
                l1 += abs(diff)
            metrics_out[b, r, hq, 0] = m
            metrics_out[b, r, hq, 1] = np.sqrt(num / den) if den > 0.0 else np.sqrt(num)
            metrics_out[b, r, hq, 2] = min(max(-np.log(max(m, 1e-300)), 0.0), 690.8)
            metrics_out[b, r, hq, 3] = l1
            metrics_out[b, r, hq, 4] = 2.0 * max(0.0, 1.0 - m) * vmax1[t, h]
