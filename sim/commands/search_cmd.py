"""``kvsim search``: optuna TPE search of a policy's hyperparameters (optionally loss vs memory Pareto)."""
from __future__ import annotations

import argparse
from pathlib import Path

from sim.commands._common import (add_budgets_option, add_executor_options, add_out_option, add_policy_option,
                                  add_quiet_option, add_trace_args, trace_ref)


def register(sub: argparse._SubParsersAction) -> None:
    from sim.replay.metrics import OBJECTIVES, objectives_help

    p = sub.add_parser("search", help="search a policy's hyperparameters with optuna (TPE, Pareto front)",
                       description="Search the hyperparameters a policy's schema declares searchable. With "
                                   "--pareto the budget is searched too and loss vs KV memory held gives a Pareto "
                                   "front. Evaluations go to the results store: reruns reuse them.")
    add_trace_args(p)
    add_policy_option(p, extra="; parameters given in the spec are held fixed, the others are searched")
    add_budgets_option(p, required=True, extra=": averaged over, or searched with --pareto")
    p.add_argument("--objective", choices=OBJECTIVES, default="err",
                   help=objectives_help())
    p.add_argument("--layer-weights", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   help="comma-separated weights per layer for err/mass (default: equal)")
    p.add_argument("--trials", type=int, default=40, help="trials of the study")
    p.add_argument("--pareto", action="store_true", help="multi-objective: loss vs memory")
    p.add_argument("--sampler-seed", dest="search_seed", type=int, default=0, help="TPE sampler seed")
    add_out_option(p, "kvsim-out/results", "results store directory")
    add_executor_options(p)
    p.add_argument("--plot", type=Path, default=None, help="write the trials (and Pareto front) to this PNG")
    add_quiet_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from sim.reports.report import plot_search
    from sim.experiments.search import run_search
    from sim.experiments.store import ResultStore

    from sim.reports.runinfo import save_ref_facts

    ref = trace_ref(args, args.trace)
    save_ref_facts(args.out, ref)                    # what `kvsim report` says about the trace
    res = run_search(ref, args.policy, args.budgets, ResultStore(args.out), objective=args.objective,
                     n_trials=args.trials, multi_objective=args.pareto, layer_weights=args.layer_weights,
                     workers=args.workers, ray_address=args.ray, threads=args.threads, seed=args.search_seed,
                     progress=not args.quiet)
    title = "Pareto front (loss vs KV bytes)" if args.pareto else f"best of {args.trials} trials"
    Console(width=140).print(f"[bold]{args.policy}: {title}, objective {args.objective}[/bold]")
    pareto = res.pareto.drop(columns=["trial"])
    Console(width=140).print(pareto.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    if args.plot:
        print(f"plot: {plot_search(res.trials, res.pareto, args.plot, args.objective)}")
    return 0
