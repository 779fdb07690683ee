"""BumbleBee's submodular prompt selection (policies/bumblebee.py's prefill): the concave functions of the
importance term and the lazy greedy maximisation (Alg. 1), one loop over two column sources: the full similarity
matrix (``greedy_select``, up to FULL_MATRIX_MAX prompt keys) and columns recomputed from the normalised keys
(``greedy_select_keys``: the same picks in O(P d) memory; the similarities: policies/_bumblebee_similarity.py).
Split out of bumblebee.py by job; the policy's docstring gives the objective and the choices.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from policies._bumblebee_similarity import (COL_ROWS, COL_W, GEMM_ROWS, VECTOR_MATH, cosine_rows, cosines_into,
                                            self_sim, sims_row)


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


# ---------------------------------------------------------------- the lazy greedy (Alg. 1), over a column source
#
# One loop, ``_greedy``, makes both prompt selections: over the full similarity matrix (``greedy_select``: a gain
# reads row e of S) and bounded (``greedy_select_keys``: a gain reads e's similarity column, cached or recomputed
# from the normalised keys). The loop keeps the picks, the importance sums, the cover and the lazy heap; a *column
# source* gives it the similarities: its state ``src`` (a named tuple) and four kernels over it,
#   cover_items(src, items, k, cover)   cover[v] = max(cover[v], sim(items[r], v)) for r < k (the forced picks)
#   gain(src, e, it, heap, n_heap, bound, stamp, cover, m, m_sel, phi_sel, obj)   e's gain at round ``it``
#   scan(src, chosen, cover, m, m_sel, phi_sel, obj) -> (best, evals)   the naive greedy's argmax of the unchosen
#   cover_pick(src, e, cover)           the cover after picking e,
# with ``obj`` = (lam, fl_norm, phi_tot, kind, alpha, beta), the objective's constants. ``_greedy`` and the
# kernels are inlined into each caller (numba IR, ``inline="always"``): each path compiles as if written out, with
# no call per gain evaluation, and caches on disk (a kernel passed at run time as a value is a process address
# numba cannot cache).


@njit(cache=True, fastmath=VECTOR_MATH)
def _coverage_gain(S, e, cover):
    """sum_v max(0, S[e, v] - cover[v]): the facility-location gain of e before normalisation (SIMD). Row e of S is
    e's similarity column: S is the whole matrix, or a buffer of columns rebuilt on demand (one sum, one order)."""
    fl = 0.0
    for v in range(cover.shape[0]):
        fl += max(S[e, v] - cover[v], 0.0)
    return fl


@njit(cache=True)
def _gain(S, e, cover, m_e, m_sel, phi_sel, lam, fl_norm, phi_tot, kind, alpha, beta):
    """The objective's gain of adding e (its similarities: row e of S): ``lam`` x the normalised coverage gain plus
    (1 - ``lam``) x the normalised concave importance gain."""
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


@njit(cache=True, inline="always")
def _greedy(src, cover_items, gain, scan, cover_pick, m, budget, forced, lazy, fl_norm, lam, kind, alpha, beta):
    """Alg. 1 over a column source (see above): greedy maximisation of g over the n items with |selection| <=
    budget, ``forced`` items first (in index order, while the budget lasts). ``lazy`` re-evaluates only the
    candidate with the highest stale upper bound (Minoux; a max-heap by bound, then lower index, whose top is the
    naive scan's argmax): the naive greedy's picks (ties to the smaller index) from far fewer gain evaluations.
    Returns (selected indices in pick order, number of gain evaluations)."""
    n = m.shape[0]
    m_tot = 0.0
    for v in range(n):
        m_tot += m[v]
    phi_tot = concave(m_tot, kind, alpha, beta)
    obj = (lam, fl_norm, phi_tot, kind, alpha, beta)
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
    cover_items(src, order, n_sel, cover)
    phi_sel = concave(m_sel, kind, alpha, beta)
    bound = np.full(n, np.inf)
    stamp = np.full(n, -1, np.int64)
    heap = np.empty(n, np.int64)
    n_heap = 0
    for e in range(n):
        if chosen[e] == 0:
            heap[n_heap] = e
            n_heap += 1
    evals = 0
    it = 0
    while n_sel < order.shape[0]:
        if lazy:
            while True:
                best = heap[0]
                if stamp[best] == it:
                    n_heap -= 1
                    heap[0] = heap[n_heap]
                    _sift_down(heap, n_heap, 0, bound)
                    break
                bound[best] = gain(src, best, it, heap, n_heap, bound, stamp, cover, m, m_sel, phi_sel, obj)
                stamp[best] = it
                evals += 1
                _sift_down(heap, n_heap, 0, bound)     # a bound only changes at the top
        else:
            best, n_evals = scan(src, chosen, cover, m, m_sel, phi_sel, obj)
            evals += n_evals
        chosen[best] = 1
        order[n_sel] = best
        n_sel += 1
        m_sel += m[best]
        phi_sel = concave(m_sel, kind, alpha, beta)
        cover_pick(src, best, cover)
        it += 1
    return order[:n_sel], evals


# ---------------------------------------------------------------- the full-matrix source (up to FULL_MATRIX_MAX keys)

FullMatrix = namedtuple("FullMatrix", ("S",))


@njit(cache=True, inline="always")
def _full_cover_items(src, items, k, cover):
    S = src.S
    for r in range(k):
        e = items[r]
        for v in range(cover.shape[0]):
            if S[e, v] > cover[v]:
                cover[v] = S[e, v]


@njit(cache=True, inline="always")
def _full_gain(src, e, it, heap, n_heap, bound, stamp, cover, m, m_sel, phi_sel, obj):
    return _gain(src.S, e, cover, m[e], m_sel, phi_sel, obj[0], obj[1], obj[2], obj[3], obj[4], obj[5])


@njit(cache=True, inline="always")
def _full_scan(src, chosen, cover, m, m_sel, phi_sel, obj):
    best = -1
    best_g = 0.0
    evals = 0
    for e in range(chosen.shape[0]):
        if chosen[e] != 0:
            continue
        g = _gain(src.S, e, cover, m[e], m_sel, phi_sel, obj[0], obj[1], obj[2], obj[3], obj[4], obj[5])
        evals += 1
        if best < 0 or g > best_g:
            best, best_g = e, g
    return best, evals


@njit(cache=True, inline="always")
def _full_cover_pick(src, e, cover):
    S = src.S
    for v in range(cover.shape[0]):
        if S[e, v] > cover[v]:
            cover[v] = S[e, v]


@njit(cache=True)
def greedy_select(S, m, budget, forced, lam, kind, alpha, beta, lazy):
    """Alg. 1: greedy maximisation of g over V = rows of S with |selection| <= budget, ``forced`` items first.

    S [n, n] similarities, m [n] accumulated attention, forced [n] uint8 (kept unconditionally, e.g. a local
    window). ``lazy`` re-evaluates only the candidate with the highest stale upper bound (Minoux; a heap): same
    picks as the naive greedy (ties to the smaller index), far fewer gain evaluations. Returns (selected
    indices in pick order, number of gain evaluations). The prefill's greedy up to FULL_MATRIX_MAX keys;
    ``greedy_select_keys`` makes the same picks without S.
    """
    fl_norm = 0.0
    for v in range(S.shape[0]):
        fl_norm += S[v, v]
    return _greedy(FullMatrix(S), _full_cover_items, _full_gain, _full_scan, _full_cover_pick, m, budget, forced,
                   lazy, fl_norm, lam, kind, alpha, beta)


# ---------------------------------------------------------------- the bounded source (no n x n matrix)

COL_CACHE_BYTES = 256 << 20  # float32 cosine columns kept between lazy rounds (all of them up to n = 8192)
#: prompts up to this length take the full-matrix path (8 n^2 bytes <= 32 MiB per head): exact by construction
FULL_MATRIX_MAX = 2048


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


#: the bounded source's state: the normalised keys uT, the similarity mode, the column cache (float32 cosines
#: [cap, n]; slot[e]: e's row or -1; owner[c]: the row's item; ckey[c]: its item's bound, the eviction order;
#: cmark[c]: the batch that filled it, never evicted by that batch), the buffers of a pass (blk, blk_rows, acc, col,
#: items, dst, open_), round 0's gains (first) and the counters (ctr: columns computed, batches of misses,
#: whether round 0's gains are in) and the block of the passes that want many columns at once (gitems, gblk:
#: GEMM_ROWS items and their cosines, `cosine_rows`)
KeyColumns = namedtuple("KeyColumns", ("uT", "mode", "cache", "slot", "owner", "ckey", "cmark", "blk", "blk_rows",
                                       "acc", "col", "items", "dst", "first", "open_", "ctr", "gitems", "gblk"))


@njit(cache=True, inline="always")
def _keys_cover_items(src, picks, k, cover):
    """Cover with the columns of picks[:k], GEMM_ROWS per BLAS call (`cosine_rows`)."""
    items, blk = src.gitems, src.gblk
    for s in range(0, k, GEMM_ROWS):
        nr = min(GEMM_ROWS, k - s)
        for r in range(nr):
            items[r] = picks[s + r]
        cosine_rows(src.uT, items, nr, blk)
        src.ctr[0] += nr
        for r in range(nr):
            sims_row(blk, r, items[r], src.mode, src.col)
            _cover_with(src.col, cover)


@njit(cache=True)
def _keys_first_round(src, heap, n_heap, cover, m, m_sel, phi_sel, obj):
    """Round 0's gain of every candidate against the cover of the forced items, GEMM_ROWS columns per BLAS call
    (`cosine_rows`, heap order), keeping the float32 columns of the best gains in the cache."""
    R = GEMM_ROWS
    items, blk = src.gitems, src.gblk
    col, cache, slot, owner, ckey, cmark = src.col, src.cache, src.slot, src.owner, src.ckey, src.cmark
    for s in range(0, n_heap, R):
        nr = min(R, n_heap - s)
        for r in range(nr):
            items[r] = heap[s + r]
        cosine_rows(src.uT, items, nr, blk)
        src.ctr[0] += nr
        for r in range(nr):
            e = items[r]
            sims_row(blk, r, e, src.mode, col)
            g = _gain(col, 0, cover, m[e], m_sel, phi_sel, obj[0], obj[1], obj[2], obj[3], obj[4], obj[5])
            src.first[e] = g
            c = _cache_slot(ckey, cmark, -2)
            if c >= 0 and ckey[c] < g:
                if owner[c] >= 0:
                    slot[owner[c]] = -1
                owner[c], slot[e], ckey[c] = e, c, g
                cache[c, :] = blk[r, :]


@njit(cache=True)
def _keys_miss(src, e, it, heap, n_heap, bound, stamp):
    """A cache miss: e's column and those of the next stale uncached items of the heap (the ones evaluated next if
    the top does not stay on top), COL_ROWS in one pass, into the cache, evicting the lowest bounds (not this
    batch's own)."""
    cache, slot, owner, ckey, cmark, items, dst = src.cache, src.slot, src.owner, src.ckey, src.cmark, src.items, src.dst
    nr = _next_uncached(heap, n_heap, bound, stamp, slot, it, items, min(COL_ROWS, cache.shape[0]), src.open_)
    src.ctr[1] += 1
    for r in range(nr):
        c = _cache_slot(ckey, cmark, src.ctr[1])
        if owner[c] >= 0:
            slot[owner[c]] = -1
        owner[c], slot[items[r]], ckey[c], cmark[c] = items[r], c, bound[items[r]], src.ctr[1]
        dst[r] = c
    cosines_into(src.uT, items, nr, cache, dst, src.acc)
    src.ctr[0] += nr


@njit(cache=True, inline="always")
def _keys_gain(src, e, it, heap, n_heap, bound, stamp, cover, m, m_sel, phi_sel, obj):
    """e's gain: in round 0 from the gains computed for all candidates at once (``_keys_first_round``, on the first
    evaluation); later from its cached column, after a miss batch (``_keys_miss``) when it is not cached. A cached
    column's key becomes the new bound."""
    if it == 0:
        if src.ctr[2] == 0:
            _keys_first_round(src, heap, n_heap, cover, m, m_sel, phi_sel, obj)
            src.ctr[2] = 1
        g = src.first[e]
    else:
        if src.slot[e] < 0:
            _keys_miss(src, e, it, heap, n_heap, bound, stamp)
        sims_row(src.cache, src.slot[e], e, src.mode, src.col)
        g = _gain(src.col, 0, cover, m[e], m_sel, phi_sel, obj[0], obj[1], obj[2], obj[3], obj[4], obj[5])
    c = src.slot[e]
    if c >= 0:
        src.ckey[c] = g
    return g


@njit(cache=True, inline="always")
def _keys_scan(src, chosen, cover, m, m_sel, phi_sel, obj):
    """The naive greedy's round: every unchosen column, COL_ROWS per pass over uT."""
    n = chosen.shape[0]
    items, blk, col = src.items, src.blk, src.col
    best = -1
    best_g = 0.0
    evals = 0
    e0 = 0
    while e0 < n:
        nr = 0
        while e0 < n and nr < COL_ROWS:
            if chosen[e0] == 0:
                items[nr] = e0
                nr += 1
            e0 += 1
        if nr == 0:
            break
        cosines_into(src.uT, items, nr, blk, src.blk_rows, src.acc)
        src.ctr[0] += nr
        for r in range(nr):
            e = items[r]
            sims_row(blk, r, e, src.mode, col)
            g = _gain(col, 0, cover, m[e], m_sel, phi_sel, obj[0], obj[1], obj[2], obj[3], obj[4], obj[5])
            evals += 1
            if best < 0 or g > best_g:
                best, best_g = e, g
    return best, evals


@njit(cache=True, inline="always")
def _keys_cover_pick(src, e, cover):
    """Cover with the pick's column (from the cache, which it leaves, else computed)."""
    c = src.slot[e]
    if c >= 0:
        sims_row(src.cache, c, e, src.mode, src.col)
        src.slot[e], src.owner[c], src.ckey[c] = -1, -1, -np.inf
    else:
        src.items[0] = e
        cosines_into(src.uT, src.items, 1, src.blk, src.blk_rows, src.acc)
        src.ctr[0] += 1
        sims_row(src.blk, 0, e, src.mode, src.col)
    _cover_with(src.col, cover)


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
    n = uT.shape[1]
    R = COL_ROWS
    cap = (default_cache_columns(n) if cache_cols < 0 else min(n, max(1, cache_cols))) if lazy else 0
    src = KeyColumns(uT, mode, np.empty((cap, n), np.float32), np.full(n, -1, np.int64), np.full(cap, -1, np.int64),
                     np.full(cap, -np.inf), np.full(cap, -1, np.int64), np.empty((R, n), np.float32), np.arange(R),
                     np.empty((R, COL_W), np.float32), np.empty((1, n), np.float64), np.empty(R, np.int64),
                     np.empty(R, np.int64), np.empty(n, np.float64), np.empty(8 * R + 3, np.int64),
                     np.zeros(3, np.int64), np.empty(GEMM_ROWS, np.int64), np.empty((GEMM_ROWS, n), np.float32))
    ss = self_sim(mode)
    fl_norm = 0.0
    for v in range(n):
        fl_norm += ss
    picks, evals = _greedy(src, _keys_cover_items, _keys_gain, _keys_scan, _keys_cover_pick, m, budget, forced,
                           lazy, fl_norm, lam, kind, alpha, beta)
    return picks, evals, src.ctr[0]
