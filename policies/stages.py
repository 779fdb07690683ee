"""The kernels of the combinator stages (policies/combinators.py): Ada-KV's head-wise allocation, CriticalKV's
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
[1] G*d, [2] hidden, then the query group's W_O as float32 pairs packed into the float64 head state.
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

@njit(cache=True)
def wo_l1(head_state, off, h, vecs):
    """CriticalKV's projected value norms of KV head h for the rows of ``vecs`` [n, d] (float32): the L1 norm of
    W_O^(j) v averaged over the query heads j of its group. One float32 GEMM against the group's W_O stacked as
    [G * hidden, d] (SGEMM: the products to ~1e-7, half the memory traffic of float64 at a decode step), the L1
    sums in float64. The stage's head-state slice at ``off``: slot-field index, G*d, hidden, then that block as
    float32 pairs packed into float64 slots (``CriticalStage.head_state_init``)."""
    gd = int(head_state[h, off + 1])
    hidden = int(head_state[h, off + 2])
    d = vecs.shape[1]
    g_n = gd // d
    m = g_n * hidden * d
    base = off + 3
    block = head_state[h, base:base + (m + 1) // 2].view(np.float32)[:m].reshape((g_n * hidden, d))
    n = vecs.shape[0]
    out = np.zeros(n)
    rows = min(n, 256)                   # GEMM row blocks: no [n, G * hidden] temporary
    prods = np.empty((rows, g_n * hidden), np.float32)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        np.dot(vecs[r0:r1], block.T, prods[:r1 - r0])
        _abs_row_means(prods, r1 - r0, g_n, out[r0:r1])
    return out


@njit(cache=True, fastmath={"reassoc", "contract"})   # SIMD sums (rounding-level differences)
def _abs_row_means(prods, m, g_n, out):
    """out[r] = sum_j |prods[r, j]| / g_n in float64 for the first m rows."""
    for r in range(m):
        acc = 0.0
        for j in range(prods.shape[1]):
            acc += abs(np.float64(prods[r, j]))
        out[r] = acc / g_n


@njit(cache=True)
def critical_stages(eps, ratio, size, lo, hi, positions, h, n, scores, norms):
    """CriticalKV's two stages on head h's first n slots. Stage 1 keeps outright (+inf) the top ``ratio`` share,
    by the current score, of the slots the head has for candidates (``size`` less its protected slots held);
    the other candidates (positions in [lo, hi)) are rescored ``(score + eps) * ||W_O v||_1`` (+inf stays +inf).
    Protected slots are never evicted and keep their score. With ``ratio = 1`` the stage changes no decision."""
    cand = np.empty(n, np.int64)
    m = 0
    for i in range(n - 1, -1, -1):                  # newest first: equal scores keep the newer token, as the
        if lo <= positions[i] < hi:                 # eviction (ties evict the older) would
            cand[m] = i
            m += 1
    n1 = int(max(size - (n - m), 0) * ratio)
    key = np.empty(m, np.float64)
    for j in range(m):
        key[j] = -scores[h, cand[j]]
    order = np.argsort(key, kind="mergesort")
    first = np.zeros(m, np.bool_)
    for j in range(min(n1, m)):
        first[order[j]] = True
    for j in range(m):
        i = cand[j]
        s = scores[h, i]
        scores[h, i] = np.inf if first[j] or s == np.inf else (s + eps) * norms[i]


@njit(cache=True)
def critical_step(eps, ratio, sizes, lo, hi, lengths, positions, values, slot_state, head_state, off, scores):
    """CriticalKV at a decode step: a slot's projected value norm is computed once, when it is new (kept in the
    stage's slot field; 0 = not yet), then the two stages within each head's current size."""
    f = int(head_state[0, off])
    d = values.shape[2]
    for h in range(lengths.shape[0]):
        n = lengths[h]
        todo = np.flatnonzero(slot_state[h, :n, f] == 0.0)
        if todo.size:
            vecs = np.empty((todo.size, d), np.float32)
            for j in range(todo.size):
                vecs[j] = values[h, todo[j]]
            norms = wo_l1(head_state, off, h, vecs)
            for j in range(todo.size):
                slot_state[h, todo[j], f] = norms[j]
        critical_stages(eps, ratio, sizes[h], lo[h], hi[h], positions[h], h, n, scores, slot_state[h, :n, f].copy())


@njit(cache=True)
def critical_prompt(eps, ratio, sizes, lo, hi, v, slot_state, head_state, off, scores):
    """CriticalKV on the prompt (v [P, Hkv, d]): every token's projected value norm (one GEMM per KV head), then
    the two stages within each head's size."""
    f = int(head_state[0, off])
    pos = np.arange(v.shape[0])
    for h in range(v.shape[1]):
        norms = wo_l1(head_state, off, h, np.ascontiguousarray(v[:, h, :]))
        slot_state[h, :, f] = norms
        critical_stages(eps, ratio, sizes[h], lo[h], hi[h], pos, h, v.shape[0], scores, norms)
