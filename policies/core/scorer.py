"""Scorer base: a policy whose rule is "score every cached token, protect some, evict the lowest".

kvpress builds most presses as a ``score()`` method; this is kvsim's equivalent, and every score-based policy
is built on it (H2O, TOVA, SnapKV, PyramidKV, StreamingLLM and the kvpress scorers). A scorer module declares

- its ``SCHEMA`` and ``P = param_indices(SCHEMA)``, and a ``Protection`` naming the parameters of its protected
  tokens (``protection(n_sink=..., n_recent=...)`` gives the usual two);
- ``score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state)`` (``SCORE_PROMPT_SIG``):
  fill ``scores[h, i]`` for the P prompt tokens (higher = keep); ``slot_state[h, i, :]`` set here travels with
  the slot into decode. Optional: a scorer without one streams its prompt through the step;
- ``score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores)``
  (``SCORE_STEP_SIG``): fill ``scores[h, i]`` for the ``lengths[h]`` cached slots at decode step ``t``;

and a ``ScorerPolicy`` subclass naming them. ``hi[h]`` is the first position of head h's protected recent window
(positions ``>= hi[h]`` are never evicted at this step); most scorers ignore it, SnapKV's pooling stops there.
Scores must be filled for every held slot, protected ones included (``critical`` ranks them all).

The base supplies the rest: protection (the first ``sinks`` positions and the recent window are never
candidates), eviction of the lowest scores down to each head's size (ties evict the older token), the state
layout, and the pipeline of the combinators wrapped around the scorer (policies/core/combinators.py): each *stage*
(``critical`` rescales the scores, ``ada`` allocates the sizes, ``decoding`` schedules the evictions) adds its own
named parameters and its own slice of head and slot state, and its kernel calls are generated into the policy's
step and prefill, innermost stage first (``critical(ada(x))`` allocates on x's scores, then rescales within the
allocated sizes; ``ada(critical(x))`` allocates on the rescaled scores).

Protected positions of a head with ``base`` slots (``base`` = its budget, or the ``decoding`` target):
``sinks`` first positions, and a recent window by one of three rules: ``count`` (the ``recent`` parameter's
value), ``share`` (``round(base * ratio)``, H2O's ``recent_slots``) or ``window`` (``min(window, base - 1)``, or
``base`` when ``window_only`` and ``base <= window``: SnapKV's observation window, ``protected_window``).

Why generated wrappers: the engine takes kernels as first-class functions of one fixed signature
(``STEP_SIG``/``PREFILL_SIG``), so the step of each (scorer, stages) chain is its own small function calling the
scorer's kernels, the stages' kernels and the shared eviction as globals, with parameters and state offsets
written in as constants found by name. It is built from a template with ``exec`` under the scorer module's
file name and a unique qualified name, which keeps numba's on-disk cache working: a second process loads it
instead of compiling (tests/test_scorers.py checks this). Closures over dispatchers would not cache (their
pickled identity changes per process).
"""
from __future__ import annotations

import functools
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

import numpy as np
from numba import njit, types

from policies.core.base import (PREFILL_SIG, STEP_SIG, Guarantees, Kernel, Param, Policy, PolicyError, _f4t, _f8m, _f8t,
                           _f8v, _i8v, compiled)
from policies.core.shared_kernels import evict_lowest, evict_lowest_sorted, prompt_attention_table

#: score_prompt(params, layer, q[P,Hq,d], k[P,Hkv,d], v[P,Hkv,d], scale, hi[Hkv], scores[Hkv,P],
#:              slot_state[Hkv,P,S], head_state[Hkv,Hs]) -> None
SCORE_PROMPT_SIG = types.void(_f8v, types.int64, _f4t, _f4t, _f4t, types.float64, _i8v, _f8m, _f8t, _f8m)
#: score_step(params, layer, t, lengths[Hkv], probs[Hkv,G,cap], keys[Hkv,cap,d], values[Hkv,cap,d],
#:            positions[Hkv,cap], slot_state[Hkv,cap,S], head_state[Hkv,Hs], hi[Hkv], scores[Hkv,cap]) -> None
SCORE_STEP_SIG = types.void(_f8v, types.int64, types.int64, types.int64[::1], _f8t, _f4t, _f4t, types.int64[:, ::1],
                            _f8t, _f8m, _i8v, _f8m)

RECENT_RULES = ("count", "share", "window")


def protection(n_sink: int = 0, n_recent: int = 1) -> tuple[Param, Param]:
    """The two usual protection parameters, with the scorer's defaults (``Protection()`` names them)."""
    return (Param("n_sink", n_sink, "int", 0, 64, doc="first positions never evicted (attention sinks)",
                  searchable=False),
            Param("n_recent", n_recent, "int", 0, 1024, doc="newest positions never evicted (recent window)",
                  searchable=False))


@dataclass(frozen=True)
class Protection:
    """Which positions a scorer never evicts, by parameter name (None: no such protection).

    ``sinks``: an int parameter, the first positions; ``recent``: the parameter of the recent window, read by
    ``rule`` (``count``, ``share`` or ``window``, see the module docstring); ``window_only``: the bool parameter
    of the ``window`` rule."""

    sinks: str | None = "n_sink"
    recent: str | None = "n_recent"
    rule: str = "count"
    window_only: str | None = None

    def __post_init__(self) -> None:
        if self.rule not in RECENT_RULES:
            raise PolicyError(f"protection rule {self.rule!r} is not one of {RECENT_RULES}")

    def sinks_of(self, params: dict[str, Any]) -> int:
        return int(params[self.sinks]) if self.sinks else 0

    def recent_of(self, params: dict[str, Any], base: int) -> int:
        """The recent window of a head holding ``base`` slots (the kernels compute the same)."""
        if not self.recent:
            return 0
        if self.rule == "count":
            return int(params[self.recent])
        if self.rule == "share":
            return int(recent_slots(base, float(params[self.recent])))
        only = bool(params[self.window_only]) if self.window_only else False
        return int(protected_window(int(params[self.recent]), base, only))

    def code(self, schema: Sequence[Param]) -> tuple[str, str]:
        """Source expressions of (sinks, recent window) in ``params`` and ``b`` (the head's base size) for the
        generated kernels, parameters found by name."""
        idx = {p.name: i for i, p in enumerate(schema)}
        for name in (self.sinks, self.recent, self.window_only):
            if name is not None and name not in idx:
                raise PolicyError(f"protection names parameter {name!r}, which is not in the schema {list(idx)}")
        sinks = f"np.int64(params[{idx[self.sinks]}])" if self.sinks else "np.int64(0)"
        if not self.recent:
            recent = "np.int64(0)"
        elif self.rule == "count":
            recent = f"np.int64(params[{idx[self.recent]}])"
        elif self.rule == "share":
            recent = f"recent_slots(b, params[{idx[self.recent]}])"
        else:
            only = f"params[{idx[self.window_only]}] != 0.0" if self.window_only else "False"
            recent = f"protected_window(np.int64(params[{idx[self.recent]}]), b, {only})"
        return sinks, recent


@njit(cache=True)
def recent_slots(budget, recent_ratio):
    """Recent-window size for a budget: ``round(budget * recent_ratio)`` within [0, budget].

    The one definition of a recent window as a share of the budget (H2O, Ada-H2O and BumbleBee use it):
    ``recent_ratio = 0`` is no window at all, the heavy-hitter-only ablation of the H2O paper and BumbleBee's
    Alg. 2 alone. Rounding is Python's (half to even), so budget 1 at the default 0.5 has no window.
    """
    return np.int64(min(budget, max(0, int(round(budget * recent_ratio)))))


@njit(cache=True)
def protected_window(window, budget, window_only=False):
    """Recent tokens a head with ``budget`` slots always keeps under SnapKV's observation window: the window,
    leaving one selected slot (``window_only``: the whole budget when it is at most the window)."""
    if window_only and budget <= window:
        return np.int64(max(0, budget))
    return np.int64(max(0, min(window, budget - 1)))


# ---------------------------------------------------------------- shared eviction

@njit(cache=True)
def evict_prompt(sizes, lo, hi, scores, keep):
    """Per head, drop the lowest-scored prompt tokens among positions [lo[h], hi[h]) down to ``sizes[h]``."""
    P = scores.shape[1]
    pos = np.arange(P)
    for h in range(scores.shape[0]):
        if P > sizes[h]:
            evict_lowest_sorted(scores[h], pos, P, P - sizes[h], lo[h], hi[h], keep[h])


@njit(cache=True)
def evict_oldest(sizes, lo, hi, lengths, positions, keep):
    """``evict_to`` for scores that are the positions (``ranks_by_position``): the oldest candidates go, found
    from the front of each head's slots (they are in position order) without a score pass."""
    for h in range(lengths.shape[0]):
        excess = lengths[h] - sizes[h]
        i = 0
        while excess > 0 and i < lengths[h]:
            if lo[h] <= positions[h, i] < hi[h]:
                keep[h, i] = 0
                excess -= 1
            i += 1


@njit(cache=True)
def given_prompt_scores(head_state, field, scores, slot_state):
    """Copy the prompt's scores [Hkv, P] and slot state [Hkv, P, S] out of the block a replay appended to the head
    state (``ScorerPolicy.with_prompt_scores``; its first column in head field ``field``): what ``score_prompt``
    computed once for every budget of the configuration."""
    hkv, P = scores.shape
    S = slot_state.shape[2]
    for h in range(hkv):
        at = int(head_state[h, field])
        for i in range(P):
            scores[h, i] = head_state[h, at + i]
        at += P
        for i in range(P):
            for f in range(S):
                slot_state[h, i, f] = head_state[h, at + i * S + f]


@njit(cache=True)
def evict_to(sizes, lo, hi, lengths, positions, scores, keep):
    """Per head, drop the lowest-scored cached slots among positions [lo[h], hi[h]) down to ``sizes[h]``."""
    for h in range(lengths.shape[0]):
        n = lengths[h]
        if n > sizes[h]:
            evict_lowest(scores[h], positions[h], n, n - sizes[h], lo[h], hi[h], keep[h])


#: the protection of each head (lo, hi: its candidate positions; recent: its recent window), shared by both kernels
_BOUNDS = '''{base}    bounds = np.empty((3, hkv), np.int64)
    lo = bounds[0]
    hi = bounds[1]
    recent = bounds[2]
    for h in range(hkv):
        b = base[h]
        lo[h] = {sinks}
        recent[h] = {recent}
'''

_HEAD = '''
def {name}_step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep,
                merge_to, merge_w):
    hkv = lengths.shape[0]
{bounds}        hi[h] = t - recent[h] + 1
{score}{sizes}    evict = True
{step}    if evict:
{evict}
'''

_PREFILL = '''
def {name}_prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    hkv = k.shape[1]
    P = k.shape[0]
{bounds}{window}    for h in range(hkv):
        hi[h] = P - recent[h]
    scores = np.zeros((hkv, P), np.float64)
    if head_state[0, {given}] > 0.0:
        given_prompt_scores(head_state, {given}, scores, slot_state)
    else:
        score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state)
{sizes}{prompt}    evict_prompt(sizes, lo, hi, scores, keep)
'''


@dataclass(frozen=True)
class StageCode:
    """What one stage contributes to the generated kernels: source lines (indented to the function body) for the
    base sizes, the step and the prompt, whether it writes the heads' ``sizes``, an optional final eviction that
    replaces ``evict_to``, whether the prompt's protected window is one for the whole layer, and the globals
    (kernels) the lines call."""

    base: str = ""
    sets_sizes: bool = False
    step: str = ""
    prompt: str = ""
    evict: str = ""
    layer_window: bool = False
    globals: tuple[tuple[str, Any], ...] = ()


def compose(cls: type["ScorerPolicy"], module: str, name: str) -> tuple[Kernel, Kernel | None]:
    """The (step, prefill) kernels of a scorer class and its stages, as ``Kernel``s with the engine's signatures
    (the prefill is None when the chain streams its prompt). Nothing is generated or compiled here: the first
    ``dispatcher`` of either writes the source and compiles both.

    Compiled under ``module``'s source file with the unique name ``name`` so numba caches them on disk like
    hand-written kernels (and invalidates them when that file changes).
    """
    built: dict[str, Any] = {}

    def build(which: str) -> Any:
        if not built:
            built.update(_compile_composed(cls, module, name))
        return built[which]

    step = Kernel(STEP_SIG, build=lambda: build("step"))
    prefill = Kernel(PREFILL_SIG, build=lambda: build("prefill")) if cls.has_prompt_selection() else None
    return step, prefill


def _compile_composed(cls: type["ScorerPolicy"], module: str, name: str) -> dict[str, Any]:
    """Generate the source of ``compose``'s kernels and compile them: {"step": ..., "prefill": ...}."""
    sinks, recent = cls.protect.code(cls.schema)
    codes = [stage.code(cls) for stage in cls.chain]
    namespace = {"np": np, "score_prompt": compiled(cls.score_prompt), "score_step": compiled(cls.score_step),
                 "given_prompt_scores": given_prompt_scores, "evict_prompt": evict_prompt, "evict_to": evict_to, "evict_oldest": evict_oldest,
                 "recent_slots": recent_slots, "protected_window": protected_window}
    for c in codes:
        namespace.update({key: compiled(fn) for key, fn in c.globals})
    base = "".join(c.base for c in codes)
    base = f"    base = budget.copy()\n{base}" if base else "    base = budget\n"
    # sizes are the base sizes unless a stage sets them (copies only where a stage writes: the step is hot)
    sizes = "    sizes = base.copy()\n" if any(c.sets_sizes for c in codes) else "    sizes = base\n"
    score = ("    scores = np.zeros((hkv, keep.shape[1]), np.float64)\n"
             "    score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, "
             "scores)\n")
    plain = "        evict_to(sizes, lo, hi, lengths, positions, scores, keep)\n"
    if cls.scorer.ranks_by_position:        # the ranking is the slot order: no score pass (ada, critical refuse it)
        score, plain = "", "        evict_oldest(sizes, lo, hi, lengths, positions, keep)\n"
    evict = next((c.evict for c in codes if c.evict), plain)
    bounds = _BOUNDS.format(base=base, sinks=sinks, recent=recent)
    src = _HEAD.format(name=name, bounds=bounds, sizes=sizes, score=score,
                       step="".join(c.step for c in codes), evict=evict.rstrip("\n"))
    if cls.has_prompt_selection():
        window = ("    w_min = recent.min()\n    for h in range(hkv):\n        recent[h] = w_min\n"
                  if any(c.layer_window for c in codes) else "")
        src += _PREFILL.format(name=name, bounds=bounds, window=window, sizes=sizes, given=cls.scorer.given_field,
                               prompt="".join(c.prompt for c in codes))
    mod = sys.modules.get(module)
    filename = getattr(mod, "__file__", None)    # exec'd code (a notebook, a README test) has none: no disk cache
    exec(compile(src, filename or f"<scorer {name}>", "exec"), namespace)
    cache = filename is not None
    step = namespace[f"{name}_step"]
    step.__module__ = module
    prefill = namespace.get(f"{name}_prefill")
    if prefill is not None:
        prefill.__module__ = module
        prefill = njit(PREFILL_SIG, cache=cache)(prefill)
    return {"step": njit(STEP_SIG, cache=cache)(step), "prefill": prefill}


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    """Short hash of the sources the composed kernels are generated from and call: every module of
    ``policies/core`` (the shared eviction, the stage kernels and the combinators' code snippets). Numba invalidates
    a cached function only when its own file changes, not its callees'; the composed kernels live under the
    scorer's file, so this hash goes into their names and an edit of the shared code compiles them afresh instead
    of loading stale machine code."""
    h = hashlib.sha256()
    core = Path(__file__).resolve().parent
    for path in sorted(core.rglob("*.py")):
        h.update(path.relative_to(core).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:10]


#: the scorer's head field that holds where a replay's prompt attention table starts (0: no table), for scorers
#: with a ``prompt_attention_mode`` (they reserve it: ``head_fields`` >= 1)
PROMPT_TABLE = 0


class ScorerPolicy(Policy):
    """Base class of scorers: set ``name``, ``summary``, ``schema``, ``P``, ``score_step`` and usually
    ``score_prompt`` (and ``slot_fields``/``head_fields`` if the kernels keep state, ``protect`` if the protected
    tokens are not ``n_sink``/``n_recent``); the step and prefill kernels are composed when the class is defined.

    ``stream_prompt``: the plain policy streams its prompt through the step even though it has a prompt score
    (H2O: its score accumulates over the cached tokens; ``ada(...)`` still uses the prompt score).
    ``ranks_by_position``: the score is the position alone (StreamingLLM), which ``ada`` and ``critical`` refuse;
    the eviction then takes the oldest candidates from the front of the slots without calling ``score_step``.
    ``prompt_attention_mode``: a scorer whose prompt score is the prompt's causal attention summed per key (H2O,
    observed attention) names its GQA mode there; a replay then hands its ``score_prompt`` that table, computed once
    per trace layer (``PROMPT_TABLE``), instead of every configuration computing it again.
    ``prompt_score_reads_bounds``: ``score_prompt`` reads ``hi`` (SnapKV's pooling stops there), which depends on
    the budget: its scores are shared only by budgets with the same protected windows (``prompt_bounds``).

    Head state: the scorer's own ``head_fields``, then one field more, ``given_field``: where a replay's block of
    precomputed prompt scores starts (``with_prompt_scores``; 0: none, the prefill calls ``score_prompt``), then the
    stages' slices.
    """

    score_prompt: ClassVar[Any] = None
    score_step: ClassVar[Any] = None
    protect: ClassVar[Protection] = Protection()
    stream_prompt: ClassVar[bool] = False
    ranks_by_position: ClassVar[bool] = False
    prompt_score_reads_bounds: ClassVar[bool] = False
    #: the head field holding where a replay's precomputed prompt scores start (set per plain scorer class: right
    #: after the fields it declares)
    given_field: ClassVar[int] = 0
    #: the stages wrapped around the scorer, innermost first (set on combined classes by policies/core/combinators.py)
    chain: ClassVar[tuple] = ()
    #: the plain scorer class under the stages (itself for a plain scorer)
    scorer: ClassVar[type] = None  # type: ignore[assignment]
    #: offset of each stage's head-state slice, by stage name (after the scorer's own fields)
    head_offsets: ClassVar[dict[str, int]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.chain:
            cls.scorer = cls  # a plain scorer (a subclass such as PyramidKV too), not a stage around one
            own = cls.__dict__["head_fields"] if "head_fields" in cls.__dict__ else cls.given_field
            cls.given_field = own          # the fields the scorer declares, then the given-scores field
            cls.head_fields = own + 1
        if "score_step" not in cls.__dict__ and "chain" not in cls.__dict__:
            return        # an intermediate base, a subclass with the same kernels, an alias: nothing new to compose
        if cls.score_step is None:
            raise PolicyError(f"{cls.__name__}: a scorer needs a score_step kernel")
        cls.protect.code(cls.schema)       # every named protection parameter exists
        tag = "".join(c if c.isalnum() else "_" for c in cls.name)
        base_hash = _source_hash()
        cls.step_fn, cls.prefill_fn = compose(cls, cls.score_step.py_func.__module__, f"_{tag}_{base_hash}")

    @classmethod
    def has_prompt_selection(cls) -> bool:
        """Whether the policy selects from the prompt at once (else the engine streams it through the step)."""
        if any(stage.needs_prompt_score for stage in cls.chain):
            return True
        return cls.score_prompt is not None and not cls.scorer.stream_prompt

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.slot_fields = self.scorer_slot_fields() + sum(stage.slot_fields for stage in self.chain)

    @classmethod
    def shares_prompt_scores(cls) -> bool:
        """Whether the replays of several budgets of one configuration can share its prompt scores
        (``with_prompt_scores``): it selects from the prompt by ``score_prompt``, which reads no budget (and its
        bounds only as ``prompt_bounds`` says)."""
        return cls.has_prompt_selection() and cls.score_prompt is not None

    def prompt_bounds(self, budgets: Sequence[int]) -> tuple[int, ...]:
        """What ``score_prompt`` reads of a layer's per-head budgets: nothing (``()``), or, where
        ``prompt_score_reads_bounds``, each head's protected recent window (``hi = P - window``), as the generated
        prefill computes it: from the head's base size (``base_size``), the smallest of the layer's when a stage
        makes it one window for the layer (``ada``). Budgets with the same bounds share the prompt's scores."""
        if not type(self).scorer.prompt_score_reads_bounds:
            return ()
        recent = [self.protect.recent_of(self.params, self.base_size(int(b))) for b in budgets]
        if type(self).layer_window():
            recent = [min(recent)] * len(recent)
        return tuple(recent)

    @classmethod
    @functools.lru_cache(maxsize=None)
    def layer_window(cls) -> bool:
        """Whether a stage makes the prompt's protected window one for the whole layer (``StageCode.layer_window``)."""
        return any(stage.code(cls).layer_window for stage in cls.chain)

    def with_prompt_scores(self, head: np.ndarray, layer: Any, n_prompt: int, layer_index: int,
                           budgets: Sequence[int]) -> np.ndarray:
        """``head`` (a replay's initial head state of one layer, ``layer`` its inputs, ``budgets`` its heads')
        as ``score_prompt`` leaves it, with the prompt's scores and slot state appended (their first column in
        ``given_field``): the prefill copies them (``given_prompt_scores``) instead of scoring the prompt again.
        ``score_prompt`` reads no budget, and its bounds only as ``prompt_bounds`` says, so one such head state
        serves every budget of the configuration with the same bounds (``sim.replay.step_plan``: a batch's cells
        of one configuration, layer by layer); the bits are those of scoring in the prefill."""
        hkv, P, S = head.shape[0], int(n_prompt), self.slot_fields
        out = np.array(head, np.float64, order="C")
        scores = np.zeros((hkv, P))
        slot = np.zeros((hkv, P, S))
        recent = self.prompt_bounds(budgets) or (0,) * hkv      # () : unread
        bounds = np.array([P - r for r in recent], np.int64)
        compiled(type(self).score_prompt)(self.param_vector(layer.attention), layer_index, layer.q[:P],
                                          layer.k[:P], layer.v[:P], float(layer.attention.scale), bounds, scores,
                                          slot, out)
        out = np.concatenate([out, scores, slot.reshape(hkv, P * S)], axis=1)
        out[:, type(self).scorer.given_field] = head.shape[1]
        return out

    def prompt_attention_mode(self) -> int | None:
        """The GQA mode (``policies.core.shared_kernels.group_rows_scores``) of the prompt attention column sums that
        ``score_prompt`` starts from, or None: it scores the prompt otherwise (see ``PROMPT_TABLE``)."""
        return None

    def replay_head_state(self, n_kv_heads: int, head_dim: int, layer: Any, memo: dict | None = None,
                          n_prompt: int = 0) -> np.ndarray:
        """``Policy.replay_head_state`` with the prompt attention table appended (``with_prompt_table``)."""
        head = super().replay_head_state(n_kv_heads, head_dim, layer, memo, n_prompt)
        return self.with_prompt_table(head, layer, memo, n_prompt)

    def with_prompt_table(self, head: np.ndarray, layer: Any, memo: dict | None, n_prompt: int) -> np.ndarray:
        """``head`` with the prompt's attention column sums [Hkv, n_prompt] appended and their first column in the
        scorer's head field ``PROMPT_TABLE``, when the policy selects from the prompt by them
        (``prompt_attention_mode``): trace-only work, kept in ``memo`` (``prompt_attention_table``, shared with BUZZ
        and BumbleBee), which ``score_prompt`` would otherwise do for every budget and sibling configuration. The
        table is what ``score_prompt`` computes (the same kernel, the same bits); the closed loop's head state holds
        none, so its prefill computes it."""
        mode = self.prompt_attention_mode()
        if mode is None or n_prompt < 1 or not type(self).has_prompt_selection():
            return head
        table = prompt_attention_table(layer, memo, n_prompt, mode)
        out = np.concatenate([head, table], axis=1)
        out[:, PROMPT_TABLE] = head.shape[1]
        return out

    def scorer_slot_fields(self) -> int:
        """Per-slot fields the scorer's own kernels use (SnapKV's depend on its window)."""
        return type(self).scorer.slot_fields

    def base_size(self, budget: int) -> int:
        """The slots a head keeps after an eviction at this budget (a ``decoding`` stage's target)."""
        return budget

    def min_budget(self) -> int:
        pr = self.protect
        recent = max(1, int(self.params[pr.recent])) if pr.recent and pr.rule == "count" else 1
        return pr.sinks_of(self.params) + recent

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(sinks=self.protect.sinks_of(self.params),
                          recent=self.protect.recent_of(self.params, self.base_size(budget)))
