"""Ada-KV (Feng et al., 2024): adaptive head-wise budget allocation composed with SnapKV, PyramidKV and H2O.

Eviction loss and its bound (Theorems 1-2, rebuilt from the prose; the symbols were lost in extraction).
For one head with full attention weights ``A_j`` (over all past tokens j) and values ``v_j``, keeping the set
``I`` gives post-eviction weights ``A_j 1[j in I] / F`` with retained mass ``F = sum_{j in I} A_j``
(Theorem 1: the softmax over the kept logits is the renormalised full softmax). The output difference is
``o - o' = sum_j A_j (1 - 1[j in I] / F) v_j``, so with ``C = max_j ||v_j||_1``

    ||o - o'||_1 <= C sum_j A_j |1 - 1[j in I] / F| = C ((1 - F) + F (1 / F - 1)) = 2 C (1 - F).

The paper states it after the output projection and summed over the h heads of a layer:
``L = ||y - y'||_1 <= 2 h C' - 2 C' sum_i sum_j I^i_j A^i_j`` with ``C'`` the largest row L1 norm of all
``V^i W^O_i`` (Theorem 2); the per-head form above is that statement with ``W^O_i`` the identity and a per-head
``C``, which is tighter, and the engine's metrics ``l1`` (= ||o - o'||_1) and ``l1_bound``
(= 2 (1 - F) max_{j<=t} ||v_j||_1) are exactly it (tests check both forms). Top-k selection maximises
``F`` for given budgets (Theorem 3); Ada-KV picks the budgets by a top-k over the flattened scores of all
heads of a layer, which maximises ``sum_i F_i`` for the layer's total budget, hence its bound is never above
the uniform allocation's (Theorem 4) -- with the safeguard too, see ``ada_allocate``.

Decode: the authors allocate once, after prefill, and then append every new token to every head (each head
keeps its allocated size plus what was generated). Here the budget must hold after each step, so by default
(``decode_alloc='fixed'``) each head keeps its prefill-allocated size by evicting one token per step with the
scorer's own decode rule (SnapKV: lowest pooled score over a sliding observation window; H2O: lowest
accumulated attention). ``decode_alloc='flat'`` carries Algorithm 2 into decode: each step the layer evicts
its Hkv lowest-scored candidates over the flattened scores of all heads, every head keeping its window plus
``floor(floor_alpha * (budget - window))`` slots, so head sizes keep adapting.

Against the released code (FFY0/AdaKV, ``adaptive_snapkv/monkeypatch/snapkv_utils.py``, GQA path): with
``group_reduce=mean, floor_alpha=0`` the prefill selection is the released one apart from equal-score ties.
``group_reduce=max`` is the released max (over a group's heads of the window-averaged scores); the released
rounding of the safeguard is ``rounding=released`` (default: largest remainder, exact total); at budgets <= the
window the released code keeps only the window: ``window_only=true``.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from policies._adakv_core import (ROUNDING, evict_flat, group_rows_scores, select_prompt, snap_prefill, target_size,
                                  window_mode, window_step)
from policies.base import PREFILL_SIG, STEP_SIG, Guarantees, Param, Policy, param_indices
from policies.h2o import recent_slots
from policies.kernels import GROUP_REDUCE, evict_lowest, group_score
from policies.registry import register
from policies.snapkv import BETA, WINDOW_SCHEMA, PyramidKV, WindowPolicy

FLOOR_ALPHA = Param("floor_alpha", 0.5, "float", 0.0, 1.0,
                    doc="safeguard: head budget = (1-a) * adaptive + a * uniform (0: pure Algorithm 2, 1: uniform)")
DECODE_ALLOC = Param("decode_alloc", "fixed", "choice", choices=("fixed", "flat"),
                     doc="decode: heads keep their prefill allocation (authors) or re-allocate over flattened scores")
ROUNDING_P = Param("rounding", "largest_remainder", "choice", choices=ROUNDING, searchable=False,
                   doc="safeguard rounding: exact total, or the released int() floor + round-half-even")
ADA_WINDOW_SCHEMA = WINDOW_SCHEMA + (FLOOR_ALPHA, DECODE_ALLOC, ROUNDING_P)
ADA_PYRAMID_SCHEMA = ADA_WINDOW_SCHEMA + (BETA,)
PA = param_indices(ADA_WINDOW_SCHEMA)      # a prefix of ADA_PYRAMID_SCHEMA: the kernels serve both


@njit(PREFILL_SIG, cache=True)
def _ada_window_prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    snap_prefill(int(params[PA.window_size]), int(params[PA.kernel_size]), int(params[PA.pooling]),
                 window_mode(int(params[PA.group_reduce])), params[PA.window_only] != 0.0, params[PA.floor_alpha],
                 params[PA.rounding] == 1.0, budget, q, k, scale, keep, slot_state, head_state)


@njit(STEP_SIG, cache=True)
def _ada_window_step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep,
                     merge_to, merge_w):
    flat_alpha = params[PA.floor_alpha] if params[PA.decode_alloc] == 1.0 else -1.0
    window_step(int(params[PA.window_size]), int(params[PA.kernel_size]), int(params[PA.pooling]),
                window_mode(int(params[PA.group_reduce])), params[PA.window_only] != 0.0, flat_alpha, t, budget,
                lengths, probs, positions, slot_state, head_state, keep)


@register
class AdaSnapKV(WindowPolicy):
    """Ada-SnapKV (Algorithm 3): SnapKV's pooled observation-window scores, then the layer's candidate budget
    ``Hkv * (budget - window)`` is split across KV heads by Ada-KV's allocation (top-k over the flattened
    scores, safeguard ``floor_alpha``); each head keeps the window plus its own top tokens. Heads hold
    different cache lengths; their sum is the layer's budget."""

    name = "ada_snapkv"
    summary = "SnapKV with Ada-KV head-wise budget allocation"
    schema = ADA_WINDOW_SCHEMA
    P = PA
    head_adaptive = True
    step_fn = _ada_window_step
    prefill_fn = _ada_window_prefill


@register
class AdaPyramidKV(AdaSnapKV):
    """Ada-Pyramid: PyramidKV's layer budgets, split across the heads of each layer by Ada-KV's allocation."""

    name = "ada_pyramidkv"
    summary = "PyramidKV with Ada-KV head-wise budget allocation"
    schema = ADA_PYRAMID_SCHEMA
    P = param_indices(ADA_PYRAMID_SCHEMA)
    allocate = PyramidKV.allocate


ADA_H2O_SCHEMA = (
    Param("recent_ratio", 0.5, "float", 0.0, 1.0, doc="share of the budget kept as recent window (H2O)"),
    Param("group_reduce", "mean", "choice", choices=GROUP_REDUCE, doc="GQA aggregation of query heads"),
    FLOOR_ALPHA,
    DECODE_ALLOC,
    ROUNDING_P,
)
PH = param_indices(ADA_H2O_SCHEMA)


@njit(PREFILL_SIG, cache=True)
def _ada_h2o_prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    ratio = params[PH.recent_ratio]
    mode = int(params[PH.group_reduce])
    P = q.shape[0]
    hkv = k.shape[1]
    w_e = recent_slots(budget[0], ratio)
    for h in range(1, hkv):
        w_e = min(w_e, recent_slots(budget[h], ratio))
    scores = np.zeros((hkv, P), np.float64)
    ring = np.zeros((1, 1), np.float64)
    for h in range(hkv):
        group_rows_scores(q, k, scale, h, 0, P, mode, scores[h], ring, 0)
        for i in range(P):
            slot_state[h, i, 0] = scores[h, i]
    select_prompt(scores, budget, w_e, params[PH.floor_alpha], keep, head_state, params[PH.rounding] == 1.0)


@njit(STEP_SIG, cache=True)
def _ada_h2o_step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep,
                  merge_to, merge_w):
    ratio = params[PH.recent_ratio]
    mode = int(params[PH.group_reduce])
    alpha = params[PH.floor_alpha]
    flat = params[PH.decode_alloc] == 1.0
    hkv = lengths.shape[0]
    hi = np.empty(hkv, np.int64)
    floors = np.empty(hkv, np.int64)
    over = False
    for h in range(hkv):
        n = lengths[h]
        for i in range(n):
            slot_state[h, i, 0] += group_score(probs, h, i, mode)
        recent = recent_slots(budget[h], ratio)
        hi[h] = t - recent + 1
        floors[h] = recent + int(alpha * (budget[h] - recent))
        target = target_size(budget, head_state, h)
        if n > target:
            over = True
            if not flat:
                evict_lowest(slot_state[h, :, 0], positions[h], n, n - target, 0, hi[h], keep[h])
    if flat and over:
        for h in range(hkv):
            if head_state[h, 0] == 0.0:
                head_state[h, 0] = 1.0
                head_state[h, 1] = budget[h]
        evict_flat(np.ascontiguousarray(slot_state[:, :, 0]), positions, lengths, hi, floors, head_state, keep)


@register
class AdaH2O(Policy):
    """Ada-KV allocation composed with H2O's score: at prefill, every prompt token's attention accumulated over
    all prompt queries (GQA-reduced per query); the heavy-hitter budgets ``budget - recent`` of the layer's
    heads are reallocated by Ada-KV over the flattened accumulated scores, each head keeping its recent window
    (``recent_ratio`` of the budget, as H2O). Decode: H2O's rule within each head's allocated size.
    With ``floor_alpha = 1`` this is a one-shot-prefill H2O with uniform budgets (the exact uniform twin)."""

    name = "ada_h2o"
    summary = "H2O accumulated scores with Ada-KV head-wise budget allocation"
    schema = ADA_H2O_SCHEMA
    P = PH
    slot_fields = 1
    head_fields = 2
    head_adaptive = True
    step_fn = _ada_h2o_step
    prefill_fn = _ada_h2o_prefill

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(recent=recent_slots(budget, self.params["recent_ratio"]))


def allocation_bound(weights: np.ndarray, budgets: np.ndarray, vmax1: np.ndarray | float = 1.0) -> float:
    """The layer's Theorem 2 bound ``sum_h 2 C_h (1 - top_{b_h}(weights[h]))`` for per-head budgets (Theorem 3:
    the top-k kept set maximises the retained mass). weights [H, N] observed attention, budgets [H]."""
    w = np.sort(np.asarray(weights, np.float64), axis=1)[:, ::-1]
    kept = np.array([w[h, : int(b)].sum() for h, b in enumerate(budgets)])
    return float((2.0 * np.asarray(vmax1, np.float64) * (1.0 - kept)).sum())
