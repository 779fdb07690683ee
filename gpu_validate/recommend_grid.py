"""What `kvsim recommend` chooses among, and what it must reach: the candidate configurations (each policy family's
paper default and the hyperparameter values around it that matter most), the budget ladder, and the quality target.

The families and their values are those whose hyperparameters decide what a cache keeps in a way the simulator can
get wrong: recent windows and ratios, attention sinks, BUZZ's threshold-to-window ratio, Cascading's number of
sub-caches and expected attention's two optional terms. TOVA has no hyperparameter to search and is a one-point
family. The paper default is always the first value, so a family's default is ``grid[family][0]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from gpu_validate.errors import ValidateError

if TYPE_CHECKING:
    from policies.base import Policy

#: family -> policy specs, the paper default first; four values per family with a hyperparameter
FAMILY_GRID: dict[str, tuple[str, ...]] = {
    "h2o": ("h2o", "h2o:recent_ratio=0.1", "h2o:recent_ratio=0.25", "h2o:recent_ratio=0.75"),
    "snapkv": ("snapkv", "snapkv:window_size=8", "snapkv:window_size=16", "snapkv:window_size=64"),
    "streaming_llm": ("streaming_llm", "streaming_llm:n_sinks=0", "streaming_llm:n_sinks=1",
                      "streaming_llm:n_sinks=16"),
    "buzz": ("buzz", "buzz:t_over_w=1.0", "buzz:t_over_w=2.0", "buzz:t_over_w=8.0"),
    "d2o": ("d2o", "d2o:recent_ratio=0.1", "d2o:recent_ratio=0.5", "d2o:recent_ratio=0.75"),
    "cascading": ("cascading", "cascading:n_cascades=1", "cascading:n_cascades=2", "cascading:n_cascades=8"),
    "expected_attention": ("expected_attention", "expected_attention:use_covariance=False",
                           "expected_attention:use_vnorm=False",
                           "expected_attention:use_covariance=False,use_vnorm=False"),
    "tova": ("tova",),
}

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
        i.e. a failure share ≤ 0.1; `gpu_validate.recommend_retrieval`)."""
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


def candidates(families: Sequence[str] | str = "all") -> list[Candidate]:
    """The grid of the named families (``all``: every family of `FAMILY_GRID`). A name that is not a family is
    taken as one policy spec, a family of its own with that single configuration."""
    from sim.specs import parse_policy, split_policy_list

    names = list(FAMILY_GRID) if families == "all" else (
        split_policy_list(families) if isinstance(families, str) else list(families))
    out: list[Candidate] = []
    for name in names:
        specs = FAMILY_GRID.get(name, (name,))
        for i, spec in enumerate(specs):
            pol = parse_policy(spec)
            if pol.is_oracle:
                raise ValidateError(f"{pol.label()} needs future attention and cannot be recommended")
            out.append(Candidate(name if name in FAMILY_GRID else pol.label(), pol, i == 0))
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
