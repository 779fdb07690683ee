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

import numpy as np
from numba.core.types.function_type import CompileResultWAP

from policies.core.base import LOGIT_SCALE_SIG, PREFILL_SIG, STEP_SIG, Policy, PolicyError
from sim.replay.contract import raise_on, slot_capacity
from sim.replay.engine import EngineConfig, EngineOutputs, LayerData, call_replay_layer
from sim.replay.layer_inputs import LayerInputs, PromptLayers, layer_inputs, layer_memo
from sim.replay.metrics import N_METRICS
from sim.replay.oracle_replay import replay_oracle, replay_oracle_policy
from sim.replay.plan import allocation, check_budget, check_chunk, compressed_layers, held_elsewhere, replay_threads
from sim.replay.result import ReplayResult, concat_kept
from sim.replay.threads import blas_per_layer_thread
from traces.format import Trace
from traces.reference import causal_column_sums

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
    over the layers (`sim.replay.cells.replay_plans`: every budget's layer j while the layer is hot, the budgets of a
    layer side by side on ``threads``), with the results of replaying each alone."""
    inputs = inputs if inputs is not None else layer_inputs(trace)
    if len(budgets) == 1:
        return [replay_step(trace, policy, budgets[0], inputs=inputs, record_kept=record_kept, threads=threads,
                            sliding=sliding, chunk=chunk, group=group)]
    from sim.replay.cells import replay_plans   # cells builds on this module (StepPlan): imported when used

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
    (``StepPlan.run_layer``)."""
    plan = StepPlan.make(trace, policy, budget, inputs=inputs, record_kept=record_kept, sliding=sliding,
                         chunk=chunk, group=group)
    n_threads = replay_threads(threads, len(plan.layers))
    with blas_per_layer_thread(n_threads), ThreadPoolExecutor(n_threads) as pool:
        outs = list(pool.map(plan.run_layer, range(len(plan.layers))))
    return plan.result(outs)


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

    def run_layer(self, j: int) -> LayerOutput:
        """Replay the j-th compressed layer: its metrics, slots held and kept positions."""
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
        head_init = initial_head_state(policy, li, layer_memo(self.inputs, layer), self.prompt, j)
        cfg = EngineConfig(params=policy.param_vector(li.attention), layer=layer, scale=float(li.attention.scale),
                           has_prefill=policy.has_prefill, metric_start=P, budget=b,
                           head_adaptive=policy.head_adaptive, bounded=not policy.unbounded, cap=cap,
                           n_slot_fields=policy.slot_fields, head_init=np.ascontiguousarray(head_init, np.float64),
                           rec_start=self.rec_start, reads_attention=policy.reads_attention,
                           window=int(li.attention.window or 0), chunk=self.chunk)
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


#: replay strategies by name (``Policy.replay_strategy``)
STRATEGIES: dict[str, ReplayStrategy] = {
    "step": ReplayStrategy("step", _replay_steps),
    "oracle": ReplayStrategy("oracle", replay_oracle_policy, one_pass=True),
}
