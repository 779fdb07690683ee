"""How a recommendation (`gpu_validate.studies.recommendation.recommender`) is shown: a terminal table per budget
and one self-contained HTML page (the answer, the per-budget choices, the memory-vs-loss front, every
configuration), both from its JSON."""
from __future__ import annotations

import math
import os
import shlex
from pathlib import Path
from typing import Any, Mapping

import pandas as pd
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from gpu_validate.studies.page_parts import run_facts
from gpu_validate.studies.recommendation.recommend_statistics import LOSS_FLOOR
from policies.core.kvpress_press import summary_line
from sim.reports.plotting import agg_pyplot, save_figure
from sim.reports.table import fmt3
from sim.reports.webpage import Page, esc, figure_html, legend_html, numbers_html, simple_table

FRONT_CAPTION = ("Each small point is one configuration at one budget: the K/V memory it holds (x) and the model loss "
                 "the calibrated simulator predicts for it (y), one colour per policy family. Rings are the "
                 "configurations confirmed in the model, drawn at their measured loss; the star is the answer, the "
                 "dashed line the target.")
TERMS = {
    "simulated": "the simulator's loss of the configuration (its ranking key), the mean over the segments",
    "predicted": "the model loss the calibration (a power law fitted on the confirmed runs) predicts from it",
    "measured": "the model's loss in the closed loop (the policy evicting inside the model), mean over the segments",
    "bound": "the one-sided 95% upper bound of the measured loss: the mean plus the larger of 1.645 standard errors "
             "over token blocks and a Student-t margin over segments (a retrieval target: the Clopper-Pearson limit "
             "of the failures). A budget meets the target when this does, since the best of several noisy "
             "measurements is optimistic and the answer must hold on text it has not seen",
    "confirmed": "run in the model; a budget's choice is its best confirmed configuration, else the simulator's "
                 "first",
    "pair agreement": "among pairs of configurations confirmed at the same budget, the share the simulator ordered "
                      "as the model did",
    "calibration error": "the typical factor between a confirmed run's predicted and measured loss",
    "refined": "a budget between two rungs of the ladder, tried while bisecting towards the smallest budget that "
               "meets the target",
    "confidence": "a prediction of whether the answer holds on text it has not seen, from its margin (how many "
                  "standard errors over segments its measured loss lies below the target) capped by the guarantee: "
                  "high needs the answer's own budget certified, and no certified budget is low. The levels are "
                  "those at which the recommend benchmark's answers held on held-out text",
    "guarantee": "the budget at which the chosen configuration is certified without assuming anything of how the "
                 "losses are distributed: only that a future window of your text is exchangeable with the segments "
                 "measured (for a retrieval target: the pass-key prompts). It meets the target on a new such window "
                 "with probability at least 1 - alpha",
}


def _loss(x: Any) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt3(float(x))


def _mib(x: float) -> str:
    return f"{x / 2 ** 20:.2f} MiB" if x >= 2 ** 20 else f"{x / 2 ** 10:.1f} KiB"


def budget_rows(report: Mapping[str, Any]) -> list[list[object]]:
    """One row per budget: its choice, where the choice came from, its losses and memory."""
    rows = []
    ladder = set(report["budgets"])
    for r in report["per_budget"]:
        p = r["pick"]
        budget = r["budget"] if r["budget"] in ladder else f"{r['budget']} (refined)"
        rows.append([budget, p["label"], r["source"], len(r["confirmed"]), p["simulated"], p["predicted"],
                     "—" if p["measured"] is None else p["measured"],
                     "—" if p.get("upper_bound") is None else p["upper_bound"], _mib(p["kv_bytes"])])
    return rows


#: "bound": the measured mean plus the margin (`gpu_validate.studies.recommendation.recommend_statistics.MARGIN_Z`
#: standard errors): what must meet the target
BUDGET_HEADERS = ["budget", "choice", "from", "confirmed", "simulated", "predicted", "measured", "bound", "K/V held"]


def print_report(report: Mapping[str, Any]) -> None:
    """The per-budget table in the terminal (rich)."""
    table = Table(title=escape(f"kvsim recommend — {report['model']}, target {report['target']} "
                               f"({report['target_column']} ≤ {report['target_limit']:g})"), box=box.SIMPLE_HEAD,
                  caption="from: confirmed = the configuration run in the model at that budget with the lowest bound; "
                          "simulator = the simulator's first (not run)")
    for h in BUDGET_HEADERS:
        table.add_column(h, justify="left" if h in ("choice", "from") else "right", no_wrap=True)
    answer = report["answer"]["budget"]
    for r, row in zip(report["per_budget"], budget_rows(report)):
        cells = [fmt3(v) if isinstance(v, float) else str(v) for v in row]
        table.add_row(*map(escape, cells),
                      style="bold green" if r["budget"] == answer and report["answer"]["met"] else None)
    need = Measurement.get(Console(width=400), Console(width=400).options, table).maximum
    Console(width=max(100, Console().width, need)).print(table)


def recommend_page(report: Mapping[str, Any], path: str | os.PathLike, *, plot: str | os.PathLike | None = None,
                   command: str | None = None) -> Path:
    """The recommendation's page, from its JSON (and the front's PNG)."""
    a = report["answer"]
    ch = a["choice"]
    page = Page(f"kvsim recommend — {report['model']}",
                "The policy, its hyperparameters and the smallest budget that meets the quality target on these "
                "texts: simulated for every configuration, confirmed in the model near the target.")
    page.fact("model", "model", report["model"])
    page.fact("target", "target", f"{report['target']} ({report['target_column']} ≤ {report['target_limit']:g})")
    if report.get("retrieval_prompts"):
        page.fact("segments", "pass-key prompts",
                  f"{len(report['segments'])} of {report['n_prompt']:,} tokens that the full cache answers (of "
                  f"{report['retrieval_prompts']}; they can certify retrieval ≤ {report['retrieval_certifiable']:.2f})"
                  f": {', '.join(report['segments'])}")
    else:
        page.fact("segments", "segments", f"{len(report['segments'])} of {report['n_prompt']:,} prompt + "
                                          f"{report['n_decode']:,} scored tokens: {', '.join(report['segments'])}")
    page.fact("budgets", "budgets", ", ".join(map(str, report["budgets"])))
    page.fact("runs", "closed-loop runs", str(report["model_runs"]))
    run_facts(page, report, command)
    conf, g = report["confidence"], report["guarantee"]
    boxes = [(f"{ch['budget']}", f"budget: {ch['label']}" + ("" if a["met"] else " (target NOT met)"),
              f"{a['budget_share_of_prompt']:.0%} of the prompt, {_mib(ch['kv_bytes'])} of K/V held"),
             (_loss(ch["measured"]), f"measured {report['target_column']}",
              f"predicted {_loss(ch['predicted'])}; target ≤ {report['target_limit']:g}"),
             (conf["level"], "confidence", confidence_note(conf)),
             ("—" if g["budget"] is None else str(g["budget"]), f"guaranteed budget (alpha {g['alpha']:.2g})",
              f"{g['n_units']} {g['units']} as calibration units")]
    body = numbers_html(boxes) + f"<p>{esc(conf['advice'])}.</p><p>Guarantee: {esc(g['statement'])}.</p>"
    if a["runner_up"]:
        r = a["runner_up"]
        body += (f"<p>Runner-up at budget {ch['budget']}: <b>{esc(r['label'])}</b>, measured {_loss(r['measured'])}, "
                 f"predicted {_loss(r['predicted'])}.</p>")
    body += f"<p>Use it: <code>{esc(use_command(report))}</code></p>"
    if a.get("kvpress"):
        body += f"<p>{esc(summary_line(a['kvpress']))}</p>"
    page.section("Answer", body)
    page.section("Per budget", simple_table(BUDGET_HEADERS, budget_rows(report),
                                            caption="Each budget's choice: the best confirmed configuration where "
                                                    "the budget was confirmed, else the simulator's first."))
    if plot:
        page.section("Memory against loss", figure_html(plot, FRONT_CAPTION, "memory vs loss front"))
    cfg = pd.DataFrame(report["configurations"]).sort_values(["budget", "predicted"])
    units = cfg["units"] if "units" in cfg else pd.Series(len(report["segments"]), index=cfg.index)
    rows = [[int(r.budget), r.label, r.family, float(r[report["sim_loss"]]), int(n), float(r.predicted),
             "—" if pd.isna(r.measured) else float(r.measured), _mib(float(r.kv_bytes_mean))]
            for (_, r), n in zip(cfg.iterrows(), units)]
    raced = report.get("raced")
    race_note = ("" if not raced else
                 f" Segments: how many the simulated loss is a mean over; a candidate outside the {raced['keep']} "
                 f"best at every budget on the first segment was not simulated on the others and not ranked "
                 f"({len(raced['survivors'])} of {raced['candidates']} went on).")
    page.section("Every configuration", simple_table(
        ["budget", "configuration", "family", "simulated", "segments", "predicted", "measured", "K/V held"], rows,
        label_columns=3,
        caption=f"Simulated: {report['sim_loss']}; predicted: calibrated model loss; measured: closed loop "
                f"(confirmed configurations only).{race_note}"))
    page.section("Legend", legend_html(TERMS.items()))
    return page.write(path)


def plot_front(report: dict[str, Any], path: str | Path) -> Path:
    """Memory held (x) against the model loss (y): every configuration's predicted loss (small points, one
    colour per family), the confirmed runs (black rings on their measured loss), the target (dashed) and the
    answer (star)."""
    plt = agg_pyplot()
    rows = pd.DataFrame(report["configurations"])
    fig, ax = plt.subplots(figsize=(8, 4.8))
    cmap = plt.get_cmap("tab10")
    mib = 1 / 2 ** 20
    for i, (fam, part) in enumerate(rows.groupby("family")):
        ax.scatter(part.kv_bytes_mean * mib, part.predicted, s=14, color=cmap(i % 10), alpha=0.6, label=fam)
    conf = rows.dropna(subset=["measured"])
    ax.scatter(conf.kv_bytes_mean * mib, conf.measured.clip(lower=LOSS_FLOOR), s=60, facecolors="none",
               edgecolors="black", label="confirmed in the model")
    ch = report["answer"]["choice"]
    ax.scatter([ch["kv_bytes"] * mib], [max(ch["measured"], LOSS_FLOOR)], marker="*", s=260, color="gold",
               edgecolors="black", zorder=5, label=f"answer: {ch['label']} @ {ch['budget']}")
    ax.axhline(report["target_limit"], ls="--", color="grey", lw=1)
    ax.text(ax.get_xlim()[0], report["target_limit"], f" target {report['target']}", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("K/V memory held (MiB, mean over decode steps)")
    ax.set_ylabel(f"model {report['target_column']} (predicted; rings: measured)")
    ax.set_title(f"kvsim recommend on {report['model']}: memory vs loss", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return save_figure(fig, path)


def confidence_note(conf: Mapping[str, Any]) -> str:
    """The confidence's evidence in one line: the margin, whether the guarantee certified the answer's budget, the
    simulator's order of confirmed pairs, the calibration's error."""
    t = conf["margin_t"]
    margin = "∞" if math.isinf(t) else f"{t:.1f}"
    pa = conf["pair_agreement"]
    order = "n/a" if pa is None or math.isnan(pa) else f"{pa:.0%} of {conf['pairs']}"
    cert = conf.get("certified_at_answer")          # reports written before the certificate capped the level
    certified = "" if cert is None else ("; certified at this budget" if cert else "; not certified at this budget")
    return (f"margin {margin} standard errors{certified}; pair agreement {order}; calibration error "
            f"±{math.expm1(conf['calibration_rms_log']):.0%}")


def use_command(report: Mapping[str, Any], prompt: str = "Your prompt") -> str:
    """The ``kvsim generate`` command that uses the answer, with the model as the user named it (``model_spec``:
    a registry name, folder or .gguf, which ``kvsim generate --model`` takes; not the model's id)."""
    ch = report["answer"]["choice"]
    model = report.get("model_spec") or report["model"]
    return (f"kvsim generate --model {shlex.quote(str(model))} --policy {shlex.quote(ch['spec'])} "
            f"--budget {ch['budget']} --prompt {shlex.quote(prompt)}")


def answer_lines(report: dict[str, Any]) -> list[str]:
    """The printed answer: the choice, the runner-up, the confidence, the guarantee, and the command that uses the
    choice."""
    a = report["answer"]
    ch = a["choice"]
    unit = {"delta_nll": "nats/token", "top1_disagreement": "(top-1 disagreement)",
            "retrieval_failure": "(share of pass keys lost)"}[report["target_column"]]

    def loss(c: dict[str, Any]) -> str:
        return (f"measured {c['measured']:.4f} (upper bound {c['upper_bound']:.4f}), predicted {c['predicted']:.4f} "
                f"{unit}")

    lines = [("Meets the target " if a["met"] else "NOT met at any budget tried; best at the largest ")
             + f"{report['target']}: {ch['label']} at budget {ch['budget']} "
               f"({a['budget_share_of_prompt']:.0%} of the {report['n_prompt']}-token prompt), {loss(ch)}, "
               f"{_mib(ch['kv_bytes'])} of K/V held"]
    if a["runner_up"]:
        lines.append(f"Runner-up at the same budget: {a['runner_up']['label']}, {loss(a['runner_up'])}")
    c = report["confidence"]
    lines.append(f"Confidence {c['level']}: {confidence_note(c)}. {c['advice']}.")
    g = report["guarantee"]
    lines.append(f"Guarantee (alpha {g['alpha']:.2g}, {g['n_units']} {g['units']}): {g['statement']}.")
    ahead = report.get("model_runs_ahead_unused") or 0
    lines.append(f"{report['model_runs']} closed-loop runs were made" + (
        f" ({ahead} of them ahead, for rounds the search did not need)." if ahead else "."))
    lines.append(f"Use it: {use_command(report)}")
    if a.get("kvpress"):            # answers written before the kvpress export have none
        lines.append(summary_line(a["kvpress"]))
    return lines
