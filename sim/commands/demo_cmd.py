"""``kvsim demo``: record (or generate) a default trace, replay every policy at several budgets, show the ranking."""
from __future__ import annotations

import argparse
from pathlib import Path

from sim.commands._common import add_budgets_option, add_out_option, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="replay all policies on the default trace; print a ranked table and a plot",
                       description="Record a trace from the shipped real model on real text (or generate a "
                                   "synthetic one), replay every registered policy at several budgets, print "
                                   "the ranked table and write a loss-vs-budget plot.")
    p.add_argument("--synthetic", metavar="KIND", default=None,
                   help="use a synthetic trace of this kind instead of the shipped model (e.g. mixed)")
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens in the demo trace")
    p.add_argument("--prompt", type=positive_int, default=512, help="prompt tokens of the demo trace")
    add_budgets_option(p, default=[32, 64, 128, 256])
    add_out_option(p, "kvsim-out", "output directory")
    p.set_defaults(func=run)


def demo_trace(args: argparse.Namespace):
    """The demo's trace: the shipped model on the shipped text (recorded once, then reused), or synthetic."""
    from sim.executors import TraceRef
    from traces.format import TraceError, load_trace

    if args.synthetic:
        return TraceRef(f"synthetic:{args.synthetic}", args.tokens, args.prompt, 2)
    from traces.model import record_default_trace

    path = args.out / f"demo-trace-{args.prompt}-{args.tokens - args.prompt}"
    try:
        load_trace(path)
    except TraceError:
        print(f"recording the demo trace from the shipped model into {path} ...")
        record_default_trace(path, n_prompt=args.prompt, n_decode=args.tokens - args.prompt)
    return TraceRef(str(path))


def run(args: argparse.Namespace) -> int:
    from policies import get_policy, list_policies
    from sim.report import plot_budget_curves, print_ranked, write_html
    from sim.store import ResultStore
    from sim.sweep import run_sweep, with_oracle_gap

    from sim.executors import default_workers
    from sim.specs import trace_id

    args.out.mkdir(parents=True, exist_ok=True)
    ref = demo_trace(args)
    trace = ref.open()[0]
    print(repr(trace))
    policies = [get_policy(n) for n in list_policies()]
    df = run_sweep([ref], policies, args.budgets, ResultStore(args.out / "demo-results"), workers=default_workers())
    df = with_oracle_gap(df[(df.trace_id == trace_id(trace)) & df.budget.isin(args.budgets)])
    print_ranked(df, title="kvsim demo")
    png = plot_budget_curves(df, args.out / "demo.png")
    html = write_html(df, args.out / "demo.html")
    print(f"plot: {png}\ntable: {html}\nresults store: {args.out / 'demo-results'} (rerun to resume/extend)")
    return 0
