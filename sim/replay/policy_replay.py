"""Replay a policy over a trace at a budget and collect its metrics (the Python face of the engine).

A policy is replayed by its *strategy* (``Policy.replay_strategy``): ``"step"`` streams the trace through the
policy's numba kernels (the engine, here), ``"oracle"`` computes the future-attention oracle exactly from the full
attention rows, every budget in one pass (`sim.replay.oracle_replay`). ``replay`` and ``replay_budgets`` dispatch on it,
so callers (executors, sweeps, reports) never special-case a policy.

Around the replay itself: its inputs are prepared by `sim.replay.layer_inputs`, what it compresses (budget checks,
compressed layers of a hybrid model, the allocation) is decided by `sim.replay.plan`, it returns a
`sim.replay.result.ReplayResult`, and a configuration split into layer groups (``group=``) comes from and goes back
through `sim.replay.layer_groups`. ``replay_oracle`` (the oracle's budget curve) is public API here as well.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from policies.core.base import Policy, PolicyError
from sim.replay.layer_inputs import LayerInputs, layer_inputs
from sim.replay.oracle_replay import replay_oracle, replay_oracle_policy
from sim.replay.plan import replay_threads
from sim.replay.result import ReplayResult
from sim.replay.step_plan import StepPlan, replay_plans
from sim.replay.threads import blas_per_layer_thread
from traces.format import Trace

if TYPE_CHECKING:
    from sim.replay.layer_groups import LayerGroup

__all__ = ["STRATEGIES", "ReplayStrategy", "replay", "replay_budgets", "replay_oracle", "replay_step", "strategy_of"]


@dataclass(frozen=True)
class ReplayStrategy:
    """How a family of policies is replayed.

    ``run(trace, policy, budgets, inputs=, record_kept=, threads=, sliding=, chunk=, group=)`` returns one
    ``ReplayResult`` per budget, in the given order (of the ``LayerGroup``'s layers only, when one is given);
    ``one_pass`` says it evaluates all budgets in one pass (so callers hand it every budget at once rather than
    one job per budget).
    """

    name: str
    run: Callable[..., list[ReplayResult]]
    one_pass: bool = False


def strategy_of(policy: Policy) -> ReplayStrategy:
    """The strategy that replays ``policy`` (its class's ``replay_strategy``)."""
    try:
        return STRATEGIES[policy.replay_strategy]
    except KeyError:
        raise PolicyError(f"{policy.name}: unknown replay strategy {policy.replay_strategy!r}; "
                          f"known: {sorted(STRATEGIES)}") from None


def replay_budgets(trace: Trace, policy: Policy, budgets: Sequence[int], *,
                   inputs: list[LayerInputs] | None = None, record_kept: tuple[int, int] | None = None,
                   threads: int | None = None, sliding: str = "keep", chunk: int = 1,
                   group: LayerGroup | None = None) -> list[ReplayResult]:
    """Replay ``policy`` at each of ``budgets`` by its strategy; one result per budget, in order. With a
    ``group`` (``layer_groups``), only its layers, at its shipped allocation (``merge_layer_groups`` joins the
    groups' results)."""
    return strategy_of(policy).run(trace, policy, list(budgets), inputs=inputs, record_kept=record_kept,
                                   threads=threads, sliding=sliding, chunk=chunk, group=group)


def replay(trace: Trace, policy: Policy, budget: int, *, inputs: list[LayerInputs] | None = None,
           record_kept: tuple[int, int] | None = None, threads: int | None = None,
           sliding: str = "keep", chunk: int = 1) -> ReplayResult:
    """Replay ``policy`` over the layers of ``trace`` it compresses (all, unless the model has sliding-window
    layers and ``sliding`` is ``keep``) with ``budget`` slots per KV head.

    Steps from the trace's prompt length on are measured. ``record_kept=(start, n)`` records the cached
    positions of steps start..start+n-1 (for occupancy maps and fidelity checks), for every strategy.
    ``chunk`` (chunked prefill): a policy without a prefill selector takes its prompt ``chunk`` tokens per step
    instead of one (see ``replay_step``).
    """
    return replay_budgets(trace, policy, [budget], inputs=inputs, record_kept=record_kept, threads=threads,
                          sliding=sliding, chunk=chunk)[0]


def _replay_steps(trace: Trace, policy: Policy, budgets: Sequence[int], *,
                  inputs: list[LayerInputs] | None = None, record_kept: tuple[int, int] | None = None,
                  threads: int | None = None, sliding: str = "keep", chunk: int = 1,
                  group: LayerGroup | None = None) -> list[ReplayResult]:
    """The step strategy: one engine replay per budget over the same prepared inputs; several budgets in one pass
    over the layers (`sim.replay.step_plan.replay_plans`: every budget's layer j while the layer is hot, the
    budgets of a layer side by side on ``threads``), with the results of replaying each alone."""
    inputs = inputs if inputs is not None else layer_inputs(trace)
    if len(budgets) == 1:
        return [replay_step(trace, policy, budgets[0], inputs=inputs, record_kept=record_kept, threads=threads,
                            sliding=sliding, chunk=chunk, group=group)]
    plans = [StepPlan.make(trace, policy, b, inputs=inputs, record_kept=record_kept, sliding=sliding, chunk=chunk,
                           group=group) for b in budgets]
    return [res for _, res in sorted(replay_plans(list(enumerate(plans)), threads), key=lambda x: x[0])]


def replay_step(trace: Trace, policy: Policy, budget: int, *, inputs: list[LayerInputs] | None = None,
                record_kept: tuple[int, int] | None = None, threads: int | None = None,
                sliding: str = "keep", chunk: int = 1, group: LayerGroup | None = None) -> ReplayResult:
    """Stream ``trace`` through ``policy``'s kernels at ``budget``: policies with a prefill selector compress
    the prompt first, the others stream it through ``step``, ``chunk`` prompt tokens per step (chunked
    prefill: every token of a chunk attends causally over the cache plus its chunk-mates, the step sees their
    attention summed per slot, as a token-by-token run without evictions would accumulate it, then evicts to
    the budget; 1 is token by token, the prompt length is "compress once after the prompt"). A chunk never
    crosses into the decode steps, which stay one token each. With a ``group``, only its layers at its
    shipped budgets (``layer_groups``). The layers replay side by side on ``threads`` threads
    (`sim.replay.step_plan.StepPlan.run_layer`)."""
    plan = StepPlan.make(trace, policy, budget, inputs=inputs, record_kept=record_kept, sliding=sliding,
                         chunk=chunk, group=group)
    n_threads = replay_threads(threads, len(plan.layers))
    with blas_per_layer_thread(n_threads), ThreadPoolExecutor(n_threads) as pool:
        outs = list(pool.map(plan.run_layer, range(len(plan.layers))))
    return plan.result(outs)


#: replay strategies by name (``Policy.replay_strategy``)
STRATEGIES: dict[str, ReplayStrategy] = {
    "step": ReplayStrategy("step", _replay_steps),
    "oracle": ReplayStrategy("oracle", replay_oracle_policy, one_pass=True),
}
