"""Combinators over any scorer: ``ada(<scorer>)``, ``decoding(<scorer>, every=N, target=B)`` and
``critical(<scorer>)``.

A combinator is a policy class built on demand from a scorer class (policies/scorer.py): it keeps the scorer's
kernels and parameters, appends its own parameters at the end of the schema and its state after the scorer's
head-state columns, and composes new step/prefill kernels with its eviction mode. Its name is the spec
(``ada(knorm)``), so ``get_policy("ada(knorm)", floor_alpha=0.3)`` rebuilds it anywhere (sweep workers, Ray):
a scorer written as one file gets both combinators with no other edit.

- ``ada``: Ada-KV (Feng et al., 2024) head-wise budget allocation with the safeguard, over the scorer's prompt
  scores (``_adakv_core.select_prompt``: top-k over the flattened candidate scores of the layer's heads, mixed
  with the uniform split by ``floor_alpha``); at decode every head keeps its prefill-allocated size, evicting
  with the scorer's decode score (the authors' fixed allocation; ``ada_snapkv``'s ``decode_alloc='fixed'``).
  ``ada(snapkv)``, ``ada(pyramidkv)`` and ``ada(h2o)`` resolve to the hand-written ``ada_snapkv``,
  ``ada_pyramidkv`` and ``ada_h2o`` (``NATIVE``), which are exactly this combination.
- ``decoding``: kvpress's DecodingPress: the cache grows during decoding and every ``every`` decode steps each
  head is compressed back to ``target`` by the scorer. ``target=0`` (default) means ``budget - every + 1``,
  the largest target whose peak (target + every - 1 slots after a step) stays within the budget. The prompt
  is compressed once to the target (kvpress leaves prefill to the wrapped press; here the budget must hold
  from the first step). kvpress defaults to ``compression_interval=512, target_size=2048``; kvsim budgets are
  smaller, so the default interval is 16. With ``every=1`` this is the scorer's per-step eviction.
- ``critical``: CriticalKV (Feng et al., 2025, arXiv 2502.03805; kvpress's CriticalKVPress). A token's output
  contribution is its attention times its value *after* the output projection, so the scorer's score alone
  misjudges tokens whose values W_O shrinks or amplifies. Two stages per head: the top
  ``first_stage_ratio`` x budget tokens by the scorer's score are kept; the rest compete on
  ``(score + critical_epsilon) * mean_j ||W_O^(j) v||_1`` over the group's query heads j (kvpress's L1 norm and group
  mean; paper and kvpress default ratio 0.5, epsilon 1e-4). Choices: (a) kvpress applies it once, at prefill;
  kvsim's scorers also evict per decode step, and ``critical`` applies the same two stages at every step (the
  stage-1 set is recomputed each step); (b) stage 1 ranks every held token, protected sinks / recent window
  included, as kvpress ranks every prompt token; (c) the rescaling assumes non-negative attention-like scores
  (``expected_attention``, SnapKV-like); over a negative score (``knorm`` scores are minus the key norm) the
  product inverts the ranking exactly as kvpress's does. W_O comes from the trace (``wo`` arrays, written by
  ``kvsim record``) or, closed loop, from the model's ``o_proj``.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from policies.adakv import FLOOR_ALPHA
from policies.base import Param, Policy, PolicyError, param_indices
from policies.registry import policy_class, register_wrapper, split_name
from policies.scorer import ScorerPolicy

EVERY = Param("every", 16, "int", 1, 1024, log=True, doc="decode steps between compressions (kvpress compression_interval)")
TARGET = Param("target", 0, "int", 0, 1 << 20,
               doc="slots per head after a compression; 0: budget - every + 1 (peak = budget)", searchable=False)
EPSILON = Param("critical_epsilon", 1e-4, "float", 0.0, 1.0,
                doc="added to the score before the W_O rescaling (CriticalKV, kvpress: epsilon)",
                searchable=False)
FIRST_STAGE_RATIO = Param("first_stage_ratio", 0.5, "float", 0.0, 1.0,
                          doc="share of the budget selected by the plain score before the W_O rescaling (CriticalKV)")


class Combined(ScorerPolicy):
    """Common part of the combinators: labels are specs, so a label pasted on the command line rebuilds it."""

    def label(self) -> str:
        return policy_spec(self)


class AdaScorer(Combined):
    """Ada-KV head-wise allocation over a scorer (see the module docstring)."""

    wrapper = "ada"
    extra = (FLOOR_ALPHA,)
    extra_head_fields = 2
    head_adaptive = True


class DecodingScorer(Combined):
    """DecodingPress over a scorer: compress back to ``target`` every ``every`` decode steps."""

    wrapper = "decoding"
    extra = (EVERY, TARGET)
    compresses_below_budget = True   # compressions go to the target, below the budget, even when all would fit
    extra_head_fields = 1

    def _target(self, budget: int) -> int:
        return self.params["target"] or budget - self.params["every"] + 1

    def min_budget(self) -> int:
        inner = super().min_budget()
        if self.params["target"]:
            return max(inner, self.params["target"] + self.params["every"] - 1)
        return inner + self.params["every"] - 1

    def validate(self) -> None:
        super().validate()
        if self.params["target"] and self.params["target"] < super().min_budget():
            raise PolicyError(f"{self.name}.target: {self.params['target']} is below the scorer's minimum "
                              f"{super().min_budget()} (its protected tokens plus one)")


class CriticalScorer(Combined):
    """CriticalKV over a scorer: W_O-projected value norms rescale the scores beyond a first-stage top set."""

    wrapper = "critical"
    extra = (EPSILON, FIRST_STAGE_RATIO)
    extra_slot_fields = 1        # the slot's projected value norm, computed once
    needs_wo = True

    def head_state_init(self, n_kv_heads: int, head_dim: int, wo: np.ndarray | None = None) -> np.ndarray:
        """The scorer's zeros, then per KV head its query group's W_O as float32 [G * hidden, d] (C order) packed
        in pairs into the float64 head state, then G*d and hidden (read by ``policies.scorer.wo_l1``)."""
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
        blocks = np.ascontiguousarray(wo.reshape(hidden, n_kv_heads, gd // d, d).transpose(1, 2, 0, 3))
        blocks = blocks.reshape(n_kv_heads, hidden * gd)
        if blocks.shape[1] % 2:                  # whole float64 slots: pad one float32 (never read)
            blocks = np.hstack([blocks, np.zeros((n_kv_heads, 1), np.float32)])
        blocks = blocks.view(np.float64)        # bit-for-bit; copies of the head state keep the bits
        tail = np.tile([float(gd), float(hidden)], (n_kv_heads, 1))
        return np.hstack([np.zeros((n_kv_heads, self.head_fields)), blocks, tail])


WRAPPERS: dict[str, type[ScorerPolicy]] = {"ada": AdaScorer, "decoding": DecodingScorer, "critical": CriticalScorer}

#: hand-written policies that already are a combinator over a policy not built on the scorer base:
#: ``ada(snapkv)`` is Ada-SnapKV, etc. (their scores need the observation-window ring state those kernels keep)
NATIVE = {("ada", "snapkv"): "ada_snapkv", ("ada", "pyramidkv"): "ada_pyramidkv", ("ada", "h2o"): "ada_h2o"}


def policy_spec(policy: Policy) -> str:
    """The spec string ``sim.specs.parse_policy`` turns back into an equal policy (non-default parameters
    only): ``knorm:n_sink=4``, ``decoding(knorm:n_sink=4, every=8)``."""
    diff = {p.name: policy.params[p.name] for p in policy.schema if policy.params[p.name] != p.default}
    own = {p.name for p in getattr(policy, "extra", ())} if "(" in policy.name else set()
    inner = ",".join(f"{k}={v}" for k, v in diff.items() if k not in own)
    outer = "".join(f", {k}={v}" for k, v in diff.items() if k in own)
    split = split_name(policy.name)
    if split is None:
        return f"{policy.name}:{inner}" if inner else policy.name
    return f"{split[0]}({split[1]}{':' + inner if inner else ''}{outer})"


@functools.lru_cache(maxsize=None)
def combined_class(wrapper: str, inner: type[Policy]) -> type[Policy]:
    """The policy class ``wrapper(inner)``, built once per process (its kernels cache on disk)."""
    if wrapper not in WRAPPERS:
        raise PolicyError(f"unknown combinator {wrapper!r}; available: {', '.join(WRAPPERS)}")
    if (wrapper, inner.name) in NATIVE:
        return policy_class(NATIVE[wrapper, inner.name])
    if not (issubclass(inner, ScorerPolicy) and inner.mode == "plain"):
        raise PolicyError(f"{wrapper}({inner.name}): {inner.name} does not expose per-slot scores (combinators take a "
                          f"scorer built on policies/scorer.py, not another combinator or a hand-written policy)")
    base = WRAPPERS[wrapper]
    schema = inner.schema + base.extra
    clash = {p.name for p in inner.schema} & {p.name for p in base.extra}
    if clash:
        raise PolicyError(f"{wrapper}({inner.name}): parameter name(s) {sorted(clash)} clash with the combinator's")
    attrs = {"name": f"{wrapper}({inner.name})", "summary": f"{inner.summary} + {base.__doc__.splitlines()[0]}",
             "schema": schema, "P": param_indices(schema), "mode": wrapper,
             "head_fields": inner.head_fields + base.extra_head_fields,
             "slot_fields": inner.slot_fields + base.extra_slot_fields, "__doc__": base.__doc__,
             "__module__": inner.__module__}
    return type(f"{base.__name__}_{inner.__name__}", (base, inner), attrs)


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


def decoding(inner: Policy | type[Policy] | str, **params: Any) -> Policy:
    """``decoding(get_policy("knorm"), every=64, target=128)``: DecodingPress over a scorer."""
    return _wrap("decoding", inner, params)


for _name in WRAPPERS:
    register_wrapper(_name, functools.partial(combined_class, _name),
                     lambda cls: issubclass(cls, ScorerPolicy) and cls.mode == "plain")
