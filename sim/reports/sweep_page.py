"""The page of a sweep's results (``kvsim demo``, ``kvsim report``): what was run, the ranked table per budget with
what it says, the plots with how to read them, every other metric per budget, and the legend.

The tables are `sim.reports.table.RankedTable` objects, the ones the terminal prints; the legend comes from `sim.replay.metrics`;
the figures are the PNGs the command wrote beside the page, embedded so the page is one self-contained file.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from sim.reports.runinfo import describe_layers, describe_tokens, kvsim_version, machine, now
from sim.reports.table import REFERENCES, RankedTable, fmt3, ranked_tables
from sim.reports.webpage import Page, esc, figure_html, legend_html, ranked_legend_items, ranked_table_html, simple_table

#: how to read each figure a sweep page can show (one line each), by figure key
CAPTIONS = {
    "budget_curves": "Each line is a policy: the loss (left) and the retained attention mass (right) against the "
                     "budget, slots per KV head on a log scale. Lower is better on the left, higher on the right. The "
                     "dashed black line is the oracle, the most attention mass a cache of that size can hold; "
                     "coloured lines are the best few policies and the paper policies, grey lines the rest (all of "
                     "them are in the table).",
    "pareto": "Each point is a policy at one budget: its loss against the KV memory it actually held (all layers, "
              "mean over the decode steps, log scale). The black line joins the configurations that no other beats "
              "on both; a point to the right of it pays memory for nothing.",
    "occupancy": "Which token positions (y) each policy holds at each decode step (x), shaded by the share of "
                 "layers and KV heads that hold them (bright = all). The cyan diagonal is the newest token: a bright "
                 "band along it is a recent window, a horizontal band is a token kept for good (a sink or a heavy "
                 "hitter), gaps are what was evicted.",
}
FIGURE_TITLES = {"budget_curves": "Loss against budget", "pareto": "Loss against memory held",
                 "occupancy": "What each policy holds over time"}

#: further per-budget tables of a sweep page, each ranked by its own metric (those present in the results)
MORE_METRICS = ("mass_mean", "err_gap", "err_p95", "kl_mean", "l1_mean", "slots_mean", "kv_bytes_mean")


def findings(table: RankedTable) -> list[str]:
    """What a ranked table says, in a few sentences: the best evicting policy at each budget against the oracle,
    and where the paper policies rank."""
    m = table.metric
    by_label = {r.label: r for r in table.rows}
    lines = []
    for j, c in enumerate(table.columns):
        if c.budget is None or c.metric.key != m.key:
            continue
        best = [r for r in table.rows if r.best[j]]
        if not best:
            continue
        text = (f"At budget {c.budget} the best policy is {', '.join(r.label for r in best)} "
                f"({m.short} {fmt3(best[0].values[j])})")
        orc = by_label.get("oracle")
        if orc is not None and np.isfinite(orc.values[j]):
            text += f"; the oracle reaches {fmt3(orc.values[j])}"
            ratio = best[0].values[j] / orc.values[j] if m.direction == "lower" and orc.values[j] > 0 else np.nan
            if ratio >= 1:
                text += f", so the best policy loses {fmt3(ratio)}× as much"
            elif ratio < 1:
                text += (f", above the best policy's: the oracle keeps the most attention mass, not always the "
                         f"lowest {m.short}")
        lines.append(text + ".")
    ranked = [r for r in table.rows if r.role != "reference"]
    paper = [r for r in ranked if r.role == "paper"]
    if paper:
        top = min(paper, key=lambda r: r.rank)
        who = f"Among the {len(paper)} paper policies, {top.label} ranks best" if len(paper) > 1 else \
            f"The paper policy {top.label} ranks"
        lines.append(f"{who}: {fmt3(top.rank)} of {len(ranked)} on average over the budgets.")
    return lines


def compression_note(table: RankedTable, facts: Mapping[str, Any] | None) -> str:
    """Which layers the policies compress (hybrid models: the global ones unless ``--sliding compress``)."""
    if not facts:
        return ""
    n = len(facts["layers"])
    comp = table.n_layers_compressed
    if table.sliding == "compress" or comp is None or comp >= n:
        return f"Policies compress all {n} stored layers." if facts["attention"].count("sliding") else ""
    return (f"Policies compress {comp} of the {n} stored layers (the global ones: "
            f"{', '.join(map(str, facts['global_layers']))}); the sliding-window layers keep their window, the "
            "model's own cache, which is counted in the memory held.")


def _trace_rows(facts: Sequence[Mapping[str, Any]]) -> list[list[object]]:
    return [[f["name"], f["model"], describe_tokens(f), describe_layers(f), f["text"]] for f in facts]


def sweep_page(df: pd.DataFrame, path: str | os.PathLike, *, title: str, metric: str = "err_mean",
               facts: Mapping[str, Mapping[str, Any]] | None = None, figures: Mapping[str, str | os.PathLike] = (),
               command: str | None = None, lede: str | None = None) -> Path:
    """Write the page of a sweep's results ``df`` (sweep rows with the oracle gap) to ``path``.

    ``facts``: per trace id, `sim.reports.runinfo.trace_facts` (the model, tokens, layers and text in the header; without
    them the header says what the rows say); ``figures``: PNGs by key of `CAPTIONS` (budget_curves, pareto,
    occupancy), embedded in that order; ``command``: the command line that produced the results.
    """
    facts = dict(facts or {})
    tables = ranked_tables(df, metric)
    ids = list(dict.fromkeys(df["trace_id"])) if "trace_id" in df else []
    known = [facts[i] for i in ids if i in facts]
    labels = list(dict.fromkeys(df.label))
    refs = sorted((lab for lab in labels if lab in REFERENCES), key=lambda lab: lab != "full")   # as in the table
    budgets = sorted(int(b) for b in df.budget.unique())
    page = Page(title, lede or "Every policy replayed on the trace at each budget, measured against the full "
                              "cache's attention at every decode step.")
    models = sorted({f["model"] for f in known})
    page.fact("model", "model", ", ".join(models) if models else "not recorded in this results store")
    if len(known) == 1 and len(ids) == 1:
        f = known[0]
        page.fact("trace", "trace", f["name"]).fact("tokens", "tokens", describe_tokens(f))
        page.fact("layers", "layers kept", describe_layers(f)).fact("text", "text", f["text"])
    else:
        names = list(dict.fromkeys(df.trace))
        page.fact("trace", "traces", f"{len(names)}: {', '.join(names)}" if len(names) > 1 else names[0])
        if not known and "n_tokens" in df:
            page.fact("tokens", "tokens", ", ".join(f"{int(t):,}" for t in sorted(df.n_tokens.unique())))
    page.fact("policies", "policies", f"{len(labels) - len(refs)}" + (f" + {len(refs)} references "
                                                                      f"({', '.join(refs)})" if refs else ""))
    page.fact("budgets", "budgets", f"{', '.join(map(str, budgets))} slots per KV head and layer")
    if "sliding" in df and (df.sliding.fillna("keep") != "keep").any():
        page.fact("sliding", "sliding layers", ", ".join(sorted(df.sliding.fillna("keep").unique())))
    page.fact("version", "kvsim", kvsim_version()).fact("date", "date", now()).fact("machine", "machine", machine())
    if command:
        page.fact("command", "command", command)

    body = []
    for t in tables:
        tf = next((facts[i] for i in df[df.trace == t.trace].get("trace_id", pd.Series(dtype=str)).unique()
                   if i in facts), None)
        if len(tables) > 1:
            body.append(f"<h3>{esc(t.trace)}</h3>")
            if tf:
                body.append(f"<p>{esc(tf['model'])}: {esc(describe_tokens(tf))} tokens; layers "
                            f"{esc(describe_layers(tf))}; text: {esc(tf['text'])}.</p>")
        note = compression_note(t, tf)
        body.append("<ul>" + "".join(f"<li>{esc(x)}</li>" for x in findings(t) + ([note] if note else []))
                    + "</ul>")
        body.append(ranked_table_html(t, caption=f"Policies ranked by {t.metric.short}, the {t.metric.label}, "
                                                 "best first; references on top. Click a header to sort."))
    page.section("Ranked table", "".join(body))
    if tables:
        page.section("Legend", legend_html(ranked_legend_items(tables[0])))
    figs = [(k, figures[k]) for k in CAPTIONS if k in dict(figures)]
    for key, png in figs:
        page.section(FIGURE_TITLES[key], figure_html(png, CAPTIONS[key], FIGURE_TITLES[key]))
    more = []
    for key in MORE_METRICS:
        if key == metric or key not in df or df[key].isna().all():
            continue
        for t in ranked_tables(df, key, extras=()):
            head = t.trace + (f" — sliding layers: {t.sliding}" if t.sliding != "keep" else "")
            more.append(f"<details><summary>{esc(t.metric.short)}: {esc(t.metric.label)} "
                        f"({t.metric.direction} is better){esc(' — ' + head) if len(tables) > 1 else ''}"
                        f"</summary>{ranked_table_html(t, caption=t.metric.doc)}</details>")
    if more:
        page.section("Every metric per budget", "<p>Each table ranks the policies by its own metric. Click to "
                                                "open.</p>" + "".join(more))
    if len(known) > 1:
        page.section("Traces", simple_table(["trace", "model", "tokens", "layers kept", "text"], _trace_rows(known),
                                            label_columns=5))
    return page.write(path)
