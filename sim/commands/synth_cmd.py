"""``kvsim synth``: write a synthetic trace with a known attention structure to disk."""
from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from traces.synthetic import KINDS

    p = sub.add_parser("synth", help="generate a synthetic trace directory",
                       description="Generate a trace whose attention has a known structure (sinks, Zipf heavy "
                                   "hitters, local windows, periodic recall, topic shifts, adversarial, passkey).")
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--out", type=Path, required=True, help="output trace directory (must not exist)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--q-heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from traces.synthetic import make_synthetic_trace

    tr = make_synthetic_trace(args.kind, n_tokens=args.tokens, n_prompt=args.prompt, n_layers=args.layers,
                              n_q_heads=args.q_heads, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
                              seed=args.seed, dtype=args.dtype)
    print(f"wrote {tr.save(args.out)}")
    return 0
