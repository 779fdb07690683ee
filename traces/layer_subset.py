"""A subset of a trace's layers as a trace of its own: evaluate a long recorded trace on a few layers.

Each kept layer keeps its arrays and its attention (a hybrid model's sliding-window layer stays sliding, so the
replay compresses the same layers it would on the whole trace); the layer ids are the original ones. The subset is
recorded in ``meta.source["layers_evaluated"]``, so it is part of the trace's identity
(`sim.experiments.specs.trace_id`): results of two subsets never share a store key.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from traces.format import InMemoryTrace, Trace, TraceError


def select_layers(trace: Trace, layers: Sequence[int]) -> InMemoryTrace:
    """The layers ``layers`` (original layer ids, in the order given) of ``trace`` as an in-memory trace whose
    arrays are the trace's own (a memory-mapped trace stays mapped). Unknown ids are a `TraceError` naming them."""
    ids = list(trace.meta.model.layer_ids)
    wanted = [int(x) for x in layers]
    missing = [w for w in wanted if w not in ids]
    if missing or not wanted:
        raise TraceError(f"layers {missing or wanted} not in the trace {trace.path} (it has layers {ids})")
    attn = trace.meta.model.attention
    model = dataclasses.replace(trace.meta.model, layer_ids=tuple(wanted),
                                attention=tuple(attn[ids.index(w)] for w in wanted))
    meta = dataclasses.replace(trace.meta, model=model, source={**trace.meta.source, "layers_evaluated": wanted})
    return InMemoryTrace(meta, [trace.layer(ids.index(w)) for w in wanted], trace.tokens)
