"""The pages of the model-side results: ``kvsim fidelity`` (the simulator's losses against the model's on one text),
the fidelity study over many segments (``benchmarks/fidelity_segments.py``) and ``kvsim needle`` (retrieval, and
the simulator's prediction of it).

Each page is built from the result's JSON alone (plus its PNG), so a stored result can be paged again. Every number
a reader should weigh sits next to what it is weighed against: the simulator's rho beside the model's own
reliability (how well the model agrees with itself), an agreement beside its base rate (what always giving the
commoner answer would score), with balanced accuracy and Matthews correlation where the calls are yes/no (neither
rewards the commoner answer), and the confusion matrix of the calls behind the agreement. Tables per budget come
from `sim.reports.table` (the builder the terminal uses), page parts from `sim.reports.webpage`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from gpu_validate.studies.fidelity.rank_fidelity import MODEL_COLUMNS, SIM_LOSSES, pair_agreement
from gpu_validate.studies.needle.scores import ACCURACY, AGREEMENT, PREDICTED_ACCURACY, confusion_scores
from gpu_validate.studies.fidelity.segments import SEGMENT_COLUMNS
from sim.replay.metrics import COLUMNS, Column
from sim.reports.runinfo import kvsim_version, machine, now
from sim.reports.table import RankedTable, fmt3, ranked_tables
from sim.reports.webpage import (Page, esc, figure_html, legend_html, metric_legend_items, numbers_html, ranked_legend_items,
                         ranked_table_html, simple_table)

FIDELITY_CAPTION = ("Each point is a policy at one budget (the number beside it): the simulator's loss (x; the "
                    "simulated loss that predicts best) against the model's ΔPPL (left) and top-1 disagreement "
                    "(right), both closed loop against the full cache. Points along a rising line mean the "
                    "simulator orders the configurations as the model does; each title gives Spearman ρ.")
SEGMENTS_CAPTION = ("One panel per text and budget: each policy's mean simulated attention error over the segments "
                    "(x) against its mean closed-loop ΔNLL (y). The title gives the within-budget ρ and the model's "
                    "own split-half reliability, the ceiling that ρ is read against.")
NEEDLE_CAPTION = ("One heatmap per policy (the full cache first), one row of them per budget: context length (y) "
                  "by needle depth (x, 0 = start of the haystack, 1 = next to the question); colour = share of the "
                  "seeds whose pass key the model reproduced (green 1, red 0). The title gives the mean accuracy.")

TERMS = {
    "Spearman ρ": "rank correlation of two lists (1: same order, 0: unrelated, −1: reversed)",
    "ρ over all": "Spearman ρ over every (policy, budget): dominated by the budget, which both sides order alike",
    "ρ within budget": "the mean over budgets of Spearman ρ among the lossy policies at one budget: does the "
                       "simulator rank the policies, not only the budgets?",
    "reliability": "how well the model agrees with itself: its policy ranking on one half of the data against the "
                   "other half (split-half Spearman ρ, stepped up to the whole by Spearman-Brown). A simulator "
                   "cannot be expected to predict the model better than the model predicts itself.",
    "pair agreement": "the share of pairs of policies at the same budget that the simulator orders as the model does",
    "base rate": "the agreement of always giving the commoner answer; an agreement is worth what it adds to this",
    "balanced accuracy": "the mean of the share of the model's hits the simulator calls hits and the share of its "
                         "misses it calls misses: 0.5 for any constant call, 1 for a perfect one, however unbalanced "
                         "the outcomes (— where the held-out cells hold one outcome only)",
    "MCC": "Matthews correlation of the simulator's calls with the model's outcomes: 1 perfect, 0 no better than "
           "chance or a constant call, −1 reversed; like balanced accuracy it does not reward calling the commoner "
           "outcome",
}


def _machine_text(value: Any) -> str:
    if isinstance(value, Mapping):
        parts = [str(value.get(k)) for k in ("platform", "processor") if value.get(k)]
        if value.get("cpu_count"):
            parts.append(f"{value['cpu_count']} cores")
        return ", ".join(parts) or "not recorded"
    return str(value) if value else "not recorded in this result"


def run_info() -> dict[str, str]:
    """kvsim version, date and machine of this run, for a result's JSON (the page states them)."""
    return {"kvsim": kvsim_version(), "date": now(), "machine": machine()}


def run_facts(page: Page, report: Mapping[str, Any], command: str | None) -> None:
    """The facts every page ends its header with: device, kvsim version, date and machine of the run."""
    if report.get("device"):
        page.fact("device", "device", f"{report['device']}, backend {report.get('backend', '?')}")
    page.fact("version", "kvsim", report.get("kvsim") or f"not recorded (page by kvsim {kvsim_version()})")
    page.fact("date", "date", report.get("date") or f"not recorded (page written {now()})")
    page.fact("machine", "machine", _machine_text(report.get("machine")))
    if report.get("seconds"):
        page.fact("seconds", "run time", f"{fmt3(float(report['seconds']) / 60)} min")
    if command or report.get("command"):
        page.fact("command", "command", command or report["command"])


def _loss_column(key: str) -> Column:
    """A simulated or model loss by key, from its one definition (sim.replay.metrics, the model's or the segments')."""
    return COLUMNS.get(key) or MODEL_COLUMNS.get(key) or SEGMENT_COLUMNS[key]


def confusion_html(matrix: Mapping[str, Mapping[str, int]], rows: Sequence[tuple[str, str]],
                   cols: Sequence[tuple[str, str]], caption: str) -> str:
    """A 2 x 2 (or larger) confusion matrix: ``rows``/``cols`` are (key in ``matrix``, header) pairs; the
    diagonal (agreement) is marked."""
    body = [[head] + [int(matrix[rk][ck]) for ck, _ in cols] for rk, head in rows]
    html = simple_table(["", *[h for _, h in cols]], body, caption=caption, sortable=False)
    return html


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


# ----- kvsim needle -----

def _needle_frame(report: Mapping[str, Any]) -> pd.DataFrame:
    """Accuracy per (label, budget) as result rows (with the prediction's per-configuration numbers when present;
    the full cache as a reference row at every budget)."""
    per_config = (report.get("prediction") or {}).get("per_config", {})
    rows = []
    for key, acc in report["accuracy"].items():
        label, _, b = key.rpartition("@")
        pc = per_config.get(key, {})
        rows.append({"trace": report["model"], "label": label, "policy": label, "budget": int(b), "accuracy": acc,
                     "predicted_accuracy": pc.get("predicted_accuracy", np.nan),
                     "agreement": pc.get("agreement", np.nan)})
    for b in report["budgets"]:
        rows.append({"trace": report["model"], "label": "full", "policy": "full", "budget": int(b),
                     "accuracy": report["full_accuracy"], "predicted_accuracy": np.nan, "agreement": np.nan})
    return pd.DataFrame(rows)


def needle_tables(report: Mapping[str, Any]) -> list[RankedTable]:
    """Retrieval accuracy per policy and budget as `sim.reports.table` ranked tables (the terminal's and the page's), with
    the predicted accuracy and the agreement on the held-out seeds when the result has them."""
    df = _needle_frame(report)
    extras = [c for c in (PREDICTED_ACCURACY, AGREEMENT) if df[c.key].notna().any()]
    return ranked_tables(df, ACCURACY, extras=extras)


def needle_page(report: Mapping[str, Any], path: str | os.PathLike, *, plot: str | os.PathLike | None = None,
                command: str | None = None) -> Path:
    """The page of a ``kvsim needle`` summary: retrieval accuracy per policy and budget (the full cache as the
    reference), by context length, and with ``--predict`` the simulator's calls against the model's outcomes."""
    pred = report.get("prediction")
    page = Page(f"kvsim needle — {report['model']}",
                "Pass-key retrieval closed loop in the model: a key hidden in real text at several depths and context "
                "lengths, asked for at the end; each policy × budget either reproduces it or not"
                + (", and the simulator predicts which from a replay of the prompt." if pred else "."))
    page.fact("model", "model", report["model"]).fact("text", "filler text", report.get("text", "not recorded"))
    page.fact("prompts", "prompts", f"{report['n_prompts']}: lengths {', '.join(map(str, report['lengths']))} tokens "
                                    f"× depths {', '.join(f'{d:g}' for d in report['depths'])} × seeds "
                                    f"{', '.join(map(str, report['seeds']))}")
    page.fact("policies", "policies", f"{len(report['policies'])} + the full cache (reference)")
    page.fact("budgets", "budgets", f"{', '.join(map(str, report['budgets']))} slots per KV head and layer")
    run_facts(page, report, command)

    boxes = [(fmt3(report["full_accuracy"]), "full-cache accuracy", "the model itself, every token kept: the ceiling "
                                                                    "of every policy")]
    if pred:
        sc = _scores(pred)
        seeds = ", ".join(map(str, pred["test_seeds"]))
        boxes.append((fmt3(pred["sim_agreement"]), f"simulator agrees with the model on held-out seeds {seeds}",
                      f"base rate {fmt3(sc['base_rate'])} (always the commoner outcome)"))
        boxes.append((fmt3(sc["balanced_accuracy"]), f"balanced accuracy of the simulator's calls, seeds {seeds}",
                      f"0.5 is a constant call; Matthews correlation {fmt3(sc['mcc'])} (0: no better than chance)"))
        if "sim_and_full_agreement" in pred:
            full = confusion_scores(pred["confusion_sim_and_full"])
            boxes.append((fmt3(pred["sim_and_full_agreement"]), "with the full cache's outcome per prompt",
                          f"a prompt the full cache fails is predicted a miss; balanced accuracy "
                          f"{fmt3(full['balanced_accuracy'])}, MCC {fmt3(full['mcc'])}"))
        if np.isfinite(pred.get("rho_accuracy", np.nan)):
            rel = report.get("model_reliability") or {}
            boxes.append((fmt3(pred["rho_accuracy"]), "ρ of predicted with actual accuracy per policy × budget",
                          f"the model against itself on other seeds: {fmt3(rel.get('rho', np.nan))}"))
    page.section("Headline", numbers_html(boxes))

    tables = needle_tables(report)
    extras = [c.metric for c in tables[0].columns if c.metric.key != ACCURACY.key] if tables else []
    body = "".join(ranked_table_html(t, "Retrieval accuracy per budget, best first; the full cache is the "
                                        "reference." + (" Predicted: on the held-out seeds only." if extras else ""))
                   for t in tables)
    by_len = report.get("accuracy_by_length", {})
    lengths = [int(x) for x in report["lengths"]]
    len_rows = [["full", "—"] + [float(report.get("full_accuracy_by_length", {}).get(str(L),
                                 report.get("full_accuracy_by_length", {}).get(L, np.nan))) for L in lengths]]
    for key, per in by_len.items():
        label, _, b = key.rpartition("@")
        len_rows.append([label, int(b)] + [float(per.get(str(L), per.get(L, np.nan))) for L in lengths])
    body += "<h3>By context length</h3>" + simple_table(["policy", "budget", *[f"{L} tokens" for L in lengths]],
                                                        len_rows, caption="Accuracy per context length.")
    page.section("Accuracy per budget", body)
    if report.get("by_task"):
        cells = report.get("full_accuracy_by_cell", {})
        rows = [[t, float(s["full_accuracy"])] + [float(np.mean([v for k, v in s["accuracy"].items()
                                                                 if k.endswith(f"@{b}")] or [np.nan]))
                                                  for b in report["budgets"]]
                for t, s in report["by_task"].items()]
        body = simple_table(["task", "full cache", *[f"policies' mean at {b}" for b in report["budgets"]]], rows,
                            caption="Accuracy per task (reported cells only).")
        if cells:
            body += simple_table(["task @ length", "full-cache accuracy", "reported"],
                                 [[k, float(v), "yes" if k in report.get("reported_cells", []) else "dropped"]
                                  for k, v in cells.items()],
                                 caption=f"Cells where the full cache retrieves less than "
                                         f"{report.get('min_full_accuracy', 0):g} are dropped: a policy cannot be "
                                         "judged on a task the model fails with every token kept.")
        if pred and pred.get("per_task"):
            body += _groups_table("task", pred["per_task"], "The simulator's calls per task, held-out seeds.")
        page.section("Tasks", body)
    if plot:
        page.section("Accuracy by length and depth", figure_html(plot, NEEDLE_CAPTION, "needle heatmaps"))
    for task, task_plot in report.get("task_plots", {}).items():
        page.section(f"{task}: accuracy by length and depth", figure_html(task_plot, NEEDLE_CAPTION, f"{task} heatmaps"))
    if pred:
        sc = _scores(pred)
        rows = [("model_ok", "model retrieves"), ("model_fail", "model fails")]
        cols = [("pred_ok", "simulator: retrieves"), ("pred_fail", "simulator: fails")]
        body = confusion_html(_confusion(pred["confusion"]), rows, cols,
                              f"{pred['n_test_cells']} held-out cells (seeds {', '.join(map(str, pred['test_seeds']))})"
                              f"; agreement {fmt3(pred['sim_agreement'])} against a base rate of "
                              f"{fmt3(sc['base_rate'])}; balanced accuracy {fmt3(sc['balanced_accuracy'])}, "
                              f"MCC {fmt3(sc['mcc'])}.")
        if "confusion_sim_and_full" in pred:
            full = confusion_scores(pred["confusion_sim_and_full"])
            body += confusion_html(_confusion(pred["confusion_sim_and_full"]), rows, cols,
                                   f"With the full cache's outcome: agreement {fmt3(pred['sim_and_full_agreement'])}; "
                                   f"balanced accuracy {fmt3(full['balanced_accuracy'])}, MCC {fmt3(full['mcc'])}.")
        objective = pred.get("objective", "agreement")     # results before the objective existed fitted agreement
        body += f"<p>Predictor: {esc(report.get('predictor', pred['feature']))}; threshold {fmt3(pred['threshold'])}, "
        body += (f"chosen with the predictor on seeds {', '.join(map(str, pred['train_seeds']))} by "
                 f"{esc(objective.replace('_', ' '))} (agreement there {fmt3(pred['train_agreement'])}, balanced "
                 f"accuracy {fmt3(pred.get('train_balanced_accuracy', np.nan))}).</p>")
        body += _groups_table("policy", pred.get("per_policy", {}), "Per policy, held-out seeds.")
        if pred.get("per_length"):
            body += _groups_table("context tokens", pred["per_length"], "Per context length, held-out seeds.")
        cand = pred.get("candidates", {})
        body += simple_table(["predictor", "threshold", "agreement on the training seeds", "held-out agreement",
                              "held-out balanced accuracy", "held-out MCC"],
                             [[k, float(v["threshold"]), float(v["train_agreement"]), float(v["heldout_agreement"]),
                               float(v.get("heldout_balanced_accuracy", np.nan)), float(v.get("heldout_mcc", np.nan))]
                              for k, v in cand.items()],
                             caption="Every candidate predictor, with the threshold fitted on the training seeds "
                                     "(— : not in this result).")
        page.section("The simulator's prediction", body)
    items = metric_legend_items([ACCURACY] + extras)
    if tables:
        items += [x for x in ranked_legend_items(tables[0]) if x[0] in ("rank", "reference", "paper", "bold, green")]
    page.section("Legend", legend_html(items + list(TERMS.items())))
    return page.write(path)


def _confusion(c: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """`gpu_validate.studies.needle.scores.prediction_report`'s flat confusion as rows (model outcome) x columns (prediction)."""
    return {"model_ok": {"pred_ok": c["model_ok_pred_ok"], "pred_fail": c["model_ok_pred_fail"]},
            "model_fail": {"pred_ok": c["model_fail_pred_ok"], "pred_fail": c["model_fail_pred_fail"]}}


def _scores(part: Mapping[str, Any]) -> dict[str, Any]:
    """Base rate, balanced accuracy and MCC of a prediction (or of one of its groups) as stored, or computed from its
    confusion (or the base rate from the model's accuracy) for results stored before they were recorded (NaN where
    neither is there: per-group confusions were not stored then)."""
    from_conf = confusion_scores(part["confusion"]) if "confusion" in part else {}
    if "accuracy" in part and "base_rate" not in from_conf:         # the model's accuracy gives the base rate
        from_conf["base_rate"] = max(float(part["accuracy"]), 1.0 - float(part["accuracy"]))
    return {k: float(part.get(k, from_conf.get(k, np.nan))) for k in ("base_rate", "balanced_accuracy", "mcc")}


def _groups_table(head: str, groups: Mapping[Any, Mapping[str, Any]], caption: str) -> str:
    """The prediction's scores per group (policy, context length): agreement beside its base rate, balanced
    accuracy, MCC, the model's and the predicted accuracy."""
    rows = []
    for key, v in groups.items():
        sc = _scores(v)
        rows.append([str(key), float(v["agreement"]), sc["base_rate"], sc["balanced_accuracy"], sc["mcc"],
                     float(v["accuracy"]), float(v["predicted_accuracy"]), int(v["n"])])
    return simple_table([head, "agreement", "base rate", "balanced accuracy", "MCC", "accuracy", "predicted accuracy",
                         "cells"], rows, caption=caption + " Balanced accuracy is — where the cells hold one outcome "
                                                           "only.")
