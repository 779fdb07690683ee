"""BumbleBee's submodular machinery (policies/bumblebee.py's prompt selection and step): the concave functions of
the importance term, the key-similarity kernels, the greedy maximisation over a full similarity matrix
(``greedy_select``, up to FULL_MATRIX_MAX prompt keys) and its bounded twin that recomputes similarity columns
from the normalised keys (``greedy_select_keys``: the same picks in O(P d) memory), and each kept key's nearest
selected neighbour. Split out of bumblebee.py by job; the policy's docstring gives the objective and the choices.
"""
from __future__ import annotations

import numpy as np
from numba import njit

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
def default_cache_columns(n):
    """The columns of n float32 cosines the bounded greedy keeps by default: COL_CACHE_BYTES' worth (at least
    COL_ROWS, at most n)."""
    return min(n, max(COL_ROWS, COL_CACHE_BYTES // (4 * max(n, 1))))


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
    (``cache_cols`` columns, by default ``default_cache_columns(n)``) and O(COL_ROWS n).
    """
    d, n = uT.shape
    R = COL_ROWS
    acc = np.empty((R, COL_W), np.float32)
    blk = np.empty((R, n), np.float32)
    blk_rows = np.arange(R)
    col = np.empty((1, n), np.float64)
    items = np.empty(R, np.int64)
    cap = (default_cache_columns(n) if cache_cols < 0 else min(n, max(1, cache_cols))) if lazy else 0
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
