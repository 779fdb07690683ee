"""``kvsim report``: ranked tables, loss-vs-budget and Pareto plots from a results store; occupancy maps."""
from __future__ import annotations

import argparse
from pathlib import Path

from sim.commands._common import (add_budget_option, add_policies_option, add_synthetic_size_args,
                                  add_verify_option, load)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="tables and plots from a results store (+ cache occupancy maps)",
                       description="Print the ranked table per trace and write report.html, budget_curves.png "
                                   "and pareto.png (loss vs memory held). With --occupancy TRACE, also replay the "
                                   "given policies and draw which positions each one holds over time.")
    p.add_argument("results", type=Path, help="results store directory (from kvsim sweep / search / demo)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: RESULTS/../report)")
    p.add_argument("--metric", default="err_mean", help="ranking metric column")
    p.add_argument("--occupancy", metavar="TRACE", default=None,
                   help="trace directory or synthetic:KIND for occupancy maps")
    g = p.add_argument_group("occupancy maps (--occupancy)")
    add_policies_option(g, default="window;streaming_llm;h2o;tova",
                        extra="; policies that keep everything (full) are skipped")
    add_budget_option(g, default=64)
    add_synthetic_size_args(p)
    add_verify_option(p)
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
    from sim.specs import parse_policy_list

    trace = load(args, args.occupancy)
    inputs = load_layers(trace)
    P, T = trace.meta.n_prompt, trace.meta.n_tokens
    drawn = [pol for pol in parse_policy_list(args.policies) if not pol.unbounded]
    if not drawn:
        raise ValueError(f"--policies {args.policies!r}: no policy to draw (policies that keep every token, "
                         f"such as full, have no occupancy map)")
    panels, titles, steps = [], [], None
    for pol in drawn:
        res = replay(trace, pol, args.budget, inputs=inputs, record_kept=(P, T - P))
        panels.append(res.kept)
        titles.append(f"{pol.label()} @ {args.budget}")
        steps = res.kept_steps
    return plot_occupancy(panels, steps, T, titles, out / "occupancy.png")
