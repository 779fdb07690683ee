"""BumbleBee's key similarities (policies/bumblebee.py; the greedy that reads them: policies/_bumblebee_greedy.py):
the kernel from cosine to similarity, the full similarity matrix of a head's keys (one GEMM of the normalised keys),
and the same similarities column by column from the normalised keys transposed, bit for bit the matrix's (the
bounded prompt selection beyond FULL_MATRIX_MAX keys, in O(P d) memory).
"""
from __future__ import annotations

import numpy as np
from numba import njit

VECTOR_MATH = {"reassoc", "contract"}   # lets LLVM vectorise the float32 dot products (as the engine does)


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


@njit(cache=True, fastmath=VECTOR_MATH)
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


# ---------------------------------------------------------------- similarity columns from the normalised keys
#
# Above FULL_MATRIX_MAX prompt keys (policies/_bumblebee_greedy.py) the prefill keeps the normalised keys transposed
# (uT [d, n], float32) and recomputes a column sim(., e) when the greedy needs one. Each cosine is one float32 fused
# multiply-add chain over x = 0..d-1 from 0, bitwise what BLAS SGEMM gives ``similarity_into`` for n x n products
# (OpenBLAS here, measured: d <= 448; above that it splits the sum in two, and below ~33 keys it takes another
# kernel, hence the full-matrix path for short prompts). Gains sum their column with the same vectorised loop as
# the greedy's ``_coverage_gain``, so every gain and every pick is the full-matrix greedy's (tests/test_bumblebee.py
# compares kept sets and evaluation counts).

_FMA_CHAIN = {"contract"}    # a*b + acc fused per element, never reassociated: one FMA chain per cosine
COL_W = 1024                 # v-tile of the column kernel: its accumulators stay in L1/L2
COL_ROWS = 16                # columns computed per pass over uT


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


#: rows of cosines computed per BLAS call where a greedy wants many columns at once (its first round, the forced
#: picks' cover): SGEMM gives each cosine bitwise `cosines_into`'s FMA chain from GEMM_MIN_ROWS rows up and up to
#: GEMM_MAX_D channels (OpenBLAS, measured: with fewer rows it may take another kernel, whose sums differ in the last
#: bit; above 448 channels it splits the sum), about twice as fast
GEMM_ROWS = 64
GEMM_MIN_ROWS = 16
GEMM_MAX_D = 448


@njit(cache=True)
def cosine_rows(uT, items, nr, out):
    """out[r, v] = float32 cosine of keys items[r] and v for r < nr (``out`` [>= nr, n]): `cosines_into`'s values,
    bit for bit, by one SGEMM of the gathered rows against uT where that is exact (nr >= GEMM_MIN_ROWS, d <=
    GEMM_MAX_D), else by `cosines_into`."""
    d, n = uT.shape
    if nr < GEMM_MIN_ROWS or d > GEMM_MAX_D:
        cosines_into(uT, items, nr, out, np.arange(nr), np.empty((nr, COL_W), np.float32))
        return
    a = np.empty((nr, d), np.float32)
    for r in range(nr):
        for x in range(d):
            a[r, x] = uT[x, items[r]]
    out[:nr, :] = np.dot(a, uT)


@njit(cache=True)
def sims_row(c32, i, e, mode, out):
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
        sims_row(c32, r, rows[r], mode, one)
        out[r, :] = one[0]
