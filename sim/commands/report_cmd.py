"""``kvsim report``: ranked tables, loss-vs-budget and Pareto plots from a results store; occupancy maps."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sim.commands._common import (add_budget_option, add_policies_option, add_synthetic_size_args,
                                  add_verify_option, load)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="ranked table, plots and a page from a results store (+ occupancy maps)",
                       description="Print the ranked table per trace and write budget_curves.png, pareto.png "
                                   "(loss vs memory held) and report.html, a self-contained page of the table per "
                                   "budget, the plots and the legend. With --occupancy TRACE, also replay the given "
                                   "policies and draw which positions each one holds over time.")
    p.add_argument("results", type=Path, help="results store directory (from kvsim sweep / search / demo)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: RESULTS/../report)")
    p.add_argument("--metric", default="err_mean",
                   help="summary column to rank by (sim.replay.metrics: err_mean, err_p95, mass_mean, kl_mean, "
                        "err_gap, ...)")
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
    from sim.commands._common import command_line
    from sim.reports.sweep_page import sweep_page
    from sim.reports.report import plot_budget_curves, plot_pareto, print_ranked, split_sliding
    from sim.reports.runinfo import load_trace_facts
    from sim.experiments.store import ResultStore
    from sim.experiments.sweep import with_oracle_gap

    if not args.results.is_dir():
        raise FileNotFoundError(f"{args.results}: no results store here (run kvsim sweep first)")
    df = ResultStore(args.results).load()
    if df.empty:
        raise ValueError(f"{args.results}: the results store is empty")
    df = split_sliding(with_oracle_gap(df))
    out = args.out or args.results.parent / "report"
    out.mkdir(parents=True, exist_ok=True)
    print_ranked(df, args.metric, title=f"kvsim report — {args.results.name}")
    facts = load_trace_facts(args.results)
    figures = {"budget_curves": plot_budget_curves(df, out / "budget_curves.png"),
               "pareto": plot_pareto(df, out / "pareto.png", args.metric)}
    if args.occupancy:
        figures["occupancy"] = _occupancy(args, out, facts)
    page = sweep_page(df, out / "report.html", title=f"kvsim report — {args.results.name}", metric=args.metric,
                      facts=facts, figures=figures, command=command_line(args),
                      lede=f"The results store {args.results} ({len(df)} configurations), ranked; every policy was "
                           "replayed on the trace and measured against the full cache's attention at every decode "
                           "step.")
    for path in figures.values():
        print(f"wrote {path}")
    print(f"page: {page} (open it in a browser: plots, the table per budget, legend)")
    return 0


def _occupancy(args: argparse.Namespace, out: Path, facts: dict) -> Path:
    """The occupancy maps of ``--policies`` on ``--occupancy TRACE`` at ``--budget`` (with ``all``, the policies
    the trace cannot serve or the budget cannot hold are left out, as a sweep leaves them); the trace's facts join
    ``facts`` when the store did not have them."""
    from sim.reports.report import occupancy_figure
    from sim.reports.runinfo import trace_facts
    from sim.experiments.specs import parse_policy_list
    from sim.experiments.sweep import implicit_labels, servable

    trace = load(args, args.occupancy)
    f = trace_facts(trace)
    facts.setdefault(f["trace_id"], f)
    implicit = implicit_labels(args.policies)
    policies = []
    for pol in servable(trace, parse_policy_list(args.policies), implicit):
        if pol.label() in implicit and pol.min_budget() > args.budget:
            print(f"skipping {pol.label()}: budget {args.budget} is below its minimum {pol.min_budget()}",
                  file=sys.stderr)
        else:
            policies.append(pol)
    return occupancy_figure(trace, policies, args.budget, out / "occupancy.png")
