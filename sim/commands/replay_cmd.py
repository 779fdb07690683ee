"""``kvsim replay``: replay one policy on one trace at one budget and show its metrics."""
from __future__ import annotations

import argparse
import json

from sim.commands._common import add_budget_option, add_policy_option, add_trace_args, load


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay one policy on a trace at a budget",
                       description="Replay a policy over a trace and report retained attention mass, attention-"
                                   "output error, KL, the Ada-KV L1 bound and memory held.")
    add_trace_args(p)
    add_policy_option(p)
    add_budget_option(p)
    p.add_argument("--per-head", action="store_true", help="also print metrics per layer and query head")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from sim.replay import replay
    from sim.specs import parse_policy

    trace = load(args, args.trace)
    policy = parse_policy(args.policy)
    res = replay(trace, policy, args.budget, sliding=args.sliding, chunk=args.chunk)
    summary = res.summary()
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    table = Table(title=f"{policy.label()} @ budget {args.budget} on {summary['trace']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in summary.items():
        if k not in ("trace", "policy", "label", "budget"):
            table.add_row(k, f"{v:.5g}" if isinstance(v, float) else str(v))
    console = Console()
    console.print(table)
    if args.per_head:
        console.print(res.per_head().to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    return 0
