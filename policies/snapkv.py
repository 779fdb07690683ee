"""SnapKV (Li et al., 2024) and PyramidKV (Zhang et al., 2024): observation-window prompt selection.

Settings follow Ada-KV's evaluation (which uses SnapKV's): observation window 32, max pooling with kernel 7.
PyramidKV's beta = 20 is the default of the PyramidKV/KVCache-Factory code and of Ada-KV's ``pyram_beta``
(the seed papers do not state it).

GQA (``group_reduce``): ``max`` is the Ada-KV code's meaning, the largest window-summed score among the query
heads of a group; ``rowmax`` (kvsim's earlier ``max``) sums each window row's max over the group's heads.
``window_only``: at a budget <= the window keep only the last ``budget`` tokens (the released code keeps only
the window at budget = window); by default one selected slot stays (window ``budget - 1``).

Every window policy's schema starts with ``WINDOW_SCHEMA``, so the shared kernels read those parameters by
name through ``PW`` whatever follows.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from numba import njit

from policies._adakv_core import (POOLING, WINDOW_REDUCE, protected_window, pyramid_layer_budgets, snap_prefill,
                                  window_mode, window_step)
from policies.base import PREFILL_SIG, STEP_SIG, Guarantees, Param, Policy, PolicyError, param_indices
from policies.registry import register

#: parameters shared by every observation-window policy: the first entries of each such schema
WINDOW_SCHEMA = (
    Param("window_size", 32, "int", 1, 256, doc="observation window: last prompt queries used to score tokens, "
                                                "also kept as the recent window"),
    Param("kernel_size", 7, "int", 1, 63, doc="pooling kernel over neighbouring positions (odd)"),
    Param("pooling", "max", "choice", choices=POOLING, doc="pooling of window scores (Ada-KV: max)"),
    Param("group_reduce", "mean", "choice", choices=WINDOW_REDUCE,
          doc="GQA aggregation: mean/sum per row, max of the heads' window sums (Ada-KV code), rowmax per row"),
    Param("window_only", False, "bool", doc="budget <= window: keep only the last budget tokens (released code)"),
)
PW = param_indices(WINDOW_SCHEMA)
BETA = Param("beta", 20.0, "float", 1.0, 1000.0, doc="PyramidKV: deepest layer keeps (budget - window) / beta")
PYRAMID_SCHEMA = WINDOW_SCHEMA + (BETA,)


@njit(STEP_SIG, cache=True)
def window_decode_step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state,
                       keep, merge_to, merge_w):
    """Decode step of every observation-window policy (uniform or Ada): see ``_adakv_core.window_step``."""
    window_step(int(params[PW.window_size]), int(params[PW.kernel_size]), int(params[PW.pooling]),
                window_mode(int(params[PW.group_reduce])), params[PW.window_only] != 0.0, -1.0, t, budget, lengths,
                probs, positions, slot_state, head_state, keep)


@njit(PREFILL_SIG, cache=True)
def _uniform_prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    snap_prefill(int(params[PW.window_size]), int(params[PW.kernel_size]), int(params[PW.pooling]),
                 window_mode(int(params[PW.group_reduce])), params[PW.window_only] != 0.0, -1.0, False, budget, q, k,
                 scale, keep, slot_state, head_state)


class WindowPolicy(Policy):
    """Base of the observation-window family: ring of the last ``window_size`` query rows per slot for decode."""

    head_fields = 2
    step_fn = window_decode_step

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        # per slot: running window sum + one ring cell per window query (sized by the parameter)
        self.slot_fields = 1 + self.params["window_size"]

    def validate(self) -> None:
        if self.params["kernel_size"] % 2 == 0:
            raise PolicyError(f"{self.name}.kernel_size: {self.params['kernel_size']} must be odd "
                              f"(centred pooling with padding kernel_size // 2)")

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(recent=int(protected_window(self.params["window_size"], budget,
                                                      self.params["window_only"])))


@register
class SnapKV(WindowPolicy):
    """Score prompt tokens by the attention of the last ``window_size`` prompt queries (summed over the window,
    GQA-reduced per query step), max-pool the scores over ``kernel_size`` neighbours, keep per KV head the
    window plus the top ``budget - window`` tokens. SnapKV itself only compresses the prompt; here decode keeps
    the budget with the same rule over a sliding observation window (the last ``window_size`` queries)."""

    name = "snapkv"
    summary = "observation-window prompt selection with pooling"
    schema = WINDOW_SCHEMA
    P = PW
    prefill_fn = _uniform_prefill


@register
class PyramidKV(SnapKV):
    """SnapKV with per-layer budgets decreasing linearly with depth (pyramidal information funnelling); the total
    stays ``budget * L * Hkv`` (see ``pyramid_layer_budgets``)."""

    name = "pyramidkv"
    summary = "SnapKV with layer budgets decreasing with depth"
    schema = PYRAMID_SCHEMA
    P = param_indices(PYRAMID_SCHEMA)

    def allocate(self, budget: int, n_kv_heads: int, prompt_layers: Sequence[tuple[np.ndarray, np.ndarray]],
                 scale: float) -> np.ndarray:
        n_prompt = prompt_layers[0][0].shape[0] if prompt_layers else 0
        per_layer = pyramid_layer_budgets(budget, len(prompt_layers), n_prompt, self.params["window_size"],
                                          self.params["beta"])
        return np.repeat(per_layer[:, None], n_kv_heads, axis=1)
