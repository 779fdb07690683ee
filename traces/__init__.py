"""Attention traces: the on-disk format, loaders, synthetic generators and recorders."""
from traces.format import (InMemoryTrace, LayerArrays, ModelInfo, Trace, TraceError, TraceMeta, TraceWriter,
                           load_trace, write_trace)

__all__ = ["InMemoryTrace", "LayerArrays", "ModelInfo", "Trace", "TraceError", "TraceMeta", "TraceWriter",
           "load_trace", "write_trace"]
