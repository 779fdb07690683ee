"""Combinators over any scorer, nested in any order the semantics allow: ``ada(...)``, ``decoding(...)``,
``critical(...)`` and ``threshold(...)`` (kvpress's AdaKVPress, DecodingPress, CriticalKVPress /
CriticalAdaKVPress and DMSPress).

A combinator is a *stage* of the scorer pipeline (policies/core/scorer.py): ``critical`` rescales the scores,
``ada`` allocates each head's size, ``decoding`` schedules when the chain evicts, ``threshold`` evicts by a score
cut instead of a size. A stage has its own named parameters (appended to the schema and read by name) and its own
slice of head and slot state (at offsets found by its name). The combined class's name is its spec
(``critical(ada(knorm))``), so ``get_policy("critical(ada(knorm))", floor_alpha=0.3)`` rebuilds it anywhere
(sweep workers, Ray). Stages run
innermost first: ``critical(ada(x))`` allocates on x's scores and rescales within the allocated sizes (kvpress's
CriticalAdaKVPress), ``ada(critical(x))`` allocates on the rescaled scores (AdaKVPress(CriticalKVPress(x))).

- ``ada``: Ada-KV (Feng et al., 2024) head-wise budget allocation with the safeguard ``floor_alpha`` over the
  prompt scores (``stages.ada_prompt``: top-k over the flattened candidate scores of the layer's heads, mixed
  with the uniform split); at decode every head keeps its prefill-allocated size (``decode_alloc='fixed'``, the
  authors'), or the layer re-allocates over the flattened scores at every step (``'flat'``). ``rounding``
  chooses the safeguard's rounding. The protected recent window is the layer's smallest, kept by every head.
  ``ada_snapkv``, ``ada_pyramidkv`` and ``ada_h2o`` are the names of ``ada(snapkv)``, ``ada(pyramidkv)`` and
  ``ada(h2o)``. Against the released code (FFY0/AdaKV, GQA path): with ``group_reduce=mean, floor_alpha=0``
  Ada-SnapKV's prefill is the released selection apart from equal-score ties; ``rounding=released`` is its
  rounding; at a budget equal to the prompt length the released code still compresses (and its ``int()`` floor
  can drop a slot per head) where kvsim keeps the prompt, and below the window (B < 32) it fails where kvsim
  keeps the window (``window_only``), so "as the released code" holds at B = 32 only.
- ``decoding``: kvpress's DecodingPress: the cache grows during decoding and every ``every`` steps each head is
  compressed back to ``target`` by the chain inside it. ``target=0`` (default) means ``budget - every + 1``, the
  largest target whose peak (target + every - 1 slots after a step) stays within the budget. A prompt the chain
  selects from is compressed once to the target (kvpress leaves prefill to the wrapped press; here the budget
  must hold from the first step); a streamed prompt is compressed every ``every`` steps like the decode. kvpress
  defaults to ``compression_interval=512, target_size=2048``; kvsim budgets are smaller, so the default interval
  is 16. With ``every=1`` this is the chain's per-step eviction. It must be the outermost stage: it schedules the
  whole chain (kvpress's DecodingPress wraps a press; nothing wraps it).
- ``critical``: CriticalKV (Feng et al., 2025, arXiv 2502.03805). A token's output contribution is its attention
  times its value *after* the output projection, so the score alone misjudges tokens whose values W_O shrinks
  or amplifies. Two stages per head: the top ``first_stage_ratio`` share of the head's slots for candidates
  (its size less the protected tokens it holds) is kept by the current score; the other candidates compete on
  ``(score + critical_epsilon) * mean_j ||W_O^(j) v||_1`` over the group's query heads j (kvpress's L1 norm and
  group mean; paper and kvpress defaults 0.5 and 1e-4). The size is the head's budget, or its allocation when an
  ``ada`` stage runs inside. Choices: (a) kvpress applies it once, at prefill; here the two stages run at every
  eviction too; (b) stage 1 ranks the candidates only: kvpress protects nothing and ranks every prompt token,
  here protected tokens are kept anyway, so they take no first-stage slot (with ``first_stage_ratio=1`` the
  policy is the scorer's, as in kvpress); (c) the rescaling assumes non-negative attention-like scores (``expected_attention``
  with ``use_vnorm=False``, SnapKV-like); over a negative score (``knorm``) the product inverts the ranking
  exactly as kvpress's does. W_O comes from the trace (``wo`` arrays, written by ``kvsim record``) or, closed
  loop, from the model's ``o_proj``.

- ``threshold``: kvpress's DMSPress (formerly ThresholdPress; Dynamic Memory Sparsification, Lancucki et al.,
  2025, arXiv 2506.05345, dense-prefill inference without its trained gate): budget-free eviction. A token is
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

A chain that makes no sense is refused with the reason: a stage twice, ``decoding`` inside another stage,
``ada``/``critical``/``threshold`` over a score that is only a position (StreamingLLM), ``ada``/``threshold`` over a
scorer without a prompt score, ``threshold`` with ``ada`` or ``critical`` inside or around it, and any combinator
over a policy that is not a scorer (BUZZ, Cascading, BumbleBee, D2O, DuoAttention, window, random, full, the
oracle: their rules are not "score, protect, evict the lowest").
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
from numba import njit

from policies.core import stages
from policies.core.base import Param, Policy, PolicyError, param_indices
from policies.core.shared_kernels import evict_lowest
from policies.core.kvpress_press import KvpressPress, NoKvpressPress
from policies.core.registry import policy_class, register, register_wrapper, split_name
from policies.h2o import H2O
from policies.core.scorer import ScorerPolicy, StageCode
from policies.snapkv import PyramidKV, SnapKV

FLOOR_ALPHA = Param("floor_alpha", 0.5, "float", 0.0, 1.0,
                    doc="safeguard: head budget = (1-a) * adaptive + a * uniform (0: pure Algorithm 2, 1: uniform)")
DECODE_ALLOC = Param("decode_alloc", "fixed", "choice", choices=("fixed", "flat"),
                     doc="decode: heads keep their prefill allocation (authors) or re-allocate over flattened scores")
ROUNDING = Param("rounding", "largest_remainder", "choice", choices=stages.ROUNDING, searchable=False,
                 doc="safeguard rounding: exact total, or the released int() floor + round-half-even")
EVERY = Param("every", 16, "int", 1, 1024, log=True, doc="decode steps between compressions (kvpress compression_interval)")
TARGET = Param("target", 0, "int", 0, 1 << 20,
               doc="slots per head after a compression; 0: budget - every + 1 (peak = budget)", searchable=False)
EPSILON = Param("critical_epsilon", 1e-4, "float", 0.0, 1.0,
                doc="added to the score before the W_O rescaling (CriticalKV, kvpress: epsilon)", searchable=False)


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
FIRST_STAGE_RATIO = Param("first_stage_ratio", 0.5, "float", 0.0, 1.0,
                          doc="share of the size selected by the plain score before the W_O rescaling (CriticalKV)")


class Stage:
    """One combinator: its name, its parameters, its state and the code it adds to the generated kernels."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    params: ClassVar[tuple[Param, ...]] = ()
    head_fields: ClassVar[int] = 0            # fixed head-state columns (critical adds W_O after all of them)
    slot_fields: ClassVar[int] = 0
    needs_prompt_score: ClassVar[bool] = False
    #: class attributes the combined policy takes from the stage
    policy_attrs: ClassVar[dict[str, Any]] = {}

    @classmethod
    def refuse(cls, inner: type[ScorerPolicy]) -> str | None:
        """Why ``name(inner)`` makes no sense, or None."""
        return None

    @classmethod
    def code(cls, pol: type[ScorerPolicy]) -> StageCode:
        raise NotImplementedError

    @staticmethod
    def index(pol: type[ScorerPolicy], name: str) -> int:
        return [p.name for p in pol.schema].index(name)


class AdaStage(Stage):
    name = "ada"
    summary = "Ada-KV head-wise budget allocation"
    params = (FLOOR_ALPHA, DECODE_ALLOC, ROUNDING)
    head_fields = 2
    needs_prompt_score = True
    policy_attrs = {"head_adaptive": True}

    @classmethod
    def refuse(cls, inner: type[ScorerPolicy]) -> str | None:
        if inner.scorer.ranks_by_position:
            return (f"{inner.scorer.name} ranks tokens by position only, and Ada-KV allocates a layer's budget by "
                    f"importance scores: every head ties and the first heads would take the whole budget")
        if inner.scorer.score_prompt is None:
            return (f"{inner.scorer.name} has no prompt score, and Ada-KV allocates the layer's budget across heads "
                    f"from the prompt's scores")
        if getattr(inner.scorer, "allocates_heads", False):
            return (f"{inner.scorer.name} gives every head its own budget from its scores already (ranked across "
                    f"heads and layers); Ada-KV would allocate the layer's budget a second time")
        return None

    @classmethod
    def code(cls, pol: type[ScorerPolicy]) -> StageCode:
        off = pol.head_offsets[cls.name]
        a, flat, rnd = (cls.index(pol, p.name) for p in cls.params)
        evict = (f"        if params[{flat}] == 1.0:\n"
                 f"            ada_evict_flat(params[{a}], base, recent, lo, hi, lengths, positions, scores, "
                 f"head_state, {off}, sizes, keep)\n"
                 f"        else:\n"
                 f"            evict_to(sizes, lo, hi, lengths, positions, scores, keep)\n")
        return StageCode(step=f"    ada_sizes(head_state, {off}, base, sizes)\n",
                         prompt=f"    ada_prompt(scores, base, recent[0], params[{a}], params[{rnd}] == 1.0, lo, hi, "
                                f"head_state, {off}, sizes)\n",
                         evict=evict, layer_window=True, sets_sizes=True,
                         globals=(("ada_sizes", stages.ada_sizes), ("ada_prompt", stages.ada_prompt),
                                  ("ada_evict_flat", stages.ada_evict_flat)))


class DecodingStage(Stage):
    name = "decoding"
    summary = "DecodingPress: compress every N decode steps"
    params = (EVERY, TARGET)
    head_fields = 1
    # its schedule counts one token per step, so a prompt chunk would overrun the target
    policy_attrs = {"compresses_below_budget": True, "multi_token_steps": False}

    @classmethod
    def code(cls, pol: type[ScorerPolicy]) -> StageCode:
        off = pol.head_offsets[cls.name]
        every, target = (cls.index(pol, p.name) for p in cls.params)
        return StageCode(base=(f"    for h in range(hkv):\n"
                               f"        base[h] = decoding_target(budget[h], np.int64(params[{every}]), "
                               f"np.int64(params[{target}]))\n"),
                         step=f"    evict = decoding_tick(head_state, {off}, np.int64(params[{every}]))\n",
                         globals=(("decoding_target", stages.decoding_target),
                                  ("decoding_tick", stages.decoding_tick)))


class CriticalStage(Stage):
    name = "critical"
    summary = "CriticalKV's W_O rescaling"
    params = (EPSILON, FIRST_STAGE_RATIO)
    head_fields = 4          # its slot-field index, G*d, hidden, norm-table width; the W_O block follows
    slot_fields = 1          # the slot's projected value norm, computed once
    policy_attrs = {"needs_wo": True, "reads_values": True}

    @classmethod
    def refuse(cls, inner: type[ScorerPolicy]) -> str | None:
        if inner.scorer.ranks_by_position:
            return (f"{inner.scorer.name} ranks tokens by position only: rescaling a position by the W_O-projected "
                    f"value norm has no meaning")
        return None

    @classmethod
    def code(cls, pol: type[ScorerPolicy]) -> StageCode:
        off = pol.head_offsets[cls.name]
        eps, ratio = (cls.index(pol, p.name) for p in cls.params)
        # the rescored scores of a head within its size are read only by an ``ada`` stage around this one (its flat
        # eviction compares every head's); else the eviction (evict_to, per head) reads only the heads over size
        every = any(s is AdaStage for s in pol.chain[pol.chain.index(cls) + 1:])
        return StageCode(step=f"    critical_step(params[{eps}], params[{ratio}], sizes, lo, hi, lengths, positions, "
                              f"values, slot_state, head_state, {off}, scores, {every})\n",
                         prompt=f"    critical_prompt(params[{eps}], params[{ratio}], sizes, lo, hi, v, slot_state, "
                                f"head_state, {off}, scores)\n",
                         globals=(("critical_step", stages.critical_step),
                                  ("critical_prompt", stages.critical_prompt)))


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


STAGES: dict[str, type[Stage]] = {s.name: s for s in (AdaStage, DecodingStage, CriticalStage, ThresholdStage)}


class Combined(ScorerPolicy):
    """A scorer with stages around it (built by ``combined_class``): labels are specs, so a label pasted on the
    command line rebuilds it."""

    def label(self) -> str:
        return policy_spec(self)

    def base_size(self, budget: int) -> int:
        if DecodingStage in self.chain:
            return self.params["target"] or budget - self.params["every"] + 1
        return budget

    def min_budget(self) -> int:
        inner = super().min_budget()
        if DecodingStage in self.chain:
            every, target = self.params["every"], self.params["target"]
            return max(inner, target + every - 1) if target else inner + every - 1
        return inner

    def validate(self) -> None:
        super().validate()
        if DecodingStage in self.chain and self.params["target"] and self.params["target"] < super().min_budget():
            raise PolicyError(f"{self.name}.target: {self.params['target']} is below the scorer's minimum "
                              f"{super().min_budget()} (its protected tokens plus one)")

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """The scorer's press with each stage's kvpress counterpart around it, inner first: ``ada`` only at
        ``floor_alpha=1`` (uniform head budgets, the prompt selected at once by the scorer's prompt score: kvpress's
        ``AdaKVPress`` guarantees each head its top alpha share by score, another safeguard than the Ada-KV authors'
        mixture kvsim runs); ``critical`` -> ``CriticalKVPress`` (kvpress counts the sinks inside stage 1, kvsim
        outside: stage 1 differs by about sinks x (1 - first_stage_ratio) tokens); ``threshold`` -> ``DMSPress``
        (it decides its own sizes); ``decoding`` has none checked (kvpress's DecodingPress acts while generating,
        which the parity benchmark does not compare)."""
        at_once = prompt_at_once or (AdaStage in self.chain and self.params["floor_alpha"] == 1.0)
        c = type(self).scorer.kvpress_press(self, at_once)
        p = self.params
        for stage in self.chain:
            if stage is AdaStage and p["floor_alpha"] != 1.0:
                raise NoKvpressPress(
                    f"{self.label()}: kvpress's AdaKVPress guarantees every head its top alpha_safeguard x budget "
                    "tokens by score and shares the rest by a flat top-k; kvsim's ada is the Ada-KV authors' "
                    "safeguard (head budget = (1 - floor_alpha) x its share + floor_alpha x uniform), and the head "
                    "budgets differ (SmolLM2 at 512: kvpress 148-929 tokens per head, kvsim 221-846); only "
                    "floor_alpha=1 (uniform budgets) has a counterpart, the inner press")
            if stage is CriticalStage:
                sinks = int(c.press.get("n_sink", c.press.get("num_sinks", 0)))
                off = math.ceil(sinks * (1.0 - p["first_stage_ratio"]))
                c = replace(c, press={"cls": "CriticalKVPress", "press": c.press, "epsilon": p["critical_epsilon"],
                                      "first_stage_ratio": p["first_stage_ratio"]}, differs_by=c.differs_by + off,
                            differs_why=("kvpress counts the sinks inside stage 1" if off else c.differs_why))
            if stage is ThresholdStage:
                if p["tau"] == -math.inf:
                    continue                            # no threshold: the inner rule alone
                c = replace(c, press={"cls": "DMSPress", "press": c.press, "threshold": p["tau"],
                                      "sliding_window_size": p["sliding_window_size"], "decoding": p["on_decode"]},
                            sets_ratio=False, budgets="prompt",
                            note="DMSPress decides its own sizes: kvsim's budget must hold the prompt for the "
                                 "threshold alone to decide")
            if stage is DecodingStage:
                raise NoKvpressPress(f"{self.label()}: kvpress's DecodingPress compresses while generating, which "
                                     "kvsim has not compared with kvpress (the parity benchmark compresses a prompt "
                                     "once); export the inner policy for the prompt")
        return c

    def head_state_init(self, n_kv_heads: int, head_dim: int, wo: np.ndarray | None = None) -> np.ndarray:
        """The scorer's and the stages' zeros; with a ``critical`` stage, its slice: the index of its slot field,
        G*d, hidden, then per KV head its query group's W_O transposed, float32 [d, G * hidden] (C order), packed
        in pairs into the float64 head state (read by ``stages.wo_l1``). The header's fourth field is the width of
        the norm table a replay appends (``replay_head_state``; 0 in the closed loop), so that a table appended after
        it (``Policy.prompt_head_state``) is never read as one."""
        return self._head_state(n_kv_heads, head_dim, wo)

    def replay_head_state(self, n_kv_heads: int, head_dim: int, layer: Any, memo: dict | None = None,
                          n_prompt: int = 0) -> np.ndarray:
        """``head_state_init``, and with a ``critical`` stage every position's projected value norm appended
        (``stages.projected_norms``: the trace's values are known in advance, and a value never changes in a
        scorer's cache), computed once per layer and kept in ``memo`` for the other replays of the same inputs.
        The steps then read a new slot's norm instead of projecting its value through W_O (G * hidden * d
        multiply-adds per slot, more than the step's attention), and the prefill reads the prompt's."""
        if CriticalStage not in self.chain:
            return super().replay_head_state(n_kv_heads, head_dim, layer, memo, n_prompt)
        key = ("critical.projected_norms", n_kv_heads, head_dim)
        table = None if memo is None else memo.get(key)
        if table is None:
            head = self._head_state(n_kv_heads, head_dim, layer.wo)
            table = stages.projected_norms(head, self.head_offsets[CriticalStage.name],
                                           np.ascontiguousarray(layer.v, np.float32))
            if memo is not None:
                memo[key] = table
        return self._head_state(n_kv_heads, head_dim, layer.wo, table)

    def _head_state(self, n_kv_heads: int, head_dim: int, wo: np.ndarray | None,
                    table: np.ndarray | None = None) -> np.ndarray:
        """The head state, with the norm table [Hkv, T] after the W_O block when given."""
        if CriticalStage not in self.chain:
            return np.zeros((n_kv_heads, self.head_fields))
        if wo is None:
            raise PolicyError(f"{self.label()} needs the layer's output projection W_O, and this trace has none: "
                              "record it again with `kvsim record` (which stores W_O for Llama-family models)")
        wo = np.asarray(wo, np.float32)
        hidden, width = wo.shape
        if width % n_kv_heads:
            raise PolicyError(f"{self.label()}: W_O has {width} columns, not a multiple of {n_kv_heads} KV heads")
        gd, d = width // n_kv_heads, head_dim
        if gd % d:
            raise PolicyError(f"{self.label()}: W_O's {gd} columns per KV head are not whole heads of {d}")
        # [Hkv, d, G, hidden]: row x of a KV head's block is input channel x of its G heads' W_O columns
        blocks = wo.reshape(hidden, n_kv_heads, gd // d, d).transpose(1, 3, 2, 0).reshape(n_kv_heads, hidden * gd)
        words = (blocks.shape[1] + 1) // 2          # whole float64 slots: an odd count pads one float32 (never read)
        off = self.head_offsets[CriticalStage.name]
        field = self.slot_fields - sum(s.slot_fields for s in self.chain[self.chain.index(CriticalStage):])
        n_table = 0 if table is None else table.shape[1]
        # filled in place: the scorer's (possibly large, mostly untouched) zero block stays lazily allocated
        out = np.zeros((n_kv_heads, self.head_fields + words + n_table))
        out[:, off:off + 4] = [float(field), float(gd), float(hidden), float(n_table)]
        packed = out[:, self.head_fields:self.head_fields + words]
        flat = packed.view(np.float32)              # bit-for-bit; copies of the head state keep the bits
        flat[:, :blocks.shape[1]] = blocks
        if table is not None:
            out[:, self.head_fields + words:] = table
        return out


def _why_not(stage: type[Stage], inner: type[Policy]) -> str | None:
    """Why ``stage(inner)`` makes no sense, or None."""
    wrapper = stage.name
    if not issubclass(inner, ScorerPolicy):
        return (f"{inner.name} is not a scorer (its rule is not 'score, protect, evict the lowest'), so it exposes "
                f"no per-slot scores for {wrapper} to work on; the scorers are the policies built on "
                f"policies/core/scorer.py (`kvsim policies` lists {wrapper}(...) over them)")
    if stage in inner.chain:
        return (f"{wrapper} appears twice in the chain; each stage runs at most once "
                f"({'a layer budget is allocated once' if stage is AdaStage else 'nothing is gained'})")
    if DecodingStage in inner.chain:
        return (f"decoding(...) schedules when the whole chain compresses, so it must be the outermost "
                f"combinator: write decoding({wrapper}(...)) instead")
    if ThresholdStage in inner.chain and stage is not DecodingStage:
        return (f"threshold(...) replaces the size rule that {wrapper}(...) works within; only decoding(...) "
                f"may wrap it")
    why = stage.refuse(inner)
    if why:
        return why
    clash = {p.name for p in inner.schema} & {p.name for p in stage.params}
    if clash:
        return f"parameter name(s) {sorted(clash)} clash with the combinator's"
    return None


@functools.lru_cache(maxsize=None)
def combined_class(wrapper: str, inner: type[Policy]) -> type[Policy]:
    """The policy class ``wrapper(inner)``, built once per process (its kernels cache on disk), or PolicyError
    saying why the pair makes no sense."""
    stage = STAGES.get(wrapper)
    if stage is None:
        raise PolicyError(f"unknown combinator {wrapper!r}; available: {', '.join(STAGES)}")
    why = _why_not(stage, inner)
    if why:
        raise PolicyError(f"{wrapper}({inner.name}): {why}")
    chain = inner.chain + (stage,)
    schema = inner.schema + stage.params
    fixed = [s for s in chain if s is not CriticalStage] + ([CriticalStage] if CriticalStage in chain else [])
    offsets, at = {}, inner.scorer.head_fields
    for s in fixed:                          # critical's variable-width W_O block last
        offsets[s.name] = at
        at += s.head_fields
    attrs = {"name": f"{wrapper}({inner.name})", "summary": f"{inner.summary} + {stage.summary}",
             "schema": schema, "P": param_indices(schema), "chain": chain, "scorer": inner.scorer, "head_offsets": offsets,
             "head_fields": at, "__doc__": f"{stage.summary} over {inner.name} (see policies/core/combinators.py).",
             "__module__": inner.__module__, "label": Combined.label}
    for s in chain:
        attrs.update(s.policy_attrs)
    bases = (inner,) if issubclass(inner, Combined) else (Combined, inner)
    return type(f"{stage.__name__}_{inner.__name__}", bases, attrs)


def _listed(wrapper: str, cls: type[Policy]) -> bool:
    """``list_policies`` enumerates a combinator over every plain scorer it accepts (aliases name the rest)."""
    return (issubclass(cls, ScorerPolicy) and not cls.chain and (wrapper, cls.name) not in _ALIAS_OF
            and _why_not(STAGES[wrapper], cls) is None)


def alias(name: str, spec_wrapper: str, inner: type[Policy], summary: str) -> type[Policy]:
    """Register ``name`` as another name of ``spec_wrapper(inner)`` (same class, same results, plain labels)."""
    cls = combined_class(spec_wrapper, inner)
    attrs = {"name": name, "summary": summary, "__doc__": f"``{spec_wrapper}({inner})``: {summary}.",
             "__module__": cls.__module__, "label": Policy.label}
    sub = type(name.title().replace("_", ""), (cls,), attrs)
    _ALIAS_OF[spec_wrapper, inner.name] = name
    return register(sub)


_ALIAS_OF: dict[tuple[str, str], str] = {}


def policy_spec(policy: Policy) -> str:
    """The spec string ``sim.experiments.specs.parse_policy`` turns back into an equal policy (non-default parameters
    only): ``knorm:n_sink=4``, ``decoding(knorm:n_sink=4, every=8)``, ``critical(ada(knorm, floor_alpha=0.3))``."""
    diff = {p.name: policy.params[p.name] for p in policy.schema if policy.params[p.name] != p.default}
    split = split_name(policy.name)
    if split is None:
        inner = ",".join(f"{k}={v}" for k, v in diff.items())
        return f"{policy.name}:{inner}" if inner else policy.name
    own: set[str] = {p.name for s in policy.chain for p in s.params}
    scorer = policy.scorer
    spec = scorer.name
    inner = ",".join(f"{k}={v}" for k, v in diff.items() if k not in own)
    spec += f":{inner}" if inner else ""
    names = []                               # stage names from the policy's name, innermost first
    rest = policy.name
    while (part := split_name(rest)) is not None:
        names.append(part[0])
        rest = part[1]
    if rest != scorer.name:                  # wrapped around an alias such as ada_snapkv: keep the alias
        spec = policy_spec(policy_class(rest)(**{k: v for k, v in policy.params.items()
                                                 if k in {p.name for p in policy_class(rest).schema}}))
    for name in reversed(names):
        stage = STAGES[name]
        outer = "".join(f", {p.name}={diff[p.name]}" for p in stage.params if p.name in diff)
        spec = f"{name}({spec}{outer})"
    return spec


def _wrap(wrapper: str, inner: Policy | type[Policy] | str, params: dict[str, Any]) -> Policy:
    if isinstance(inner, str):
        cls = policy_class(inner)
    elif isinstance(inner, Policy):
        cls, params = type(inner), {**inner.params, **params}
    else:
        cls = inner
    return combined_class(wrapper, cls)(**params)


def ada(inner: Policy | type[Policy] | str, **params: Any) -> Policy:
    """``ada(get_policy("knorm"), floor_alpha=0.2)``: Ada-KV head-wise allocation over a scorer."""
    return _wrap("ada", inner, params)


def critical(inner: Policy | type[Policy] | str, **params: Any) -> Policy:
    """``critical(get_policy("expected_attention", use_vnorm=False))``: CriticalKV's W_O rescaling over a scorer."""
    return _wrap("critical", inner, params)


def threshold(inner: Policy | type[Policy] | str, **params: Any) -> Policy:
    """``threshold(get_policy("knorm"), tau=-3.0, sliding_window_size=16)``: DMSPress's score threshold over a
    scorer."""
    return _wrap("threshold", inner, params)


def decoding(inner: Policy | type[Policy] | str, **params: Any) -> Policy:
    """``decoding(get_policy("knorm"), every=64, target=128)``: DecodingPress over a scorer."""
    return _wrap("decoding", inner, params)


for _name in STAGES:
    register_wrapper(_name, functools.partial(combined_class, _name), functools.partial(_listed, _name))

alias("ada_snapkv", "ada", SnapKV, "SnapKV with Ada-KV head-wise budget allocation")
alias("ada_pyramidkv", "ada", PyramidKV, "PyramidKV with Ada-KV head-wise budget allocation")
alias("ada_h2o", "ada", H2O, "H2O accumulated scores with Ada-KV head-wise budget allocation")
