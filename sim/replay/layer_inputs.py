"""Engine inputs of a trace's layers: float32 q, k, v, the reference (lse, o) and the v-norm maxima per layer
(`LayerInputs`), prepared once for many replays (`load_layers`), or read a layer at a time for a trace too large
to hold whole (`LayerLoader`; `layer_inputs` picks between them by `EAGER_INPUT_BYTES`), and the prompt view a
policy's allocator reads (`PromptLayers`).

Preparing the inputs is the trace-only part of a replay: every policy and budget replayed on the same prepared
layers shares them, and the tables policies derive from them (`PreparedLayers.stats`, `layer_memo`).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from policies.core.errors import PolicyError
from sim.replay.trace_tables import table_memo
from traces.format import LayerArrays, LayerAttention, ModelInfo, Trace
from traces.reference import full_attention_reference


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


class PreparedLayers(list):
    """Engine inputs prepared once for several replays, plus ``stats``: prompt statistics allocators computed on
    them (``policies.core.base.prompt_memo``), shared by every replay that uses these inputs. ``trace``: the trace
    whose every layer they are, in order (None for a subset), whose trace-only tables are also kept on disk
    (``layer_memo``)."""

    def __init__(self, items=(), trace: Trace | None = None) -> None:
        super().__init__(items)
        self.stats: dict = {}
        self.trace = trace


def load_layers(trace: Trace, layers: Sequence[int] | None = None) -> PreparedLayers:
    """Prepare the engine inputs of the chosen layers (all by default) once, for several replays."""
    idx = range(trace.n_layers) if layers is None else layers
    return PreparedLayers((LayerInputs.from_arrays(trace.layer(i), trace.meta.attention(i)) for i in idx),
                          trace if layers is None else None)


class LayerLoader(Sequence):
    """The engine inputs of every layer of a trace, each prepared from the memory-mapped files when asked for
    and not kept: a long trace's replay holds one layer per replay thread, not the whole trace (Gemma-3 at 32 k
    tokens: 0.34 GB per layer instead of 6 GB). ``load_layers`` is the eager list for many replays of a short
    trace."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.stats: dict = {}
        #: the layers some caller still holds: asked for again meanwhile (a replay's head state and its engine run,
        #: cells of one layer on other threads), the same copy, not another (0.34 GB a Gemma-3 layer at 32 k)
        self._held: weakref.WeakValueDictionary[int, LayerInputs] = weakref.WeakValueDictionary()

    def __len__(self) -> int:
        return self.trace.n_layers

    def __getitem__(self, i: int) -> LayerInputs:   # type: ignore[override]
        li = self._held.get(i)
        if li is None:
            li = LayerInputs.from_arrays(self.trace.layer(i), self.trace.meta.attention(i))
            self._held[i] = li
        return li


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
        self.cache = None if stats is None else _stats_memo(stats, (tuple(self.layers), n_prompt), trace,
                                                             self.layers, n_prompt)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, j: int) -> tuple[np.ndarray, np.ndarray]:   # type: ignore[override]
        i, P = self.layers[j], self.P
        if isinstance(self.inputs, LayerLoader):
            la = self.trace.layer(i)
            return np.array(la.q[:P], np.float32), np.array(la.k[:P], np.float32)
        return self.inputs[i].q[:P], self.inputs[i].k[:P]

    def rope_theta(self, j: int) -> float | None:
        """Layer j's RoPE base as the trace recorded it (None where the trace has no plain base)."""
        return self.trace.meta.attention(self.layers[j]).rope_theta

    def reconstruction(self, j: int, chunk_size: int) -> tuple:
        """Layer j's context-reconstruction pass as the trace recorded it (``Trace.reconstruction``; a synthetic
        trace's own, in chunks of ``chunk_size``): (plan, recon_q, recon_k, prompt keys, softmax scale)."""
        i = self.layers[j]
        plan, recon_q, recon_k = self.trace.reconstruction(i, chunk_size)
        return plan, recon_q, recon_k, self[j][1], float(self.trace.meta.attention(i).scale)

    def reconstruction_extras(self, j: int, chunk_size: int) -> tuple:
        """What KVzip+ reads beside the pass (``policies.kvzip_plus``): layer j's repeat tokens' hidden-state norms
        [R] as the trace recorded them, the prompt's values [P, Hkv, d] and the layer's W_O [hidden, Hq * d]."""
        i, P = self.layers[j], self.P
        if not self.trace.has_wo:
            raise PolicyError("KVzip+ needs the layers' output projection W_O, which this trace does not hold: "
                              "record it again with `kvsim record --kvzip`")
        norms = self.trace.reconstruction_hidden_norms(i)
        la = self.trace.layer(i)
        return np.asarray(norms, np.float32), np.asarray(la.v[:P], np.float32), np.asarray(la.wo, np.float32)


def layer_memo(inputs: Sequence[LayerInputs], layer: int) -> dict | None:
    """The dict where policies keep trace-only tables of one layer (``Policy.replay_head_state``: CriticalKV's
    projected value norms, the prompt attention BUZZ and BumbleBee read), shared by every replay of these prepared
    inputs (``PreparedLayers.stats``) and, for a recorded trace, by later processes through the disk
    (``sim.replay.trace_tables.table_memo``); None for a plain list of inputs (computed per replay)."""
    stats = getattr(inputs, "stats", None)
    if stats is None:
        return None
    trace = getattr(inputs, "trace", None)
    return _stats_memo(stats, ("layer_memo", layer), trace, [layer], trace.meta.n_prompt if trace else 0)


def _stats_memo(stats: dict, key: tuple, trace: Trace | None, layers: Sequence[int], n_prompt: int) -> dict:
    """``stats[key]``, created on first use as the ``sim.replay.trace_tables.table_memo`` of ``layers`` of ``trace`` (on
    disk for a recorded trace, so later processes share it too)."""
    memo = stats.get(key)
    if memo is None:
        memo = stats[key] = table_memo(trace, layers, n_prompt)
    return memo
