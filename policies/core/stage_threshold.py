"""The ``threshold`` stage: kvpress's DMSPress, its class and its kernels.

kvpress's DMSPress (formerly ThresholdPress; Dynamic Memory Sparsification, Lancucki et al., 2025, arXiv
2506.05345, dense-prefill inference without its trained gate): budget-free eviction. A token is
judged once, when it leaves the sliding window of the ``sliding_window_size`` newest positions: it is evicted
if the chain's score is below ``tau`` and kept for good otherwise (kvpress: ``scores < threshold`` masked).
The prompt is scored at once (``score_prompt``; kvpress scores the prompt at prefill) and its tokens older
than the window are judged there; the others are judged at the decode step they leave the window, by that
step's score (kvpress: by the score they got when appended; the same number for scorers whose score of a
token never changes, such as ``knorm``, ``qfilter``, ``cur`` once its window is complete). Protected tokens
(sinks, the recent window) are never judged evicted; a token protected when it leaves the window is judged
when it stops being protected. ``on_decode`` (kvpress ``decoding``) also judges during decoding. So the memory
held varies with the text; the budget stays an upper bound: a head still above its size after the threshold
evicts its lowest scores, as the scorer alone would (so ``tau=-inf``, the default, judges nothing and the
policy is the scorer's, with its prompt selected at once). kvpress's defaults: no threshold (it must be set:
the scale is the scorer's), a window of 128, ``decoding=False``; here ``on_decode=True`` (DMS evicts during
generation; kvsim holds the budget at every step). Inside ``decoding(...)`` the tokens are judged at each
compression. It replaces the size rule, so it takes no ``ada`` or ``critical`` inside it and goes inside
neither (only ``decoding`` wraps it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numba import njit

from policies.core.base import Param, Policy
from policies.core.kvpress_press import KvpressPress
from policies.core.scorer import ScorerPolicy, StageCode
from policies.core.shared_kernels import evict_lowest
from policies.core.stage_ada import AdaStage
from policies.core.stage_base import Stage
from policies.core.stage_critical import CriticalStage


@dataclass(frozen=True)
class UnboundedFloat(Param):
    """A float parameter that also takes -inf and +inf (``tau=-inf``: no threshold)."""

    def coerce(self, value: Any, policy: str) -> Any:
        text = str(value).strip().lower()
        if text in ("-inf", "-infinity", "inf", "+inf", "infinity", "+infinity"):
            return float(text)
        return super().coerce(value, policy)


TAU = UnboundedFloat("tau", -math.inf, "float", searchable=False,
                     doc="threshold: a token leaving the window is evicted when its score is below it (DMSPress "
                         "threshold; -inf: none)")
SLIDING_WINDOW = Param("sliding_window_size", 128, "int", 0, 1 << 20, searchable=False,
                       doc="newest positions never judged by the threshold (DMSPress sliding_window_size)")
ON_DECODE = Param("on_decode", True, "bool", doc="judge tokens during decoding too (DMSPress decoding; kvpress: false)")


@njit(cache=True)
def threshold_prompt(tau, window, sizes, lo, hi, scores, head_state, off, keep):
    """DMSPress on the prompt: per head, the candidates (positions in [lo, hi)) older than the window (positions
    below P - window) scored below ``tau`` are evicted; ``sizes`` grows by their number, so the prompt's eviction
    that follows (``evict_prompt``, counting every prompt token) leaves the head at most its size; the first
    position not yet judged goes to the stage's head state."""
    P = scores.shape[1]
    for h in range(scores.shape[0]):
        d1 = max(min(P - window, hi[h]), 0)
        dropped = 0
        for i in range(lo[h], d1):
            if scores[h, i] < tau:
                keep[h, i] = 0
                dropped += 1
        head_state[h, off] = d1
        sizes[h] += dropped


@njit(cache=True)
def threshold_evict(tau, window, on_decode, t, sizes, lo, hi, lengths, positions, scores, head_state, off, keep):
    """DMSPress at a step: the candidates that left the window since the last judgement (positions in
    [judged, min(t - window + 1, hi))) scored below ``tau`` are evicted (``on_decode``); then a head still above
    its size evicts its lowest-scored candidates down to it (ties: the older), as ``evict_to`` would."""
    for h in range(lengths.shape[0]):
        n = lengths[h]
        dropped = 0
        if on_decode:
            d0 = np.int64(head_state[h, off])
            d1 = min(t - window + 1, hi[h])
            if d1 > d0:
                for i in range(n):
                    p = positions[h, i]
                    if d0 <= p < d1 and p >= lo[h] and scores[h, i] < tau:
                        keep[h, i] = 0
                        dropped += 1
                head_state[h, off] = d1
        held = n - dropped
        if held > sizes[h]:
            evict_lowest(scores[h], positions[h], n, held - sizes[h], lo[h], hi[h], keep[h])


class ThresholdStage(Stage):
    name = "threshold"
    summary = "DMSPress: evict tokens scored below tau once out of the window"
    params = (TAU, SLIDING_WINDOW, ON_DECODE)
    head_fields = 1          # the first position not yet judged
    needs_prompt_score = True
    policy_attrs = {"compresses_below_budget": True}

    @classmethod
    def refuse(cls, inner: type[ScorerPolicy]) -> str | None:
        if inner.scorer.ranks_by_position:
            return (f"{inner.scorer.name} ranks tokens by position only: a threshold on a position is a sliding "
                    f"window, not a score cut")
        if inner.scorer.score_prompt is None:
            return (f"{inner.scorer.name} has no prompt score, and the threshold judges the prompt from the scores "
                    f"of the whole prompt")
        for stage in (AdaStage, CriticalStage):
            if stage in inner.chain:
                return (f"the threshold replaces the size rule, and {stage.name}(...) works within sizes "
                        f"({'allocating them' if stage is AdaStage else 'rescaling within them'}); use "
                        f"threshold over the plain scorer")
        return None

    @classmethod
    def code(cls, pol: type[ScorerPolicy]) -> StageCode:
        off = pol.head_offsets[cls.name]
        tau, window, on_decode = (cls.index(pol, p.name) for p in cls.params)
        return StageCode(prompt=f"    threshold_prompt(params[{tau}], np.int64(params[{window}]), sizes, lo, hi, "
                                f"scores, head_state, {off}, keep)\n",
                         evict=f"        threshold_evict(params[{tau}], np.int64(params[{window}]), "
                               f"params[{on_decode}] != 0.0, t, sizes, lo, hi, lengths, positions, scores, "
                               f"head_state, {off}, keep)\n",
                         sets_sizes=True,
                         globals=(("threshold_prompt", threshold_prompt), ("threshold_evict", threshold_evict)))

    @classmethod
    def kvpress(cls, policy: Policy, inner: KvpressPress) -> KvpressPress:
        """``DMSPress`` around the inner press (it decides its own sizes); no threshold: the inner rule alone."""
        p = policy.params
        if p["tau"] == -math.inf:
            return inner
        return replace(inner, press={"cls": "DMSPress", "press": inner.press, "threshold": p["tau"],
                                     "sliding_window_size": p["sliding_window_size"], "decoding": p["on_decode"]},
                       sets_ratio=False, budgets="prompt",
                       note="DMSPress decides its own sizes: kvsim's budget must hold the prompt for the "
                            "threshold alone to decide")
