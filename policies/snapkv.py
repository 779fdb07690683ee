"""SnapKV (Li et al., 2024) and PyramidKV (Zhang et al., 2024): observation-window prompt selection.

Settings follow Ada-KV's evaluation (which uses SnapKV's): observation window 32, max pooling with kernel 7.
PyramidKV's beta = 20 is the default of the PyramidKV/KVCache-Factory code and of Ada-KV's ``pyram_beta``
(the seed papers do not state it).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from numba import njit

from policies._adakv_core import POOLING, protected_window, pyramid_layer_budgets, snap_prefill, window_step
from policies.base import PREFILL_SIG, STEP_SIG, Guarantees, Param, Policy, PolicyError
from policies.kernels import GROUP_REDUCE
from policies.registry import register

#: parameters shared by every observation-window policy, in kernel order (params[0..3])
WINDOW_SCHEMA = (
    Param("window_size", 32, "int", 1, 256, doc="observation window: last prompt queries used to score tokens, "
                                                "also kept as the recent window"),
    Param("kernel_size", 7, "int", 1, 63, doc="pooling kernel over neighbouring positions (odd)"),
    Param("pooling", "max", "choice", choices=POOLING, doc="pooling of window scores (Ada-KV: max)"),
    Param("group_reduce", "mean", "choice", choices=GROUP_REDUCE, doc="GQA aggregation of query heads"),
)
BETA = Param("beta", 20.0, "float", 1.0, 1000.0, doc="PyramidKV: deepest layer keeps (budget - window) / beta")


@njit(STEP_SIG, cache=True)
def window_decode_step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state,
                       keep, merge_to, merge_w):
    """Decode step of every observation-window policy (uniform or Ada): see ``_adakv_core.window_step``."""
    window_step(int(params[0]), int(params[1]), int(params[2]), int(params[3]), -1.0, t, budget, lengths, probs,
                positions, slot_state, head_state, keep)


@njit(PREFILL_SIG, cache=True)
def _uniform_prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    snap_prefill(int(params[0]), int(params[1]), int(params[2]), int(params[3]), -1.0, budget, q, k, scale, keep,
                 slot_state, head_state)


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
        return Guarantees(recent=int(protected_window(self.params["window_size"], budget)))


@register
class SnapKV(WindowPolicy):
    """Score prompt tokens by the attention of the last ``window_size`` prompt queries (summed over the window,
    GQA-reduced per query step), max-pool the scores over ``kernel_size`` neighbours, keep per KV head the
    window plus the top ``budget - window`` tokens. SnapKV itself only compresses the prompt; here decode keeps
    the budget with the same rule over a sliding observation window (the last ``window_size`` queries)."""

    name = "snapkv"
    summary = "observation-window prompt selection with pooling"
    schema = WINDOW_SCHEMA
    prefill_fn = _uniform_prefill


@register
class PyramidKV(SnapKV):
    """SnapKV with per-layer budgets decreasing linearly with depth (pyramidal information funnelling); the total
    stays ``budget * L * Hkv`` (see ``pyramid_layer_budgets``)."""

    name = "pyramidkv"
    summary = "SnapKV with layer budgets decreasing with depth"
    schema = WINDOW_SCHEMA + (BETA,)

    def allocate(self, budget: int, n_kv_heads: int, prompt_layers: Sequence[tuple[np.ndarray, np.ndarray]],
                 scale: float) -> np.ndarray:
        n_prompt = prompt_layers[0][0].shape[0] if prompt_layers else 0
        per_layer = pyramid_layer_budgets(budget, len(prompt_layers), n_prompt, self.params["window_size"],
                                          self.params["beta"])
        return np.repeat(per_layer[:, None], n_kv_heads, axis=1)
