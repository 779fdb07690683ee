"""``kvsim sweep``: policies x hyperparameter grids x budgets x traces into a resumable Parquet store."""
from __future__ import annotations

import argparse
from pathlib import Path

from sim.commands._common import add_trace_args, int_list, trace_refs


def register(sub: argparse._SubParsersAction) -> None:
    from sim.executors import default_workers

    p = sub.add_parser("sweep", help="replay policies x grids x budgets x traces into a Parquet store (resumable)",
                       description="Evaluate every (trace, policy, params, budget) configuration not already in "
                                   "the store, on local worker processes or a Ray cluster. Interrupt at any time: "
                                   "finished rows are kept and skipped next time.")
    add_trace_args(p, many=True)
    p.add_argument("--policies", default="all",
                   help="';'-separated policy specs with '|' alternatives, e.g. "
                        "'h2o:recent_ratio=0.1|0.25|0.5;tova;oracle' (default: all, paper defaults)")
    p.add_argument("--budgets", type=int_list, default=None, help="comma-separated budgets (default: powers of 2)")
    p.add_argument("--out", type=Path, default=Path("kvsim-out/results"), help="results store directory")
    p.add_argument("--workers", type=int, default=default_workers(), help="local worker processes (default: cores)")
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run on Ray: a cluster address (ray://host:10001, auto) or 'local' (needs kvsim[ray])")
    p.add_argument("--plot", type=Path, default=None, help="also write loss-vs-budget curves to this PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sim.report import default_budgets, plot_budget_curves, print_ranked
    from sim.store import ResultStore
    from sim.sweep import parse_policy_list, run_sweep, with_oracle_gap

    refs = trace_refs(args)
    budgets = args.budgets or default_budgets(min(r.open()[0].meta.n_tokens for r in refs))
    df = run_sweep(refs, parse_policy_list(args.policies), budgets, ResultStore(args.out), workers=args.workers,
                   ray_address=args.ray, progress=not args.quiet)
    df = with_oracle_gap(df[df.budget.isin(budgets)])
    print_ranked(df)
    print(f"results: {args.out} ({len(df)} rows for these budgets)")
    if args.plot:
        print(f"plot: {plot_budget_curves(df, args.plot)}")
    return 0
