"""Numba helpers shared by policies: group reduction of scores, ranked eviction, counter-based RNG."""
from __future__ import annotations

import numpy as np
from numba import njit

#: How a KV head aggregates the scores of the query heads that share it (GQA); a policy parameter.
GROUP_REDUCE = ("mean", "sum", "max")


@njit(cache=True, inline="always")
def group_score(probs, h, i, mode):
    """Aggregate the G query-head probabilities of slot i of KV head h: 0 mean, 1 sum, 2 max."""
    g_n = probs.shape[1]
    acc = 0.0
    if mode == 2:
        acc = probs[h, 0, i]
        for g in range(1, g_n):
            if probs[h, g, i] > acc:
                acc = probs[h, g, i]
        return acc
    for g in range(g_n):
        acc += probs[h, g, i]
    return acc / g_n if mode == 0 else acc


@njit(cache=True)
def evict_lowest(scores, positions, n, n_evict, lo_pos, hi_pos, keep):
    """Evict the ``n_evict`` slots with the lowest score among slots whose position is in [lo_pos, hi_pos).

    Ties go to the older token (smaller position) first, so decisions are deterministic. Slots
    outside the window are protected. Returns how many slots were evicted (fewer if too few candidates).
    """
    done = 0
    for _ in range(n_evict):
        best = -1
        for i in range(n):
            if keep[i] == 0 or positions[i] < lo_pos or positions[i] >= hi_pos:
                continue
            if best < 0 or scores[i] < scores[best] or (scores[i] == scores[best] and positions[i] < positions[best]):
                best = i
        if best < 0:
            break
        keep[best] = 0
        done += 1
    return done


@njit(cache=True)
def evict_lowest_sorted(scores, positions, n, n_evict, lo_pos, hi_pos, keep):
    """Same result as ``evict_lowest`` in O(n log n): used when many slots go at once (prefill)."""
    idx = np.empty(n, np.int64)
    m = 0
    for i in range(n):
        if keep[i] != 0 and lo_pos <= positions[i] < hi_pos:
            idx[m] = i
            m += 1
    cand = idx[:m]
    key = np.empty(m, np.float64)
    for j in range(m):
        key[j] = scores[cand[j]]
    # stable sort by (score, position): positions are increasing with slot order in every cache we build
    order = np.argsort(key, kind="mergesort")
    done = 0
    for j in range(min(n_evict, m)):
        keep[cand[order[j]]] = 0
        done += 1
    return done


@njit(cache=True, inline="always")
def splitmix64(x):
    """One round of SplitMix64 (counter-based randomness: deterministic and order independent)."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    z = x
    z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    return z ^ (z >> np.uint64(31))


@njit(cache=True)
def hash_uniform(seed, a, b, c):
    """A uniform number in [0, 1) determined by (seed, a, b, c) alone."""
    x = splitmix64(np.uint64(seed))
    x = splitmix64(x ^ np.uint64(a))
    x = splitmix64(x ^ np.uint64(b))
    x = splitmix64(x ^ np.uint64(c))
    return float(x >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@njit(cache=True)
def causal_row(q, k, scale, hq, h, r, row):
    """row[:r+1] = causal softmax attention of query ``r`` (head ``hq``) over KV head ``h``'s keys 0..r."""
    d = q.shape[2]
    mx = -np.inf
    for i in range(r + 1):
        acc = 0.0
        for x in range(d):
            acc += np.float64(q[r, hq, x]) * np.float64(k[i, h, x])
        row[i] = acc * scale
        if row[i] > mx:
            mx = row[i]
    tot = 0.0
    for i in range(r + 1):
        row[i] = np.exp(row[i] - mx)
        tot += row[i]
    for i in range(r + 1):
        row[i] /= tot


@njit(cache=True)
def causal_attention_rows(q, k, scale, hq, h, r0, r1):
    """Causal softmax attention of query head ``hq`` rows [r0, r1) over KV head ``h``'s keys 0..row.

    Returns float64 [r1 - r0, r1]; entries right of the diagonal are 0. Prompt-time helper for prefill
    selectors (SnapKV observation windows, accumulated prompt attention): O((r1 - r0) * r1 * d).
    """
    out = np.zeros((r1 - r0, r1), np.float64)
    for r in range(r0, r1):
        causal_row(q, k, scale, hq, h, r, out[r - r0])
    return out


@njit(cache=True)
def causal_column_sums(q, k, scale, hq, h, r0, r1):
    """Sum over query rows [r0, r1) of query head ``hq``'s causal attention probabilities: float64 [r1].

    Column i is the attention token i accumulated from those queries (H2O-style accumulated score).
    Streams row by row: O(r1) memory.
    """
    sums = np.zeros(r1, np.float64)
    row = np.zeros(r1, np.float64)
    for r in range(r0, r1):
        causal_row(q, k, scale, hq, h, r, row)
        for i in range(r + 1):
            sums[i] += row[i]
    return sums
