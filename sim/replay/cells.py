"""The simulate stage of a search: many (policy, budget) cells of one trace replayed together, results identical to
replaying each on its own (`sim.replay.policy_replay.replay`).

A search (``kvsim recommend``, a sweep, the fidelity study) replays tens to hundreds of configurations on one trace.
Replayed one by one, each walks all of the trace's layers again (Llama-shaped 640-token traces: 4 MB of q, k, v and
reference per layer, 120 MB a trace, more than the last-level cache). Here the cells are replayed layer by layer:
layer j of every cell of a batch runs while layer j's data and its trace-only tables are hot, and the cells of a
one-pass strategy (the oracle's) are replayed all their budgets at once. Each layer of each cell runs the code
`sim.replay.policy_replay.replay` runs (`sim.replay.policy_replay.StepPlan.run_layer`), so the results are the same bit for bit
(``tests/test_replay_cells.py`` checks every registered policy).

Memory: a batch holds its cells' per-layer outputs until its last layer (metrics are float64 [layers, decode steps,
query heads, metrics]: 1.4 MB a cell on SmolLM2 at 128 decode steps); batches are cut so that they stay under
``batch_bytes``, and results are yielded batch by batch.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence

from policies.core.base import Policy
from sim.replay.contract import slot_capacity
from sim.replay.layer_inputs import LayerInputs, layer_inputs
from sim.replay.metrics import N_METRICS
from sim.replay.policy_replay import StepPlan, replay_budgets, strategy_of
from sim.replay.plan import check_budget, effective_chunk, replay_threads
from sim.replay.result import ReplayResult
from sim.replay.threads import blas_per_layer_thread
from traces.format import Trace

#: a batch of step cells holds at most this many bytes of outputs before its results are handed on
BATCH_BYTES = 512 << 20


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


def replay_plans(plans: list[tuple[int, StepPlan]], threads: int | None = 1,
                 on_progress: Callable[[float], None] | None = None,
                 batch_bytes: int = BATCH_BYTES) -> Iterator[tuple[int, ReplayResult]]:
    """``(i, plan.result(...))`` for the indexed step plans, batch by batch, each batch layer by layer (the plans
    must compress the same layers): the engine's part of `replay_cells`, also `sim.replay.policy_replay.replay_budgets`'s for
    several budgets of a step policy."""
    tick = on_progress or (lambda x: None)
    for batch in _batches(plans, batch_bytes):
        yield from _replay_batch(batch, threads, tick)


def _batches(plans: list[tuple[int, StepPlan]], batch_bytes: int) -> Iterator[list[tuple[int, StepPlan]]]:
    """``plans`` cut into consecutive batches whose outputs stay under ``batch_bytes`` (at least one cell each)."""
    batch: list[tuple[int, StepPlan]] = []
    size = 0
    for item in plans:
        need = output_bytes(item[1])
        if batch and size + need > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += need
    if batch:
        yield batch


def output_bytes(plan: StepPlan) -> int:
    """Bytes of a step cell's outputs over all its layers (metrics, slots, kept positions)."""
    meta = plan.trace.meta
    S, hq, hkv = meta.n_tokens - meta.n_prompt, meta.model.n_q_heads, meta.model.n_kv_heads
    cap = int(slot_capacity(plan.policy, plan.budgets, meta.n_tokens, plan.chunk).max())
    return len(plan.layers) * (S * hq * N_METRICS * 8 + S * hkv * 4 + plan.n_rec * hkv * cap * 4)


def _replay_batch(batch: list[tuple[int, StepPlan]], threads: int | None,
                  tick: Callable[[float], None]) -> Iterator[tuple[int, ReplayResult]]:
    """The batch's cells, layer by layer: layer j of every cell before layer j + 1 of any."""
    n_layers = len(batch[0][1].layers)
    if any(len(plan.layers) != n_layers for _, plan in batch):
        raise ValueError("the cells of a batch must compress the same layers")
    outs: list[list] = [[] for _ in batch]
    n_threads = replay_threads(threads, len(batch))
    with blas_per_layer_thread(n_threads), ThreadPoolExecutor(n_threads) as pool:
        for j in range(n_layers):
            run = (lambda item: item[1].run_layer(j))
            layer = map(run, batch) if n_threads == 1 else pool.map(run, batch)
            for c, out in enumerate(layer):
                outs[c].append(out)
                tick(1.0 / n_layers)
    for (i, plan), layer_outs in zip(batch, outs):
        yield i, plan.result(layer_outs)

