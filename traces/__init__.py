"""Attention traces: the on-disk format, loaders, synthetic generators and recorders.

The names below are imported when first used (PEP 562), so that ``import traces.texts`` (the CLI's help) does not
import numpy.
"""
from __future__ import annotations

from traces.lazy_exports import lazy_exports

__all__ = ["InMemoryTrace", "LayerArrays", "ModelInfo", "Trace", "TraceError", "TraceMeta", "TraceWriter",
           "load_trace", "write_trace"]
__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(__all__, "traces.format"))
