"""``kvsim inspect``: validate a trace directory and describe it."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="validate a trace (checksums, shapes, NaN) and describe it",
                       description="Load a trace with full verification and print its model geometry and sizes.")
    p.add_argument("trace", help="trace directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from traces.format import load_trace

    tr = load_trace(args.trace, verify=True)
    print(repr(tr))
    model = tr.meta.to_json()["model"]
    model.pop("attention")        # shown grouped below
    print(json.dumps({"model": model, "dtype": tr.meta.dtype, "kind": tr.meta.kind,
                      "softmax_scale": tr.meta.softmax_scale, "has_reference": tr.has_reference,
                      "source": tr.meta.source}, indent=1, default=str))
    print("layers (model layer: attention):")
    for group in layer_groups(tr):
        print(f"  {group}")
    print("verified: checksums match, shapes and dtypes as declared, all values finite")
    return 0


def layer_groups(trace) -> list[str]:
    """One line per kind of attention among the stored layers: ``5, 11, 17: global, RoPE 1e+06, scale 0.0625``."""
    groups: dict[str, list[int]] = {}
    for i, layer in enumerate(trace.meta.model.layer_ids):
        a = trace.meta.attention(i)
        groups.setdefault(f"{a.describe()}, scale {a.scale:.4g}", []).append(layer)
    return [f"{', '.join(map(str, ids))}: {what}" for what, ids in groups.items()]
