"""Comparing kept sets: the positions a cache holds, as replays (``ReplayResult.kept``), the closed loop's runner
and kvpress's presses record them, turned into masks and compared by their Jaccard index.

A kept-position record holds, per (..., KV head), the cached positions padded with -1 (``ReplayResult.kept``
[L, steps, Hkv, W]); ``kept_mask`` makes it a boolean mask over the positions, ``jaccard`` compares two masks, and
``compare_kept`` is the agreement of two records step by step (the simulator against the closed loop, one
backend against another). Two empty sets are equal: their Jaccard index is 1.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def kept_mask(kept_positions: np.ndarray, n: int) -> np.ndarray:
    """Boolean [..., n] of -1-padded kept positions [..., cap]."""
    kp = np.asarray(kept_positions)
    out = np.zeros(kp.shape[:-1] + (n,), bool)
    idx = np.nonzero(kp >= 0)
    out[idx[:-1] + (kp[idx],)] = True
    return out


def jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Jaccard index of the kept sets of two boolean masks [..., n] over their last axis (two empty sets: 1)."""
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    inter = (a & b).sum(-1)
    union = (a | b).sum(-1)
    return np.where(union == 0, 1.0, inter / np.maximum(union, 1))


def compare_kept(gpu: np.ndarray, sim: np.ndarray, n_steps: int) -> dict[str, Any]:
    """Kept-set agreement of two [L, >= n_steps, Hkv, W] position records (-1 padded; the widths may differ): share
    of equal sets, mean Jaccard index, and the most positions in one set's symmetric difference, over (layer,
    step, KV head) of the first ``n_steps`` steps. One layer's masks at a time (memory: steps x Hkv x positions);
    the mean sums the indices in (layer, step, head) order."""
    gpu, sim = np.asarray(gpu), np.asarray(sim)
    n_pos = int(max(gpu[:, :n_steps].max(initial=-1), sim[:, :n_steps].max(initial=-1))) + 1
    equal, jac, n, worst = 0, 0.0, 0, 0
    for layer in range(gpu.shape[0]):
        a = kept_mask(gpu[layer, :n_steps], n_pos)
        b = kept_mask(sim[layer, :n_steps], n_pos)
        diff = (a ^ b).sum(-1)
        equal += int((diff == 0).sum())
        worst = max(worst, int(diff.max(initial=0)))
        for x in jaccard(a, b).ravel().tolist():
            jac += x
        n += diff.size
    return {"kept_agreement": equal / n, "kept_jaccard": jac / n, "symmetric_difference_max": worst,
            "n_compared": n, "n_steps": n_steps}
