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

Each stage is one module beside this one, its class with its kernels: ``stage_ada`` (Ada-KV's head-wise
allocation), ``stage_decoding`` (DecodingPress's schedule), ``stage_critical`` (CriticalKV's W_O rescaling) and
``stage_threshold`` (DMSPress's score threshold), on the base ``stage_base.Stage``. This module composes them:
``combined_class`` builds ``wrapper(inner)`` (its schema, state offsets and generated kernels), ``Combined`` asks
each stage about sizes, validation, its kvpress counterpart and its head state, and ``policy_spec`` writes a
combined policy back as the spec that rebuilds it. Named combinations (the Ada-KV paper's ``ada_snapkv``...) are
registered by policy modules with ``alias`` (policies/adakv.py).

A chain that makes no sense is refused with the reason: a stage twice, ``decoding`` inside another stage,
``ada``/``critical``/``threshold`` over a score that is only a position (StreamingLLM), ``ada``/``threshold`` over a
scorer without a prompt score, ``threshold`` with ``ada`` or ``critical`` inside or around it, and any combinator
over a policy that is not a scorer (BUZZ, Cascading, BumbleBee, D2O, DuoAttention, window, random, full, the
oracle: their rules are not "score, protect, evict the lowest").
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from policies.core.base import Policy, PolicyError, param_indices
from policies.core.kvpress_press import KvpressPress
from policies.core.registry import policy_class, register, register_wrapper, split_name
from policies.core.scorer import ScorerPolicy
from policies.core.stage_ada import AdaStage
from policies.core.stage_base import Stage
from policies.core.stage_critical import CriticalStage
from policies.core.stage_decoding import DecodingStage
from policies.core.stage_threshold import ThresholdStage

STAGES: dict[str, type[Stage]] = {s.name: s for s in (AdaStage, DecodingStage, CriticalStage, ThresholdStage)}


class Combined(ScorerPolicy):
    """A scorer with stages around it (built by ``combined_class``): labels are specs, so a label pasted on the
    command line rebuilds it."""

    def label(self) -> str:
        return policy_spec(self)

    def base_size(self, budget: int) -> int:
        for stage in self.chain:
            budget = stage.base_size(self.params, budget)
        return budget

    def min_budget(self) -> int:
        least = super().min_budget()
        for stage in self.chain:
            least = stage.min_budget(self.params, least)
        return least

    def validate(self) -> None:
        super().validate()
        for stage in self.chain:
            stage.validate(self, super().min_budget())

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """The scorer's press with each stage's kvpress counterpart around it, inner first (``Stage.kvpress``:
        ``ada`` only at ``floor_alpha=1``, ``critical`` -> ``CriticalKVPress``, ``threshold`` -> ``DMSPress``,
        ``decoding`` none checked)."""
        at_once = prompt_at_once or any(stage.kvpress_prompt_at_once(self.params) for stage in self.chain)
        c = type(self).scorer.kvpress_press(self, at_once)
        for stage in self.chain:
            c = stage.kvpress(self, c)
        return c

    def head_state_init(self, n_kv_heads: int, head_dim: int, wo: np.ndarray | None = None) -> np.ndarray:
        """The scorer's and the stages' zeros; with a ``critical`` stage, its slice (``CriticalStage.head_state``:
        the index of its slot field, G*d, hidden, the width of the norm table a replay appends, 0 in the closed
        loop, so that a table appended after it by ``Policy.prompt_head_state`` is never read as one; then the
        query groups' W_O)."""
        if CriticalStage not in self.chain:
            return np.zeros((n_kv_heads, self.head_fields))
        return CriticalStage.head_state(self, n_kv_heads, head_dim, wo)

    def replay_head_state(self, n_kv_heads: int, head_dim: int, layer: Any, memo: dict | None = None,
                          n_prompt: int = 0) -> np.ndarray:
        """``head_state_init``, and with a ``critical`` stage every position's projected value norm appended
        (``CriticalStage.replay_head_state``: the trace's values are known in advance, and a value never changes
        in a scorer's cache), computed once per layer and kept in ``memo`` for the other replays of the same
        inputs. The steps then read a new slot's norm instead of projecting its value through W_O (G * hidden * d
        multiply-adds per slot, more than the step's attention), and the prefill reads the prompt's; then the
        scorer's prompt attention table (``ScorerPolicy.with_prompt_table``)."""
        if CriticalStage not in self.chain:
            return super().replay_head_state(n_kv_heads, head_dim, layer, memo, n_prompt)
        head = CriticalStage.replay_head_state(self, n_kv_heads, head_dim, layer, memo)
        return self.with_prompt_table(head, layer, memo, n_prompt)


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
