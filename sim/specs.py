"""Text specs for policies and traces on the command line, e.g. ``h2o:recent_ratio=0.3`` or ``synthetic:zipf``."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from policies import Policy, PolicyError, get_policy
from policies.combinators import policy_spec  # noqa: F401  (re-exported: the inverse of parse_policy)
from traces.format import Trace, load_trace
from traces.synthetic import KINDS, make_synthetic_trace


def _split_top(text: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if depth < 0:
            raise PolicyError(f"policy spec {text!r}: unbalanced parentheses")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise PolicyError(f"policy spec {text!r}: unbalanced parentheses")
    return parts + ["".join(cur)]


def _kv(spec: str, items: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in items)):
        key, eq, value = item.partition("=")
        if not eq:
            raise PolicyError(f"policy spec {spec!r}: expected param=value, got {item!r}")
        params[key.strip()] = value.strip()
    return params


def _parse(spec: str) -> tuple[str, dict[str, Any]]:
    """``spec`` -> (registry name, params), combinators flattened: ``ada(knorm:n_sink=4, floor_alpha=0.2)`` ->
    (``ada(knorm)``, {n_sink: 4, floor_alpha: 0.2})."""
    spec = spec.strip()
    head, paren, rest = spec.partition("(")
    if paren and ":" not in head:
        if not rest.rstrip().endswith(")"):
            raise PolicyError(f"policy spec {spec!r}: unbalanced parentheses; expected wrapper(INNER[, k=v ...])")
        inner, *items = _split_top(rest.rstrip()[:-1])
        inner_name, params = _parse(inner)
        own = _kv(spec, items)
        both = sorted(set(own) & set(params))
        if both:
            raise PolicyError(f"policy spec {spec!r}: parameter(s) {both} given twice")
        return f"{head.strip()}({inner_name})", {**params, **own}
    name, _, rest = spec.partition(":")
    return name.strip(), _kv(spec, rest.split(","))


def parse_policy(spec: str) -> Policy:
    """One policy spec -> a validated policy: ``name``, ``name:param=value,...`` or a combinator
    ``wrapper(INNER[, param=value ...])`` such as ``ada(knorm)`` or
    ``decoding(snapkv:window_size=64, every=64, target=128)``. A combinator's policy carries the inner
    scorer's parameters and its own; ``policy_spec`` writes the spec back."""
    name, params = _parse(spec)
    return get_policy(name, **params)


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
