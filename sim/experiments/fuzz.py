"""Fuzzing any registered policy (including a user's own) with hypothesis-generated traces.

Traces cover random attention, sink-heavy, Zipf heavy hitters, exact ties (all-equal scores), one-hot
attention, NaN-free extremes (logits around 1e-30 and 1e30), length 1, budget 1 and budget >= length. Every
case checks the interface invariants; a failing case is shrunk by hypothesis and saved as a small trace
directory that ``kvsim replay`` can load.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import Policy, PolicyError, get_policy
from sim.replay.policy_replay import replay
from traces.format import InMemoryTrace, LayerArrays, ModelInfo, TraceMeta
from traces.reference import full_attention_reference
from traces.synthetic import random_output_projection

SHAPES = ("random", "sinks", "zipf", "ties", "one_hot", "tiny_logits", "huge_logits")
_EPS = 1e-3

#: hypothesis profiles: "ci" keeps the whole suite fast, "deep" is for nightly or manual runs
PROFILES = {"ci": 500, "deep": 20_000, "quick": 50}


class InvariantViolation(AssertionError):
    """A policy broke one of the interface invariants on a generated trace."""


def _keys_queries(shape: str, T: int, hq: int, hkv: int, d: int, rng: np.random.Generator):
    q = rng.standard_normal((T, hq, d))
    k = rng.standard_normal((T, hkv, d))
    if shape == "sinks":
        k[: min(4, T), :, 0] = 8.0
        q[:, :, 0] = np.abs(q[:, :, 0]) + 2.0
    elif shape == "zipf":
        w = np.log(rng.permutation(T) + 1.0)
        k[:, :, 0] = -w[:, None]
        q[:, :, 0] = 4.0
    elif shape == "ties":
        q[:] = 0.0                       # every score equal: exact ties everywhere
    elif shape == "one_hot":
        q = np.abs(q)                    # every query aligns with one hot key: attention ~ one-hot after it
        k[rng.integers(0, T)] = 30.0
    elif shape == "tiny_logits":
        q *= 1e-15                       # logits around 1e-30
        k *= 1e-15
    elif shape == "huge_logits":
        q *= 1e15                        # logits around 1e30 (finite in float32)
        k *= 1e15
    return q.astype(np.float32), k.astype(np.float32)


def make_fuzz_trace(shape: str, T: int, hq: int, hkv: int, d: int, n_prompt: int, seed: int) -> InMemoryTrace:
    """A small trace of the given adversarial shape with its full-attention reference."""
    rng = np.random.default_rng(seed)
    q, k = _keys_queries(shape, T, hq, hkv, d, rng)
    v = rng.standard_normal((T, hkv, d)).astype(np.float32)
    lse, o = full_attention_reference(q, k, v, d ** -0.5)
    if not (np.isfinite(lse).all() and np.isfinite(o).all()):
        raise ValueError(f"fuzz trace {shape} overflowed its reference")
    meta = TraceMeta(ModelInfo(f"fuzz-{shape}", 1, hq, hkv, d, rope="none", hidden_size=hq * d), T, n_prompt,
                     kind="synthetic", source={"generator": "sim.experiments.fuzz", "shape": shape, "seed": seed})
    return InMemoryTrace(meta, [LayerArrays(q, k, v, lse, o, random_output_projection(hq, d, seed))])


@dataclass
class FuzzCase:
    trace: InMemoryTrace
    budget: int
    description: str = ""


#: share of cases drawn deliberately below a policy's minimum budget (they exercise its clean rejection)
INVALID_SHARE = 0.03


@st.composite
def fuzz_cases(draw, min_budget: int = 1) -> FuzzCase:
    """Hypothesis strategy over adversarial (trace, budget) pairs inside a policy's valid range.

    Lengths and budgets are drawn from ``min_budget`` up, so nearly every case runs; about
    ``INVALID_SHARE`` of the cases (when the policy has a minimum above 1) take a budget below it on
    purpose, to check that it is refused with a clean error.
    """
    lo = max(1, int(min_budget))
    seed = draw(st.integers(0, 2**31 - 1))
    # decided by the case's seed, not by a drawn flag: hypothesis favours small draws, which would over-sample it
    invalid = lo > 1 and np.random.default_rng([seed, 1]).random() < INVALID_SHARE
    shape = draw(st.sampled_from(SHAPES))
    hq, hkv = draw(st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2)]))
    if invalid:
        T = draw(st.integers(1, 40))
        budget = draw(st.integers(1, min(lo - 1, T)))
    else:
        T = draw(st.one_of(st.just(lo), st.integers(lo, max(lo, 40))))
    n_prompt = draw(st.integers(0, T - 1))
    d = draw(st.sampled_from([4, 8, 16]))
    if not invalid:
        budget = draw(st.one_of(st.just(lo), st.just(T), st.integers(lo, T)))
    trace = make_fuzz_trace(shape, T, hq, hkv, d, n_prompt, seed)
    return FuzzCase(trace, budget, f"{shape} T={T} P={n_prompt} Hq={hq} Hkv={hkv} d={d} seed={seed} budget={budget}")


def check_invariants(policy_factory: Callable[[], Policy], case: FuzzCase) -> str:
    """Replay one case and check the interface invariants; returns 'ok' or 'rejected' (a clean PolicyError)."""
    policy = policy_factory()
    trace, budget = case.trace, case.budget
    try:
        res = replay(trace, policy, budget, record_kept=(trace.meta.n_prompt, trace.meta.n_tokens))
    except PolicyError as e:
        if budget < policy.min_budget() and str(e):
            return "rejected"                        # a budget the policy declares it cannot take: clean error
        raise InvariantViolation(f"{policy.label()} raised on {case.description}: {e}") from e
    m = res.metrics
    if not np.isfinite(m).all():
        raise InvariantViolation(f"{policy.label()}: non-finite metrics on {case.description}")
    mass = res.metric("mass")
    if (mass < -_EPS).any() or (mass > 1 + _EPS).any():
        raise InvariantViolation(f"{policy.label()}: retained mass outside [0, 1] ({mass.min()}, {mass.max()}) "
                                 f"on {case.description}")
    if (res.metric("err") < 0).any() or (res.metric("kl") < 0).any():
        raise InvariantViolation(f"{policy.label()}: negative error or KL on {case.description}")
    if not policy.unbounded:
        held = res.slots.sum(axis=2) if policy.head_adaptive else res.slots
        cap = res.budgets.sum(axis=1)[:, None] if policy.head_adaptive else res.budgets[:, None, :]
        if (held > cap).any():
            raise InvariantViolation(f"{policy.label()}: over budget on {case.description}")
    sinks, recent = policy.guarantees(budget)
    if res.kept is not None:
        for r, t in enumerate(res.kept_steps):
            promised = set(range(min(sinks, t + 1))) | set(range(max(0, t - recent + 1), t + 1))
            for h in range(res.kept.shape[2]):
                row = res.kept[0, r, h]
                lost = promised - set(row[row >= 0].tolist())
                if lost:
                    raise InvariantViolation(f"{policy.label()}: lost promised positions {sorted(lost)} at step "
                                             f"{t} head {h} on {case.description}")
    again = replay(trace, policy_factory(), budget)
    if not np.array_equal(again.metrics, res.metrics):
        raise InvariantViolation(f"{policy.label()}: not deterministic on {case.description}")
    return "ok"


@dataclass
class FuzzReport:
    policy: str
    cases: int = 0
    rejected: int = 0
    failure: str | None = None
    saved: Path | None = None
    shapes: dict[str, int] = field(default_factory=dict)

    @property
    def effective(self) -> int:
        """Cases that ran through the policy (not refused before replay)."""
        return self.cases - self.rejected


def fuzz_policy(policy_factory: Callable[[], Policy] | str, *, max_examples: int = PROFILES["ci"],
                save_failures: str | Path | None = None, seed: int | None = None,
                params: dict[str, Any] | None = None) -> FuzzReport:
    """Run the fuzzer on one policy; on failure the shrunk case is saved under ``save_failures`` and reported."""
    if isinstance(policy_factory, str):
        name = policy_factory
        policy_factory = lambda: get_policy(name, **(params or {}))
    probe = policy_factory()
    label = probe.label()
    report = FuzzReport(label)
    last: list[FuzzCase] = []

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=seed is not None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(case=fuzz_cases(probe.min_budget()))
    def run(case: FuzzCase) -> None:
        last[:] = [case]
        report.cases += 1
        shape = case.trace.meta.source["shape"]
        report.shapes[shape] = report.shapes.get(shape, 0) + 1
        if check_invariants(policy_factory, case) == "rejected":
            report.rejected += 1

    try:
        run()
    except InvariantViolation as e:
        report.failure = str(e)
        if save_failures is not None and last:
            out = Path(save_failures) / f"{label.replace('(', '_').replace(')', '').replace(', ', '_')}-failure"
            report.saved = last[0].trace.save(out, overwrite=True)
            (report.saved / "FAILURE.txt").write_text(f"{e}\nbudget={last[0].budget}\n", encoding="utf-8")
    return report
