"""Replay a policy over a trace at a budget and collect its metrics (the Python face of the engine).

A policy is replayed by its *strategy* (``Policy.replay_strategy``): ``"step"`` streams the trace through the
policy's numba kernels (the engine), ``"oracle"`` computes the future-attention oracle exactly from the full
attention rows, every budget in one pass. ``replay`` and ``replay_budgets`` dispatch on it, so callers
(executors, sweeps, reports) never special-case a policy.

Hybrid models (Gemma-3: sliding-window layers next to global ones). On a sliding layer the model's own cache
*is* its window, and the trace's reference is that windowed attention. By default (``sliding="keep"``) a
policy compresses the global layers only: the sliding layers keep their window, are not replayed (their loss
is zero by definition) and count in the memory held (``kv_bytes_mean``) at min(t + 1, window - 1) slots per KV
head after step t. ``sliding="compress"`` applies the policy to the sliding layers too, on top of their window
(``sim.contract.apply_window``), so budgets below the window save memory there. Metrics are means over the
layers a policy compresses (``ReplayResult.layers``).

Layer groups (``--split-layers N``). A configuration's layers replay independently once each knows its budget,
so a long trace's replay can be cut into groups of consecutive compressed layers run as separate jobs
(``sim.executors``). What couples layers is the allocation alone (``Policy.allocate``: PyramidKV's depth
schedule, D2O's variance-based budgets): ``layer_groups`` computes it once over every compressed layer and hands
each ``LayerGroup`` its rows, the strategies replay just the group's layers from them (``group=``), and
``merge_layer_groups`` puts the groups' results back together, identical to the unsplit replay.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from policies.base import Policy, PolicyError
from sim.contract import PolicyContractError, check_allocation, raise_on, slot_capacity  # noqa: F401 (re-export)
from sim.engine import EngineConfig, EngineOutputs, LayerData, replay_layer
from sim.metrics import N_METRICS, NAMES, summarise
from sim.oracle import oracle_layer
from sim.threads import KVSIM_THREADS, available_cores, blas_per_layer_thread
from traces.format import LayerArrays, LayerAttention, ModelInfo, Trace
from traces.reference import causal_column_sums, full_attention_reference

#: bytes per cached element on the GPU the memory figures model (fp16/bf16 caches)
KV_ELEMENT_BYTES = 2
#: what a replay does with a hybrid model's sliding-window layers (see the module docstring)
SLIDING_MODES = ("keep", "compress")


class BudgetError(ValueError):
    """A budget that is not a positive integer, or larger than the trace it is replayed on."""


@dataclass
class LayerInputs:
    """One layer's arrays as the engine wants them: C-contiguous float32 plus the reference and v-norm maxima."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    lse: np.ndarray
    o: np.ndarray
    vmax1: np.ndarray
    wo: np.ndarray | None = None   # the layer's output projection [hidden, Hq*d] when the trace has it
    attention: LayerAttention = LayerAttention()   # the layer's own attention (scale, window, RoPE base)

    @staticmethod
    def from_arrays(la: LayerArrays, attention: LayerAttention) -> "LayerInputs":
        f32 = lambda a: np.array(a, dtype=np.float32, order="C")   # an owned, writable copy (traces are read-only maps)
        q, k, v = f32(la.q), f32(la.k), f32(la.v)
        if la.lse is None or la.o is None:
            lse, o = full_attention_reference(q, k, v, attention.scale, window=attention.window)
        else:
            lse, o = f32(la.lse), f32(la.o)
        vmax1 = np.maximum.accumulate(np.abs(v).sum(axis=2, dtype=np.float64), axis=0)
        return LayerInputs(q, k, v, lse, o, np.ascontiguousarray(vmax1), None if la.wo is None else f32(la.wo),
                           attention)


@dataclass
class ReplayResult:
    """Metrics of one (trace, policy, budget) replay.

    ``metrics[l, s, hq, m]`` for replayed layer l (the trace's stored layer ``layer_index[l]``), measured step s
    (absolute position ``steps[s]``), query head hq and metric m in ``sim.metrics.NAMES``; ``slots[l, s, h]`` slots held
    per KV head after the step's eviction; ``kept[l, r, h, :]`` cached positions (-1 padded) for the recorded
    steps, when asked for. ``held_elsewhere[s]`` counts the slots the layers *not* replayed hold after step s
    (a hybrid model's sliding windows, summed over layers and KV heads), so memory covers every layer.
    """

    trace: str
    policy: str
    label: str
    params: dict[str, Any]
    budget: int
    budgets: np.ndarray
    steps: np.ndarray
    metrics: np.ndarray
    slots: np.ndarray
    head_dim: int
    kept: np.ndarray | None = None
    kept_steps: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    layers: np.ndarray | None = None          # stored-layer index of each replayed layer (None: all, in order)
    held_elsewhere: np.ndarray | None = None  # [S] slots held by the layers not replayed
    sliding: str = "keep"

    @property
    def layer_index(self) -> np.ndarray:
        """The trace's stored-layer index of each replayed layer."""
        return np.arange(self.metrics.shape[0]) if self.layers is None else self.layers

    def metric(self, name: str) -> np.ndarray:
        """One metric as [L, S, Hq]."""
        return self.metrics[..., NAMES.index(name)]

    def summary(self) -> dict[str, Any]:
        """Scalar aggregates users read: means over layers, heads and measured steps."""
        out: dict[str, Any] = {"trace": self.trace, "policy": self.policy, "label": self.label,
                               "budget": self.budget}
        n = self.metrics.shape[1]
        out.update(summarise(self.metrics))
        out["slots_mean"] = float(self.slots.mean()) if n else float("nan")
        out["slots_peak"] = int(self.slots.sum(axis=2).max()) if n else 0
        held = self.slots.sum(axis=(0, 2)) + (0 if self.held_elsewhere is None else self.held_elsewhere)
        per_step_bytes = held * 2 * self.head_dim * KV_ELEMENT_BYTES
        out["kv_bytes_mean"] = float(per_step_bytes.mean()) if n else float("nan")
        out["n_steps"] = int(n)
        out["n_layers_compressed"] = int(self.metrics.shape[0])
        out["err_by_layer"] = [float(x) for x in self.metric("err").mean(axis=(1, 2))] if n else []
        out["mass_by_layer"] = [float(x) for x in self.metric("mass").mean(axis=(1, 2))] if n else []
        return out

    def per_head(self) -> pd.DataFrame:
        """Metric means per (layer, query head)."""
        L, _, hq, _ = self.metrics.shape
        means = self.metrics.mean(axis=1)
        rows = {"layer": np.repeat(self.layer_index, hq), "head": np.tile(np.arange(hq), L)}
        rows.update({name: means[:, :, i].reshape(-1) for i, name in enumerate(NAMES)})
        return pd.DataFrame(rows)

    def per_step(self) -> pd.DataFrame:
        """Metric means over layers and heads per measured step."""
        means = self.metrics.mean(axis=(0, 2))
        df = pd.DataFrame({name: means[:, i] for i, name in enumerate(NAMES)})
        df.insert(0, "position", self.steps)
        df["slots"] = self.slots.mean(axis=(0, 2))
        return df


def _check_budget(trace: Trace, policy: Policy, budget: int) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise BudgetError(f"budget must be an integer, got {budget!r}")
    if budget > trace.meta.n_tokens:
        raise BudgetError(f"budget {budget} is larger than the trace's {trace.meta.n_tokens} tokens "
                          f"({trace.path}); use budget <= {trace.meta.n_tokens} (equal means the full cache)")
    policy.check_budget(int(budget))


def _threads(threads: int | None, n_layers: int) -> int:
    """Layers replayed side by side: ``threads``, else this process's share (``KVSIM_THREADS``, which a sweep
    worker's thread budget sets), else every core it may use."""
    return max(1, min(n_layers, threads or int(os.environ.get(KVSIM_THREADS, available_cores()))))


class PreparedLayers(list):
    """Engine inputs prepared once for several replays, plus ``stats``: prompt statistics allocators computed on
    them (``policies.base.prompt_memo``), shared by every replay that uses these inputs."""

    def __init__(self, items=()) -> None:
        super().__init__(items)
        self.stats: dict = {}


def load_layers(trace: Trace, layers: Sequence[int] | None = None) -> PreparedLayers:
    """Prepare the engine inputs of the chosen layers (all by default) once, for several replays."""
    idx = range(trace.n_layers) if layers is None else layers
    return PreparedLayers(LayerInputs.from_arrays(trace.layer(i), trace.meta.attention(i)) for i in idx)


class LayerLoader(Sequence):
    """The engine inputs of every layer of a trace, each prepared from the memory-mapped files when asked for
    and not kept: a long trace's replay holds one layer per replay thread, not the whole trace (Gemma-3 at 32 k
    tokens: 0.34 GB per layer instead of 6 GB). ``load_layers`` is the eager list for many replays of a short
    trace."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.stats: dict = {}

    def __len__(self) -> int:
        return self.trace.n_layers

    def __getitem__(self, i: int) -> LayerInputs:   # type: ignore[override]
        return LayerInputs.from_arrays(self.trace.layer(i), self.trace.meta.attention(i))


#: a trace whose engine inputs (float32 q, k, v, lse, o of every layer) exceed this many bytes is replayed from a
#: ``LayerLoader`` (a layer at a time) rather than prepared whole
EAGER_INPUT_BYTES = 1 << 30


def layer_input_bytes(model: ModelInfo, n_tokens: int) -> int:
    """Bytes of one layer's float32 engine inputs (q, k, v, lse, o) over ``n_tokens`` tokens: what each replay
    thread holds while it replays a layer."""
    hq, hkv, d = model.n_q_heads, model.n_kv_heads, model.head_dim
    return 4 * (2 * hq * d + 2 * hkv * d + hq) * n_tokens


def input_bytes(trace: Trace) -> int:
    """Bytes of float32 engine inputs the whole trace would take."""
    return layer_input_bytes(trace.meta.model, trace.meta.n_tokens) * trace.n_layers


def layer_inputs(trace: Trace) -> Sequence[LayerInputs]:
    """The engine inputs for several replays of ``trace``: prepared once when they fit in ``EAGER_INPUT_BYTES``,
    else loaded a layer at a time (``LayerLoader``)."""
    return load_layers(trace) if input_bytes(trace) <= EAGER_INPUT_BYTES else LayerLoader(trace)


class PromptLayers(Sequence):
    """``allocate()``'s view of the compressed layers' prompt: (q[:P], k[:P]) float32 per layer, read from the
    prepared inputs or, for a ``LayerLoader``, from the trace's files, only when an allocator asks."""

    def __init__(self, trace: Trace, inputs: Sequence[LayerInputs], layers: Sequence[int], n_prompt: int) -> None:
        self.trace, self.inputs, self.layers, self.P = trace, inputs, list(layers), n_prompt
        stats = getattr(inputs, "stats", None)     # shared by the replays of these inputs, per set of layers
        self.cache = None if stats is None else stats.setdefault((tuple(self.layers), n_prompt), {})

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, j: int) -> tuple[np.ndarray, np.ndarray]:   # type: ignore[override]
        i, P = self.layers[j], self.P
        if isinstance(self.inputs, LayerLoader):
            la = self.trace.layer(i)
            return np.array(la.q[:P], np.float32), np.array(la.k[:P], np.float32)
        return self.inputs[i].q[:P], self.inputs[i].k[:P]


def check_chunk(policy: Policy, chunk: int) -> int:
    """The prompt chunk a replay of ``policy`` uses: ``chunk`` (an integer >= 1) for a policy that streams its
    prompt, 1 for one with a prefill selector (it sees the whole prompt at once anyway). A policy whose step
    assumes one new token per step (``Policy.multi_token_steps`` False) refuses chunk > 1, saying so."""
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
    if policy.has_prefill or chunk == 1:
        return 1
    if not policy.multi_token_steps:
        raise PolicyError(f"{policy.label()} steps one token at a time (its state follows each new token), so it "
                          f"cannot take its prompt in chunks of {chunk}; use chunk 1")
    return int(chunk)


def effective_chunk(policy: Policy, chunk: int) -> int:
    """The prompt chunk ``policy`` runs with when a sweep asks for ``chunk``: 1 for a policy with a prefill
    selector or one that steps token by token, ``chunk`` otherwise (sweep rows record it as ``prefill_chunk``)."""
    return 1 if policy.has_prefill or not policy.multi_token_steps else int(chunk)


def check_sliding(sliding: str) -> str:
    """``sliding`` itself, or a ValueError naming the modes."""
    if sliding not in SLIDING_MODES:
        raise ValueError(f"sliding must be one of {SLIDING_MODES}, got {sliding!r}")
    return sliding


def compressed_layers(trace: Trace, sliding: str = "keep") -> list[int]:
    """Stored-layer indices a policy compresses: every global layer, and the sliding ones with ``compress``."""
    check_sliding(sliding)
    idx = [i for i in range(trace.n_layers) if sliding == "compress" or not trace.meta.attention(i).sliding]
    if not idx:
        raise ValueError(f"trace {trace.path} has only sliding-window layers: with sliding='keep' nothing is "
                         "compressed; replay with sliding='compress' (--sliding compress)")
    return idx


def held_elsewhere(trace: Trace, replayed: Sequence[int]) -> np.ndarray | None:
    """[T - P] slots the layers not in ``replayed`` hold after each measured step: a sliding layer keeps its
    window, min(t + 1, window - 1) per KV head after step t (the newest token joins before the next attention),
    a global one everything. None when every layer is replayed."""
    rest = [i for i in range(trace.n_layers) if i not in set(replayed)]
    if not rest:
        return None
    meta = trace.meta
    t = np.arange(meta.n_prompt, meta.n_tokens) + 1
    out = np.zeros(t.shape, np.int64)
    for i in rest:
        w = meta.attention(i).window
        out += np.minimum(t, w - 1) if w else t
    return out * meta.model.n_kv_heads


def allocation(trace: Trace, policy: Policy, budget: int, inputs: Sequence[LayerInputs],
               layers: Sequence[int]) -> np.ndarray:
    """``policy``'s slots per layer and KV head [len(layers), Hkv] at ``budget`` over the compressed ``layers``:
    ``Policy.allocate`` on their prompts, checked. The one place a replay allocates, so that the policies whose
    budgets couple layers (PyramidKV, D2O) see every compressed layer, whether the replay is split or not."""
    meta = trace.meta
    hkv = meta.model.n_kv_heads
    prompt = PromptLayers(trace, inputs, layers, meta.n_prompt)
    return check_allocation(policy, policy.allocate(int(budget), hkv, prompt, meta.softmax_scale), len(layers), hkv)


@dataclass(frozen=True, eq=False)
class LayerGroup:
    """Consecutive compressed layers of one configuration, replayed on their own (``layer_groups``).

    ``layers``: their stored-layer indices; ``alloc[budget]``: their rows [len(layers), Hkv] of the policy's
    allocation over *all* compressed layers, computed where the configuration was split and shipped as plain
    arrays, so a worker replays its group without reading (or allocating from) any other layer.
    """

    layers: tuple[int, ...]
    alloc: dict[int, np.ndarray]

    def budgets(self, budget: int) -> np.ndarray:
        """The group's slots per layer and KV head at ``budget`` (a writable copy: the engine takes no
        read-only array, and Ray hands a task's array arguments over read-only)."""
        try:
            return np.array(self.alloc[int(budget)], np.int64)
        except KeyError:
            raise ValueError(f"layer group {list(self.layers)} carries no allocation for budget {budget} "
                             f"(only {sorted(self.alloc)}); split the configuration at that budget") from None


def layer_groups(trace: Trace, policy: Policy, budgets: Sequence[int], n_groups: int, *,
                 inputs: Sequence[LayerInputs] | None = None, sliding: str = "keep") -> list[LayerGroup]:
    """``policy``'s configuration at ``budgets`` cut into ``n_groups`` groups of consecutive compressed layers
    (sizes differing by at most one), each with its rows of the allocation computed here, once per budget."""
    layers = compressed_layers(trace, sliding)
    if not 1 <= n_groups <= len(layers):
        raise ValueError(f"cannot split the {len(layers)} layers {policy.label()} compresses on {trace.path} "
                         f"(sliding={sliding!r}) into {n_groups!r} groups; use 1 to {len(layers)}")
    for b in budgets:
        _check_budget(trace, policy, b)
    inputs = inputs if inputs is not None else layer_inputs(trace)
    full = {int(b): allocation(trace, policy, b, inputs, layers) for b in budgets}
    return [LayerGroup(tuple(layers[j] for j in rows), {b: a[rows] for b, a in full.items()})
            for rows in np.array_split(np.arange(len(layers)), n_groups)]


def _concat_kept(blocks: Sequence[np.ndarray]) -> np.ndarray:
    """Kept-position blocks [n_i, ..., width_i] joined along the first axis, padded with -1 to the widest."""
    width = max(b.shape[-1] for b in blocks)
    out = np.full((sum(len(b) for b in blocks), *blocks[0].shape[1:-1], width), -1, np.int32)
    start = 0
    for b in blocks:
        out[start: start + len(b), ..., : b.shape[-1]] = b
        start += len(b)
    return out


def merge_layer_groups(trace: Trace, parts: Sequence[ReplayResult]) -> ReplayResult:
    """One configuration's result from its layer groups' results (any order), identical to the unsplit replay:
    layers in trace order, kept sets padded to the widest, and ``held_elsewhere`` recomputed for all of them (a
    group's own counts the other groups' layers as held in full, so summing the groups' would double-count)."""
    parts = sorted(parts, key=lambda r: int(r.layer_index[0]))
    layers = np.concatenate([r.layer_index for r in parts])
    expected = compressed_layers(trace, parts[0].sliding)
    if layers.tolist() != expected:
        raise ValueError(f"layer groups cover layers {layers.tolist()}, the configuration compresses {expected}")
    kept = None if parts[0].kept is None else _concat_kept([r.kept for r in parts])
    return replace(parts[0], trace=str(trace.path), layers=layers, kept=kept,
                   budgets=np.concatenate([r.budgets for r in parts]),
                   metrics=np.concatenate([r.metrics for r in parts]), slots=np.concatenate([r.slots for r in parts]),
                   held_elsewhere=held_elsewhere(trace, expected))


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
    """The step strategy: one engine replay per budget over the same prepared inputs."""
    inputs = inputs if inputs is not None else layer_inputs(trace)
    return [replay_step(trace, policy, b, inputs=inputs, record_kept=record_kept, threads=threads, sliding=sliding,
                        chunk=chunk, group=group) for b in budgets]


def replay_step(trace: Trace, policy: Policy, budget: int, *, inputs: list[LayerInputs] | None = None,
                record_kept: tuple[int, int] | None = None, threads: int | None = None,
                sliding: str = "keep", chunk: int = 1, group: LayerGroup | None = None) -> ReplayResult:
    """Stream ``trace`` through ``policy``'s kernels at ``budget``: policies with a prefill selector compress
    the prompt first, the others stream it through ``step``, ``chunk`` prompt tokens per step (chunked
    prefill: every token of a chunk attends causally over the cache plus its chunk-mates, the step sees their
    attention summed per slot, as a token-by-token run without evictions would accumulate it, then evicts to
    the budget; 1 is token by token, the prompt length is "compress once after the prompt"). A chunk never
    crosses into the decode steps, which stay one token each. With a ``group``, only its layers at its
    shipped budgets (``layer_groups``)."""
    _check_budget(trace, policy, budget)
    chunk = check_chunk(policy, chunk)
    meta = trace.meta
    inputs = inputs if inputs is not None else layer_inputs(trace)
    layers = compressed_layers(trace, sliding) if group is None else list(group.layers)
    T, P = meta.n_tokens, meta.n_prompt
    hkv = meta.model.n_kv_heads
    budgets = allocation(trace, policy, budget, inputs, layers) if group is None else group.budgets(budget)
    kernels = tuple((fn,) for fn in policy.kernels())
    n_steps = T - P
    rec_start, n_rec = record_kept if record_kept else (0, 0)
    n_rec = max(0, min(n_rec, T - rec_start))

    def run(j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        layer = layers[j]
        li = inputs[layer]
        b = budgets[j]
        cap = int(slot_capacity(policy, b, T, chunk).max())
        out = EngineOutputs(metrics=np.zeros((n_steps, meta.model.n_q_heads, N_METRICS), np.float64),
                            slots=np.zeros((n_steps, hkv), np.int32), kept=np.full((n_rec, hkv, cap), -1, np.int32),
                            info=np.zeros(3, np.int64))
        head_init = policy.replay_head_state(hkv, meta.model.head_dim, li, layer_memo(inputs, layer), n_prompt=P)
        cfg = EngineConfig(params=policy.param_vector(li.attention), layer=layer, scale=float(li.attention.scale),
                           has_prefill=policy.has_prefill, metric_start=P, budget=b,
                           head_adaptive=policy.head_adaptive, bounded=not policy.unbounded, cap=cap,
                           n_slot_fields=policy.slot_fields, head_init=np.ascontiguousarray(head_init, np.float64),
                           rec_start=rec_start, reads_attention=policy.reads_attention,
                           window=int(li.attention.window or 0), chunk=chunk)
        status = replay_layer(kernels, cfg, LayerData(li.q, li.k, li.v, li.lse, li.o, li.vmax1,
                                                      _whole_prompt_acc(inputs, li, layer, P, chunk, policy)), out)
        raise_on(policy, status, out.info, layer)
        return out.metrics, out.slots, out.kept

    n_threads = _threads(threads, len(layers))
    with blas_per_layer_thread(n_threads), ThreadPoolExecutor(n_threads) as pool:
        outs = list(pool.map(run, range(len(layers))))
    kept = _concat_kept([o[2][None] for o in outs]) if n_rec else None
    return ReplayResult(
        trace=str(trace.path), policy=policy.name, label=policy.label(), params=dict(policy.params),
        budget=int(budget), budgets=budgets, steps=np.arange(P, T), metrics=np.stack([o[0] for o in outs]),
        slots=np.stack([o[1] for o in outs]), head_dim=meta.model.head_dim, kept=kept,
        kept_steps=np.arange(rec_start, rec_start + n_rec) if n_rec else None,
        layers=np.asarray(layers, np.int64), held_elsewhere=held_elsewhere(trace, layers), sliding=sliding,
    )


def layer_memo(inputs: Sequence[LayerInputs], layer: int) -> dict | None:
    """The dict where policies keep trace-only tables of one layer (``Policy.replay_head_state``: CriticalKV's
    projected value norms), shared by every replay of these prepared inputs (``PreparedLayers.stats``), or None
    for a plain list of inputs (computed per replay)."""
    stats = getattr(inputs, "stats", None)
    return None if stats is None else stats.setdefault(("layer_memo", layer), {})


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


def _replay_oracle_policy(trace: Trace, policy: Policy, budgets: Sequence[int], *,
                          inputs: list[LayerInputs] | None = None, record_kept: tuple[int, int] | None = None,
                          threads: int | None = None, sliding: str = "keep", chunk: int = 1,
                          group: LayerGroup | None = None) -> list[ReplayResult]:
    """The oracle strategy: its ``scope`` parameter is read here, and only here (the oracle reads no prompt
    steps, so ``chunk`` changes nothing)."""
    return replay_oracle(trace, budgets, scope=policy.params["scope"], inputs=inputs, threads=threads,
                         label=policy.label(), record_kept=record_kept, sliding=sliding,
                         layers=None if group is None else group.layers)


def replay_oracle(trace: Trace, budgets: Sequence[int], *, scope: str = "head",
                  inputs: list[LayerInputs] | None = None, threads: int | None = None,
                  label: str = "oracle", record_kept: tuple[int, int] | None = None,
                  sliding: str = "keep", layers: Sequence[int] | None = None) -> list[ReplayResult]:
    """The oracle at several budgets from one pass over the full attention rows (a budget curve).

    ``record_kept=(start, n)`` records, for steps start..start+n-1, the positions the oracle attends at that
    step: the newest token plus the top-``budget`` past tokens of each KV head (``scope='layer'``: the top
    ``budget * Hkv`` across the layer's heads), ranked as ``sim.oracle.oracle_layer`` ranks them.
    ``layers``: only these of the compressed layers (a ``LayerGroup``'s: the oracle allocates nothing, so a
    group needs no other layer).
    """
    from policies.registry import get_policy

    oracle = get_policy("oracle", scope=scope)
    for b in budgets:
        _check_budget(trace, oracle, b)
    meta = trace.meta
    inputs = inputs if inputs is not None else layer_inputs(trace)
    layers = compressed_layers(trace, sliding) if layers is None else list(layers)
    T, P = meta.n_tokens, meta.n_prompt
    order = np.argsort(np.asarray(budgets, np.int64), kind="stable")
    sorted_b = np.ascontiguousarray(np.asarray(budgets, np.int64)[order])
    nb, hq, hkv = len(sorted_b), meta.model.n_q_heads, meta.model.n_kv_heads

    def run(layer: int) -> tuple[np.ndarray, np.ndarray]:
        li = inputs[layer]
        metrics = np.zeros((nb, T - P, hq, N_METRICS), np.float64)
        slots = np.zeros((nb, T - P, hkv), np.int32)
        oracle_layer(li.q, li.k, li.v, li.o, li.vmax1, float(li.attention.scale), sorted_b, P,
                     scope == "layer", int(li.attention.window or 0), metrics, slots)
        return metrics, slots

    n_threads = _threads(threads, len(layers))
    with blas_per_layer_thread(n_threads), ThreadPoolExecutor(n_threads) as pool:
        outs = list(pool.map(run, layers))
    rec_start, n_rec = record_kept if record_kept else (0, 0)
    n_rec = max(0, min(n_rec, T - rec_start))
    results: list[ReplayResult] = [None] * nb  # type: ignore[list-item]
    for j, b in enumerate(sorted_b):
        kept = None
        if n_rec:
            kept = np.stack([oracle_kept(inputs[i], int(b), rec_start, n_rec, scope == "layer") for i in layers])
        results[int(order[j])] = ReplayResult(
            trace=str(trace.path), policy="oracle", label=label, params={"scope": scope}, budget=int(b),
            budgets=np.full((len(layers), hkv), int(b), np.int64), steps=np.arange(P, T),
            metrics=np.stack([o[0][j] for o in outs]), slots=np.stack([o[1][j] for o in outs]),
            head_dim=meta.model.head_dim, kept=kept,
            kept_steps=np.arange(rec_start, rec_start + n_rec) if n_rec else None,
            layers=np.asarray(layers, np.int64), held_elsewhere=held_elsewhere(trace, layers), sliding=sliding)
    return results


def oracle_kept(li: LayerInputs, budget: int, start: int, n: int, layer_scope: bool) -> np.ndarray:
    """Positions the oracle attends at steps start..start+n-1 of one layer: [n, Hkv, width], -1 padded,
    ascending per head (the layout of ``ReplayResult.kept``); width = min(T, budget [* Hkv]) + 1.

    The ranking is the one ``oracle_layer`` uses: the float64 full-attention probability (of the layer's own,
    possibly windowed, attention) summed over a KV head's query heads, descending, ties to the older token
    (then the lower head, with ``layer_scope``).
    """
    scale, window = float(li.attention.scale), li.attention.window
    T, hq, _ = li.q.shape
    hkv = li.k.shape[1]
    g = hq // hkv
    width = min(T, budget * hkv if layer_scope else budget) + 1
    out = np.full((n, hkv, width), -1, np.int32)
    k64 = li.k.astype(np.float64)
    for r in range(n):
        t = start + r
        if t == 0:
            out[r, :, 0] = 0
            continue
        q = li.q[t].astype(np.float64).reshape(hkv, g, -1)
        logits = np.einsum("hgd,ihd->hgi", q, k64[: t + 1]) * scale
        if window:
            logits[:, :, : max(0, t + 1 - window)] = -np.inf
        p = np.exp(logits - logits.max(axis=2, keepdims=True))
        p /= p.sum(axis=2, keepdims=True)
        mass = p[:, :, :t].sum(axis=1)                                     # [Hkv, t] past tokens
        if layer_scope:
            top = np.argsort(-mass.reshape(-1), kind="stable")[: min(budget * hkv, hkv * t)]
            heads, pos = np.divmod(top, t)
        else:
            top = np.argsort(-mass, axis=1, kind="stable")[:, : min(budget, t)]
            heads, pos = np.repeat(np.arange(hkv), top.shape[1]), top.reshape(-1)
        for h in range(hkv):
            mine = np.sort(np.append(pos[heads == h], t))
            out[r, h, : mine.size] = mine
    return out


#: replay strategies by name (``Policy.replay_strategy``)
STRATEGIES: dict[str, ReplayStrategy] = {
    "step": ReplayStrategy("step", _replay_steps),
    "oracle": ReplayStrategy("oracle", _replay_oracle_policy, one_pass=True),
}
