"""The pages of the fidelity study: ``kvsim fidelity`` (`fidelity_page`: the simulator's losses against the model's on
one text) and the study over many segments of two texts (`segments_page`, ``benchmarks/fidelity_segments.py``).
The simulator's rho stands beside the model's own reliability, the ceiling it is read against, and each pair
agreement beside its base rate with the confusion matrix of the calls behind it (`gpu_validate.studies.page_parts`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from gpu_validate.studies.fidelity.rank_fidelity import MODEL_COLUMNS, SIM_LOSSES, pair_agreement
from gpu_validate.studies.fidelity.segments import SEGMENT_COLUMNS
from gpu_validate.studies.page_parts import TERMS, confusion_html, run_facts
from sim.replay.metrics import COLUMNS, Column
from sim.reports.table import RankedTable, fmt3, ranked_tables
from sim.reports.webpage import (Page, esc, figure_html, legend_html, metric_legend_items, numbers_html,
                                 ranked_legend_items, ranked_table_html, simple_table)

FIDELITY_CAPTION = ("Each point is a policy at one budget (the number beside it): the simulator's loss (x; the "
                    "simulated loss that predicts best) against the model's ΔPPL (left) and top-1 disagreement "
                    "(right), both closed loop against the full cache. Points along a rising line mean the "
                    "simulator orders the configurations as the model does; each title gives Spearman ρ.")
SEGMENTS_CAPTION = ("One panel per text and budget: each policy's mean simulated attention error over the segments "
                    "(x) against its mean closed-loop ΔNLL (y). The title gives the within-budget ρ and the model's "
                    "own split-half reliability, the ceiling that ρ is read against.")


def _loss_column(key: str) -> Column:
    """A simulated or model loss by key, from its one definition (sim.replay.metrics, the model's or the segments')."""
    return COLUMNS.get(key) or MODEL_COLUMNS.get(key) or SEGMENT_COLUMNS[key]



def _pairs_section(pairs: Mapping[str, Any], sim_label: str, model_label: str) -> str:
    c = pairs["confusion"]
    cap = (f"{pairs['n_pairs']} pairs of policies at the same budget (A before B by name); the diagonal is where the "
           f"simulator's {sim_label} and the model's {model_label} make the same call. Agreement "
           f"{fmt3(pairs['agreement'])} against a base rate of {fmt3(pairs['base_rate'])}"
           + (f"; {pairs['ties']} pairs tie on one side and are left out." if pairs.get("ties") else "."))
    return confusion_html(c, [("model_a_worse", "model: A loses more"), ("model_b_worse", "model: B loses more")],
                          [("sim_a_worse", "simulator: A loses more"), ("sim_b_worse", "simulator: B loses more")], cap)


# ----- kvsim fidelity -----

def fidelity_tables(report: Mapping[str, Any]) -> tuple[list[RankedTable], list[RankedTable]]:
    """(the model's ranking: ΔNLL per budget with the simulated error, top-1 disagreement and kept-set agreement
    beside it; the simulator's ranking: err per budget with ΔNLL beside it) as `sim.reports.table` ranked tables."""
    df = pd.DataFrame([{**r, "trace": report["model"]} for r in report["rows"]])
    extras = [c for c in (COLUMNS["err_mean"], MODEL_COLUMNS["top1_disagreement"], MODEL_COLUMNS["kept_agreement"])
              if c.key in df]
    return (ranked_tables(df, MODEL_COLUMNS["delta_nll"], extras=extras),
            ranked_tables(df, COLUMNS["err_mean"], extras=[MODEL_COLUMNS["delta_nll"]]))


def fidelity_page(report: Mapping[str, Any], path: str | os.PathLike, *, plot: str | os.PathLike | None = None,
                  command: str | None = None) -> Path:
    """The page of a `gpu_validate.studies.fidelity.rank_fidelity.run_fidelity` report (with ``model_reliability`` and
    ``pair_agreement`` when the command added them; the pair agreement is computed here otherwise)."""
    rows = list(report["rows"])
    rel = report.get("model_reliability")
    pairs = report.get("pair_agreement") or pair_agreement(rows)
    within = report["spearman_within_budget"]
    page = Page(f"kvsim fidelity — {report['model']}",
                "Every policy × budget replayed in the simulator and run closed loop inside the model on the same "
                "text: does the simulator rank the configurations as the model does?")
    page.fact("model", "model", report["model"]).fact("text", "text", report.get("text", "not recorded"))
    page.fact("tokens", "tokens", f"{report['n_prompt'] + report['n_decode']:,} ({report['n_prompt']:,} prompt + "
                                  f"{report['n_decode']:,} teacher-forced, scored)")
    skipped = report.get("skipped") or []
    page.fact("policies", "policies", f"{len(report['policies'])}" + (f" (skipped: {', '.join(skipped)}, which "
                                                                       "cannot run closed loop)" if skipped else ""))
    page.fact("budgets", "budgets", f"{', '.join(map(str, report['budgets']))} slots per KV head and layer")
    run_facts(page, report, command)

    target = report.get("target", {})
    rel_text = (lambda k: f"the model's own reliability: {fmt3(rel[k])} (split-half over blocks of "
                          f"{rel['block_tokens']} tokens)") if rel else (lambda k: "the model's reliability is not "
                                                                                   "in this result")
    page.section("Headline", numbers_html([
        (fmt3(report["rho_primary"]), "Spearman ρ, simulated err vs the model's ΔNLL, over all configurations",
         f"target ≥ {target.get('rho', 0.9)}; {rel_text('pooled')}"),
        (fmt3(within["err_mean"]["delta_nll"]), "ρ within a budget (err vs ΔNLL, lossy policies)",
         rel_text("within_budget")),
        (fmt3(pairs["agreement"]), "pairs of policies ordered as the model orders them",
         f"base rate {fmt3(pairs['base_rate'])} (always the model's commoner call); {pairs['n_pairs']} pairs"),
        (fmt3(report["kept_agreement"]), "open-loop kept-set agreement (model cache = simulator's)",
         f"target ≥ {target.get('kept_agreement', 0.99)}; first {report.get('n_open_steps', '?')} decode steps"),
    ]))

    table_rows, best = [], []
    rho = report["spearman"]
    keys = [k for k in SIM_LOSSES if k in rho]
    for i, k in enumerate(keys):
        table_rows.append([_loss_column(k).label, rho[k]["delta_nll"], within[k]["delta_nll"],
                           rho[k]["top1_disagreement"], within[k]["top1_disagreement"]])
    for j in range(1, 5):
        vals = [r[j] for r in table_rows]
        if np.isfinite(vals).any():
            best.append((int(np.nanargmax(vals)), j))
    if rel:
        table_rows.append(["the model against itself (reliability)", float(rel["pooled"]),
                           float(rel["within_budget"]), "—", "—"])
    page.section("Simulator against model", simple_table(
        ["simulated loss", "ΔNLL: ρ over all", "ΔNLL: ρ within budget", "top-1 ≠: ρ over all",
         "top-1 ≠: ρ within budget"], table_rows, best=best,
        caption="Spearman ρ of each simulated loss with each model loss (bold: the best predictor); the last row is "
                "the ceiling: how well the model's ranking on half the text predicts its ranking on the other half.")
        + "<h3>Pairs of policies: the calls behind the agreement</h3>"
        + _pairs_section(pairs, _loss_column(pairs["sim"]).short, MODEL_COLUMNS[pairs["model"]].short))

    tables, sim_tables = fidelity_tables(report)
    body = "".join(ranked_table_html(t, "The model's ranking: ΔNLL per budget (closed loop), with the "
                                        "simulator's mean error beside it.") for t in tables)
    body += "".join(ranked_table_html(t, "The simulator's ranking of the same configurations: err per budget.")
                    for t in sim_tables)
    page.section("Per budget", body)
    if plot:
        page.section("Simulator against model, point by point", figure_html(plot, FIDELITY_CAPTION,
                                                                            "fidelity scatter"))
    legend = metric_legend_items([_loss_column(k) for k in keys] + list(MODEL_COLUMNS.values()))
    if tables:
        legend += [x for x in ranked_legend_items(tables[0]) if x[0] in ("rank", "reference", "paper", "bold, green")]
    page.section("Legend", legend_html(legend + list(TERMS.items())))
    return page.write(path)


# ----- the fidelity study over segments (benchmarks/fidelity_segments.py) -----

def segments_page(report: Mapping[str, Any], path: str | os.PathLike, *, plot: str | os.PathLike | None = None,
                  command: str | None = None) -> Path:
    """The page of the segment study's JSON: per text and budget the model's split-half reliability next to the
    simulator's rho, pooled and within-budget rho of every simulated loss, the pair calls, and the rankings."""
    by_text = report["by_text"]
    losses = [k for k in report.get("sim_losses", SIM_LOSSES) if k in COLUMNS or k in SEGMENT_COLUMNS]
    page = Page(f"kvsim fidelity over segments — {report['model']}",
                "Every policy × budget closed loop in the model on many segments of two texts, and replayed in the "
                "simulator on each segment's trace: how reproducible is the model's ranking, and how close does the "
                "simulator come to it?")
    page.fact("model", "model", report["model"])
    texts = report.get("texts", {})
    page.fact("text", "texts", "; ".join(f"{t} ({texts.get(t, '?')}): {report['segments_per_text'].get(t, '?')} "
                                         "segments" for t in by_text))
    page.fact("tokens", "tokens", f"{report['n_prompt'] + report['n_decode']:,} per segment ({report['n_prompt']:,} "
                                  f"prompt + {report['n_decode']:,} teacher-forced, scored)")
    page.fact("policies", "policies", str(len(report["policies"])))
    page.fact("budgets", "budgets", f"{', '.join(map(str, report['budgets']))} slots per KV head and layer")
    run_facts(page, report, command)

    head = "err_wo_mean" if "err_wo_mean" in losses else "err_mean"
    boxes = []
    for text, r in by_text.items():
        rel = [v["reliability"]["delta_nll"]["spearman_brown"] for v in r["by_budget"].values()]
        boxes.append((fmt3(r["within_budget_rho"][head]["delta_nll"]),
                      f"{text}: ρ within budget, {_loss_column(head).short} vs ΔNLL",
                      f"the model's reliability: {fmt3(float(np.nanmean(rel)))} (mean over budgets)"))
    page.section("Headline", numbers_html(boxes))

    body = []
    for text, r in by_text.items():
        budgets = sorted(r["by_budget"], key=int)
        per = r["by_budget"]
        rel = [float(per[b]["reliability"]["delta_nll"]["spearman_brown"]) for b in budgets]
        rows = [["the model against itself (reliability)", *rel, float(np.nanmean(rel)), "—", "—"]]
        rows += [[_loss_column(k).label, *[float(per[b]["rho"][k]["delta_nll"]) for b in budgets],
                  float(r["within_budget_rho"][k]["delta_nll"]), float(r["pooled_rho"][k]["delta_nll"]),
                  float(r["within_budget_rho"][k]["top1_disagreement"])] for k in losses]
        best = []
        for j in range(1, len(budgets) + 4):          # a loss fitted on this very text is not a candidate
            vals = [row[j] if isinstance(row[j], float) and "insample" not in k else np.nan
                    for k, row in zip(losses, rows[1:])]
            if np.isfinite(vals).any():
                best.append((1 + int(np.nanargmax(vals)), j))
        body.append(f"<h3>{esc(text)}</h3>" + simple_table(
            ["", *[f"ρ at {b}" for b in budgets], "ρ within budget", "ρ over all", "ρ within budget (top-1 ≠)"],
            rows, best=best,
            caption=f"First row: the model's split-half reliability per budget (Spearman-Brown over {r['n_segments']} "
                    "segments), the ceiling; below, each simulated loss's Spearman ρ with the mean ΔNLL per budget, "
                    "its mean over budgets and over all configurations (bold: the best simulated loss not fitted on "
                    "this text)."))
    page.section("The model's reliability next to the simulator's ρ", "".join(body))

    pair_body, rank_body = [], []
    for text, r in by_text.items():
        means = [{"trace": text, "policy": lab, "label": lab, "budget": int(b), **m}
                 for b, v in r["by_budget"].items() for lab, m in v["policy_means"].items()]
        pairs = pair_agreement(means, sim=head)
        pair_body.append(f"<h3>{esc(text)}</h3>" + _pairs_section(pairs, _loss_column(head).short, "ΔNLL"))
        df = pd.DataFrame(means)
        extras = [_loss_column(k) for k in ("err_mean", head) if k in df]
        for t in ranked_tables(df, MODEL_COLUMNS["delta_nll"], extras=list(dict.fromkeys(extras))):
            rank_body.append(f"<h3>{esc(text)}</h3>" + ranked_table_html(
                t, "The model's ranking: mean ΔNLL over the segments per budget, with the simulator's mean losses."))
    page.section("Pairs of policies: the calls behind the agreement", "".join(pair_body))
    page.section("Per budget", "".join(rank_body))
    if plot:
        page.section("Simulator against model, per text and budget", figure_html(plot, SEGMENTS_CAPTION,
                                                                                 "segment fidelity"))
    page.section("Legend", legend_html(metric_legend_items([_loss_column(k) for k in losses]
                                                           + [MODEL_COLUMNS["delta_nll"],
                                                              MODEL_COLUMNS["top1_disagreement"]])
                                       + list(TERMS.items())))
    return page.write(path)

