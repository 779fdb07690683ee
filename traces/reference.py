"""Full causal attention reference (log-sum-exp and output per query) computed once per trace."""
from __future__ import annotations

import numpy as np

_ROW_CHUNK = 256


def full_attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Causal softmax attention of every query over all keys up to its own position.

    q: [T, Hq, d]; k, v: [T, Hkv, d] with Hq a multiple of Hkv (GQA). Returns lse [T, Hq] (of the scaled
    logits) and o [T, Hq, d], both float32, computed in float64 in row chunks to bound memory.
    """
    T, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != (T, hkv, d) or v.shape != (T, hkv, d) or hq % hkv:
        raise ValueError(f"incompatible shapes q{q.shape} k{k.shape} v{v.shape}")
    g = hq // hkv
    lse = np.empty((T, hq), np.float32)
    out = np.empty((T, hq, d), np.float32)
    for h in range(hkv):
        kh = np.asarray(k[:, h], np.float64)
        vh = np.asarray(v[:, h], np.float64)
        for r0 in range(0, T, _ROW_CHUNK):
            r1 = min(T, r0 + _ROW_CHUNK)
            qs = np.asarray(q[r0:r1, h * g:(h + 1) * g], np.float64)          # [R, G, d]
            logits = np.einsum("rgd,td->rgt", qs, kh[:r1]) * scale              # [R, G, r1]
            future = np.arange(r1)[None, :] > np.arange(r0, r1)[:, None]           # [R, r1]
            logits = np.where(future[:, None, :], -np.inf, logits)
            m = logits.max(axis=2, keepdims=True)
            p = np.exp(logits - m)
            s = p.sum(axis=2, keepdims=True)
            lse[r0:r1, h * g:(h + 1) * g] = (m + np.log(s))[..., 0]
            out[r0:r1, h * g:(h + 1) * g] = np.einsum("rgt,td->rgd", p / s, vh[:r1])
    return lse, out
