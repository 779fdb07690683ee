"""Attention error after the output projection W_O, from a replay's kept sets.

The engine's ``err`` is the relative error of each query head's attention output. What the next layer sees is
W_O applied to all heads' outputs together, so heads whose value subspace W_O shrinks matter less and errors of
different heads can cancel or add (CriticalKV's argument, arXiv 2502.03805). This module recomputes, per layer
and decode step, ``||W_O (o_cache - o_full)|| / ||W_O o_full||`` in numpy, one GEMM per KV head and layer.

The cache of decode step P+r is the replay's kept set after step P+r-1 plus the new token: exact for every
eviction policy; a policy that merges values (D2O) or scales logits (BUZZ log-n) is approximated by its kept
set, i.e. as if it only evicted.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def projected_errors(inputs: Sequence, kept: np.ndarray, wo: Sequence[np.ndarray], n_prompt: int,
                     scale: float) -> np.ndarray:
    """Per layer, the mean over decode steps P+1 .. P+R-1 of ``||W_O (o_cache - o_full)|| / ||W_O o_full||``.

    ``inputs``: the replay's `sim.layer_inputs.LayerInputs` (q, k, v, o of every position), ``kept`` [L, R, Hkv, W]:
    positions held after steps P .. P+R-1 (-1 padded; `replay(..., record_kept=(P, R))`), ``wo``: per layer the
    o_proj weight [hidden, Hq * d] (as torch's Linear stores it)."""
    L, R, hkv, _ = kept.shape
    if len(inputs) != L or len(wo) != L:
        raise ValueError(f"kept has {L} layers, inputs {len(inputs)}, wo {len(wo)}")
    if R < 2:
        raise ValueError("need kept sets of at least 2 decode steps")
    out = np.zeros(L)
    for l, li in enumerate(inputs):
        q = np.asarray(li.q, np.float32)
        S, T = R - 1, n_prompt + R
        hq, d = q.shape[1], q.shape[2]
        g = hq // hkv
        w = np.asarray(wo[l], np.float32)
        if w.shape != (w.shape[0], hq * d):
            raise ValueError(f"layer {l}: W_O must be [hidden, {hq * d}], got {w.shape}")
        qs = q[n_prompt + 1:T].reshape(S, hkv, g, d)
        k = np.asarray(li.k[:T], np.float32)
        v = np.asarray(li.v[:T], np.float32)
        step = n_prompt + 1 + np.arange(S)
        causal = np.arange(T)[None, :] <= step[:, None]                            # [S, T]
        held = np.zeros((S, hkv, T + 1), bool)                                     # column T absorbs the -1 pads
        ks = kept[l, :S]
        np.put_along_axis(held, np.where(ks >= 0, ks, T), True, axis=2)
        held = held[:, :, :T]
        held[np.arange(S), :, step] = True                                         # the step's own new token
        o_cache = np.empty((S, hkv, g, d), np.float32)
        for h in range(hkv):   # one GEMM per KV head and side (BLAS on contiguous operands), not an einsum
            kh, vh = np.ascontiguousarray(k[:, h]), np.ascontiguousarray(v[:, h])
            logits = (np.ascontiguousarray(qs[:, h]).reshape(S * g, d) @ kh.T).reshape(S, g, T) * np.float32(scale)
            logits = np.where((causal & held[:, h])[:, None, :], logits, -np.inf)
            logits -= logits.max(-1, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(-1, keepdims=True)
            o_cache[:, h] = (p.reshape(S * g, T) @ vh).reshape(S, g, d)
        o_cache = o_cache.reshape(S, hq * d)
        o_full = np.asarray(li.o[n_prompt + 1:T], np.float32).reshape(S, hq * d)
        num = np.linalg.norm((o_cache - o_full) @ w.T, axis=1)
        den = np.linalg.norm(o_full @ w.T, axis=1)
        out[l] = float(np.mean(num / np.maximum(den, 1e-30)))
    return out
