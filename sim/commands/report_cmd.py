"""``kvsim report``: ranked tables, loss-vs-budget and Pareto plots from a results store; occupancy maps."""
from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="tables and plots from a results store (+ cache occupancy maps)",
                       description="Print the ranked table per trace and write report.html, budget_curves.png "
                                   "and pareto.png (loss vs memory held). With --occupancy TRACE, also replay the "
                                   "given policies and draw which positions each one holds over time.")
    p.add_argument("results", type=Path, help="results store directory (from kvsim sweep / search / demo)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: RESULTS/../report)")
    p.add_argument("--metric", default="err_mean", help="ranking metric column (default err_mean)")
    p.add_argument("--occupancy", metavar="TRACE", default=None, help="trace for occupancy maps")
    p.add_argument("--policies", default="window;streaming_llm;h2o;tova",
                   help="';'-separated policy specs for the occupancy maps")
    p.add_argument("--budget", type=int, default=64, help="budget of the occupancy maps")
    for flag, default in (("--tokens", 1024), ("--prompt", 128), ("--layers", 2), ("--seed", 0)):
        p.add_argument(flag, type=int, default=default, help=f"synthetic occupancy trace size (default {default})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sim.report import plot_budget_curves, plot_occupancy, plot_pareto, print_ranked, write_html
    from sim.store import ResultStore
    from sim.sweep import with_oracle_gap

    if not args.results.is_dir():
        raise FileNotFoundError(f"{args.results}: no results store here (run kvsim sweep first)")
    df = ResultStore(args.results).load()
    if df.empty:
        raise ValueError(f"{args.results}: the results store is empty")
    df = with_oracle_gap(df)
    out = args.out or args.results.parent / "report"
    out.mkdir(parents=True, exist_ok=True)
    print_ranked(df, args.metric)
    written = [write_html(df, out / "report.html", args.metric), plot_budget_curves(df, out / "budget_curves.png"),
               plot_pareto(df, out / "pareto.png", args.metric)]
    if args.occupancy:
        written.append(_occupancy(args, out))
    for path in written:
        print(f"wrote {path}")
    return 0


def _occupancy(args: argparse.Namespace, out: Path) -> Path:
    from sim.replay import load_layers, replay
    from sim.report import plot_occupancy
    from sim.specs import open_trace
    from sim.sweep import parse_policy_list

    trace = open_trace(args.occupancy, n_tokens=args.tokens, n_prompt=args.prompt, n_layers=args.layers,
                       seed=args.seed)
    inputs = load_layers(trace)
    P, T = trace.meta.n_prompt, trace.meta.n_tokens
    panels, titles = [], []
    for pol in parse_policy_list(args.policies):
        if pol.is_oracle or pol.unbounded:
            continue
        res = replay(trace, pol, args.budget, inputs=inputs, record_kept=(P, T - P))
        panels.append(res.kept)
        titles.append(f"{pol.label()} @ {args.budget}")
    return plot_occupancy(panels, res.kept_steps, T, titles, out / "occupancy.png")
