"""BumbleBee (Kumari et al., 2024): submodular mixture of key diversity and accumulated-attention importance.

Objective (eq. 4): g(A) = lam * f_FL(A) + (1 - lam) * c(A) over a ground set V of keys of one KV head, with
  f_FL(A) = sum_{v in V} max_{a in A} sim(v, a) / sum_{v in V} sim(v, v)      (eq. 2, normalised: f_FL(V) = 1)
  c(A)    = phi(sum_{a in A} m(a)) / phi(sum_{v in V} m(v))                   (eq. 3, |U| = 1, c(V) = 1)
where sim is ReLU-truncated cosine similarity of keys (Appx. D; 1 + cos and |cos| also exposed), m is the
attention a key accumulated and phi is log(1 + x) or the inverse of g(y) = alpha * y**(1/alpha) + beta * y.

Prompt (Alg. 1, ``prefill_fn``): V = the prompt keys, m = causal attention accumulated over all prompt queries,
greedy maximisation of g under |S| <= budget (lazy/Minoux greedy by default: the same picks as the naive greedy;
the paper's stochastic greedy with eps = 1e-5 samples nearly all of V per pick, so it is not offered). Up to
FULL_MATRIX_MAX = 2048 prompt tokens it builds the P x P similarity matrix (8 P^2 bytes per head, <= 32 MiB);
beyond, it keeps only the normalised keys and recomputes a similarity column (O(P d)) when a gain needs one
(``greedy_select_keys``): the same picks from bitwise the same gains (where BLAS sums each cosine as one FMA
chain, as OpenBLAS does up to d = 448), in O(P d) memory plus a 256 MiB column cache
(a 32 k-token replay at d = 256 peaks at 0.9 GB instead of 13 GB: benchmarks/bumblebee_long.py). Time O(P^2 d)
for the first round of gains plus O(P d) per later evaluation that misses the cache (lazy: 1-1.5 P of them at
32 k tokens; naive: O(budget P^2 d) in all); single-threaded (the replay runs layers in parallel).
Decode (Alg. 2, ``step``): V = S' = cache plus the new key; when over budget, drop argmin_k g(k | S' \\ k).
With V = S' the facility-location gain of k is (sim(k, k) - max_{j != k} sim(k, j)) / |V| sim(k, k), so each slot
carries its nearest-neighbour similarity (and that neighbour's position) in slot_state: a step costs O(budget * d)
plus O(budget * d) for each slot whose nearest neighbour was the one evicted (0.01-0.2 per step measured in
benchmarks/bumblebee_step.py; O(budget^2 d) in the worst case) instead of the O(budget^2) similarity matrix of
the paper's Appx. E.

Choices the paper leaves open: GQA (the paper's LLaMA has none) reduces a group's probabilities with
``group_reduce``; the importance of the incoming key at the eviction decision is its attention over S' and,
when it stays, is renormalised over S_t (line 14); ties evict the older token / pick the earlier one.
``recent_ratio``: the paper "further combine[s] the global submodular summary with the most recent local context"
(Sec. 1, Fig. 1) and compares against "+ Local" baselines, but gives no split and Alg. 2 alone has no window.
Default 0.5 (the even split of its H2+Local baseline); 0 is Alg. 2 alone, which on a local-attention model
(the shipped tiny Llama) evicts each new token at once and retains less attention than random eviction.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from policies.base import PREFILL_SIG, STEP_SIG, Guarantees, Param, Policy, kernel, param_indices
from policies.kernels import GROUP_REDUCE, causal_attention_scores, group_score
from policies.scorer import recent_slots
from policies.registry import register

CONCAVE = ("power", "log")
SIMILARITY = ("relu_cos", "one_plus_cos", "abs_cos")
GREEDY = ("lazy", "naive")

SCHEMA = (
    Param("lam", 0.3, "float", 0.0, 1.0, doc="mixture weight of facility-location diversity (eq. 4)"),
    Param("concave", "power", "choice", choices=CONCAVE,
          doc="phi of the importance term: inverse of alpha y^(1/alpha) + beta y (power) or log(1 + x)"),
    Param("alpha", 0.04, "float", 0.005, 1.0, log=True, doc="curvature of the power concave function"),
    Param("beta", 1.0, "float", 0.0, 10.0, doc="linear part of the power concave function"),
    Param("similarity", "relu_cos", "choice", choices=SIMILARITY, doc="facility-location kernel on keys"),
    Param("recent_ratio", 0.5, "float", 0.0, 1.0, doc="share of the budget kept as local window (Fig. 1)"),
    Param("group_reduce", "mean", "choice", choices=GROUP_REDUCE, doc="GQA aggregation of query heads"),
    Param("greedy", "lazy", "choice", choices=GREEDY, searchable=False,
          doc="prompt greedy: lazy (Minoux) or naive (every gain every pick: O(budget P^2 d) beyond 2048 prompt "
              "tokens); identical selections"),
)
P = param_indices(SCHEMA)
# slot_state fields
F_ACC, F_NN, F_NNPOS, F_NORM = range(4)


@njit(cache=True, inline="always")
def _ipow(y, n):
    """y**n for a small non-negative integer n by repeated squaring."""
    r = 1.0
    b = y
    while n > 0:
        if n & 1:
            r *= b
        b *= b
        n >>= 1
    return r


@njit(cache=True)
def concave_from(x, kind, alpha, beta, y_hi):
    """phi(x); for the power form, Newton from ``y_hi`` (any point with g(y_hi) >= x, or -1 for a safe start)."""
    if x <= 0.0:
        return 0.0
    if kind == 1:
        return np.log1p(x)
    p = 1.0 / alpha
    e = p - 1.0
    n_int = int(round(e))
    exact = abs(e - n_int) < 1e-9 and n_int < 64    # alpha = 0.04: y**24 by squaring, not pow (10x faster)
    y = y_hi
    if y < 0.0:
        y = (x / alpha) ** alpha
        if beta > 0.0 and x / beta < y:
            y = x / beta
    # g is increasing and convex on y >= 0: Newton from the right decreases monotonically onto the root
    for _ in range(200):
        yp1 = _ipow(y, n_int) if exact else y ** e
        f = alpha * yp1 * y + beta * y - x
        if f <= 0.0:
            break
        step = f / (yp1 + beta)
        y -= step
        if step <= 1e-14 * y:
            break
    return y


@njit(cache=True)
def concave(x, kind, alpha, beta):
    """phi(x) of eq. 3: kind 0 the inverse of alpha * y**(1/alpha) + beta * y (paper's power form), 1 log(1 + x)."""
    return concave_from(x, kind, alpha, beta, -1.0)


@njit(cache=True, inline="always")
def kernel_sim(cos, mode):
    """Similarity from cosine (clamped to [-1, 1] against rounding): 0 ReLU(cos) (paper), 1 1 + cos, 2 |cos|."""
    cos = min(1.0, max(-1.0, cos))
    if mode == 0:
        return cos if cos > 0.0 else 0.0
    if mode == 1:
        return 1.0 + cos
    return abs(cos)


@njit(cache=True, inline="always")
def self_sim(mode):
    return 2.0 if mode == 1 else 1.0


_VECTOR_MATH = {"reassoc", "contract"}   # lets LLVM vectorise the float32 dot products (as the engine does)


@njit(cache=True, fastmath=_VECTOR_MATH)
def _dots_to(keys, h, j, n, out):
    """out[i] = keys[h, i] . keys[h, j] for i < n, float32 SIMD: the O(n d) part of a step."""
    d = keys.shape[2]
    for i in range(n):
        acc = np.float32(0.0)
        for x in range(d):
            acc += keys[h, i, x] * keys[h, j, x]
        out[i] = acc


@njit(cache=True, inline="always")
def _cos_from(dot, ni, nj):
    if ni == 0.0 or nj == 0.0:
        return 0.0
    return np.float64(dot) / (ni * nj)


@njit(cache=True)
def unit_keys(k):
    """The rows of k [n, d] over their L2 norms (the norm summed in float64, the result in k's dtype; a zero key
    stays zero): the one normalisation behind both the full similarity matrix and the bounded path's columns, so
    their cosines agree to the bit."""
    n, d = k.shape
    u = np.zeros((n, d), k.dtype)
    for i in range(n):
        s = 0.0
        for x in range(d):
            s += np.float64(k[i, x]) ** 2
        if s > 0.0:
            inv = 1.0 / np.sqrt(s)
            for x in range(d):
                u[i, x] = np.float64(k[i, x]) * inv
    return u


@njit(cache=True)
def similarity_matrix(k, mode):
    """sim of all pairs of rows of k [n, d] (float64 [n, n]; a zero key has cosine 0 with every other key)."""
    S = np.empty((k.shape[0], k.shape[0]), np.float64)
    similarity_into(k, mode, S)
    return S


@njit(cache=True)
def similarity_into(k, mode, S):
    """``similarity_matrix`` into S[:n, :n] (a buffer the prefill reuses for every head: no fresh 8 MB per head);
    the prefill's path up to FULL_MATRIX_MAX keys, and the reference of the bounded path beyond (``sim_columns``).

    The cosines are one GEMM of the normalised keys (BLAS) in the keys' own precision (float32 keys, as traces
    and caches hold them: SGEMM, ~3x a float64 one at d = 64; cosines to ~1e-7), symmetrised from the lower
    triangle in tiles.
    """
    n = k.shape[0]
    u = unit_keys(k)
    C = np.dot(u, u.T)
    B = 16       # tile by tile, so that the mirrored writes S[j, i] stay within a few pages
    for b0 in range(0, n, B):
        for c0 in range(0, b0 + 1, B):
            for i in range(b0, min(n, b0 + B)):
                for j in range(c0, min(i, c0 + B)):
                    s = kernel_sim(np.float64(C[i, j]), mode)
                    S[i, j] = s
                    S[j, i] = s
    for i in range(n):
        S[i, i] = self_sim(mode)


@njit(cache=True, fastmath=_VECTOR_MATH)
def _coverage_gain(S, e, cover):
    """sum_v max(0, S[e, v] - cover[v]): the facility-location gain of e before normalisation (SIMD). Row e of S is
    e's similarity column: S is the whole matrix, or a buffer of columns rebuilt on demand (one sum, one order)."""
    fl = 0.0
    for v in range(cover.shape[0]):
        fl += max(S[e, v] - cover[v], 0.0)
    return fl


@njit(cache=True)
def _gain(S, e, cover, m_e, m_sel, phi_sel, lam, fl_norm, phi_tot, kind, alpha, beta):
    fl = _coverage_gain(S, e, cover)
    imp = 0.0
    if phi_tot > 0.0:
        imp = (concave(m_sel + m_e, kind, alpha, beta) - phi_sel) / phi_tot
    return lam * fl / fl_norm + (1.0 - lam) * imp


@njit(cache=True, inline="always")
def _before(a, b, bound):
    """Heap order of the lazy greedy: larger bound first, ties to the lower index (the naive scan's order)."""
    return bound[a] > bound[b] or (bound[a] == bound[b] and a < b)


@njit(cache=True)
def _sift_down(heap, n, i, bound):
    """Restore the max-heap ``heap[:n]`` below position i (after its item's bound changed or it was replaced)."""
    while True:
        top = i
        left = 2 * i + 1
        if left < n and _before(heap[left], heap[top], bound):
            top = left
        if left + 1 < n and _before(heap[left + 1], heap[top], bound):
            top = left + 1
        if top == i:
            return
        heap[i], heap[top] = heap[top], heap[i]
        i = top


@njit(cache=True)
def greedy_select(S, m, budget, forced, lam, kind, alpha, beta, lazy):
    """Alg. 1: greedy maximisation of g over V = rows of S with |selection| <= budget, ``forced`` items first.

    S [n, n] similarities, m [n] accumulated attention, forced [n] uint8 (kept unconditionally, e.g. a local
    window). ``lazy`` re-evaluates only the candidate with the highest stale upper bound (Minoux; a heap): same
    picks as the naive greedy (ties to the smaller index), far fewer gain evaluations. Returns (selected
    indices in pick order, number of gain evaluations). The prefill's greedy up to FULL_MATRIX_MAX keys;
    ``greedy_select_keys`` makes the same picks without S.
    """
    n = S.shape[0]
    fl_norm = 0.0
    m_tot = 0.0
    for v in range(n):
        fl_norm += S[v, v]
        m_tot += m[v]
    phi_tot = concave(m_tot, kind, alpha, beta)
    cover = np.zeros(n, np.float64)
    chosen = np.zeros(n, np.uint8)
    order = np.empty(min(budget, n), np.int64)
    n_sel = 0
    m_sel = 0.0
    for e in range(n):
        if forced[e] != 0 and n_sel < order.shape[0]:
            chosen[e] = 1
            order[n_sel] = e
            n_sel += 1
            m_sel += m[e]
            for v in range(n):
                if S[e, v] > cover[v]:
                    cover[v] = S[e, v]
    phi_sel = concave(m_sel, kind, alpha, beta)
    bound = np.full(n, np.inf)
    stamp = np.full(n, -1, np.int64)
    # max-heap of the unchosen items by (stale bound, then lower index): its top is the scan's argmax
    heap = np.empty(n, np.int64)
    n_heap = 0
    for e in range(n):
        if chosen[e] == 0:
            heap[n_heap] = e
            n_heap += 1
    evals = 0
    it = 0
    while n_sel < order.shape[0]:
        best = -1
        if lazy:
            while True:
                best = heap[0]
                if stamp[best] == it:
                    n_heap -= 1
                    heap[0] = heap[n_heap]
                    _sift_down(heap, n_heap, 0, bound)
                    break
                bound[best] = _gain(S, best, cover, m[best], m_sel, phi_sel, lam, fl_norm, phi_tot, kind, alpha, beta)
                stamp[best] = it
                evals += 1
                _sift_down(heap, n_heap, 0, bound)     # a bound only changes at the top
        else:
            best_g = 0.0
            for e in range(n):
                if chosen[e] != 0:
                    continue
                g = _gain(S, e, cover, m[e], m_sel, phi_sel, lam, fl_norm, phi_tot, kind, alpha, beta)
                evals += 1
                if best < 0 or g > best_g:
                    best, best_g = e, g
        chosen[best] = 1
        order[n_sel] = best
        n_sel += 1
        m_sel += m[best]
        phi_sel = concave(m_sel, kind, alpha, beta)
        for v in range(n):
            if S[best, v] > cover[v]:
                cover[v] = S[best, v]
        it += 1
    return order[:n_sel], evals


# ---------------------------------------------------------------- bounded prompt selection (no n x n matrix)
#
# Above FULL_MATRIX_MAX prompt keys the prefill keeps the normalised keys transposed (uT [d, n], float32) and
# recomputes a column sim(., e) when the greedy needs one. Each cosine is one float32 fused multiply-add chain over
# x = 0..d-1 from 0, bitwise what BLAS SGEMM gives ``similarity_into`` for n x n products (OpenBLAS here, measured:
# d <= 448; above that it splits the sum in two, and below ~33 keys it takes another kernel, hence the full-matrix
# path for short prompts). Gains sum their column with the same vectorised loop as ``_coverage_gain``, so every gain
# and every pick is the full-matrix greedy's (tests/test_bumblebee.py compares kept sets and evaluation counts).

_FMA_CHAIN = {"contract"}    # a*b + acc fused per element, never reassociated: one FMA chain per cosine
COL_W = 1024                 # v-tile of the column kernel: its accumulators stay in L1/L2
COL_ROWS = 16                # columns computed per pass over uT
COL_CACHE_BYTES = 256 << 20  # float32 cosine columns kept between lazy rounds (all of them up to n = 8192)
#: prompts up to this length take the full-matrix path (8 n^2 bytes <= 32 MiB per head): exact by construction
FULL_MATRIX_MAX = 2048


@njit(cache=True, fastmath=_FMA_CHAIN)
def _fma4(acc, a0, a1, a2, a3, b0, b1, b2, b3):
    """acc[j] = fma(a3, b3[j], fma(a2, b2[j], fma(a1, b1[j], fma(a0, b0[j], acc[j])))): four steps of each
    element's chain per load/store of acc (SIMD across j, the order within a chain kept)."""
    for j in range(acc.shape[0]):
        acc[j] = (((acc[j] + a0 * b0[j]) + a1 * b1[j]) + a2 * b2[j]) + a3 * b3[j]


@njit(cache=True, fastmath=_FMA_CHAIN)
def _fma1(acc, a, b):
    for j in range(acc.shape[0]):
        acc[j] = acc[j] + a * b[j]


@njit(cache=True)
def unit_keys_t(k):
    """``unit_keys(k)`` transposed, in float32: uT [d, n], the layout the bounded selection reads columns from."""
    u = unit_keys(k)
    n, d = u.shape
    uT = np.empty((d, n), np.float32)
    for i in range(n):
        for x in range(d):
            uT[x, i] = u[i, x]
    return uT


@njit(cache=True)
def cosines_into(uT, items, nr, dst, dst_rows, acc):
    """dst[dst_rows[r], v] = float32 cosine of keys items[r] and v, for r < nr and every v: one pass over uT for
    all nr, per COL_W-wide tile of v float32 accumulators ``acc`` [>= nr, COL_W] take one FMA per x in order.
    O(nr n d) time."""
    d, n = uT.shape
    W = acc.shape[1]
    a = np.empty((nr, d), np.float32)
    for r in range(nr):
        for x in range(d):
            a[r, x] = uT[x, items[r]]
    for v0 in range(0, n, W):
        w = min(W, n - v0)
        for r in range(nr):
            for j in range(w):
                acc[r, j] = 0.0
        x = 0
        while x + 4 <= d:
            b0 = uT[x, v0:v0 + w]
            b1 = uT[x + 1, v0:v0 + w]
            b2 = uT[x + 2, v0:v0 + w]
            b3 = uT[x + 3, v0:v0 + w]
            for r in range(nr):
                _fma4(acc[r, :w], a[r, x], a[r, x + 1], a[r, x + 2], a[r, x + 3], b0, b1, b2, b3)
            x += 4
        while x < d:
            b0 = uT[x, v0:v0 + w]
            for r in range(nr):
                _fma1(acc[r, :w], a[r, x], b0)
            x += 1
        for r in range(nr):
            row = dst_rows[r]
            for j in range(w):
                dst[row, v0 + j] = acc[r, j]


@njit(cache=True)
def _sims_row(c32, i, e, mode, out):
    """out[0, :] = the similarities of key e (float64), from its cosines c32[i, :]."""
    for v in range(c32.shape[1]):
        out[0, v] = kernel_sim(np.float64(c32[i, v]), mode)
    out[0, e] = self_sim(mode)


@njit(cache=True)
def sim_columns(uT, rows, nr, mode, out):
    """out[r, :] = row rows[r] of ``similarity_matrix`` (float64) for r < nr, computed from uT."""
    n = uT.shape[1]
    c32 = np.empty((nr, n), np.float32)
    cosines_into(uT, rows, nr, c32, np.arange(nr), np.empty((nr, COL_W), np.float32))
    one = np.empty((1, n), np.float64)
    for r in range(nr):
        _sims_row(c32, r, rows[r], mode, one)
        out[r, :] = one[0]


@njit(cache=True)
def _cover_with(C, cover):
    for v in range(cover.shape[0]):
        if C[0, v] > cover[v]:
            cover[v] = C[0, v]


@njit(cache=True)
def _next_uncached(heap, n_heap, bound, stamp, slot, it, rows, k_max, open_):
    """Up to k_max items of the heap, in its order from the top, that are stale this round and not cached: the
    next ones the lazy greedy evaluates if the top does not stay on top (best-first walk from the root)."""
    n_open = 1
    open_[0] = 0
    k = 0
    pops = 0
    while n_open > 0 and k < k_max and 2 * pops + 3 <= open_.shape[0]:
        t = 0
        for s in range(1, n_open):
            if _before(heap[open_[s]], heap[open_[t]], bound):
                t = s
        p = open_[t]
        n_open -= 1
        open_[t] = open_[n_open]
        pops += 1
        e = heap[p]
        if stamp[e] != it and slot[e] < 0:
            rows[k] = e
            k += 1
        for c in (2 * p + 1, 2 * p + 2):
            if c < n_heap:
                open_[n_open] = c
                n_open += 1
    return k


@njit(cache=True)
def _cache_slot(ckey, cmark, mark):
    """The cache slot to overwrite: the lowest key (free slots hold -inf), except slots marked ``mark``."""
    best = -1
    for s in range(ckey.shape[0]):
        if cmark[s] != mark and (best < 0 or ckey[s] < ckey[best]):
            best = s
    return best


@njit(cache=True)
def greedy_select_keys(uT, m, budget, forced, lam, kind, alpha, beta, lazy, mode, cache_cols=-1):
    """``greedy_select`` over V = the columns of uT (``unit_keys_t``) without the n x n matrix: the same picks in
    the same order after the same gain evaluations. Returns (picks, gain evaluations, columns computed).

    A gain needs its column, recomputed from uT (O(n d), COL_ROWS per pass). The first lazy round evaluates every
    candidate against the cover of the forced items: in blocks, keeping the float32 columns of the best gains in a
    cache of COL_CACHE_BYTES. A later round evaluates candidates in the order of their stale bounds: from the cache
    when held, else it computes the column with the next COL_ROWS - 1 uncached stale items of the heap (the ones it
    evaluates next if the top does not stay on top) into the cache, evicting the lowest bounds; a pick leaves it.
    The naive greedy computes every unchosen column each round, O(budget n^2 d) time. Memory: uT, the cache
    (``cache_cols`` columns, by default min(n, COL_CACHE_BYTES / 4n)) and O(COL_ROWS n).
    """
    d, n = uT.shape
    R = COL_ROWS
    acc = np.empty((R, COL_W), np.float32)
    blk = np.empty((R, n), np.float32)
    blk_rows = np.arange(R)
    col = np.empty((1, n), np.float64)
    items = np.empty(R, np.int64)
    cap = (min(n, max(R, COL_CACHE_BYTES // (4 * max(n, 1)))) if cache_cols < 0 else min(n, max(1, cache_cols))
           if lazy else 0)
    cache = np.empty((cap, n), np.float32)
    slot = np.full(n, -1, np.int64)
    owner = np.full(cap, -1, np.int64)
    ckey = np.full(cap, -np.inf)
    cmark = np.full(cap, -1, np.int64)
    dst = np.empty(R, np.int64)
    kb = min(R, cap)                      # columns per miss: all of them go to the cache
    computed = 0
    ss = self_sim(mode)
    fl_norm = 0.0
    m_tot = 0.0
    for v in range(n):
        fl_norm += ss
        m_tot += m[v]
    phi_tot = concave(m_tot, kind, alpha, beta)
    cover = np.zeros(n, np.float64)
    chosen = np.zeros(n, np.uint8)
    order = np.empty(min(budget, n), np.int64)
    n_sel = 0
    m_sel = 0.0
    nf = 0
    for e in range(n + 1):
        if e < n and forced[e] != 0 and n_sel < order.shape[0]:
            chosen[e] = 1
            order[n_sel] = e
            n_sel += 1
            m_sel += m[e]
            items[nf] = e
            nf += 1
        if nf == R or (e == n and nf > 0):
            cosines_into(uT, items, nf, blk, blk_rows, acc)
            computed += nf
            for r in range(nf):
                _sims_row(blk, r, items[r], mode, col)
                _cover_with(col, cover)
            nf = 0
    phi_sel = concave(m_sel, kind, alpha, beta)
    bound = np.full(n, np.inf)
    stamp = np.full(n, -1, np.int64)
    first = np.empty(n, np.float64)           # round 0's gains, computed in blocks before its lazy loop
    heap = np.empty(n, np.int64)
    n_heap = 0
    for e in range(n):
        if chosen[e] == 0:
            heap[n_heap] = e
            n_heap += 1
    open_ = np.empty(8 * R + 3, np.int64)
    evals = 0
    it = 0
    n_batches = 0
    while n_sel < order.shape[0]:
        best = -1
        if lazy:
            if it == 0:
                for s in range(0, n_heap, R):
                    nr = min(R, n_heap - s)
                    for r in range(nr):
                        items[r] = heap[s + r]
                    cosines_into(uT, items, nr, blk, blk_rows, acc)
                    computed += nr
                    for r in range(nr):
                        e = items[r]
                        _sims_row(blk, r, e, mode, col)
                        g = _gain(col, 0, cover, m[e], m_sel, phi_sel, lam, fl_norm, phi_tot, kind, alpha, beta)
                        first[e] = g
                        c = _cache_slot(ckey, cmark, -2)
                        if c >= 0 and ckey[c] < g:
                            if owner[c] >= 0:
                                slot[owner[c]] = -1
                            owner[c], slot[e], ckey[c] = e, c, g
                            cache[c, :] = blk[r, :]
            while True:
                best = heap[0]
                if stamp[best] == it:
                    n_heap -= 1
                    heap[0] = heap[n_heap]
                    _sift_down(heap, n_heap, 0, bound)
                    break
                if it == 0:
                    g = first[best]
                elif slot[best] >= 0:
                    _sims_row(cache, slot[best], best, mode, col)
                    g = _gain(col, 0, cover, m[best], m_sel, phi_sel, lam, fl_norm, phi_tot, kind, alpha, beta)
                else:
                    nr = _next_uncached(heap, n_heap, bound, stamp, slot, it, items, kb, open_)
                    n_batches += 1
                    for r in range(nr):
                        c = _cache_slot(ckey, cmark, n_batches)
                        if owner[c] >= 0:
                            slot[owner[c]] = -1
                        owner[c], slot[items[r]], ckey[c], cmark[c] = items[r], c, bound[items[r]], n_batches
                        dst[r] = c
                    cosines_into(uT, items, nr, cache, dst, acc)
                    computed += nr
                    _sims_row(cache, slot[best], best, mode, col)
                    g = _gain(col, 0, cover, m[best], m_sel, phi_sel, lam, fl_norm, phi_tot, kind, alpha, beta)
                bound[best] = g
                if slot[best] >= 0:
                    ckey[slot[best]] = g
                stamp[best] = it
                evals += 1
                _sift_down(heap, n_heap, 0, bound)     # a bound only changes at the top
        else:
            best_g = 0.0
            e0 = 0
            while e0 < n:
                nr = 0
                while e0 < n and nr < R:
                    if chosen[e0] == 0:
                        items[nr] = e0
                        nr += 1
                    e0 += 1
                if nr == 0:
                    break
                cosines_into(uT, items, nr, blk, blk_rows, acc)
                computed += nr
                for r in range(nr):
                    e = items[r]
                    _sims_row(blk, r, e, mode, col)
                    g = _gain(col, 0, cover, m[e], m_sel, phi_sel, lam, fl_norm, phi_tot, kind, alpha, beta)
                    evals += 1
                    if best < 0 or g > best_g:
                        best, best_g = e, g
        chosen[best] = 1
        order[n_sel] = best
        n_sel += 1
        m_sel += m[best]
        phi_sel = concave(m_sel, kind, alpha, beta)
        c = slot[best]
        if c >= 0:
            _sims_row(cache, c, best, mode, col)
            slot[best], owner[c], ckey[c] = -1, -1, -np.inf
        else:
            items[0] = best
            cosines_into(uT, items, 1, blk, blk_rows, acc)
            computed += 1
            _sims_row(blk, 0, best, mode, col)
        _cover_with(col, cover)
        it += 1
    return order[:n_sel], evals, computed


@njit(cache=True)
def nearest_selected(uT, inset, mode):
    """For each selected i (inset[i] != 0): (largest sim(i, j), j) over the selected j != i, ties to the smaller
    j; (0, -1) when alone. The similarities are ``similarity_matrix``'s (``sim_columns``). O(s^2 d) time for s
    selected, O(s d + COL_ROWS s) memory."""
    d, n = uT.shape
    idx = np.flatnonzero(inset)
    s = idx.shape[0]
    uTs = np.empty((d, s), np.float32)
    for x in range(d):
        for a in range(s):
            uTs[x, a] = uT[x, idx[a]]
    nn = np.zeros(n, np.float64)
    nn_pos = np.full(n, -1, np.int64)
    R = COL_ROWS
    C = np.empty((R, s), np.float64)
    rows = np.empty(R, np.int64)
    for a0 in range(0, s, R):
        nr = min(R, s - a0)
        for r in range(nr):
            rows[r] = a0 + r
        sim_columns(uTs, rows, nr, mode, C)
        for r in range(nr):
            a = a0 + r
            best, best_s = -1, 0.0
            for b in range(s):
                if b != a and (best < 0 or C[r, b] > best_s):
                    best, best_s = b, C[r, b]
            nn[idx[a]] = best_s
            nn_pos[idx[a]] = idx[best] if best >= 0 else -1
    return nn, nn_pos


@njit(cache=True)
def prompt_importance(q, k, scale, h, mode):
    """Attention each prompt key of KV head h accumulates over all prompt queries (Alg. 1 line 3): float64 [n_prompt].

    Per query row the G query heads' causal probabilities are reduced like ``group_score`` (mean/sum/max).
    Blocked GEMM tiles (``causal_attention_scores``), O(n_prompt^2 G d) time.
    """
    n_prompt, hq_n, _ = q.shape
    g_n = hq_n // k.shape[1]
    acc = np.zeros(n_prompt, np.float64)
    causal_attention_scores(q, k, scale, h * g_n, g_n, h, 0, n_prompt, mode, acc, np.zeros((1, 1)), 0)
    return acc


@kernel(PREFILL_SIG)
def _prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    lam = params[P.lam]
    kind = int(params[P.concave])
    alpha, beta = params[P.alpha], params[P.beta]
    mode = int(params[P.similarity])
    lazy = params[P.greedy] == 0.0
    n_prompt = k.shape[0]
    full = n_prompt <= FULL_MATRIX_MAX
    S = np.empty((n_prompt if full else 0, n_prompt if full else 0), np.float64)
    memoised = n_prompt > 0 and head_state.shape[1] == n_prompt     # a replay's importance table (replay_head_state)
    for h in range(k.shape[1]):
        m = head_state[h].copy() if memoised else prompt_importance(q, k, scale, h, int(params[P.group_reduce]))
        recent = recent_slots(budget[h], params[P.recent_ratio])
        forced = np.zeros(n_prompt, np.uint8)
        forced[max(0, n_prompt - recent):] = 1
        inset = np.zeros(n_prompt, np.uint8)
        if full:
            similarity_into(k[:, h, :], mode, S)
            sel, _ = greedy_select(S, m, budget[h], forced, lam, kind, alpha, beta, lazy)
            for e in sel:
                inset[e] = 1
            nn = np.zeros(n_prompt, np.float64)
            nn_pos = np.full(n_prompt, -1, np.int64)
            for i in range(n_prompt):
                if inset[i] == 0:
                    continue
                best, best_s = -1, 0.0
                for j in range(n_prompt):
                    if j != i and inset[j] != 0 and (best < 0 or S[i, j] > best_s):
                        best, best_s = j, S[i, j]
                nn[i], nn_pos[i] = best_s, best
        else:
            uT = unit_keys_t(k[:, h, :])
            if budget[h] >= n_prompt:
                inset[:] = 1            # the greedy would pick every key
            else:
                sel, _, _ = greedy_select_keys(uT, m, budget[h], forced, lam, kind, alpha, beta, lazy, mode)
                for e in sel:
                    inset[e] = 1
            nn, nn_pos = nearest_selected(uT, inset, mode)
        for i in range(n_prompt):
            keep[h, i] = inset[i]
            if inset[i] == 0:
                continue
            slot_state[h, i, F_ACC] = m[i]
            nrm = 0.0
            for x in range(k.shape[2]):
                nrm += np.float64(k[i, h, x]) ** 2
            slot_state[h, i, F_NORM] = np.sqrt(nrm)
            slot_state[h, i, F_NN] = nn[i]
            slot_state[h, i, F_NNPOS] = nn_pos[i]


@njit(cache=True)
def _nearest(keys, slot_state, positions, keep, h, i, n, mode):
    """Nearest neighbour (similarity, position) of slot i among the kept slots j != i (0, -1 when alone)."""
    best, best_pos = 0.0, -1
    ni = slot_state[h, i, F_NORM]
    dots = np.empty(n, np.float32)
    _dots_to(keys, h, i, n, dots)
    for j in range(n):
        if j == i or keep[h, j] == 0:
            continue
        s = kernel_sim(_cos_from(dots[j], ni, slot_state[h, j, F_NORM]), mode)
        if best_pos < 0 or s > best:
            best, best_pos = s, positions[h, j]
    return best, best_pos


@kernel(STEP_SIG)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    lam = params[P.lam]
    kind = int(params[P.concave])
    alpha, beta = params[P.alpha], params[P.beta]
    mode = int(params[P.similarity])
    gmode = int(params[P.group_reduce])
    g_n = probs.shape[1]
    ss = self_sim(mode)
    gone = np.zeros(g_n, np.float64)
    dots = np.empty(keys.shape[1], np.float32)
    for h in range(lengths.shape[0]):
        n = lengths[h]
        new = n - 1
        # Alg. 2 line 5: accumulate this query's attention (over S_{t-1} + k_t) into every slot
        for i in range(n):
            slot_state[h, i, F_ACC] += group_score(probs, h, i, gmode)
        nrm = 0.0
        for x in range(keys.shape[2]):
            nrm += np.float64(keys[h, new, x]) ** 2
        slot_state[h, new, F_NORM] = np.sqrt(nrm)
        # nearest neighbours: the new key against every cached key, O(n d)
        nn, nn_pos = 0.0, -1
        _dots_to(keys, h, new, new, dots)
        for i in range(new):
            s = kernel_sim(_cos_from(dots[i], slot_state[h, i, F_NORM], slot_state[h, new, F_NORM]), mode)
            if slot_state[h, i, F_NNPOS] < 0 or s > slot_state[h, i, F_NN]:
                slot_state[h, i, F_NN] = s
                slot_state[h, i, F_NNPOS] = t
            if nn_pos < 0 or s > nn:
                nn, nn_pos = s, positions[h, i]
        slot_state[h, new, F_NN] = nn
        slot_state[h, new, F_NNPOS] = nn_pos
        excess = n - budget[h]
        if excess <= 0:
            continue
        recent = recent_slots(budget[h], params[P.recent_ratio])
        hi_pos = t - recent + 1
        for g in range(g_n):
            gone[g] = 0.0
        live = n
        while excess > 0:
            # Alg. 2 line 10: argmin_k g(k | S' \ k) with V = S'
            m_tot = 0.0
            for i in range(n):
                if keep[h, i] != 0:
                    m_tot += slot_state[h, i, F_ACC]
            phi_tot = concave(m_tot, kind, alpha, beta)
            worst, worst_g = -1, 0.0
            for i in range(n):
                if keep[h, i] == 0 or positions[h, i] >= hi_pos:
                    continue
                imp = 0.0
                if phi_tot > 0.0:
                    rest = concave_from(m_tot - slot_state[h, i, F_ACC], kind, alpha, beta, phi_tot)
                    imp = (phi_tot - rest) / phi_tot
                fl = (ss - slot_state[h, i, F_NN]) / (live * ss) if slot_state[h, i, F_NNPOS] >= 0 else 1.0 / live
                gain = lam * fl + (1.0 - lam) * imp
                if worst < 0 or gain < worst_g:
                    worst, worst_g = i, gain
            if worst < 0:    # only protected slots left (cannot happen while recent <= budget)
                break
            keep[h, worst] = 0
            live -= 1
            excess -= 1
            gone_pos = positions[h, worst]
            for g in range(g_n):
                gone[g] += probs[h, g, worst]
            # line 14: the kept new key's attention renormalised over S_t
            if keep[h, new] != 0:
                acc = 0.0
                for g in range(g_n):
                    p = probs[h, g, new] / (1.0 - gone[g]) if gone[g] < 1.0 else 0.0
                    if gmode == 2:
                        acc = p if g == 0 or p > acc else acc
                    else:
                        acc += p
                slot_state[h, new, F_ACC] = acc / g_n if gmode == 0 else acc
            # slots whose nearest neighbour just left look for a new one
            for i in range(n):
                if keep[h, i] != 0 and slot_state[h, i, F_NNPOS] == gone_pos:
                    s, p = _nearest(keys, slot_state, positions, keep, h, i, n, mode)
                    slot_state[h, i, F_NN] = s
                    slot_state[h, i, F_NNPOS] = p


def objective(keys: np.ndarray, importance: np.ndarray, subset, ground=None, *, lam: float = 0.3,
              concave_kind: str = "power", alpha: float = 0.04, beta: float = 1.0,
              similarity: str = "relu_cos") -> float:
    """g_lam(subset) of eq. 4 over the ground set ``ground`` (default all rows of keys [n, d]); for tests/eval."""
    n = keys.shape[0]
    ground = np.arange(n) if ground is None else np.asarray(list(ground), dtype=np.int64)
    subset = np.asarray(list(subset), dtype=np.int64)
    mode = SIMILARITY.index(similarity)
    kind = CONCAVE.index(concave_kind)
    S = similarity_matrix(np.ascontiguousarray(keys, dtype=np.float64), mode)
    fl = S[np.ix_(ground, subset)].max(axis=1).sum() / np.diag(S)[ground].sum() if len(subset) else 0.0
    phi_tot = concave(float(importance[ground].sum()), kind, alpha, beta)
    imp = concave(float(importance[subset].sum()), kind, alpha, beta) / phi_tot if phi_tot > 0 else 0.0
    return float(lam * fl + (1.0 - lam) * imp)


@register
class BumbleBee(Policy):
    """Keep a diverse and important summary: greedy submodular selection on the prompt (Alg. 1), then per
    decode step drop the key with the smallest conditional gain of the diversity/importance mixture (Alg. 2).
    Defaults follow the paper's LongBench setting (lam = 0.3, power concave alpha = 0.04, beta = 1, ReLU cosine).
    """

    name = "bumblebee"
    summary = "submodular diversity + importance"
    schema = SCHEMA
    P = P
    slot_fields = 4
    step_fn = _step
    prefill_fn = _prefill

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(recent=int(recent_slots(budget, self.params["recent_ratio"])))

    def replay_head_state(self, n_kv_heads: int, head_dim: int, layer: Any, memo: dict | None = None,
                          n_prompt: int = 0) -> np.ndarray:
        """Every prompt key's importance [Hkv, n_prompt] (``prompt_importance``, O(P^2 G d), most of a replay's
        time): it depends on the trace and ``group_reduce`` only, so it is computed once per prepared layer and
        kept in ``memo`` for the other budgets; the prefill reads it (the same bits) instead of recomputing. The
        closed loop's head state has no columns, and its prefill computes the importance itself."""
        if n_prompt < 1:
            return super().replay_head_state(n_kv_heads, head_dim, layer, memo, n_prompt)
        mode = int(self.param_vector(layer.attention)[P.group_reduce])
        scale = float(layer.attention.scale)
        key = ("bumblebee.importance", n_prompt, mode, scale)
        table = None if memo is None else memo.get(key)
        if table is None:
            q, k = layer.q[:n_prompt], layer.k[:n_prompt]
            table = np.stack([prompt_importance(q, k, scale, h, mode) for h in range(n_kv_heads)])
            if memo is not None:
                memo[key] = table
        return table.copy()
