"""Attention traces: the on-disk format, loaders, synthetic generators and recorders.

The names below are imported when first used (PEP 562), so that ``import traces.texts`` (the CLI's help) does not
import numpy.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["InMemoryTrace", "LayerArrays", "ModelInfo", "Trace", "TraceError", "TraceMeta", "TraceWriter",
           "load_trace", "write_trace"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'traces' has no attribute {name!r}")
    value = getattr(importlib.import_module("traces.format"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
