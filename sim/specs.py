"""Text specs for policies and traces on the command line, e.g. ``h2o:recent_ratio=0.3`` or ``synthetic:zipf``."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from policies import Policy, PolicyError, get_policy
from traces.format import Trace, load_trace
from traces.synthetic import KINDS, make_synthetic_trace


def parse_policy(spec: str) -> Policy:
    """``name`` or ``name:param=value,param=value`` -> a validated policy."""
    name, _, rest = spec.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise PolicyError(f"policy spec {spec!r}: expected param=value, got {item!r}")
        params[key.strip()] = value.strip()
    return get_policy(name.strip(), **params)


def open_trace(spec: str, *, n_tokens: int = 1024, n_prompt: int = 128, n_layers: int = 2, seed: int = 0,
               verify: bool = True) -> Trace:
    """A trace directory, or ``synthetic:KIND`` generated in memory with the given size."""
    if spec.startswith("synthetic"):
        kind = spec.partition(":")[2] or "mixed"
        if kind not in KINDS:
            raise ValueError(f"unknown synthetic kind {kind!r}; choose from {', '.join(KINDS)}")
        return make_synthetic_trace(kind, n_tokens=n_tokens, n_prompt=n_prompt, n_layers=n_layers, seed=seed)
    return load_trace(Path(spec), verify=verify)


def trace_id(trace: Trace) -> str:
    """A stable identity of a trace's content: its metadata plus array checksums (or generator parameters)."""
    payload = {"meta": trace.meta.to_json(), "arrays": getattr(trace, "_entries", {})}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def trace_name(trace: Trace) -> str:
    """Short human name of a trace for tables and plots."""
    if str(trace.path) == "<memory>":
        return f"synthetic:{trace.meta.source.get('kind', '?')}"
    return Path(trace.path).name
