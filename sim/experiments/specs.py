"""Text specs for policies and traces on the command line, e.g. ``h2o:recent_ratio=0.3`` or ``synthetic:zipf``."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from policies import Policy, PolicyError, get_policy, list_policies
from policies.core.combinators import policy_spec  # noqa: F401  (re-exported: the inverse of parse_policy)
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


def policy_parts(spec: str) -> tuple[str, dict[str, Any]]:
    """``spec`` -> (registry name, params), combinators flattened: ``ada(knorm:n_sink=4, floor_alpha=0.2)`` ->
    (``ada(knorm)``, {n_sink: 4, floor_alpha: 0.2})."""
    spec = spec.strip()
    head, paren, rest = spec.partition("(")
    if paren and ":" not in head:
        if not rest.rstrip().endswith(")"):
            raise PolicyError(f"policy spec {spec!r}: unbalanced parentheses; expected wrapper(INNER[, k=v ...])")
        inner, *items = _split_top(rest.rstrip()[:-1])
        inner_name, params = policy_parts(inner)
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
    name, params = policy_parts(spec)
    return get_policy(name, **params)


def split_policy_list(text: str) -> list[str]:
    """Split a policy LIST at its top-level ``;`` (never inside parentheses) into single policy specs.

    ``"h2o:recent_ratio=0.3,group_reduce=max;decoding(snapkv:window_size=64, every=64)"`` gives two specs;
    unbalanced parentheses are an error. Empty items are dropped.
    """
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise PolicyError(f"policy list {text!r}: ')' at character {i + 1} closes nothing")
        elif ch == ";" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise PolicyError(f"policy list {text!r}: {depth} unclosed '('")
    parts.append(text[start:])
    return [s.strip() for s in parts if s.strip()]


def parse_policy_list(text: str, *, exclude: tuple[str, ...] = ()) -> list[Policy]:
    """A ``;``-separated list of full policy specs -> policies (duplicates removed, order kept).

    ``all`` (alone, or as one item) stands for every registered policy at its paper defaults, except the
    names in ``exclude``.
    """
    seen: dict[str, Policy] = {}
    for spec in split_policy_list(text):
        pols = ([get_policy(n) for n in list_policies() if n not in exclude] if spec == "all"
                else [parse_policy(spec)])
        for pol in pols:
            seen.setdefault(pol.label(), pol)
    if not seen:
        raise PolicyError(f"no policy in {text!r}")
    return list(seen.values())


#: the exact prefix that asks for a trace generated in memory
SYNTHETIC_PREFIX = "synthetic:"


def open_trace(spec: str, *, n_tokens: int = 1024, n_prompt: int = 128, n_layers: int = 2, seed: int = 0,
               verify: bool = True) -> Trace:
    """A trace directory, or ``synthetic:KIND`` generated in memory with the given size.

    An existing path always wins (a directory may well be called ``synthetic_zipf_run``). Only a spec
    starting with exactly ``synthetic:`` names a generated trace; a missing path that merely starts with
    ``synthetic`` is ambiguous and refused with an error that says so.
    """
    path = Path(spec)
    if path.exists():
        return load_trace(path, verify=verify)
    if spec.startswith(SYNTHETIC_PREFIX):
        kind = spec[len(SYNTHETIC_PREFIX):]
        if kind not in KINDS:
            raise ValueError(f"unknown synthetic kind {kind!r}; choose from {', '.join(KINDS)}")
        return make_synthetic_trace(kind, n_tokens=n_tokens, n_prompt=n_prompt, n_layers=n_layers, seed=seed)
    if spec.lower().startswith("synthetic"):
        raise ValueError(f"ambiguous trace {spec!r}: no such trace directory exists, and a generated trace is "
                         f"written {SYNTHETIC_PREFIX}KIND (KIND one of {', '.join(KINDS)})")
    return load_trace(path, verify=verify)


def trace_id(trace: Trace) -> str:
    """A stable identity of a trace's content: its metadata plus array checksums (or generator parameters)."""
    payload = {"meta": trace.meta.to_json(), "arrays": getattr(trace, "_entries", {})}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def trace_name(trace: Trace) -> str:
    """Short human name of a trace for tables and plots."""
    if str(trace.path) == "<memory>":
        return f"synthetic:{trace.meta.source.get('kind', '?')}"
    return Path(trace.path).name
