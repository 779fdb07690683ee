"""One (policy, budget) configuration of the step strategy, prepared and replayed layer by layer: `StepPlan` (its
checks, layers, allocation, kernels and prompt view; ``run_layer(j)`` replays one compressed layer, ``result``
assembles them) and `replay_plans`, which runs many plans layer by layer while a layer's data is hot, batch by batch.

Both `sim.replay.policy_replay` (several budgets of one step policy) and `sim.replay.cells` (a search's simulate
stage) run their configurations through here, so their results are the same bit for bit. Within a batch, the
budgets of one scorer configuration start each layer from one head state with the prompt already scored
(``ScorerPolicy.with_prompt_scores``): the prompt's scoring is trace-only work, done once per layer, not per budget.

Memory: a batch holds its cells' per-layer outputs until its last layer (metrics are float64 [layers, decode steps,
query heads, metrics]: 1.4 MB a cell on SmolLM2 at 128 decode steps); batches are cut so that they stay under
``batch_bytes``.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np
from numba.core.types.function_type import CompileResultWAP

from policies.core.base import LOGIT_SCALE_SIG, PREFILL_SIG, STEP_SIG, Policy
from sim.replay.contract import raise_on, slot_capacity
from sim.replay.engine import EngineConfig, EngineOutputs, LayerData, call_replay_layer
from sim.replay.layer_inputs import LayerInputs, PromptLayers, layer_inputs, layer_memo
from sim.replay.metrics import N_METRICS
from sim.replay.plan import allocation, check_budget, check_chunk, compressed_layers, held_elsewhere, replay_threads
from sim.replay.result import ReplayResult, concat_kept
from sim.replay.threads import blas_per_layer_thread
from traces.format import Trace
from traces.reference import causal_column_sums

if TYPE_CHECKING:
    from sim.replay.layer_groups import LayerGroup

#: a batch of step cells holds at most this many bytes of outputs before its results are handed on
BATCH_BYTES = 512 << 20


#: what one layer's replay returns: metrics [S, Hq, N_METRICS], slots [S, Hkv], kept [n_rec, Hkv, cap]
LayerOutput = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One (policy, budget) configuration of the step strategy, prepared: its budget and chunk checked, the layers
    it compresses, its allocation over them, its kernels and the prompt view. ``run_layer(j)`` replays the j-th of
    its layers (independent of the others: threads run them side by side, and a search's simulate stage runs many
    configurations' layer j one after another while the layer's data is hot, `sim.replay.cells`); ``result``
    assembles the layers' outputs into the configuration's `ReplayResult`."""

    trace: Trace
    policy: Policy
    budget: int
    inputs: Sequence[LayerInputs]
    layers: list[int]
    budgets: np.ndarray
    prompt: PromptLayers
    kernels: tuple
    chunk: int
    rec_start: int
    n_rec: int
    sliding: str

    @classmethod
    def make(cls, trace: Trace, policy: Policy, budget: int, *, inputs: Sequence[LayerInputs] | None = None,
             record_kept: tuple[int, int] | None = None, sliding: str = "keep", chunk: int = 1,
             group: LayerGroup | None = None) -> "StepPlan":
        """The plan of ``replay_step``'s arguments (checked here: a bad budget or chunk fails before any replay)."""
        check_budget(trace, policy, budget)
        chunk = check_chunk(policy, chunk)
        inputs = inputs if inputs is not None else layer_inputs(trace)
        layers = compressed_layers(trace, sliding) if group is None else list(group.layers)
        T, P = trace.meta.n_tokens, trace.meta.n_prompt
        budgets = allocation(trace, policy, budget, inputs, layers) if group is None else group.budgets(budget)
        rec_start, n_rec = record_kept if record_kept else (0, 0)
        return cls(trace, policy, int(budget), inputs, layers, budgets, PromptLayers(trace, inputs, layers, P),
                   engine_kernels(policy), chunk, rec_start, max(0, min(n_rec, T - rec_start)), sliding)

    def head_init(self, j: int, shared: bool = False) -> np.ndarray:
        """The head state the j-th compressed layer's replay starts with (``initial_head_state``); ``shared``: with
        the prompt's scores computed in it (``ScorerPolicy.with_prompt_scores``, where the policy
        ``shares_prompt_scores``), the same for every budget of the configuration (``replay_plans`` hands one to all
        of a batch's budgets)."""
        layer = self.layers[j]
        li = self.inputs[layer]
        head = initial_head_state(self.policy, li, layer_memo(self.inputs, layer), self.prompt, j)
        P = self.trace.meta.n_prompt
        if shared and P > 0 and self.policy.shares_prompt_scores():
            head = self.policy.with_prompt_scores(head, li, P, layer, self.budgets[j])
        return head

    def run_layer(self, j: int, head_init: np.ndarray | None = None) -> LayerOutput:
        """Replay the j-th compressed layer: its metrics, slots held and kept positions. ``head_init``: the head
        state to start from (``head_init(j, shared=True)``, copied: the replay writes into its own), else this
        plan's own."""
        meta, policy = self.trace.meta, self.policy
        T, P = meta.n_tokens, meta.n_prompt
        hkv = meta.model.n_kv_heads
        layer = self.layers[j]
        li = self.inputs[layer]
        b = self.budgets[j]
        cap = int(slot_capacity(policy, b, T, self.chunk).max())
        out = EngineOutputs(metrics=np.zeros((T - P, meta.model.n_q_heads, N_METRICS), np.float64),
                            slots=np.zeros((T - P, hkv), np.int32),
                            kept=np.full((self.n_rec, hkv, cap), -1, np.int32), info=np.zeros(3, np.int64))
        head_init = self.head_init(j) if head_init is None else head_init.copy()
        cfg = EngineConfig(params=policy.param_vector(li.attention), layer=layer, scale=float(li.attention.scale),
                           has_prefill=policy.has_prefill, metric_start=P, budget=b,
                           head_adaptive=policy.head_adaptive, bounded=not policy.unbounded, cap=cap,
                           n_slot_fields=policy.slot_fields, head_init=np.ascontiguousarray(head_init, np.float64),
                           rec_start=self.rec_start, reads_attention=policy.reads_attention,
                           window=int(li.attention.window or 0), chunk=self.chunk,
                           reads_keys=policy.reads_keys, reads_values=policy.reads_values)
        status = call_replay_layer(self.kernels, cfg, LayerData(li.q, li.k, li.v, li.lse, li.o, li.vmax1,
                                                           _whole_prompt_acc(self.inputs, li, layer, P, self.chunk,
                                                                             policy)), out)
        raise_on(policy, status, out.info, layer)
        return out.metrics, out.slots, out.kept

    def result(self, outs: Sequence[LayerOutput]) -> ReplayResult:
        """The configuration's result from its layers' outputs (in the order of ``layers``)."""
        meta, policy = self.trace.meta, self.policy
        T, P = meta.n_tokens, meta.n_prompt
        kept = concat_kept([o[2][None] for o in outs]) if self.n_rec else None
        return ReplayResult(
            trace=str(self.trace.path), policy=policy.name, label=policy.label(), params=dict(policy.params),
            budget=self.budget, budgets=self.budgets, steps=np.arange(P, T), metrics=np.stack([o[0] for o in outs]),
            slots=np.stack([o[1] for o in outs]), head_dim=meta.model.head_dim, kept=kept,
            kept_steps=np.arange(self.rec_start, self.rec_start + self.n_rec) if self.n_rec else None,
            layers=np.asarray(self.layers, np.int64), held_elsewhere=held_elsewhere(self.trace, self.layers),
            sliding=self.sliding,
        )


#: compiled kernels as the engine takes them, by dispatcher (`engine_kernels`)
_ENGINE_KERNELS: dict[int, tuple[object, object]] = {}


def engine_kernels(policy: Policy) -> tuple:
    """``policy``'s (step, prefill, logit_scale) kernels as ``replay_layer`` takes them, each in a 1-tuple (one
    compiled engine for every policy): the compiled function itself (numba's wrapper address protocol,
    ``CompileResultWAP``), looked up once per process. Handed a dispatcher, numba re-derives its first-class
    function type at every call (signature inspection and compile-result lookup, ~0.8 ms: 14% of a search's
    replays of 640-token traces, a call per cell and layer); the machine code called is the same."""
    out = []
    for fn, sig in zip(policy.kernels(), (STEP_SIG, PREFILL_SIG, LOGIT_SCALE_SIG)):
        hit = _ENGINE_KERNELS.get(id(fn))
        if hit is None or hit[0] is not fn:
            cres = getattr(fn, "overloads", {}).get(sig.args)
            if cres is None and hasattr(fn, "compile"):
                fn.compile(sig.args)
                cres = fn.overloads.get(sig.args)
            hit = _ENGINE_KERNELS[id(fn)] = (fn, CompileResultWAP(cres) if cres is not None else fn)
        out.append((hit[1],))
    return tuple(out)


def initial_head_state(policy: Policy, li: LayerInputs, memo: dict | None, prompt: PromptLayers,
                       j: int) -> np.ndarray:
    """The head state a replay starts compressed layer j of ``prompt`` (its inputs ``li``) with: the policy's
    trace-only tables (``Policy.replay_head_state``, kept in ``memo``, ``layer_memo``), then what it adds once the
    prompt is known (``Policy.prompt_head_state``: KVzip's prompt scores)."""
    head = policy.replay_head_state(li.k.shape[1], li.k.shape[2], li, memo, n_prompt=prompt.P)
    return policy.prompt_head_state(head, prompt, j)


def _whole_prompt_acc(inputs: Sequence[LayerInputs], li: LayerInputs, layer: int, P: int, chunk: int,
                      policy: Policy) -> np.ndarray:
    """The prompt's summed attention per key (``traces.reference.causal_column_sums``) when ``policy`` streams the
    whole prompt as one chunk and reads attention: trace-only work, computed once per layer and shared by every
    replay of the prepared inputs (``PreparedLayers.stats``); else an empty array (the engine streams)."""
    if policy.has_prefill or chunk < P or P < 2 or not policy.reads_attention:
        return np.zeros((0, 0, 0))
    window = int(li.attention.window or 0) or None
    compute = lambda: causal_column_sums(li.q, li.k, float(li.attention.scale), stop=P, window=window)
    stats = getattr(inputs, "stats", None)
    if stats is None:
        return compute()
    key = ("whole_prompt_acc", layer, P, window, float(li.attention.scale))
    if key not in stats:
        stats[key] = compute()
    return stats[key]


def replay_plans(plans: list[tuple[int, StepPlan]], threads: int | None = 1,
                 on_progress: Callable[[float], None] | None = None,
                 batch_bytes: int = BATCH_BYTES) -> Iterator[tuple[int, ReplayResult]]:
    """``(i, plan.result(...))`` for the indexed step plans, batch by batch, each batch layer by layer (the plans
    must compress the same layers): the engine's part of `sim.replay.cells.replay_cells`, and of
    `sim.replay.policy_replay.replay_budgets` for several budgets of a step policy."""
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
            keys = [_sharing_key(plan, j) for _, plan in batch]
            heads = {key: plan.head_init(j, shared=True) for key, plan in _sharing_groups(batch, keys).items()}
            run = (lambda c: batch[c][1].run_layer(j, heads.get(keys[c])))
            layer = map(run, range(len(batch))) if n_threads == 1 else pool.map(run, range(len(batch)))
            for c, out in enumerate(layer):
                outs[c].append(out)
                tick(1.0 / n_layers)
    for (i, plan), layer_outs in zip(batch, outs):
        yield i, plan.result(layer_outs)


def _sharing_key(plan: StepPlan, j: int) -> tuple | None:
    """Plans with the same key start their j-th layer from the same head state, the prompt scored once: one
    configuration (its label) on the same prepared inputs and layers, its prompt score reading the same bounds
    (``ScorerPolicy.prompt_bounds``); None where the policy does not share its prompt scores."""
    policy = plan.policy
    if not policy.shares_prompt_scores():
        return None
    return policy.label(), id(plan.inputs), tuple(plan.layers), plan.sliding, policy.prompt_bounds(plan.budgets[j])


def _sharing_groups(batch: list[tuple[int, StepPlan]], keys: list[tuple | None]) -> dict[tuple, StepPlan]:
    """One plan per key (``_sharing_key``) that several of the batch's plans share: their head state is computed
    once per layer (``StepPlan.head_init(j, shared=True)``), the prompt scored once."""
    count: dict[tuple, int] = {}
    first: dict[tuple, StepPlan] = {}
    for (_, plan), key in zip(batch, keys):
        if key is not None:
            count[key] = count.get(key, 0) + 1
            first.setdefault(key, plan)
    return {key: plan for key, plan in first.items() if count[key] > 1}
