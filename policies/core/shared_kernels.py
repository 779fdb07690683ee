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


@njit(cache=True, inline="always")
def l2_norm(x):
    """||x||_2 of a 1-d row in float64, without temporaries (scorers call it per slot and step)."""
    acc = 0.0
    for i in range(x.shape[0]):
        v = np.float64(x[i])
        acc += v * v
    return np.sqrt(acc)


@njit(cache=True)
def evict_lowest(scores, positions, n, n_evict, lo_pos, hi_pos, keep):
    """Evict the ``n_evict`` slots with the lowest score among slots whose position is in [lo_pos, hi_pos).

    Ties go to the older token (smaller position) first, so decisions are deterministic: slots are in position
    order in every cache kvsim builds (appends at the end, stable compaction), so the first lowest slot in slot
    order is the oldest. Slots outside the window are protected. Returns how many slots were evicted (fewer if
    too few candidates).
    """
    done = 0
    for _ in range(n_evict):
        best = -1
        low = np.inf
        for i in range(n):
            if keep[i] != 0 and lo_pos <= positions[i] < hi_pos and (best < 0 or scores[i] < low):
                best = i
                low = scores[i]
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
    """row[:r+1] = causal softmax attention of query ``r`` (head ``hq``) over KV head ``h``'s keys 0..r: float32
    dot products (as the engine's attention), the scaling and softmax in float64."""
    d = q.shape[2]
    mx = -np.inf
    for i in range(r + 1):
        acc = np.float32(0.0)
        for x in range(d):
            acc += np.float32(q[r, hq, x]) * np.float32(k[i, h, x])
        row[i] = np.float64(acc) * scale
        if row[i] > mx:
            mx = row[i]
    tot = 0.0
    for i in range(r + 1):
        row[i] = np.exp(row[i] - mx)
        tot += row[i]
    for i in range(r + 1):
        row[i] /= tot


_VECTOR_MATH = {"reassoc", "contract"}   # lets LLVM vectorise the loops below (rounding-level differences)
_LOG2E = 1.4426950408889634
_LN2_HI = 0.6931471803691238     # ln 2 split so that k * _LN2_HI is exact for |k| < 2^20 (Cody-Waite)
_LN2_LO = 1.9082149292705877e-10


@njit(cache=True, fastmath=_VECTOR_MATH)
def softmax_rows_inplace(x, n, scale, ibuf):
    """x[:n] <- softmax(scale * x[:n]) in float64, vectorised: the numbers of ``causal_row`` to ~1 ulp.

    exp by Cody-Waite reduction x = k ln2 + r (|r| <= ln2 / 2), a degree-13 Taylor polynomial (truncation
    < 5e-18 relative) and 2^k from its IEEE-754 bits (``ibuf``: int64 scratch of >= n); arguments below
    -708 are clamped (e^-708 ~ 3e-308, against a row sum >= 1).
    """
    mx = -np.inf
    for i in range(n):
        x[i] *= scale
        mx = max(mx, x[i])
    tot = 0.0
    for i in range(n):
        y = max(x[i] - mx, -708.0)
        k = np.floor(y * _LOG2E + 0.5)
        r = y - k * _LN2_HI - k * _LN2_LO
        e = 1.0 / 6227020800.0
        e = e * r + 1.0 / 479001600.0
        e = e * r + 1.0 / 39916800.0
        e = e * r + 1.0 / 3628800.0
        e = e * r + 1.0 / 362880.0
        e = e * r + 1.0 / 40320.0
        e = e * r + 1.0 / 5040.0
        e = e * r + 1.0 / 720.0
        e = e * r + 1.0 / 120.0
        e = e * r + 1.0 / 24.0
        e = e * r + 1.0 / 6.0
        e = e * r + 0.5
        e = e * r + 1.0
        e = e * r + 1.0
        x[i] = e
        ibuf[i] = (np.int64(k) + np.int64(1023)) << np.int64(52)
    pow2 = ibuf[:n].view(np.float64)
    for i in range(n):
        x[i] *= pow2[i]
        tot += x[i]
    inv = 1.0 / tot
    for i in range(n):
        x[i] *= inv


#: rows and keys per tile of the blocked prompt-attention kernels (GEMM tiles of B x d x B in float64)
ATTN_BLOCK = 128


@njit(cache=True)
def key_tiles(k, h, n, dtype):
    """Keys 0..n-1 of KV head ``h`` as transposed tiles [ceil(n / B), d, B] of ``dtype`` (zero padded) for GEMM."""
    d = k.shape[2]
    B = ATTN_BLOCK
    out = np.zeros(((n + B - 1) // B, d, B), dtype)
    for i in range(n):
        c = i // B
        j = i - c * B
        for x in range(d):
            out[c, x, j] = k[i, h, x]
    return out


@njit(cache=True)
def causal_attention_scores(q, k, scale, hq0, g_n, h, r0, r1, mode, scores, ring, ring_w):
    """Add, for every query row r in [r0, r1), the causal attention of query heads [hq0, hq0 + g_n) over KV head
    ``h``'s keys 0..r, reduced over those heads (mode 0 mean, 1 sum, 2 max, as ``group_score``), to
    ``scores[:r1]``. When ``ring_w > 0`` each row's reduced probabilities also go to ``ring[:, 1 + r % ring_w]``.

    The numbers of ``causal_row`` per row up to rounding: the float32 logits come from SGEMMs on B x B tiles
    (BLAS, twice a float64 GEMM's rate; only tiles on or below the diagonal), the float64 softmax is
    ``softmax_rows_inplace``. O((r1 - r0) * r1 * g_n * d) time, O(g_n * B * r1) memory.
    """
    B = ATTN_BLOCK
    d = q.shape[2]
    if r1 <= r0:
        return
    kt = key_tiles(k, h, r1, np.float32)
    qbuf = np.empty((g_n * B, d), np.float32)
    tiles = np.empty((kt.shape[0], g_n * B, B), np.float32)
    p = np.empty((g_n, r1), np.float64)
    ibuf = np.empty(r1, np.int64)
    red = np.empty(r1, np.float64)
    for b0 in range(r0, r1, B):
        b1 = min(r1, b0 + B)
        nb = b1 - b0
        m = g_n * nb
        for g in range(g_n):
            for r in range(b0, b1):
                for x in range(d):
                    qbuf[g * nb + r - b0, x] = q[r, hq0 + g, x]
        n_tiles = (b1 + B - 1) // B
        for c in range(n_tiles):
            np.dot(qbuf[:m], kt[c], tiles[c, :m])
        for r in range(b0, b1):
            n = r + 1
            for g in range(g_n):
                row = g * nb + r - b0
                for c in range(n_tiles):
                    for j in range(min(B, n - c * B)):
                        p[g, c * B + j] = tiles[c, row, j]
                softmax_rows_inplace(p[g], n, scale, ibuf)
            _reduce_group(p, g_n, n, mode, red)
            for i in range(n):
                scores[i] += red[i]
            if ring_w > 0:
                for i in range(n):
                    ring[i, 1 + r % ring_w] = red[i]


@njit(cache=True)
def _reduce_group(p, g_n, n, mode, out):
    """out[:n] = the ``group_score`` reduction (0 mean, 1 sum, 2 max) of rows p[:g_n, :n], in the same order."""
    if mode == 2:
        for i in range(n):
            out[i] = p[0, i]
        for g in range(1, g_n):
            for i in range(n):
                if p[g, i] > out[i]:
                    out[i] = p[g, i]
        return
    for i in range(n):
        out[i] = 0.0
    for g in range(g_n):
        for i in range(n):
            out[i] += p[g, i]
    if mode == 0:
        for i in range(n):
            out[i] /= g_n


@njit(cache=True)
def causal_column_sums(q, k, scale, hq, h, r0, r1):
    """Sum over query rows [r0, r1) of query head ``hq``'s causal attention probabilities: float64 [r1].

    Column i is the attention token i accumulated from those queries (H2O-style accumulated score).
    Blocked GEMM tiles (``causal_attention_scores``): O(B * r1) memory.
    """
    sums = np.zeros(r1, np.float64)
    causal_attention_scores(q, k, scale, hq, 1, h, r0, r1, 1, sums, np.zeros((1, 1)), 0)
    return sums


@njit(cache=True)
def prompt_attention(q, k, scale, mode):
    """Attention each prompt key accumulates over every prompt query, per KV head: float64 [Hkv, n_prompt], the
    G query heads of a row reduced by ``mode`` (``group_rows_scores``). O(n_prompt^2 G d): what BUZZ's and
    BumbleBee's prefills score the prompt by, and a replay computes once per trace (``prompt_attention_table``)."""
    out = np.zeros((k.shape[1], q.shape[0]), np.float64)
    prompt_attention_into(q, k, scale, mode, out)
    return out


@njit(cache=True, nogil=True)
def prompt_attention_into(q, k, scale, mode, out):
    """``prompt_attention`` added into ``out`` [Hkv, n_prompt] (zeros in, the table out), with the GIL released: a
    replay's layer threads compute their layers' tables side by side. It returns no array: numba boxes a returned
    array with a dtype it reads from the function's environment, which two threads entering a cached function for
    the first time at once can find unset ("'descr' is NULL", seen on Gemma-3's global layers)."""
    no_ring = np.zeros((1, 1), np.float64)
    for h in range(k.shape[1]):
        group_rows_scores(q, k, scale, h, 0, q.shape[0], mode, out[h], no_ring, 0)


def prompt_attention_table(layer, memo: dict | None, n_prompt: int, mode: int) -> np.ndarray:
    """``prompt_attention`` of a recorded layer's (``sim.replay.layer_inputs.LayerInputs``) first ``n_prompt`` tokens:
    trace-only work, kept in ``memo`` (``Policy.replay_head_state``'s, which a recorded trace's replays also keep
    on disk: ``sim.replay.trace_tables``), so that every budget, parameter and policy reading it shares one computation.
    A fresh array each call (a prefill may write into it)."""
    scale = float(layer.attention.scale)
    key = ("prompt_attention", int(n_prompt), int(mode), scale)
    table = None if memo is None else memo.get(key)
    if table is None:
        table = np.zeros((layer.k.shape[1], n_prompt), np.float64)
        prompt_attention_into(np.ascontiguousarray(layer.q[:n_prompt]), np.ascontiguousarray(layer.k[:n_prompt]),
                              scale, int(mode), table)
        if memo is not None:
            memo[key] = table
    return np.array(table, np.float64)


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
