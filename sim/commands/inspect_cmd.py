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
    print(json.dumps({"model": tr.meta.to_json()["model"], "dtype": tr.meta.dtype, "kind": tr.meta.kind,
                      "softmax_scale": tr.meta.softmax_scale, "has_reference": tr.has_reference,
                      "source": tr.meta.source}, indent=1, default=str))
    print("verified: checksums match, shapes and dtypes as declared, all values finite")
    return 0
