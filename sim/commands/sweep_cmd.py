"""``kvsim sweep``: policies x budgets x traces into a resumable Parquet results store."""
from __future__ import annotations

import argparse
from pathlib import Path

from sim.commands._common import add_trace_args, int_list, load


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="replay policies x budgets x traces into a Parquet store (resumable)",
                       description="Evaluate every (trace, policy, budget) configuration not already in the "
                                   "store. Interrupt at any time: finished rows are kept and skipped next time.")
    add_trace_args(p, many=True)
    p.add_argument("--policies", default="all",
                   help="';'-separated policy specs, or 'all' (default), e.g. 'h2o;tova;streaming_llm:n_sinks=8'")
    p.add_argument("--budgets", type=int_list, default=None, help="comma-separated budgets (default: powers of 2)")
    p.add_argument("--out", type=Path, default=Path("kvsim-out/results"), help="results store directory")
    p.add_argument("--plot", type=Path, default=None, help="also write loss-vs-budget curves to this PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def parse_policies(text: str):
    from policies import get_policy, list_policies
    from sim.specs import parse_policy

    if text == "all":
        return [get_policy(n) for n in list_policies()]
    return [parse_policy(s) for s in text.split(";") if s.strip()]


def run(args: argparse.Namespace) -> int:
    from sim.report import default_budgets, plot_budget_curves, print_ranked
    from sim.store import ResultStore
    from sim.sweep import run_sweep, with_oracle_gap

    traces = [load(args, spec) for spec in args.traces]
    budgets = args.budgets or default_budgets(min(t.meta.n_tokens for t in traces))
    df = run_sweep(traces, parse_policies(args.policies), budgets, ResultStore(args.out), progress=not args.quiet)
    df = with_oracle_gap(df)
    print_ranked(df[df.budget.isin(budgets)])
    print(f"results: {args.out} ({len(df)} rows)")
    if args.plot:
        print(f"plot: {plot_budget_curves(df[df.budget.isin(budgets)], args.plot)}")
    return 0
