"""``kvsim synth``: write a synthetic trace with a known attention structure to disk."""
from __future__ import annotations

import argparse

from sim.commands._common import add_out_option, add_synthetic_size_args, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    from traces.synthetic import KINDS

    p = sub.add_parser("synth", help="generate a synthetic trace directory",
                       description="Generate a trace whose attention has a known structure (sinks, Zipf heavy "
                                   "hitters, local windows, periodic recall, topic shifts, adversarial, passkey).")
    p.add_argument("kind", choices=KINDS, help="attention structure of the generated trace")
    add_out_option(p, None, "output trace directory (must not exist)")
    add_synthetic_size_args(p)
    p.add_argument("--q-heads", type=positive_int, default=4, help="query heads per layer")
    p.add_argument("--kv-heads", type=positive_int, default=2, help="number of KV heads per layer")
    p.add_argument("--head-dim", type=positive_int, default=32, help="head dimension")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="storage dtype of q/k/v")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from traces.synthetic import make_synthetic_trace

    tr = make_synthetic_trace(args.kind, n_tokens=args.tokens, n_prompt=args.prompt, n_layers=args.layers,
                              n_q_heads=args.q_heads, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
                              seed=args.seed, dtype=args.dtype)
    print(f"wrote {tr.save(args.out)}")
    return 0
