"""``kvsim export --kvpress``: a policy spec out as the NVIDIA kvpress press that keeps the same tokens.

The press comes from the policy's own declaration (``Policy.kvpress_press``, ``policies/core/kvpress_press.py``),
checked by ``benchmarks/kvpress_parity.py`` inside kvpress; a policy kvpress cannot express is refused with the reason
(exit status 2). Needs neither kvpress nor a model: it prints Python to run where kvpress is installed.
"""
from __future__ import annotations

import argparse

from sim.commands._common import positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="print the kvpress press that keeps the same tokens as a kvsim policy",
        description="Print the Python that builds NVIDIA kvpress's press (and compression ratio) whose kept sets of a "
                    "prompt compressed once after its prefill equal kvsim's policy at --budget slots per KV head "
                    "(kvpress keeps every token generated after it; kvsim's policy holds its budget while decoding). "
                    "A policy kvpress cannot express is refused with the reason.")
    p.add_argument("--kvpress", required=True, metavar="SPEC",
                   help="the kvsim policy spec to export, e.g. 'snapkv:pooling=avg,window_size=64,kernel_size=5'")
    p.add_argument("--budget", type=positive_int, required=True, help="slots per KV head and layer")
    p.add_argument("--prompt-tokens", type=positive_int, required=True,
                   help="the prompt's length in tokens (kvpress's compression ratio is a share of it)")
    p.add_argument("--json", action="store_true", help="print the export as JSON (press spec, ratio, Python)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from policies.core.kvpress_press import export
    from sim.experiments.specs import parse_policy

    out = export(parse_policy(args.kvpress), args.budget, args.prompt_tokens, spec=args.kvpress)
    print(json.dumps(out.to_json(), indent=1) if args.json else out.python())
    return 0
