"""The base of a combinator stage (policies/core/combinators.py composes them; one module per stage beside this one:
``stage_ada``, ``stage_decoding``, ``stage_critical``, ``stage_threshold``).

A stage is one step of the scorer pipeline (policies/core/scorer.py) wrapped around any scorer: it has its own
named parameters (appended to the schema and read by name), its own slice of head and slot state (at offsets
found by its name, ``ScorerPolicy.head_offsets``), the source lines it adds to the generated step and prefill
kernels (``code``), and the hooks by which the combined policy asks it about sizes, validation and its kvpress
counterpart. Each stage's numba kernels live in its own module, beside its class.
"""
from __future__ import annotations

from typing import Any, ClassVar

from policies.core.base import Param, Policy
from policies.core.kvpress_press import KvpressPress
from policies.core.scorer import ScorerPolicy, StageCode


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

    @classmethod
    def base_size(cls, params: dict[str, Any], budget: int) -> int:
        """The slots a head keeps after an eviction at this budget (``ScorerPolicy.base_size``)."""
        return budget

    @classmethod
    def min_budget(cls, params: dict[str, Any], inner: int) -> int:
        """The least budget of the chain with this stage, given the least budget ``inner`` of what it wraps."""
        return inner

    @classmethod
    def validate(cls, policy: Policy, scorer_min: int) -> None:
        """Refuse parameter values that make no sense together (PolicyError); ``scorer_min``: the scorer's
        least budget."""

    @classmethod
    def kvpress_prompt_at_once(cls, params: dict[str, Any]) -> bool:
        """Whether kvpress's counterpart of the chain selects the prompt at once by the scorer's prompt score."""
        return False

    @classmethod
    def kvpress(cls, policy: Policy, inner: KvpressPress) -> KvpressPress:
        """kvpress's counterpart of this stage around ``inner`` (the counterpart of what the stage wraps), or
        ``NoKvpressPress`` saying why there is none."""
        return inner
