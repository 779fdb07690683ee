"""The page of ``kvsim needle`` (and of the RULER benchmark's needle tasks): retrieval accuracy per policy and budget
with the full cache as the reference, by context length and task, and with ``--predict`` the simulator's calls
against the model's outcomes, each agreement beside its base rate, balanced accuracy and MCC
(`gpu_validate.studies.page_parts`)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from gpu_validate.studies.needle.scores import ACCURACY, AGREEMENT, PREDICTED_ACCURACY, confusion_scores
from gpu_validate.studies.page_parts import TERMS, confusion_html, run_facts
from sim.reports.table import RankedTable, fmt3, ranked_tables
from sim.reports.webpage import (Page, esc, figure_html, legend_html, metric_legend_items, numbers_html,
                                 ranked_legend_items, ranked_table_html, simple_table)

NEEDLE_CAPTION = ("One heatmap per policy (the full cache first), one row of them per budget: context length (y) "
                  "by needle depth (x, 0 = start of the haystack, 1 = next to the question); colour = share of the "
                  "seeds whose pass key the model reproduced (green 1, red 0). The title gives the mean accuracy.")


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
    """Retrieval accuracy per policy and budget as `sim.reports.table` ranked tables (the terminal's and the
    page's), with the predicted accuracy and the agreement on the held-out seeds when the result has them."""
    df = _needle_frame(report)
    extras = [c for c in (PREDICTED_ACCURACY, AGREEMENT) if df[c.key].notna().any()]
    return ranked_tables(df, ACCURACY, extras=extras)


def needle_page(report: Mapping[str, Any], path: str | os.PathLike, *, plot: str | os.PathLike | None = None,
                command: str | None = None) -> Path:
    """The page of a ``kvsim needle`` summary: retrieval accuracy per policy and budget (the full cache as the
    reference), by context length, and with ``--predict`` the simulator's calls against the model's outcomes."""
    pred = report.get("prediction")
    page = _needle_header(report, command)
    page.section("Headline", numbers_html(_headline_boxes(report)))
    tables = needle_tables(report)
    extras = [c.metric for c in tables[0].columns if c.metric.key != ACCURACY.key] if tables else []
    page.section("Accuracy per budget", _accuracy_body(report, tables, predicted=bool(extras)))
    if report.get("by_task"):
        page.section("Tasks", _tasks_body(report))
    if plot:
        page.section("Accuracy by length and depth", figure_html(plot, NEEDLE_CAPTION, "needle heatmaps"))
    for task, task_plot in report.get("task_plots", {}).items():
        page.section(f"{task}: accuracy by length and depth",
                     figure_html(task_plot, NEEDLE_CAPTION, f"{task} heatmaps"))
    if pred:
        page.section("The simulator's prediction", _prediction_body(report, pred))
    items = metric_legend_items([ACCURACY] + extras)
    if tables:
        items += [x for x in ranked_legend_items(tables[0]) if x[0] in ("rank", "reference", "paper", "bold, green")]
    page.section("Legend", legend_html(items + list(TERMS.items())))
    return page.write(path)


def _needle_header(report: Mapping[str, Any], command: str | None) -> Page:
    """The page with its title, what was run (model, filler text, prompts, policies, budgets) and the run's facts."""
    page = Page(f"kvsim needle — {report['model']}",
                "Pass-key retrieval closed loop in the model: a key hidden in real text at several depths and context "
                "lengths, asked for at the end; each policy × budget either reproduces it or not"
                + (", and the simulator predicts which from a replay of the prompt." if report.get("prediction")
                   else "."))
    page.fact("model", "model", report["model"]).fact("text", "filler text", report.get("text", "not recorded"))
    page.fact("prompts", "prompts", f"{report['n_prompts']}: lengths {', '.join(map(str, report['lengths']))} tokens "
                                    f"× depths {', '.join(f'{d:g}' for d in report['depths'])} × seeds "
                                    f"{', '.join(map(str, report['seeds']))}")
    page.fact("policies", "policies", f"{len(report['policies'])} + the full cache (reference)")
    page.fact("budgets", "budgets", f"{', '.join(map(str, report['budgets']))} slots per KV head and layer")
    run_facts(page, report, command)
    return page


def _headline_boxes(report: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """The headline numbers: the full cache's accuracy (the ceiling) and, with a prediction, the simulator's
    agreement on the held-out seeds beside its base rate, balanced accuracy and MCC, and its rho per configuration
    beside the model's own reliability."""
    boxes = [(fmt3(report["full_accuracy"]), "full-cache accuracy", "the model itself, every token kept: the ceiling "
                                                                    "of every policy")]
    pred = report.get("prediction")
    if not pred:
        return boxes
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
    return boxes


def _accuracy_body(report: Mapping[str, Any], tables: list[RankedTable], *, predicted: bool) -> str:
    """The ranked accuracy tables per budget (``predicted``: they carry the held-out prediction's columns) and the
    accuracy per context length of every configuration."""
    body = "".join(ranked_table_html(t, "Retrieval accuracy per budget, best first; the full cache is the "
                                        "reference." + (" Predicted: on the held-out seeds only." if predicted else ""))
                   for t in tables)
    by_len = report.get("accuracy_by_length", {})
    lengths = [int(x) for x in report["lengths"]]
    len_rows = [["full", "—"] + [float(report.get("full_accuracy_by_length", {}).get(str(L),
                                 report.get("full_accuracy_by_length", {}).get(L, np.nan))) for L in lengths]]
    for key, per in by_len.items():
        label, _, b = key.rpartition("@")
        len_rows.append([label, int(b)] + [float(per.get(str(L), per.get(L, np.nan))) for L in lengths])
    return body + "<h3>By context length</h3>" + simple_table(["policy", "budget", *[f"{L} tokens" for L in lengths]],
                                                               len_rows, caption="Accuracy per context length.")


def _tasks_body(report: Mapping[str, Any]) -> str:
    """Accuracy per task (the full cache's and the policies' mean per budget), the task × length cells the full
    cache fails (dropped from the report) and, with a prediction, the simulator's calls per task."""
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
    pred = report.get("prediction")
    if pred and pred.get("per_task"):
        body += _groups_table("task", pred["per_task"], "The simulator's calls per task, held-out seeds.")
    return body


def _prediction_body(report: Mapping[str, Any], pred: Mapping[str, Any]) -> str:
    """The simulator's calls against the model's outcomes on the held-out seeds: the confusion matrices (alone and
    with the full cache's outcome), the predictor and its threshold, the scores per policy and context length, and
    every candidate predictor."""
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
    return body + simple_table(["predictor", "threshold", "agreement on the training seeds", "held-out agreement",
                                "held-out balanced accuracy", "held-out MCC"],
                               [[k, float(v["threshold"]), float(v["train_agreement"]), float(v["heldout_agreement"]),
                                 float(v.get("heldout_balanced_accuracy", np.nan)),
                                 float(v.get("heldout_mcc", np.nan))] for k, v in cand.items()],
                               caption="Every candidate predictor, with the threshold fitted on the training seeds "
                                       "(— : not in this result).")


def _confusion(c: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """`gpu_validate.studies.needle.scores.prediction_report`'s flat confusion as rows (model outcome) x columns
    (prediction)."""
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
