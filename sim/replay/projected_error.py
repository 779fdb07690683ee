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


#: the trace-only arrays `ProjectedReference` keeps across kept sets, at most (beyond: recomputed per kept set)
REFERENCE_BYTES = 1 << 30


def projected_errors(inputs: Sequence, kept: np.ndarray, wo: Sequence[np.ndarray], n_prompt: int,
                     scale: float) -> np.ndarray:
    """Per layer, the mean over decode steps P+1 .. P+R-1 of ``||W_O (o_cache - o_full)|| / ||W_O o_full||``.

    ``inputs``: the replay's `sim.replay.layer_inputs.LayerInputs` (q, k, v, o of every position), ``kept`` [L, R, Hkv, W]:
    positions held after steps P .. P+R-1 (-1 padded; `replay(..., record_kept=(P, R))`), ``wo``: per layer the
    o_proj weight [hidden, Hq * d] (as torch's Linear stores it). Many kept sets of one trace: `ProjectedReference`."""
    return ProjectedReference(inputs, wo, n_prompt, scale).errors(kept)


class ProjectedReference:
    """The error after W_O of many kept sets of one trace's layers (``inputs``, ``wo`` as `projected_errors` takes
    them): the parts that depend on the trace only (the measured steps' logits over every key, per KV head, the
    full-cache outputs and their norms after W_O) are computed once per layer, on first use, and kept (up to
    ``max_bytes``) for every kept set measured against them; the results are `projected_errors`'s, bit for bit."""

    def __init__(self, inputs: Sequence, wo: Sequence[np.ndarray], n_prompt: int, scale: float,
                 max_bytes: int = REFERENCE_BYTES) -> None:
        if len(inputs) != len(wo):
            raise ValueError(f"{len(inputs)} layers of inputs, {len(wo)} of wo")
        self.inputs, self.wo, self.P, self.scale = list(inputs), list(wo), int(n_prompt), float(scale)
        self.max_bytes, self.held = int(max_bytes), 0
        self._layers: dict[tuple[int, int, int], tuple] = {}

    def errors(self, kept: np.ndarray) -> np.ndarray:
        """Per layer, the mean over decode steps P+1 .. P+R-1 of the relative error after W_O of ``kept``
        [L, R, Hkv, W] (see `projected_errors`)."""
        L, R, hkv, _ = kept.shape
        if len(self.inputs) != L:
            raise ValueError(f"kept has {L} layers, inputs {len(self.inputs)}, wo {len(self.wo)}")
        if R < 2:
            raise ValueError("need kept sets of at least 2 decode steps")
        out = np.zeros(L)
        S, T = R - 1, self.P + R
        step = self.P + 1 + np.arange(S)
        causal = np.arange(T)[None, :] <= step[:, None]                            # [S, T]
        for l in range(L):
            logits_h, w, o_full, den = self._layer(l, R, hkv)
            v = np.asarray(self.inputs[l].v[:T], np.float32)
            g, d = logits_h[0].shape[1], v.shape[2]
            held = np.zeros((S, hkv, T + 1), bool)                                 # column T absorbs the -1 pads
            ks = kept[l, :S]
            np.put_along_axis(held, np.where(ks >= 0, ks, T), True, axis=2)
            held = held[:, :, :T]
            held[np.arange(S), :, step] = True                                     # the step's own new token
            o_cache = np.empty((S, hkv, g, d), np.float32)
            for h in range(hkv):   # one GEMM per KV head (BLAS on contiguous operands), not an einsum
                vh = np.ascontiguousarray(v[:, h])
                logits = np.where((causal & held[:, h])[:, None, :], logits_h[h], -np.inf)
                logits -= logits.max(-1, keepdims=True)
                p = np.exp(logits)
                p /= p.sum(-1, keepdims=True)
                o_cache[:, h] = (p.reshape(S * g, T) @ vh).reshape(S, g, d)
            num = np.linalg.norm((o_cache.reshape(S, -1) - o_full) @ w.T, axis=1)
            out[l] = float(np.mean(num / np.maximum(den, 1e-30)))
        return out

    def _layer(self, l: int, R: int, hkv: int) -> tuple:
        """Layer l's trace-only arrays for kept sets of R steps: per KV head the scaled logits [S, G, T] of the
        measured steps' queries over every key, W_O (float32), the full-cache outputs [S, Hq * d] and the norms of
        their projections."""
        key = (l, R, hkv)
        if key in self._layers:
            return self._layers[key]
        li = self.inputs[l]
        q = np.asarray(li.q, np.float32)
        S, T = R - 1, self.P + R
        hq, d = q.shape[1], q.shape[2]
        g = hq // hkv
        w = np.asarray(self.wo[l], np.float32)
        if w.shape != (w.shape[0], hq * d):
            raise ValueError(f"layer {l}: W_O must be [hidden, {hq * d}], got {w.shape}")
        qs = q[self.P + 1:T].reshape(S, hkv, g, d)
        k = np.asarray(li.k[:T], np.float32)
        logits_h = [(np.ascontiguousarray(qs[:, h]).reshape(S * g, d) @ np.ascontiguousarray(k[:, h]).T
                     ).reshape(S, g, T) * np.float32(self.scale) for h in range(hkv)]
        o_full = np.asarray(li.o[self.P + 1:T], np.float32).reshape(S, hq * d)
        den = np.linalg.norm(o_full @ w.T, axis=1)
        arrays = (logits_h, w, o_full, den)
        size = sum(a.nbytes for a in logits_h) + o_full.nbytes
        if self.held + size <= self.max_bytes:
            self._layers[key] = arrays
            self.held += size
        return arrays
