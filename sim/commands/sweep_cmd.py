"""``kvsim sweep``: policies x hyperparameter grids x budgets x traces into a resumable Parquet store."""
from __future__ import annotations

import argparse
from pathlib import Path

from sim.commands._common import (add_budgets_option, add_executor_options, add_out_option, add_policies_option,
                                  add_quiet_option, add_split_option, add_trace_args, trace_refs)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="replay policies x grids x budgets x traces into a Parquet store (resumable)",
                       description="Evaluate every (trace, policy, params, budget) configuration not already in "
                                   "the store, on local worker processes or a Ray cluster. Interrupt at any time: "
                                   "finished rows are kept and skipped next time.")
    add_trace_args(p, many=True)
    add_policies_option(p, default="all", extra="; in a NAME:param=value spec, '|' gives a grid of alternatives, "
                                              "e.g. 'h2o:recent_ratio=0.1|0.25|0.5;tova;oracle'")
    add_budgets_option(p, extra=" (default: powers of 2 up to the shortest trace)")
    add_out_option(p, "kvsim-out/results", "results store directory")
    add_executor_options(p)
    add_split_option(p)
    p.add_argument("--plot", type=Path, default=None, help="also write loss-vs-budget curves to this PNG")
    add_quiet_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sim.reports.report import default_budgets, plot_budget_curves, print_ranked, split_sliding
    from sim.reports.runinfo import save_ref_facts
    from sim.experiments.store import ResultStore
    from sim.experiments.sweep import implicit_labels, parse_policy_grid, run_sweep, with_oracle_gap

    refs = trace_refs(args)
    budgets = args.budgets or default_budgets(min(r.open()[0].meta.n_tokens for r in refs))
    store = ResultStore(args.out)
    for ref in refs:
        save_ref_facts(store.root, ref)              # what `kvsim report` says about each trace
    df = run_sweep(refs, parse_policy_grid(args.policies), budgets, store, workers=args.workers,
                   ray_address=args.ray, threads=args.threads, split_layers=args.split_layers,
                   progress=not args.quiet, optional=implicit_labels(args.policies))
    df = split_sliding(with_oracle_gap(df[df.budget.isin(budgets)]))
    print_ranked(df)
    print(f"results: {args.out} ({len(df)} rows for these budgets; `kvsim report {args.out}` writes the page)")
    if args.plot:
        print(f"plot: {plot_budget_curves(df, args.plot)}")
    return 0
