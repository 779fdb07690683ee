"""``kvsim replay``: replay one policy on one trace at one budget and show its metrics."""
from __future__ import annotations

import argparse
import json

from sim.commands._common import (add_budget_option, add_executor_options, add_policy_option, add_split_option,
                                  add_trace_args, load, trace_ref)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay one policy on a trace at a budget",
                       description="Replay a policy over a trace and report retained attention mass, attention-"
                                   "output error, KL, the Ada-KV L1 bound and memory held.")
    add_trace_args(p)
    add_policy_option(p)
    add_budget_option(p)
    add_executor_options(p)
    add_split_option(p, extra=" (unless N > 1 or --ray is given, the replay runs in this process, its layers on "
                              "--threads threads; otherwise on at most N local workers)")
    p.add_argument("--per-head", action="store_true", help="also print metrics per layer and query head")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from sim.experiments.executors import replay_split
    from sim.replay.policy_replay import replay
    from sim.experiments.specs import parse_policy

    policy = parse_policy(args.policy)
    if args.split_layers > 1 or args.ray:
        res = replay_split(trace_ref(args, args.trace), policy, args.budget, args.split_layers, workers=args.workers,
                           ray_address=args.ray, threads=args.threads)
    else:
        res = replay(load(args, args.trace), policy, args.budget, sliding=args.sliding, chunk=args.chunk,
                     threads=args.threads)
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
