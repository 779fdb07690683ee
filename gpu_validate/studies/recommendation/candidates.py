"""What `kvsim recommend` chooses among, and what it must reach: the candidate configurations (every registered
policy's paper default and the hyperparameter values its own module declares, ``Policy.search_grid``), the budget
ladder, and the quality target.

A policy's search space lives where the policy is defined, so a newly registered policy -- a plug-in's included --
is a candidate of ``--policies all`` with no edit here. ``all`` also wraps the combinators people stack on a scorer
(`COMBINATORS`: Ada-KV's head-wise allocation and CriticalKV's W_O rescaling) around every scorer they accept, each
with the scorer's grid. Left out: the full cache (it holds everything: nothing to recommend) and policies that need
future attention (the oracle).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from gpu_validate.validate_error import ValidateError

# ``kvsim --help`` imports this module (the command's help lists `TARGETS` and `COMBINATORS`), so the policy
# registry and the spec parser, which load numba, are imported in the functions that need them
if TYPE_CHECKING:
    from policies.core.base import Policy

#: the combinators ``--policies all`` puts around every scorer they accept (kvpress's AdaKVPress and CriticalKVPress).
#: ``decoding`` and ``threshold`` change when and how much a cache holds rather than which tokens a budget keeps;
#: name them to search them (``--policies 'decoding(knorm)'``)
COMBINATORS = ("ada", "critical")

#: what each target names: (the closed-loop column it bounds, how the given number becomes that column's limit)
TARGETS = {
    "dnll": ("delta_nll", "the mean next-token NLL increase over the full cache, nats/token (e.g. dnll=0.05)"),
    "top1": ("top1_disagreement", "the share of greedy next tokens equal to the full cache's (e.g. top1=0.95)"),
    "retrieval": ("retrieval_failure", "of the pass-key prompts laid into your texts that the full cache answers, "
                                       "the share the compressed cache answers too (e.g. retrieval=0.9)"),
}


@dataclass(frozen=True)
class Target:
    """A quality target: the closed-loop loss ``column`` must be at most ``limit``."""

    name: str
    value: float
    column: str
    limit: float

    @classmethod
    def parse(cls, text: str) -> "Target":
        """``dnll=0.05`` (ΔNLL ≤ 0.05 nats/token), ``top1=0.95`` (≥ 95% of greedy tokens as the full cache's,
        i.e. top-1 disagreement ≤ 0.05) or ``retrieval=0.9`` (≥ 90% of the pass keys the full cache retrieves,
        i.e. a failure share ≤ 0.1; `gpu_validate.studies.recommendation.retrieval`)."""
        name, eq, value = text.partition("=")
        name = name.strip()
        if not eq or name not in TARGETS:
            raise ValidateError(f"target {text!r}: expected NAME=VALUE with NAME one of {sorted(TARGETS)} "
                                f"({'; '.join(f'{k}: {v[1]}' for k, v in TARGETS.items())})")
        try:
            x = float(value)
        except ValueError:
            raise ValidateError(f"target {text!r}: {value!r} is not a number") from None
        share = name in ("top1", "retrieval")
        if not math.isfinite(x) or (share and not 0 < x <= 1) or (name == "dnll" and x <= 0):
            raise ValidateError(f"target {text!r}: dnll must be > 0, top1 and retrieval in (0, 1]")
        # rounded: 1 - 0.9 is 0.0999...98 in floating point, and one failure in ten must meet retrieval=0.9
        return cls(name, x, TARGETS[name][0], round(1.0 - x, 12) if share else x)

    def met(self, loss: float) -> bool:
        return bool(loss <= self.limit)

    def __str__(self) -> str:
        return f"{self.name}={self.value:g}"


@dataclass(frozen=True)
class Candidate:
    """One configuration the recommendation may choose: a policy of a family (``default``: the family's paper
    default)."""

    family: str
    policy: Policy
    default: bool

    @property
    def label(self) -> str:
        return self.policy.label()


def families() -> list[str]:
    """Every policy name ``--policies all`` searches: each registered policy that can be recommended (not the full
    cache, not an oracle), then each combinator of `COMBINATORS` over every scorer it accepts (``ada(knorm)``,
    ``critical(snapkv)``...), as ``kvsim policies`` lists them."""
    from policies.core.registry import list_policies, policy_class, split_name

    out = []
    for name in list_policies(combinators=True):
        split = split_name(name)
        if split is not None and split[0] not in COMBINATORS:
            continue
        cls = policy_class(name)
        if not (cls.is_oracle or cls.unbounded):
            out.append(name)
    return out


def candidates(policies: Sequence[str] | str = "all") -> list[Candidate]:
    """The configurations to choose among: ``all`` (every family of `families`), or a ';'-separated list (or a
    sequence) of policy names and specs. A bare name (``h2o``, ``ada(knorm)``) is a family: its paper default and
    the values its ``search_grid`` declares (``Policy.search_configs``); a spec with values (``h2o:recent_ratio=0.3``)
    is one configuration, a family of its own."""
    from sim.experiments.specs import policy_parts, parse_policy, split_policy_list
    from policies.core.registry import policy_class

    names = families() if policies == "all" else (
        split_policy_list(policies) if isinstance(policies, str) else list(policies))
    out: list[Candidate] = []
    for spec in names:
        name, given = policy_parts(spec)
        pols = ([policy_class(name)(**params) for params in policy_class(name).search_configs()] if not given
                else [parse_policy(spec)])
        for i, pol in enumerate(pols):
            if pol.is_oracle:
                raise ValidateError(f"{pol.label()} needs future attention and cannot be recommended")
            if pol.unbounded:
                raise ValidateError(f"{pol.label()} keeps the whole cache: there is no budget to recommend")
            out.append(Candidate(name if not given else pol.label(), pol, i == 0 and not given))
    labels = [c.label for c in out]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValidateError(f"configurations listed twice: {dup}")
    return out


def budget_ladder(n_prompt: int, spec: str | Sequence[int] = "auto") -> list[int]:
    """The budgets to consider: ``auto`` is a ladder at ratio ~1.5 from 1/16 to 3/4 of the prompt (so that
    consecutive rungs differ by a memory step a user would notice), else a list of budgets or a comma-separated
    string of them."""
    if not isinstance(spec, str):
        spec = ",".join(str(int(b)) for b in spec)
    if spec == "auto":
        out, b = [], max(16.0, n_prompt / 16)
        while b <= 0.75 * n_prompt:
            out.append(int(round(b / 8) * 8))
            b *= 1.5
        return sorted(set(out))
    try:
        out = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise ValidateError(f"--budgets {spec!r}: expected 'auto' or comma-separated integers") from None
    if not out or out[0] < 1:
        raise ValidateError(f"--budgets {spec!r}: budgets must be integers >= 1")
    if out[-1] >= n_prompt:
        raise ValidateError(f"budget {out[-1]} holds the whole {n_prompt}-token prompt: nothing to recommend")
    return out
