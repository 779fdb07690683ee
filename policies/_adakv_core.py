"""Shared kernels of SnapKV, PyramidKV and Ada-KV: observation-window scores, pooling, Ada-KV head-budget
allocation (Algorithm 2 with the safeguard), per-head top-k prompt selection (Algorithm 1) and the decode rule.

Scores of a KV head are ``sum over query steps r of reduce_g p_r[g, i]`` (reduce = mean/sum/row max over the
query heads sharing the KV head), or, for ``max`` (the Ada-KV code's GQA ``max``), ``max_g sum_r p_r[g, i]``:
the largest window-summed score of the group's heads. The decode ring holds one reduced value per query row, so
at decode ``max`` ranks by the row max (the released code never evicts during decode). The protected recent
window of a per-head budget ``b`` is ``min(window, b - 1)`` tokens: budgets at or below the window keep one
selected slot instead of degenerating into a sliding window; ``window_only`` keeps just the last ``b`` tokens
there, as the released code does at ``b = window``.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from policies.kernels import causal_attention_scores, evict_lowest, evict_lowest_sorted, group_score

POOLING = ("max", "avg")
#: GQA reduction of the observation-window policies; kernel modes (``group_rows_scores``): mean 0, sum 1, max 3,
#: rowmax 2 (``window_mode``)
WINDOW_REDUCE = ("mean", "sum", "max", "rowmax")
#: rounding of Ada-KV's safeguard mixture: exact total by largest remainder, or the released code's
#: int() floor, round-half-even, no total correction (``ada_allocate``)
ROUNDING = ("largest_remainder", "released")


@njit(cache=True)
def window_mode(choice):
    """Kernel mode of a ``WINDOW_REDUCE`` choice index: max of the heads' window sums is mode 3, row max 2."""
    if choice == 2:
        return 3
    if choice == 3:
        return 2
    return choice


@njit(cache=True)
def protected_window(window, budget, window_only=False):
    """Recent tokens a head with ``budget`` slots always keeps: the SnapKV window, leaving one selected slot
    (``window_only``: the whole budget when it is at most the window, as the released code)."""
    if window_only and budget <= window:
        return max(0, budget)
    return max(0, min(window, budget - 1))


@njit(cache=True)
def group_rows_scores(q, k, scale, h, r0, r1, mode, scores, ring, ring_w):
    """Add, for every query row r in [r0, r1), the group-reduced causal attention of KV head h to ``scores[:r1]``.

    mode: 0 mean, 1 sum, 2 max over the G query heads of each row; 3 the max over the group's heads of their
    sums over the rows (the ring then gets the row max). When ``ring_w > 0`` each row's reduced probabilities
    also go to ``ring[:, 1 + r % ring_w]`` (the decode-time observation-window ring).
    Blocked float64 GEMM tiles (``causal_attention_scores``): O((r1 - r0) * r1 * G * d) time.
    """
    g_n = q.shape[1] // k.shape[1]
    if mode != 3:
        causal_attention_scores(q, k, scale, h * g_n, g_n, h, r0, r1, mode, scores, ring, ring_w)
        return
    if ring_w > 0:   # the ring holds each row's max over the group
        causal_attention_scores(q, k, scale, h * g_n, g_n, h, r0, r1, 2, np.zeros(r1), ring, ring_w)
    head_sums = np.zeros((g_n, r1), np.float64)
    no_ring = np.zeros((1, 1), np.float64)
    for g in range(g_n):
        causal_attention_scores(q, k, scale, h * g_n + g, 1, h, r0, r1, 1, head_sums[g], no_ring, 0)
    for i in range(r1):
        m = head_sums[0, i]
        for g in range(1, g_n):
            m = max(m, head_sums[g, i])
        scores[i] += m


@njit(cache=True)
def pool_scores(scores, n, kernel, pooling, out):
    """1-D pooling of ``scores[:n]`` with stride 1 and padding kernel // 2 (SnapKV's clustering step).

    pooling 0: max (padding ignored), 1: average over the full kernel (padding counts as 0, like
    ``avg_pool1d``'s default ``count_include_pad``).
    """
    r = kernel // 2
    for i in range(n):
        lo = max(0, i - r)
        hi = min(n, i + r + 1)
        if pooling == 0:
            m = scores[lo]
            for j in range(lo + 1, hi):
                if scores[j] > m:
                    m = scores[j]
            out[i] = m
        else:
            s = 0.0
            for j in range(lo, hi):
                s += scores[j]
            out[i] = s / kernel


@njit(cache=True)
def ada_allocate(scores, base, alpha, released=False):
    """Ada-KV head budgets for one layer: int64 [H] summing exactly to ``sum(base)``.

    scores [H, C]: observed (pooled) scores of each head's C candidate tokens; base [H]: the uniform per-head
    budgets (each <= C). Algorithm 2: take the top ``K = sum(base)`` entries of the flattened scores of all
    heads; head h's adaptive count ``n_h`` is how many of them are its own. Safeguard (authors' code): the
    budget is the mixture ``(1 - alpha) * n_h + alpha * base_h``, so every head keeps at least
    ``floor(alpha * base_h)`` and ``alpha = 1`` is the uniform allocation. The authors round each head
    independently (``round``) after truncating the floor with ``int``, which can miss the total by a few
    slots; here the mixture is rounded by largest remainder (ties: larger n_h, then lower head), so the sum is
    exact and each budget stays between ``n_h`` and ``base_h`` -- which keeps Theorem 4 (the adaptive
    bound is never above the uniform one) true for every alpha. Flattened ties go to the lower head index.
    ``released``: the released rounding, ``round_half_even((1 - alpha) * n_h + int(alpha * base_h))``, whose
    total can fall short of ``sum(base)`` (left short) or exceed it by up to H / 2 slots; an excess would break
    the layer budget, so it is taken back one slot at a time from the heads that rounded up the most (ties:
    the higher head), the one deviation from the released code.
    """
    h_n, c_n = scores.shape
    total = 0
    for h in range(h_n):
        total += base[h]
    flat = np.empty(h_n * c_n, np.float64)
    for h in range(h_n):
        for i in range(c_n):
            flat[h * c_n + i] = -scores[h, i]
    order = np.argsort(flat, kind="mergesort")
    counts = np.zeros(h_n, np.int64)
    for j in range(min(total, h_n * c_n)):
        counts[order[j] // c_n] += 1
    out = np.zeros(h_n, np.int64)
    if released:
        gain = np.zeros(h_n, np.float64)
        got = 0
        for h in range(h_n):
            x = (1.0 - alpha) * counts[h] + np.float64(np.int64(alpha * base[h]))
            out[h] = np.int64(np.round(x))
            gain[h] = out[h] - x
            got += out[h]
        for _ in range(got - total):
            best = 0
            for h in range(1, h_n):
                if gain[h] >= gain[best]:
                    best = h
            out[best] -= 1
            gain[best] -= 1.0
        return out
    rem = np.zeros(h_n, np.float64)
    given = 0
    for h in range(h_n):
        x = (1.0 - alpha) * counts[h] + alpha * base[h]
        f = np.floor(x + 1e-9)
        out[h] = np.int64(f)
        rem[h] = max(0.0, x - f)
        given += out[h]
    for _ in range(total - given):
        best = -1
        for h in range(h_n):
            if best < 0 or rem[h] > rem[best] or (rem[h] == rem[best] and counts[h] > counts[best]):
                best = h
        out[best] += 1
        rem[best] = -1.0
    return out


@njit(cache=True)
def select_prompt(scores, budget, w_e, alpha, keep, head_state, released_rounding=False):
    """Keep, per KV head, the last ``w_e`` prompt tokens plus its top candidates (positions < P - w_e) by
    ``scores[h]`` (Algorithm 1; ties evict the older token). Candidate budgets are ``budget[h] - w_e``
    (uniform) or, when ``alpha >= 0``, Ada-KV's allocation over the flattened candidate scores. Heads whose
    prompt fits their budget keep everything. Each head's resulting cache size (its decode-time target)
    goes to ``head_state[h, 1]`` with ``head_state[h, 0] = 1`` marking it as set.
    """
    h_n, P = scores.shape
    c_n = P - w_e
    fits = True
    for h in range(h_n):
        if budget[h] < P:
            fits = False
    if fits or c_n <= 0:
        for h in range(h_n):
            head_state[h, 0] = 1.0
            head_state[h, 1] = budget[h]
        return
    base = np.empty(h_n, np.int64)
    for h in range(h_n):
        base[h] = min(max(budget[h] - w_e, 0), c_n)
    if alpha >= 0.0:
        alloc = ada_allocate(np.ascontiguousarray(scores[:, :c_n]), base, alpha, released_rounding)
    else:
        alloc = base
    pos = np.arange(P)
    for h in range(h_n):
        evict_lowest_sorted(scores[h], pos, P, c_n - alloc[h], 0, c_n, keep[h])
        head_state[h, 0] = 1.0
        head_state[h, 1] = alloc[h] + w_e if budget[h] < P else budget[h]


@njit(cache=True)
def target_size(budget, head_state, h):
    """A head's cache size after each decode step: its prefill allocation, else its plain budget."""
    return np.int64(head_state[h, 1]) if head_state[h, 0] > 0 else budget[h]


@njit(cache=True)
def evict_flat(scores, positions, lengths, hi_pos, floors, head_state, keep):
    """Ada-KV re-allocation at decode: the layer drops ``sum(lengths) - sum(targets)`` slots, each time the
    lowest-scored candidate (position < hi_pos[h]) of any head still above its floor (ties: lower head, older
    token); the heads' new sizes become their targets."""
    hkv = lengths.shape[0]
    excess = 0
    left = np.empty(hkv, np.int64)
    for h in range(hkv):
        left[h] = lengths[h]
        excess += lengths[h] - np.int64(head_state[h, 1])
    for _ in range(excess):
        bh = -1
        bi = -1
        for h in range(hkv):
            if left[h] <= floors[h]:
                continue
            for i in range(lengths[h]):
                if keep[h, i] == 0 or positions[h, i] >= hi_pos[h]:
                    continue
                if bh < 0 or scores[h, i] < scores[bh, bi]:
                    bh = h
                    bi = i
        if bh < 0:
            break
        keep[bh, bi] = 0
        left[bh] -= 1
    for h in range(hkv):
        head_state[h, 0] = 1.0
        head_state[h, 1] = left[h]


@njit(cache=True)
def window_step(window, kernel, pooling, mode, window_only, flat_alpha, t, budget, lengths, probs, positions,
                slot_state, head_state, keep):
    """SnapKV at decode: the observation window is the last ``window`` queries (a ring of their reduced
    probabilities in ``slot_state[:, :, 1:]``, running sum in ``slot_state[:, :, 0]``); a head over its target
    size evicts its candidate (outside the protected window) with the lowest pooled window score. Pooling runs
    over cached candidates whose positions lie within kernel // 2 of each other (uncached positions have no
    observed score, like padding). With ``flat_alpha >= 0`` the layer re-allocates instead (``evict_flat``),
    each head keeping its window plus ``floor(flat_alpha * (budget - window))`` slots. ``mode`` is a kernel mode
    (``window_mode``); the ring holds row reductions, so mode 3 ranks by the row max here."""
    col = 1 + t % window
    row_mode = 2 if mode == 3 else mode
    r = kernel // 2
    hkv = lengths.shape[0]
    pooled = np.zeros((hkv, probs.shape[2]), np.float64)
    hi = np.empty(hkv, np.int64)
    floors = np.empty(hkv, np.int64)
    over = False
    for h in range(hkv):
        n = lengths[h]
        for i in range(n):
            s = group_score(probs, h, i, row_mode)
            slot_state[h, i, 0] += s - slot_state[h, i, col]
            slot_state[h, i, col] = s
        w_e = protected_window(window, budget[h], window_only)
        hi[h] = t - w_e + 1
        floors[h] = w_e + int(flat_alpha * (budget[h] - w_e))
        target = target_size(budget, head_state, h)
        if n <= target and flat_alpha < 0.0:
            continue
        if n > target:
            over = True
        for i in range(n):
            if positions[h, i] >= hi[h]:
                continue
            acc = slot_state[h, i, 0]
            j = i - 1
            while j >= 0 and positions[h, i] - positions[h, j] <= r:
                if pooling == 0:
                    acc = max(acc, slot_state[h, j, 0])
                else:
                    acc += slot_state[h, j, 0]
                j -= 1
            j = i + 1
            while j < n and positions[h, j] < hi[h] and positions[h, j] - positions[h, i] <= r:
                if pooling == 0:
                    acc = max(acc, slot_state[h, j, 0])
                else:
                    acc += slot_state[h, j, 0]
                j += 1
            pooled[h, i] = acc if pooling == 0 else acc / kernel
        if flat_alpha < 0.0:
            evict_lowest(pooled[h], positions[h], n, n - target, 0, hi[h], keep[h])
    if flat_alpha >= 0.0 and over:
        for h in range(hkv):
            if head_state[h, 0] == 0.0:
                head_state[h, 0] = 1.0
                head_state[h, 1] = budget[h]
        evict_flat(pooled, positions, lengths, hi, floors, head_state, keep)


@njit(cache=True)
def snap_prefill(window, kernel, pooling, mode, window_only, alpha, released_rounding, budget, q, k, scale, keep,
                 slot_state, head_state):
    """SnapKV prefill (Ada-KV when ``alpha >= 0``): score the candidates with the last ``window`` prompt queries,
    pool them, select per head; kept slots carry the window ring for decode. ``mode`` is a kernel mode."""
    P = q.shape[0]
    hkv = k.shape[1]
    w_obs = min(window, P)
    w_e = protected_window(window, budget[0], window_only)
    for h in range(1, hkv):
        w_e = min(w_e, protected_window(window, budget[h], window_only))
    raw = np.zeros((hkv, P), np.float64)
    pooled = np.zeros((hkv, P), np.float64)
    for h in range(hkv):
        group_rows_scores(q, k, scale, h, P - w_obs, P, mode, raw[h], slot_state[h], window)
        c_n = max(P - w_e, 0)
        pool_scores(raw[h], c_n, kernel, pooling, pooled[h])
        for i in range(P):
            slot_state[h, i, 0] = raw[h, i]
    select_prompt(pooled, budget, w_e, alpha, keep, head_state, released_rounding)


def pyramid_layer_budgets(budget: int, n_layers: int, n_prompt: int, window: int, beta: float) -> np.ndarray:
    """PyramidKV per-layer budgets (slots per KV head), decreasing linearly with depth, summing to budget * L.

    As in the PyramidKV/Ada-KV code: with the selectable part ``base = budget - window`` the deepest layer gets
    ``min = base // beta`` and the first ``max = 2 * base - min`` (capped at the prompt's candidates, then
    ``min = 2 * base - max``), the window being added to every layer. Differences, chosen so the total is
    exactly ``budget * L``: the linear schedule is rounded by largest remainder instead of integer steps
    (which lose up to L-1 slots per head), and ``min >= 1`` so every layer keeps a selected slot. The layers
    are those the trace holds, in order (a trace of a layer subset gets the pyramid over that subset).
    """
    w_e = max(0, min(window, budget - 1))
    base = budget - w_e
    if n_layers == 1 or n_prompt <= budget:
        return np.full(n_layers, budget, np.int64)
    lo = max(1, int(base // beta))
    hi = 2 * base - lo
    if hi >= n_prompt - w_e:
        hi = n_prompt - w_e
        lo = 2 * base - hi
    if lo > hi:
        return np.full(n_layers, budget, np.int64)
    ideal = hi - np.arange(n_layers) * (hi - lo) / (n_layers - 1)
    out = np.floor(ideal + 1e-9).astype(np.int64)
    rem = ideal - out
    short = base * n_layers - int(out.sum())
    for layer in np.argsort(-rem, kind="stable")[:short]:
        out[layer] += 1
    return out + w_e
