"""The kernels of the combinator stages (policies/core/combinators.py): Ada-KV's head-wise allocation, CriticalKV's
W_O rescaling and DecodingPress's schedule. Each reads its parameters as arguments and its state from its own
slice of the head state, at an offset the generated step passes in (``ScorerPolicy.head_offsets``).

Ada-KV (Feng et al., 2024). Eviction loss and its bound (Theorems 1-2, rebuilt from the prose; the symbols were
lost in extraction): for one head with full attention weights ``A_j`` and values ``v_j``, keeping the set ``I``
gives post-eviction weights ``A_j 1[j in I] / F`` with retained mass ``F = sum_{j in I} A_j`` (Theorem 1), so
with ``C = max_j ||v_j||_1``, ``||o - o'||_1 <= C sum_j A_j |1 - 1[j in I] / F| = 2 C (1 - F)``. The paper states
it after the output projection and summed over the heads of a layer (Theorem 2); the per-head form is that
statement with ``W^O_i`` the identity and a per-head ``C``, which is tighter, and the engine's metrics ``l1`` and
``l1_bound`` are exactly it (tests check both forms). Top-k selection maximises ``F`` for given budgets
(Theorem 3); Ada-KV picks the budgets by a top-k over the flattened scores of all heads of a layer, which
maximises ``sum_i F_i`` for the layer's total, hence its bound is never above the uniform allocation's
(Theorem 4) -- with the safeguard too, see ``ada_allocate``.

Ada-KV state (2 head-state columns): [0] 1 once the head's decode-time size is set, [1] that size.
Decoding state (1 column, head 0's): decode steps since the last compression.
CriticalKV state: [0] the index of its slot field (the slot's projected value norm, 0 = not yet computed),
[1] G*d, [2] hidden, then the query group's W_O, transposed [d, G * hidden], as float32 pairs packed into the
float64 head state; in a replay of a recorded trace, then every position's projected value norm (the table
``projected_norms`` computes once per trace layer), which the steps read instead of projecting each new value.
"""
from __future__ import annotations

import numpy as np
from numba import njit


#: rounding of Ada-KV's safeguard mixture: exact total by largest remainder, or the released code's int() floor,
#: round-half-even, no total correction (``ada_allocate``)
ROUNDING = ("largest_remainder", "released")


# ---------------------------------------------------------------- Ada-KV

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
def target_size(base, head_state, off, h):
    """A head's size after each decode step: its prefill allocation, else its base size."""
    return np.int64(head_state[h, off + 1]) if head_state[h, off] > 0 else base[h]


@njit(cache=True)
def ada_sizes(head_state, off, base, sizes):
    """Ada-KV at decode (the authors' fixed allocation): every head keeps its prefill-allocated size."""
    for h in range(sizes.shape[0]):
        sizes[h] = target_size(base, head_state, off, h)


@njit(cache=True)
def ada_prompt(scores, base, w_e, alpha, released, lo, hi, head_state, off, sizes):
    """Ada-KV's prompt selection (Algorithm 1 with Algorithm 2's budgets) over any scores [Hkv, P]: sinks (the
    positions below ``lo[h]``) rank first (+inf; other scores are capped at 1e300), the last ``w_e`` prompt
    tokens are kept by every head, and the layer's candidate budget ``sum(base - w_e)`` is split across heads by
    ``ada_allocate`` over the flattened candidate scores (safeguard ``alpha``; ``released`` rounding). Sets
    ``sizes`` (what each head keeps of the prompt) and ``lo``/``hi`` (its candidates: positions [0, P - w_e)),
    and stores each head's decode-time size. Heads whose prompt fits keep everything."""
    h_n, P = scores.shape
    for h in range(h_n):
        for i in range(P):
            scores[h, i] = np.inf if i < lo[h] else min(scores[h, i], 1e300)
    c_n = P - w_e
    fits = True
    for h in range(h_n):
        lo[h] = 0
        hi[h] = max(c_n, 0)
        if base[h] < P:
            fits = False
    if fits or c_n <= 0:
        for h in range(h_n):
            head_state[h, off] = 1.0
            head_state[h, off + 1] = base[h]
            sizes[h] = P
        return
    cand = np.empty(h_n, np.int64)
    for h in range(h_n):
        cand[h] = min(max(base[h] - w_e, 0), c_n)
    alloc = ada_allocate(np.ascontiguousarray(scores[:, :c_n]), cand, alpha, released)
    for h in range(h_n):
        sizes[h] = alloc[h] + w_e
        head_state[h, off] = 1.0
        head_state[h, off + 1] = alloc[h] + w_e if base[h] < P else base[h]


@njit(cache=True)
def evict_flat(scores, positions, lengths, lo_pos, hi_pos, floors, head_state, off, keep):
    """Ada-KV re-allocation at decode: the layer drops ``sum(lengths) - sum(targets)`` slots, each time the
    lowest-scored candidate (position in [lo_pos[h], hi_pos[h])) of any head still above its floor (ties: lower
    head, older token); the heads' new sizes become their targets."""
    hkv = lengths.shape[0]
    excess = 0
    left = np.empty(hkv, np.int64)
    for h in range(hkv):
        left[h] = lengths[h]
        excess += lengths[h] - np.int64(head_state[h, off + 1])
    for _ in range(excess):
        bh = -1
        bi = -1
        for h in range(hkv):
            if left[h] <= floors[h]:
                continue
            for i in range(lengths[h]):
                if keep[h, i] == 0 or positions[h, i] < lo_pos[h] or positions[h, i] >= hi_pos[h]:
                    continue
                if bh < 0 or scores[h, i] < scores[bh, bi]:
                    bh = h
                    bi = i
        if bh < 0:
            break
        keep[bh, bi] = 0
        left[bh] -= 1
    for h in range(hkv):
        head_state[h, off] = 1.0
        head_state[h, off + 1] = left[h]


@njit(cache=True)
def ada_evict_flat(alpha, base, recent, lo, hi, lengths, positions, scores, head_state, off, sizes, keep):
    """``decode_alloc='flat'``: Algorithm 2 carried into decode. When a head is over its size, the layer evicts
    its lowest-scored candidates over the flattened scores of all heads, every head keeping its recent window
    plus ``floor(alpha * (base - recent))`` slots, so head sizes keep adapting."""
    hkv = lengths.shape[0]
    floors = np.empty(hkv, np.int64)
    over = False
    for h in range(hkv):
        floors[h] = recent[h] + int(alpha * (base[h] - recent[h]))
        if lengths[h] > sizes[h]:
            over = True
    if not over:
        return
    for h in range(hkv):
        if head_state[h, off] == 0.0:
            head_state[h, off] = 1.0
            head_state[h, off + 1] = base[h]
    evict_flat(scores, positions, lengths, lo, hi, floors, head_state, off, keep)


def allocation_bound(weights: np.ndarray, budgets: np.ndarray, vmax1: np.ndarray | float = 1.0) -> float:
    """The layer's Theorem 2 bound ``sum_h 2 C_h (1 - top_{b_h}(weights[h]))`` for per-head budgets (Theorem 3:
    the top-k kept set maximises the retained mass). weights [H, N] observed attention, budgets [H]."""
    w = np.sort(np.asarray(weights, np.float64), axis=1)[:, ::-1]
    kept = np.array([w[h, : int(b)].sum() for h, b in enumerate(budgets)])
    return float((2.0 * np.asarray(vmax1, np.float64) * (1.0 - kept)).sum())


# ---------------------------------------------------------------- DecodingPress

@njit(cache=True)
def decoding_target(budget, every, target):
    """The size a ``decoding`` stage compresses a head to: ``target``, or ``budget - every + 1`` when 0."""
    return np.int64(target) if target > 0 else budget - every + 1


@njit(cache=True)
def decoding_tick(head_state, off, every):
    """Count a step in head 0's slice; True (and restart the count) every ``every`` steps: a compression."""
    head_state[0, off] += 1.0
    if head_state[0, off] < every:
        return False
    head_state[0, off] = 0.0
    return True


# ---------------------------------------------------------------- CriticalKV

@njit(cache=True, nogil=True)
def _projected_l1(bt, vec, g_n, prods):
    """mean_j ||W_O^(j) vec||_1 for one value row ``vec`` [d] (float32) against its group's W_O stacked and
    transposed as ``bt`` [d, G * hidden]: the products in float32 into ``prods`` [G * hidden], summed over x = 0, 1,
    ... in that order (four x per pass over ``prods``, SIMD over its entries), their absolute values summed in
    float64 in four fixed partial sums.

    No fast-math: every number is the same whatever else is computed beside it, so a norm taken for one new slot
    at a step (closed loop, ``sim.replay.numpy_reference``), for a prompt, or for a whole trace at once
    (``projected_norms``) is bit for bit the same, and replays with and without the precomputed table agree.
    """
    d, J = bt.shape
    a = vec[0]
    for j in range(J):
        prods[j] = a * bt[0, j]
    for xx in range((d - 1) // 4):
        x = 1 + 4 * xx
        a0 = vec[x]
        a1 = vec[x + 1]
        a2 = vec[x + 2]
        a3 = vec[x + 3]
        for j in range(J):
            prods[j] = (((prods[j] + a0 * bt[x, j]) + a1 * bt[x + 1, j]) + a2 * bt[x + 2, j]) + a3 * bt[x + 3, j]
    for x in range(1 + 4 * ((d - 1) // 4), d):
        a = vec[x]
        for j in range(J):
            prods[j] = prods[j] + a * bt[x, j]
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    for jj in range(J // 4):
        j = 4 * jj
        s0 += abs(np.float64(prods[j]))
        s1 += abs(np.float64(prods[j + 1]))
        s2 += abs(np.float64(prods[j + 2]))
        s3 += abs(np.float64(prods[j + 3]))
    for j in range(4 * (J // 4), J):
        s0 += abs(np.float64(prods[j]))
    return ((s0 + s1) + (s2 + s3)) / g_n


@njit(cache=True)
def _wo_block(head_state, off, h, d):
    """KV head h's W_O block [d, G * hidden] (float32, read in place from the head state) and G."""
    gd = int(head_state[h, off + 1])
    hidden = int(head_state[h, off + 2])
    g_n = gd // d
    m = g_n * hidden * d
    base = off + 4
    return head_state[h, base:base + (m + 1) // 2].view(np.float32)[:m].reshape((d, g_n * hidden)), g_n


@njit(cache=True)
def norm_table(head_state, off):
    """First column of the precomputed per-position norm table in the head state (``projected_norms``, after the
    W_O block), or -1 when the head state has none (closed loop: norms are computed as slots arrive)."""
    start = off + 4 + (int(head_state[0, off + 1]) * int(head_state[0, off + 2]) + 1) // 2
    return start if head_state[0, off + 3] > 0.0 else -1


@njit(cache=True)
def wo_l1(head_state, off, h, vecs):
    """CriticalKV's projected value norms of KV head h for the rows of ``vecs`` [n, d] (float32): the L1 norm of
    W_O^(j) v averaged over the query heads j of its group (``_projected_l1``, row by row). The stage's head-state
    slice at ``off``: slot-field index, G*d, hidden, norm-table width, then the group's W_O transposed, [d, G * hidden], as float32
    pairs packed into float64 slots (``CriticalStage.head_state_init``)."""
    bt, g_n = _wo_block(head_state, off, h, vecs.shape[1])
    prods = np.empty(bt.shape[1], np.float32)
    out = np.empty(vecs.shape[0])
    for r in range(vecs.shape[0]):
        out[r] = _projected_l1(bt, vecs[r], g_n, prods)
    return out


@njit(cache=True, nogil=True)
def projected_norms(head_state, off, v):
    """Every token's projected value norm [Hkv, T] for the values v [T, Hkv, d] of a whole trace layer: the table a
    replay appends to the head state (``Combined.replay_head_state``), so that neither the prompt nor the decode
    steps project a value again. Bit for bit what ``wo_l1`` gives each row."""
    T, hkv, d = v.shape
    out = np.empty((hkv, T))
    for h in range(hkv):
        bt, g_n = _wo_block(head_state, off, h, d)
        prods = np.empty(bt.shape[1], np.float32)
        for t in range(T):
            out[h, t] = _projected_l1(bt, v[t, h], g_n, prods)
    return out


@njit(cache=True)
def _sort_desc(a, m):
    """Insertion sort of a[:m], largest first."""
    for i in range(1, m):
        x = a[i]
        j = i - 1
        while j >= 0 and a[j] < x:
            a[j + 1] = a[j]
            j -= 1
        a[j + 1] = x


@njit(cache=True)
def _quickselect_desc(vals, m, k):
    """The k-th largest (1 <= k <= m) of vals[:m] (reordered): quickselect, median-of-three pivot, three-way
    partition (runs of equal scores cost one pass)."""
    lo = 0
    hi = m - 1
    t = k - 1
    while hi - lo >= 16:
        a = vals[lo]
        b = vals[(lo + hi) >> 1]
        c = vals[hi]
        if a < b:
            a, b = b, a
        if b < c:
            b = c
            if a < b:
                b = a
        pivot = b
        lt = lo
        i = lo
        gt = hi
        while i <= gt:
            x = vals[i]
            if x > pivot:
                vals[i] = vals[lt]
                vals[lt] = x
                lt += 1
                i += 1
            elif x < pivot:
                vals[i] = vals[gt]
                vals[gt] = x
                gt -= 1
            else:
                i += 1
        if t < lt:
            hi = lt - 1
        elif t > gt:
            lo = gt + 1
        else:
            return pivot
    _sort_desc(vals[lo:hi + 1], hi - lo + 1)
    return vals[t]


_SAMPLE = 32      # values sampled per narrowing round of ``kth_largest``
_MARGIN = 4       # sample ranks kept on either side of the expected rank


@njit(cache=True)
def kth_largest(vals, m, k, buf, samp):
    """The k-th largest (1 <= k <= m) of vals[:m], in O(m) with few mispredicted branches (vals and buf, each at
    least m long, and samp, _SAMPLE long, are overwritten): while many values are left, two pivots bracket the
    expected rank in a sorted sample, one branch-free pass counts the values above, between and below them, and
    a second copies the part that holds the k-th value; the last few dozen go to a quickselect."""
    while m > 2 * _SAMPLE:
        for i in range(_SAMPLE):
            samp[i] = vals[(i * m) // _SAMPLE + m // (2 * _SAMPLE)]
        _sort_desc(samp, _SAMPLE)
        r = ((k - 1) * _SAMPLE) // m
        hi_p = samp[r - _MARGIN] if r >= _MARGIN else np.inf
        lo_p = samp[r + _MARGIN] if r + _MARGIN < _SAMPLE else -np.inf
        above = 0
        mid = 0
        for i in range(m):
            x = vals[i]
            above += x > hi_p
            mid += (x >= lo_p) & (x <= hi_p)
        w = 0
        if k <= above:
            for i in range(m):
                x = vals[i]
                buf[w] = x
                w += x > hi_p
        elif k <= above + mid:
            k -= above
            if lo_p == hi_p:
                return lo_p
            for i in range(m):
                x = vals[i]
                buf[w] = x
                w += (x >= lo_p) & (x <= hi_p)
        else:
            k -= above + mid
            for i in range(m):
                x = vals[i]
                buf[w] = x
                w += x < lo_p
        if w == m:
            break
        vals, buf = buf, vals
        m = w
    return _quickselect_desc(vals, m, k)


@njit(cache=True)
def critical_stages(eps, ratio, size, lo, hi, positions, h, n, scores, norms):
    """CriticalKV's two stages on head h's first n slots. Stage 1 keeps outright (+inf) the top ``ratio`` share,
    by the current score, of the slots the head has for candidates (``size`` less its protected slots held);
    the other candidates (positions in [lo, hi)) are rescored ``(score + eps) * ||W_O v||_1`` (+inf stays +inf).
    Protected slots are never evicted and keep their score. With ``ratio = 1`` the stage changes no decision.

    Stage 1 is a selection, not a sort (O(n) per step, ``kth_largest``): the candidates scored above the n1-th
    largest candidate score, then as many of those equal to it as are left, newest first (equal scores keep the
    newer token, as the eviction, whose ties evict the older, would)."""
    work = np.empty(2 * n + _SAMPLE, np.float64)
    vals = work[:n]
    m = 0
    for i in range(n):
        if lo <= positions[i] < hi:
            vals[m] = scores[h, i]
            m += 1
    n1 = min(int(max(size - (n - m), 0) * ratio), m)
    kth = np.inf           # n1 = 0: no candidate is stage 1's
    ties = 0               # how many of the candidates scored kth stage 1 takes (the newest)
    n_eq = 0
    eq = work              # the slots of the candidates scored kth, in slot order (free again)
    if n1 > 0:
        kth = kth_largest(vals, m, n1, work[n:2 * n], work[2 * n:])
        ties = n1
        for i in range(n):
            if lo <= positions[i] < hi:
                s = scores[h, i]
                ties -= s > kth
                if s == kth:
                    eq[n_eq] = i
                    n_eq += 1
    for i in range(n):      # branch-free (SIMD); the candidates scored kth are settled below
        s = scores[h, i]
        rescored = np.inf if (s > kth) | (s == np.inf) else (s + eps) * norms[i]
        scores[h, i] = rescored if (lo <= positions[i] < hi) & (s != kth) else s
    for e in range(n_eq - 1, -1, -1):
        i = int(eq[e])
        s = scores[h, i]
        scores[h, i] = np.inf if ties > 0 or s == np.inf else (s + eps) * norms[i]
        ties -= 1


@njit(cache=True)
def critical_step(eps, ratio, sizes, lo, hi, lengths, positions, values, slot_state, head_state, off, scores,
                  every_head):
    """CriticalKV at a decode step: a slot's projected value norm is set once, when it is new (kept in the stage's
    slot field; 0 = not yet): read from the head state's per-position table when the replay precomputed it, else
    projected here; then the two stages within each head's current size. Heads within their size are left as
    they are unless ``every_head`` (an ``ada`` stage outside compares the scores of all heads)."""
    f = int(head_state[0, off])
    tab = norm_table(head_state, off)
    d = values.shape[2]
    for h in range(lengths.shape[0]):
        n = lengths[h]
        if n <= sizes[h] and not every_head:
            continue
        norms = slot_state[h, :, f]
        if tab >= 0:
            for i in range(n):
                if norms[i] == 0.0:
                    norms[i] = head_state[h, tab + positions[h, i]]
        else:
            bt, g_n = _wo_block(head_state, off, h, d)
            prods = np.empty(bt.shape[1], np.float32)
            for i in range(n):
                if norms[i] == 0.0:
                    norms[i] = _projected_l1(bt, values[h, i], g_n, prods)
        critical_stages(eps, ratio, sizes[h], lo[h], hi[h], positions[h], h, n, scores, norms)


@njit(cache=True)
def critical_prompt(eps, ratio, sizes, lo, hi, v, slot_state, head_state, off, scores):
    """CriticalKV on the prompt (v [P, Hkv, d]): every token's projected value norm (from the head state's table
    when the replay precomputed it, else ``wo_l1`` per KV head), then the two stages within each head's size."""
    f = int(head_state[0, off])
    tab = norm_table(head_state, off)
    P = v.shape[0]
    pos = np.arange(P)
    for h in range(v.shape[1]):
        if tab >= 0:
            norms = head_state[h, tab:tab + P].copy()
        else:
            norms = wo_l1(head_state, off, h, np.ascontiguousarray(v[:, h, :]))
        slot_state[h, :, f] = norms
        critical_stages(eps, ratio, sizes[h], lo[h], hi[h], pos, h, P, scores, norms)
