"""The softmax of the engine's inner loop (`sim.replay.engine`): one KV head's G query heads' float32 logits to float64
probabilities, their normalisers and log-sum-exp (`softmax_rows`), with a vectorised float32 exp (no libm call
per element).

Beside `sim.replay.attention_kernels` (q.k and p.v, the passes before and after it), in its own module because it shares
nothing with them: the engine calls the three in turn.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)


#: the softmax passes also assume finite values (the trace loader rejects NaN/inf): max and sum reductions vectorise
_SOFTMAX_MATH = {"reassoc", "contract", "nnan", "nsz"}


@njit(cache=True, nogil=True, fastmath=_SOFTMAX_MATH)
def _exp_shifted(dots, g, n, f, shift, ibuf, fbuf, out):
    """out[i] = exp(dots[g, i] * f - shift) for logits <= shift in float32, vectorised (no libm call per element);
    returns the float64 sum of out[:n]. ``fbuf`` is ``ibuf`` viewed as float32 (made once with the scratch).

    Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, a degree-6 Taylor polynomial for e^r (relative error
    < 2e-7) and 2^k built from its IEEE-754 bits. Arguments are clamped to [-87, 0] (below: ~1e-38, not 0):
    an absolute error below 2e-38 on values normalised by a sum >= 1.
    """
    for i in range(n):
        # clamped to <= 0 as well: `contract` may fuse dots * f - shift into one FMA, which leaves the largest
        # logit the rounding error of shift (~1e21 for logits ~1e30) above 0 instead of exactly 0
        x = min(max(dots[g, i] * f - shift, np.float32(-87.0)), np.float32(0.0))
        k = np.floor(x * _LOG2E + np.float32(0.5))
        r = x - k * _LN2_HI - k * _LN2_LO
        p = np.float32(1.0 / 720.0)
        p = p * r + np.float32(1.0 / 120.0)
        p = p * r + np.float32(1.0 / 24.0)
        p = p * r + np.float32(1.0 / 6.0)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        p = p * r + np.float32(1.0)
        out[i] = p
        ibuf[i] = (np.int32(k) + np.int32(127)) << np.int32(23)
    tot = 0.0
    for i in range(n):
        out[i] *= fbuf[i]
        tot += out[i]
    return tot


@njit(cache=True, nogil=True, fastmath=_SOFTMAX_MATH)
def _normalise(ebuf, n, inv, row):
    """row[:n] = ebuf[:n] * inv in float64 (one query head's probabilities)."""
    for i in range(n):
        row[i] = ebuf[i] * inv


@njit(cache=True, nogil=True)
def softmax_rows(dots, dmax, h, g_n, n, f, probs, ebuf, ibuf, fbuf, inv, lse_caches):
    """The G query heads' softmax over the float32 logits dots[g, :n] * f (f > 0), shifted by the largest logit
    (the largest dot times f: rounding is monotone): the float32 numerators into the scratch's ``ebuf`` [G, n], their
    normalisers 1 / sum into ``inv`` and the log-sum-exp into ``lse_caches``, the probabilities (float64) into
    probs[h]."""
    for g in range(g_n):
        mx = dmax[g] * f
        tot = _exp_shifted(dots, g, n, f, mx, ibuf, fbuf, ebuf[g])
        inv[g] = 1.0 / tot
        _normalise(ebuf[g], n, inv[g], probs[h, g])
        lse_caches[g] = np.float64(mx) + np.log(tot)
