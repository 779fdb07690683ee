"""Full-cache attention reference (log-sum-exp and output per query), computed once per trace layer.

"Full cache" means the layer's own attention: causal over every earlier token on a global layer, over the last
``window`` tokens (itself included) on a sliding layer. The work is blocked: queries in chunks of
``_ROW_CHUNK`` rows against only the keys they can see, so memory is O(chunk x visible keys) per KV head,
never T x T.
"""
from __future__ import annotations

import numpy as np

_ROW_CHUNK = 256


def visible_range(r0: int, r1: int, window: int | None) -> int:
    """First key any query of rows r0..r1-1 can see (0 on a global layer)."""
    return 0 if not window else max(0, r0 - window + 1)


def causal_column_sums(q: np.ndarray, k: np.ndarray, scale: float, *, start: int = 0, stop: int | None = None,
                       window: int | None = None) -> np.ndarray:
    """The attention the queries start..stop-1 put on every key before ``stop``, summed over those queries:
    [Hkv, G, stop] float64 (causal; with ``window`` each query sees only its last ``window`` positions).

    This is what a chunk of prompt tokens streamed through a cache that has evicted nothing yet accumulates per
    slot (the engine's and the closed loop's chunked prefill); both compute it here, from the same q/k, so a whole
    prompt taken as one chunk costs BLAS products instead of a per-token loop and gives the same sums in both.
    q: [T, Hq, d], k: [T, Hkv, d] (T >= stop), float64 in row chunks."""
    stop = q.shape[0] if stop is None else int(stop)
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    if k.shape[0] < stop or q.shape[0] < stop or k.shape[2] != d or hq % hkv or not 0 <= start <= stop:
        raise ValueError(f"incompatible shapes or range: q{q.shape} k{k.shape} start {start} stop {stop}")
    g = hq // hkv
    out = np.zeros((hkv, g, stop), np.float64)
    for h in range(hkv):
        for r0 in range(start, stop, _ROW_CHUNK):
            r1 = min(stop, r0 + _ROW_CHUNK)
            c0 = visible_range(r0, r1, window)
            kh = np.asarray(k[c0:r1, h], np.float64)
            qs = np.asarray(q[r0:r1, h * g:(h + 1) * g], np.float64)
            R = r1 - r0
            logits = (qs.reshape(R * g, d) @ kh.T).reshape(R, g, r1 - c0) * scale
            cols = np.arange(c0, r1)[None, :]
            rows = np.arange(r0, r1)[:, None]
            hidden = cols > rows
            if window:
                hidden |= cols <= rows - window
            logits = np.where(hidden[:, None, :], -np.inf, logits)
            p = np.exp(logits - logits.max(axis=2, keepdims=True))
            p /= p.sum(axis=2, keepdims=True)
            out[h, :, c0:r1] += p.sum(axis=0)
    return out


def full_attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, *,
                             window: int | None = None, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Causal softmax attention of every query over the keys it sees: all earlier positions and itself, or
    with ``window`` only the last ``window`` positions (query i sees keys i - window + 1 .. i).

    q: [T, Hq, d]; k, v: [T, Hkv, d] with Hq a multiple of Hkv (GQA). Returns lse [T, Hq] (of the scaled
    logits) and o [T, Hq, d], both float32, computed in float64 in row chunks to bound memory. ``start``: only the
    queries from ``start`` on (the rows before are zero), for a trace whose earlier rows nothing reads.
    """
    T, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != (T, hkv, d) or v.shape != (T, hkv, d) or hq % hkv:
        raise ValueError(f"incompatible shapes q{q.shape} k{k.shape} v{v.shape}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    g = hq // hkv
    lse = np.zeros((T, hq), np.float32)
    out = np.zeros((T, hq, d), np.float32)
    for h in range(hkv):
        for r0 in range(start, T, _ROW_CHUNK):
            r1 = min(T, r0 + _ROW_CHUNK)
            c0 = visible_range(r0, r1, window)
            kh = np.asarray(k[c0:r1, h], np.float64)
            vh = np.asarray(v[c0:r1, h], np.float64)
            qs = np.asarray(q[r0:r1, h * g:(h + 1) * g], np.float64)          # [R, G, d]
            R = r1 - r0                                                          # BLAS products, not einsum loops
            logits = (qs.reshape(R * g, d) @ kh.T).reshape(R, g, r1 - c0) * scale    # [R, G, r1 - c0]
            cols = np.arange(c0, r1)[None, :]
            rows = np.arange(r0, r1)[:, None]
            hidden = cols > rows
            if window:
                hidden |= cols <= rows - window
            logits = np.where(hidden[:, None, :], -np.inf, logits)
            m = logits.max(axis=2, keepdims=True)
            p = np.exp(logits - m)
            s = p.sum(axis=2, keepdims=True)
            lse[r0:r1, h * g:(h + 1) * g] = (m + np.log(s))[..., 0]
            out[r0:r1, h * g:(h + 1) * g] = ((p / s).reshape(R * g, r1 - c0) @ vh).reshape(R, g, d)
    return lse, out
