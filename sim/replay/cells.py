"""The simulate stage of a search: many (policy, budget) cells of one trace replayed together, results identical to
replaying each on its own (`sim.replay.policy_replay.replay`).

A search (``kvsim recommend``, a sweep, the fidelity study) replays tens to hundreds of configurations on one trace.
Replayed one by one, each walks all of the trace's layers again (Llama-shaped 640-token traces: 4 MB of q, k, v and
reference per layer, 120 MB a trace, more than the last-level cache). Here the cells are replayed layer by layer:
layer j of every cell of a batch runs while layer j's data and its trace-only tables are hot, the budgets of one
scorer configuration share the scoring of its prompt (`sim.replay.step_plan`), and the cells of a one-pass strategy
(the oracle's) are replayed all their budgets at once. Each layer of each cell runs the code
`sim.replay.policy_replay.replay` runs (`sim.replay.step_plan.StepPlan.run_layer`), so the results are the
same bit for bit (``tests/test_replay_cells.py`` checks every registered policy).

Memory: bounded by ``batch_bytes`` of outputs at a time (`sim.replay.step_plan`); results are yielded batch by batch.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

from policies.core.base import Policy
from sim.replay.layer_inputs import LayerInputs, layer_inputs
from sim.replay.plan import check_budget, effective_chunk
from sim.replay.policy_replay import replay_budgets, strategy_of
from sim.replay.result import ReplayResult
from sim.replay.step_plan import BATCH_BYTES, StepPlan, replay_plans
from traces.format import Trace


def replay_cells(trace: Trace, cells: Sequence[tuple[Policy, int]], *,
                 inputs: Sequence[LayerInputs] | None = None, record_kept: tuple[int, int] | None = None,
                 sliding: str = "keep", chunk: int = 1, threads: int | None = 1,
                 on_progress: Callable[[float], None] | None = None,
                 batch_bytes: int = BATCH_BYTES) -> Iterator[tuple[int, ReplayResult]]:
    """``(i, replay(trace, *cells[i], ...))`` for every cell, equal to the one-by-one replays, as the cells finish
    (one-pass strategies first, then the step cells batch by batch; within a batch, layer by layer).

    ``chunk`` is taken as a sweep takes it: a policy that steps one token at a time streams its prompt token by
    token (`sim.replay.plan.effective_chunk`). Every cell's budget is checked before anything runs. ``threads`` > 1
    replays the cells of a layer side by side (the engine releases the GIL). ``on_progress(x)`` is called as work
    finishes with ``x`` the cells' share done since the last call (a cell's layer counts 1 / its layers), so that a
    progress bar counts configurations, not layers."""
    inputs = inputs if inputs is not None else layer_inputs(trace)
    tick = on_progress or (lambda x: None)
    one_pass: dict[str, list[int]] = {}
    plans: list[tuple[int, StepPlan]] = []
    for i, (policy, budget) in enumerate(cells):
        if strategy_of(policy).one_pass:
            check_budget(trace, policy, budget)
            one_pass.setdefault(policy.label(), []).append(i)
        else:
            plans.append((i, StepPlan.make(trace, policy, budget, inputs=inputs, record_kept=record_kept,
                                           sliding=sliding, chunk=effective_chunk(policy, chunk))))
    for idx in one_pass.values():
        policy = cells[idx[0]][0]
        results = replay_budgets(trace, policy, [int(cells[i][1]) for i in idx], inputs=inputs,
                                 record_kept=record_kept, threads=threads, sliding=sliding, chunk=chunk)
        for i, res in zip(idx, results):
            tick(1.0)
            yield i, res
    yield from replay_plans(plans, threads, tick, batch_bytes)


