"""SnapKV (Li et al., 2024) and PyramidKV (Zhang et al., 2024): observation-window scores, on the scorer base.

A token's score is the attention the last ``window_size`` queries gave it (summed over the window, GQA-reduced per
query step by ``group_reduce``), pooled over ``kernel_size`` neighbouring positions (SnapKV's clustering); the
window itself is the protected recent window (``protected_window``: the window, leaving one selected slot, or
with ``window_only`` the whole budget when it is at most the window). The prompt is selected at once from the
last prompt queries; at decode the observation window slides over the last ``window_size`` queries (a ring of
their reduced probabilities per slot, its running sum in ``slot_state[..., 0]``) and pooling runs over cached
candidates whose positions lie within ``kernel_size // 2`` of each other (uncached positions have no observed
score, like padding). Protected slots score as the best candidate (kvpress pads the window with the maximum), which
only ``critical``'s first stage reads.

Settings follow Ada-KV's evaluation (which uses SnapKV's): observation window 32, max pooling with kernel 7.
PyramidKV's beta = 20 is the default of the PyramidKV/KVCache-Factory code and of Ada-KV's ``pyram_beta`` (the
seed papers do not state it). GQA (``group_reduce``): ``max`` is the Ada-KV code's meaning, the largest
window-summed score among the query heads of a group (the decode ring holds one reduced value per query row, so
at decode it ranks by the row max; the released code never evicts during decode); ``rowmax`` sums each window
row's max over the group's heads. ``window_only``: at a budget <= the window keep only the last ``budget``
tokens; the released Ada-KV code keeps only the window at budget = window and fails below it, so this is "as the
released code" at B = window only. ``ada(snapkv)`` / ``ada(pyramidkv)`` (``ada_snapkv``, ``ada_pyramidkv``) are
Ada-KV's head-wise allocation over these scores (policies/core/stage_ada.py, policies/adakv.py).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import njit

from policies.core.base import Param, PolicyError, kernel, param_indices
from policies.core.shared_kernels import group_rows_scores, group_score, pool_scores
from policies.core.registry import register
from policies.core.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, Protection, ScorerPolicy, protected_window
from policies.core.kvpress_press import KvpressPress, NoKvpressPress, require

POOLING = ("max", "avg")
#: GQA reduction of the observation window; kernel modes (``group_rows_scores``): mean 0, sum 1, max 3, rowmax 2
WINDOW_REDUCE = ("mean", "sum", "max", "rowmax")

SCHEMA = (
    Param("window_size", 32, "int", 1, 256, doc="observation window: last prompt queries used to score tokens, "
                                                "also kept as the recent window"),
    Param("kernel_size", 7, "int", 1, 63, doc="pooling kernel over neighbouring positions (odd)"),
    Param("pooling", "max", "choice", choices=POOLING, doc="pooling of window scores (Ada-KV: max)"),
    Param("group_reduce", "mean", "choice", choices=WINDOW_REDUCE,
          doc="GQA aggregation: mean/sum per row, max of the heads' window sums (Ada-KV code), rowmax per row"),
    Param("window_only", False, "bool", doc="budget <= window: keep only the last budget tokens (released code)"),
)
P = param_indices(SCHEMA)
BETA = Param("beta", 20.0, "float", 1.0, 1000.0, doc="PyramidKV: deepest layer keeps (budget - window) / beta")
PYRAMID_SCHEMA = SCHEMA + (BETA,)


@njit(cache=True)
def window_mode(choice):
    """Kernel mode of a ``WINDOW_REDUCE`` choice index: max of the heads' window sums is mode 3, row max 2."""
    if choice == 2:
        return 3
    if choice == 3:
        return 2
    return choice


@njit(cache=True)
def _pad_protected(scores, n, hi, positions):
    """Protected slots (positions >= hi) score as the best candidate (kvpress pads the window with the max)."""
    best = 0.0
    found = False
    for i in range(n):
        if positions[i] < hi and (not found or scores[i] > best):
            best = scores[i]
            found = True
    for i in range(n):
        if positions[i] >= hi:
            scores[i] = best


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    """Window scores of the last ``window_size`` prompt queries, pooled over the candidates [0, hi[h]); the
    window's rows go into each slot's ring for decode."""
    n = q.shape[0]
    window = int(params[P.window_size])
    w_obs = min(window, n)
    mode = window_mode(int(params[P.group_reduce]))
    pos = np.arange(n)
    for h in range(k.shape[1]):
        raw = np.zeros(n, np.float64)
        group_rows_scores(q, k, scale, h, n - w_obs, n, mode, raw, slot_state[h], window)
        pool_scores(raw, max(hi[h], 0), int(params[P.kernel_size]), int(params[P.pooling]), scores[h])
        _pad_protected(scores[h], n, hi[h], pos)
        for i in range(n):
            slot_state[h, i, 0] = raw[i]


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    """Slide the observation window (the ring of the last ``window_size`` queries' reduced probabilities, running
    sum in slot_state[..., 0]) and pool the window scores of the candidates (positions < hi[h])."""
    window = int(params[P.window_size])
    col = 1 + t % window
    mode = window_mode(int(params[P.group_reduce]))
    row_mode = 2 if mode == 3 else mode
    r = int(params[P.kernel_size]) // 2
    kernel = int(params[P.kernel_size])
    pooling = int(params[P.pooling])
    for h in range(lengths.shape[0]):
        n = lengths[h]
        for i in range(n):
            s = group_score(probs, h, i, row_mode)
            slot_state[h, i, 0] += s - slot_state[h, i, col]
            slot_state[h, i, col] = s
        for i in range(n):
            if positions[h, i] >= hi[h]:
                continue
            acc = slot_state[h, i, 0]
            j = i - 1
            while j >= 0 and positions[h, i] - positions[h, j] <= r:
                if pooling == 0:
                    acc = max(acc, slot_state[h, j, 0])
                else:
                    acc += slot_state[h, j, 0]
                j -= 1
            j = i + 1
            while j < n and positions[h, j] < hi[h] and positions[h, j] - positions[h, i] <= r:
                if pooling == 0:
                    acc = max(acc, slot_state[h, j, 0])
                else:
                    acc += slot_state[h, j, 0]
                j += 1
            scores[h, i] = acc if pooling == 0 else acc / kernel
        _pad_protected(scores[h], n, hi[h], positions[h])


@register
class SnapKV(ScorerPolicy):
    """Score prompt tokens by the attention of the last ``window_size`` prompt queries (summed over the window,
    GQA-reduced per query step), max-pool the scores over ``kernel_size`` neighbours, keep per KV head the
    window plus the top ``budget - window`` tokens. SnapKV itself only compresses the prompt; here decode keeps
    the budget with the same rule over a sliding observation window (the last ``window_size`` queries)."""

    name = "snapkv"
    reads_keys = False
    reads_values = False
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"window_size": (32, 8, 16, 64)}
    summary = "observation-window prompt selection with pooling"
    schema = SCHEMA
    P = P
    protect = Protection(sinks=None, recent="window_size", rule="window", window_only="window_only")
    prompt_score_reads_bounds = True      # the pooling stops at the protected window (``prompt_bounds``)
    score_prompt = score_prompt
    score_step = score_step

    def scorer_slot_fields(self) -> int:
        """Per slot: the running window sum and one ring cell per window query (sized by the parameter)."""
        return 1 + self.params["window_size"]

    def validate(self) -> None:
        super().validate()
        if self.params["kernel_size"] % 2 == 0:
            raise PolicyError(f"{self.name}.kernel_size: {self.params['kernel_size']} must be odd "
                              f"(centred pooling with padding kernel_size // 2)")

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``SnapKVPress``: the same window scores, avg-pooled, GQA-averaged, the window kept."""
        require(self, "SnapKVPress", pooling="avg", group_reduce="mean")
        return KvpressPress({"cls": "SnapKVPress", "window_size": self.params["window_size"],
                             "kernel_size": self.params["kernel_size"]})


@register
class PyramidKV(SnapKV):
    """SnapKV with per-layer budgets decreasing linearly with depth (pyramidal information funnelling); the total
    stays ``budget * L * Hkv`` (see ``pyramid_layer_budgets``)."""

    name = "pyramidkv"
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"window_size": (32, 8, 16, 64)}
    summary = "SnapKV with layer budgets decreasing with depth"
    schema = PYRAMID_SCHEMA
    P = param_indices(PYRAMID_SCHEMA)

    def allocate(self, budget: int, n_kv_heads: int, prompt_layers: Sequence[tuple[np.ndarray, np.ndarray]],
                 scale: float) -> np.ndarray:
        n_prompt = prompt_layers[0][0].shape[0] if prompt_layers else 0
        per_layer = pyramid_layer_budgets(budget, len(prompt_layers), n_prompt, self.params["window_size"],
                                          self.params["beta"])
        return np.repeat(per_layer[:, None], n_kv_heads, axis=1)

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """None: ``PyramidKVPress`` selects as this policy does (parity at its per-layer counts), but its layer
        budgets are another schedule, which no setting of either side makes equal."""
        raise NoKvpressPress(
            "pyramidkv: kvpress's PyramidKVPress selects within a layer as kvsim does, but its layer budgets differ: "
            "it builds the pyramid on window + budget and counts the window inside each layer's total, kvsim "
            "(KVCache-Factory's and Ada-KV's rule) adds the window on top of the pyramid of budget - window, so "
            "the kept sets of most layers differ in size (SmolLM2 at 512: kvpress 960..64, kvsim 938..86)")


def pyramid_layer_budgets(budget: int, n_layers: int, n_prompt: int, window: int, beta: float) -> np.ndarray:
    """PyramidKV per-layer budgets (slots per KV head), decreasing linearly with depth, summing to budget * L.

    As in the PyramidKV/Ada-KV code: with the selectable part ``base = budget - window`` the deepest layer gets
    ``min = base // beta`` and the first ``max = 2 * base - min`` (capped at the prompt's candidates, then
    ``min = 2 * base - max``), the window being added to every layer. Differences, chosen so the total is
    exactly ``budget * L``: the linear schedule is rounded by largest remainder instead of integer steps
    (which lose up to L-1 slots per head), and ``min >= 1`` so every layer keeps a selected slot. The layers
    are those the trace holds, in order (a trace of a layer subset gets the pyramid over that subset).
    """
    w_e = int(protected_window(window, budget))
    base = budget - w_e
    if n_layers == 1 or n_prompt <= budget:
        return np.full(n_layers, budget, np.int64)
    lo = max(1, int(base // beta))
    hi = 2 * base - lo
    if hi >= n_prompt - w_e:
        hi = n_prompt - w_e
        lo = 2 * base - hi
    if lo > hi:
        return np.full(n_layers, budget, np.int64)
    ideal = hi - np.arange(n_layers) * (hi - lo) / (n_layers - 1)
    out = np.floor(ideal + 1e-9).astype(np.int64)
    rem = ideal - out
    short = base * n_layers - int(out.sum())
    for layer in np.argsort(-rem, kind="stable")[:short]:
        out[layer] += 1
    return out + w_e
