"""Every result page, rendered from small synthetic results, has the structure a reader relies on: the header's
facts, one embedded image per plot, the table's columns (a column per budget and the mean), references and paper
policies marked, the best per budget, the legend from sim.replay.metrics, and nothing fetched from the network. The terminal
prints the same numbers. (A real browser looks at the pages in tests/test_pages_browser.py when one is installed.)"""
from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest

from gpu_validate.studies.fidelity.rank_fidelity import MODEL_COLUMNS, pair_agreement, token_reliability
from gpu_validate.studies.needle.scores import prediction_report, seed_reliability, summarize
from gpu_validate.studies.fidelity.fidelity_page import fidelity_page, segments_page
from gpu_validate.studies.needle.needle_page import needle_page
from gpu_validate.studies.fidelity.segments import fidelity_by_text
from policies import get_policy
from sim.replay.metrics import column
from sim.reports.sweep_page import sweep_page
from sim.reports.report import occupancy_figure, plot_budget_curves, plot_pareto, split_sliding
from sim.reports.runinfo import load_trace_facts, save_trace_facts, trace_facts
from sim.experiments.specs import trace_id
from sim.experiments.store import ResultStore
from sim.experiments.sweep import run_sweep, with_oracle_gap
from sim.reports.table import fmt3, print_tables, ranked_tables
from traces.synthetic import make_synthetic_trace

HEADER = ("model", "budgets", "policies", "version", "date", "machine")


class PageParser(HTMLParser):
    """What a page holds: facts by key, images, tables (header cells, rows of cell texts, cell classes), sections,
    every URL-carrying attribute, tag balance."""

    def __init__(self) -> None:
        super().__init__()
        self.facts: dict[str, str] = {}
        self.images: list[str] = []
        self.urls: list[str] = []
        self.tables: list[dict] = []
        self.sections: list[str] = []
        self.depth: dict[str, int] = {}
        self._fact = None
        self._cell = None
        self._text: list[str] = []
        self.scripts_with_src = 0
        self.links = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.depth[tag] = self.depth.get(tag, 0) + 1
        for k in ("src", "href", "action", "poster", "srcset"):
            if k in a:
                self.urls.append(a[k])
        if tag == "div" and "data-fact" in a:
            self._fact, self._text = a["data-fact"], []
        elif tag == "dd" and self._fact:
            self._text = []                               # the value, not its label
        elif tag == "img":
            self.images.append(a["src"])
        elif tag == "table":
            self.tables.append({"class": a.get("class", ""), "head": [], "rows": [], "classes": []})
        elif tag == "tr" and self.tables:
            self._row, self._row_cls = [], []
        elif tag in ("td", "th"):
            self._cell, self._text = (tag, a), []
        elif tag == "section":
            self.sections.append(a.get("id", ""))
        elif tag == "script" and "src" in a:
            self.scripts_with_src += 1
        elif tag == "link":
            self.links += 1

    def handle_endtag(self, tag):
        self.depth[tag] = self.depth.get(tag, 0) - 1
        if tag == "div" and self._fact:
            self.facts[self._fact] = " ".join("".join(self._text).split())
            self._fact = None
        elif tag in ("td", "th") and self._cell:
            text = " ".join("".join(self._text).split())
            if self._cell[0] == "th":
                self.tables[-1]["head"].append(text)
            else:
                self._row.append(text)
                self._row_cls.append(self._cell[1].get("class", ""))
            self._cell = None
        elif tag == "tr" and self.tables and self._row:
            self.tables[-1]["rows"].append(self._row)
            self.tables[-1]["classes"].append(self._row_cls)

    def handle_data(self, data):
        if self._fact or self._cell:
            self._text.append(data)


def parse(path) -> tuple[PageParser, str]:
    html = path.read_text(encoding="utf-8")
    p = PageParser()
    p.feed(html)
    return p, html


def check_page(path, facts=HEADER, n_images=0):
    """The checks every page passes; returns the parsed page."""
    p, html = parse(path)
    assert html.startswith("<!DOCTYPE html>") and "<meta charset=\"utf-8\">" in html
    for tag in ("table", "tr", "td", "th", "section", "figure", "div", "dl", "details"):
        assert p.depth.get(tag, 0) == 0, f"unbalanced <{tag}>"
    for key in facts:
        assert p.facts.get(key), f"header fact {key!r} missing or empty"
    assert len(p.images) == n_images
    for src in p.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    # offline: nothing fetched, every link is to a place in the page
    assert p.scripts_with_src == 0 and p.links == 0
    assert all(u.startswith(("#", "data:")) for u in p.urls), [u for u in p.urls if not u.startswith(("#", "data:"))]
    assert not re.search(r"(https?:)?//[a-z0-9]", re.sub(r"data:[^\"]+", "", html), re.I)
    assert "<script>" in html and "sortable" in html      # the inline sorter
    return p


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A small real sweep: references, a paper policy and baselines on a synthetic trace, with its plots."""
    out = tmp_path_factory.mktemp("sweep")
    trace = make_synthetic_trace("mixed", n_tokens=96, n_prompt=24, n_layers=2)
    from sim.experiments.executors import TraceRef

    ref = TraceRef("synthetic:mixed", 96, 24, 2)
    store = ResultStore(out / "res")
    save_trace_facts(store.root, trace)
    pols = [get_policy(n) for n in ("full", "oracle", "h2o", "window", "d2o", "tova")]
    df = with_oracle_gap(run_sweep([ref], pols, [8, 16, 32], store, progress=False))
    figs = {"budget_curves": plot_budget_curves(df, out / "b.png"), "pareto": plot_pareto(df, out / "p.png"),
            "occupancy": occupancy_figure(trace, [get_policy("h2o"), get_policy("window")], 16, out / "o.png")}
    return out, trace, df, figs


def test_sweep_page_has_the_header_plots_table_and_legend(sweep):
    out, trace, df, figs = sweep
    facts = load_trace_facts(out / "res")
    assert facts == {trace_id(trace): trace_facts(trace)}
    path = sweep_page(df, out / "demo.html", title="kvsim demo — synthetic", facts=facts, figures=figs,
                      command="kvsim demo --synthetic mixed")
    p = check_page(path, facts=HEADER + ("trace", "tokens", "layers", "text", "command"), n_images=3)
    assert p.facts["tokens"] == "96 (24 prompt + 72 decode)" and p.facts["text"] == "synthetic (mixed, seed 0)"
    assert p.facts["budgets"].startswith("8, 16, 32") and p.facts["policies"] == "4 + 2 references (full, oracle)"
    main = p.tables[0]
    assert "sortable" in main["class"]
    for head in ("rank", "policy", "8", "16", "32", "err ↓ mean", "mass ↑ (mean)", "err−oracle ↓ (mean)"):
        assert head in main["head"], head
    labels = [r[1] for r in main["rows"]]
    assert labels[:2] == ["full reference", "oracle reference"] and "d2o paper" in labels
    assert [r[0] for r in main["rows"][:2]] == ["ref", "ref"]
    # rows after the references in rank order; each budget column has its best (not a reference) marked
    ranks = [float(r[0]) for r in main["rows"][2:]]
    assert ranks == sorted(ranks)
    for j, budget in zip((2, 3, 4), (8, 16, 32)):                 # cells: rank, policy, then one per budget
        marked = [i for i, cls in enumerate(main["classes"]) if cls[j] == "best"]
        assert marked and all(i >= 2 for i in marked)
        vals = [float(df[(df.label == main["rows"][i][1].split()[0]) & (df.budget == budget)].err_mean.iloc[0])
                for i in range(2, len(main["rows"]))]
        assert {i - 2 for i in marked} == {k for k, v in enumerate(vals) if v == min(vals)}
    # numbers to 3 significant digits, as the frame has them
    h2o = next(r for r in main["rows"] if r[1] == "h2o")
    assert h2o[2] == fmt3(df[(df.label == "h2o") & (df.budget == 8)].err_mean.iloc[0])
    # the legend is sim.replay.metrics' definition of each column shown
    html = path.read_text(encoding="utf-8")
    for key in ("err_mean", "mass_mean", "err_gap", "slots_mean"):
        assert column(key).doc in html.replace("&#x27;", "'"), key
    assert {"ranked-table", "legend", "loss-against-budget", "loss-against-memory-held",
            "what-each-policy-holds-over-time", "every-metric-per-budget"} <= set(p.sections)


def test_terminal_prints_the_numbers_the_page_shows(sweep):
    from rich.console import Console

    out, trace, df, figs = sweep
    path = sweep_page(df, out / "same.html", title="t", figures={})
    page_rows = {r[1].split()[0]: r for r in parse(path)[0].tables[0]["rows"]}
    console = Console(record=True, width=200)
    print_tables(ranked_tables(df), "t", console=console)
    text = console.export_text()
    for label, row in page_rows.items():
        line = next(x for x in text.splitlines() if re.match(rf"\s*\S+\s+{re.escape(label)}\b", x))
        assert line.split()[-len(row[2:]):] == row[2:], label


def test_hybrid_results_get_one_table_per_sliding_mode_and_say_what_is_compressed(sweep):
    out, trace, df, _ = sweep
    facts = trace_facts(trace)
    facts.update(layers=[0, 5], n_model_layers=18, global_layers=[5], attention="1 global + 1 sliding-window (512)")
    both = pd.concat([df.assign(sliding="keep", n_layers_compressed=1),
                      df.assign(sliding="compress", n_layers_compressed=2)], ignore_index=True)
    tables = ranked_tables(split_sliding(both))
    assert [t.trace for t in tables] == ["synthetic:mixed", "synthetic:mixed (sliding: compress)"]
    path = sweep_page(split_sliding(both), out / "hybrid.html", title="hybrid", facts={trace_id(trace): facts})
    p = check_page(path)
    assert len([t for t in p.tables if "ranked" in t["class"]]) >= 2
    html = path.read_text(encoding="utf-8")
    assert "Policies compress 1 of the 2 stored layers (the global ones: 5)" in html
    assert p.facts["layers"] == "0, 5 of 18 (1 global + 1 sliding-window (512))"


def test_fmt3_is_three_significant_digits():
    assert [fmt3(x) for x in (1.264e-07, 0.04452, 12.345, 32768, 0.5, 0, float("nan"), -0.00345, 2.95e7)] == \
        ["1.26e-7", "0.0445", "12.3", "32,800", "0.500", "0", "—", "-0.00345", "2.95e7"]


# ----- fidelity -----

def _fidelity_report(n_tokens: int = 64) -> dict:
    """A fidelity report as run_fidelity writes it, for 4 policies x 2 budgets, with per-token ΔNLL."""
    rng = np.random.default_rng(0)
    rows = []
    for b in (8, 16):
        for i, pol in enumerate(("full", "h2o", "window", "tova", "buzz")):
            harm = 0.0 if pol == "full" else (i + 1) / b
            tok = harm + (rng.normal(0, 0.02, n_tokens) if pol != "full" else np.zeros(n_tokens))
            err = harm + rng.normal(0, 0.01) * (pol != "full")
            rows.append({"policy": pol, "label": pol, "budget": b, "err_mean": err,
                         "err_p95": 2 * harm, "kl_mean": harm / 2, "l1_mean": 3 * harm, "mass_mean": 1 - harm / 4,
                         "miss_mass": harm / 4, "delta_nll": float(tok.mean()),
                         "delta_ppl": float(np.expm1(tok.mean())),
                         "top1_disagreement": harm / 3, "kept_agreement": 1.0, "nll_per_token": tok.tolist()})
    from gpu_validate.studies.fidelity.rank_fidelity import correlations, within_budget_correlations

    rho = correlations(rows)
    return {"model": "tiny-test", "backend": "torch", "device": "cpu", "n_prompt": 32, "n_decode": n_tokens + 1,
            "n_open_steps": 8, "policies": ["full", "h2o", "window", "tova", "buzz"], "budgets": [8, 16],
            "skipped": ["oracle"], "spearman": rho, "spearman_within_budget": within_budget_correlations(rows),
            "best_sim_metric": {}, "rho_primary": rho["err_mean"]["delta_nll"], "kept_agreement": 1.0,
            "target": {"rho": 0.9, "kept_agreement": 0.99}, "rows": rows, "seconds": 12.0, "text": "test-text",
            "kvsim": "0.1.0", "date": "2025-01-01 00:00 UTC", "machine": "test machine", "command": "kvsim fidelity",
            "model_reliability": token_reliability(rows), "pair_agreement": pair_agreement(rows)}


def test_reliability_and_pair_agreement_measure_what_they_say():
    rep = _fidelity_report()
    rel = rep["model_reliability"]
    assert rel["n_blocks"] == 8 and rel["within_budget"] > 0.9 and rel["pooled"] > 0.9   # clear separation
    pairs = rep["pair_agreement"]
    assert pairs["n_pairs"] == 12 and pairs["agreement"] == 1.0 and pairs["ties"] == 0
    assert pairs["confusion"]["model_a_worse"]["sim_b_worse"] == 0
    flipped = [{**r, "err_mean": -r["err_mean"]} for r in rep["rows"]]
    assert pair_agreement(flipped)["agreement"] == 0.0
    a_worse = sum(pairs["confusion"]["model_a_worse"].values())
    assert pairs["base_rate"] == max(a_worse, 12 - a_worse) / 12
    noise = [{**r, "nll_per_token": np.random.default_rng(i).normal(0, 1, 64).tolist()} for i, r in
             enumerate(rep["rows"])]
    assert token_reliability(noise)["pooled"] < 0.6                    # no signal: the model disagrees with itself
    assert token_reliability([{**r, "nll_per_token": r["nll_per_token"][:16]} for r in rep["rows"]]) is None


def test_fidelity_page(tmp_path):
    from sim.reports.plotting import agg_pyplot, save_figure

    plt = agg_pyplot()
    png = save_figure(plt.subplots()[0], tmp_path / "f.png")
    path = fidelity_page(_fidelity_report(), tmp_path / "f.html", plot=png)
    p = check_page(path, facts=HEADER + ("text", "tokens", "device", "command"), n_images=1)
    html = path.read_text(encoding="utf-8")
    assert "the model&#x27;s own reliability" in html and "base rate" in html
    conf = next(t for t in p.tables if "simulator: A loses more" in t["head"])
    assert [r[0] for r in conf["rows"]] == ["model: A loses more", "model: B loses more"]
    assert sum(int(x) for r in conf["rows"] for x in r[1:]) == 12
    sim_vs_model = next(t for t in p.tables if "ΔNLL: ρ within budget" in t["head"])
    assert sim_vs_model["rows"][-1][0] == "the model against itself (reliability)"
    ranked = [t for t in p.tables if "ranked" in t["class"]]
    assert len(ranked) == 2 and {"8", "16", "ΔNLL ↓ mean"} <= set(ranked[0]["head"])
    assert ranked[0]["rows"][0][:2] == ["ref", "full reference"] and "buzz paper" in [r[1] for r in ranked[0]["rows"]]
    for c in MODEL_COLUMNS.values():
        assert c.doc.split(",")[0] in html.replace("&#x27;", "'")


def test_fidelity_page_of_a_stored_result_without_the_new_fields(tmp_path):
    rep = _fidelity_report()
    for k in ("model_reliability", "pair_agreement", "kvsim", "date", "machine", "command", "text"):
        rep.pop(k)
    p = check_page(fidelity_page(rep, tmp_path / "old.html"), facts=("model", "budgets", "date", "machine"))
    assert "not recorded" in p.facts["date"]


def test_segments_page(tmp_path):
    rng = np.random.default_rng(1)
    rows = [{"text": t, "segment": f"{t}@{s}", "label": lab, "budget": b, "err_mean": h / b + rng.normal(0, .01),
             "err_wo_mean": h / b + rng.normal(0, .005), "delta_nll": h / b + rng.normal(0, .01),
             "top1_disagreement": h / (2 * b)}
            for t in ("default", "idle") for s in range(4) for b in (32, 64)
            for h, lab in enumerate(("h2o", "tova", "snapkv", "buzz"), start=1)]
    merged = pd.DataFrame(rows)
    res = fidelity_by_text(merged, ["err_mean", "err_wo_mean"], ["delta_nll", "top1_disagreement"])
    rep = {"model": "m", "policies": ["h2o", "tova", "snapkv", "buzz"], "budgets": [32, 64], "n_prompt": 64,
           "n_decode": 16, "texts": {"default": "d-id", "idle": "i-id"}, "segments_per_text": {"default": 4, "idle": 4},
           "backend": "torch", "device": "cpu", "sim_losses": ["err_mean", "err_wo_mean"],
           "model_losses": {"delta_nll": "ΔNLL", "top1_disagreement": "top-1"}, "by_text": res, "rows": rows,
           "seconds": 60.0, "machine": {"platform": "Linux", "processor": "x86_64", "cpu_count": 2},
           "kvsim": "0.1.0", "date": "2025-01-01 00:00 UTC"}
    rep = json.loads(json.dumps(rep, default=float))              # as read back from the JSON file
    p = check_page(segments_page(rep, tmp_path / "s.html"), facts=HEADER + ("text", "tokens"))
    rel = [t for t in p.tables if t["rows"] and t["rows"][0][0] == "the model against itself (reliability)"]
    assert len(rel) == 2 and rel[0]["head"][1:4] == ["ρ at 32", "ρ at 64", "ρ within budget"]
    assert p.facts["machine"] == "Linux, x86_64, 2 cores"


# ----- needle -----

def _needle_report():
    rng = np.random.default_rng(2)
    rows, feats = [], []
    for L in (256, 512):
        for d in (0.0, 1.0):
            for seed in (1, 2, 3):
                pid = f"L{L}-d{d:g}-s{seed}"
                rows.append({"prompt_id": pid, "length": L, "depth": d, "seed": seed, "policy": "full",
                             "label": "full", "budget": 1, "success": True})
                for pol in ("h2o", "snapkv", "buzz"):
                    for b in (32, 64):
                        share = float(rng.uniform())
                        rows.append({"prompt_id": pid, "length": L, "depth": d, "seed": seed, "policy": pol,
                                     "label": pol, "budget": b, "success": share > 0.5 - b / 400})
                        feats.append({"prompt_id": pid, "label": pol, "budget": b, "retained_share": share,
                                      "first_answer_step": float(rng.uniform())})
    df = pd.DataFrame(rows)
    merged = df[df.policy != "full"].merge(pd.DataFrame(feats), on=["prompt_id", "label", "budget"])
    merged["full_success"] = merged.length < 512                 # the full cache fails the longer prompts
    summary = summarize(df)
    pred = prediction_report(merged, [1])
    rep = {"model": "m", "backend": "torch", "device": "cpu", "lengths": [256, 512], "depths": [0.0, 1.0],
           "seeds": [1, 2, 3], "policies": ["h2o", "snapkv", "buzz"], "budgets": [32, 64], "n_prompts": 12,
           "text": "default", "kvsim": "0.1.0", "date": "2025-01-01 00:00 UTC", "machine": "test machine",
           **summary, "sim_agreement": pred["sim_agreement"], "prediction": pred, "predictor": "retained_share: ...",
           "model_reliability": seed_reliability(summary["accuracy_by_seed"], [1])}
    return json.loads(json.dumps(rep, default=float)), df


def test_needle_prediction_has_its_base_rate_and_per_configuration_numbers():
    rep, df = _needle_report()
    pred = rep["prediction"]
    truth = df[(df.policy != "full") & (df.seed != 1)].success
    assert pred["base_rate"] == pytest.approx(max(truth.mean(), 1 - truth.mean()))
    assert set(pred["per_config"]) == {f"{p}@{b}" for p in ("h2o", "snapkv", "buzz") for b in (32, 64)}
    assert sum(v["n"] for v in pred["per_config"].values()) == pred["n_test_cells"]
    assert -1 <= pred["rho_accuracy"] <= 1 and rep["model_reliability"]["n_configs"] == 6
    assert rep["accuracy_by_seed"]["h2o@32"].keys() == {"1", "2", "3"}


def test_needle_page(tmp_path):
    from gpu_validate.studies.needle.scores import plot_needle

    rep, df = _needle_report()
    png = plot_needle(df, tmp_path / "n.png")
    p = check_page(needle_page(rep, tmp_path / "n.html", plot=png), facts=HEADER + ("text", "prompts"), n_images=1)
    ranked = next(t for t in p.tables if "ranked" in t["class"])
    assert {"32", "64", "accuracy ↑ mean", "predicted ↑ (mean)", "agreement ↑ (mean)"} <= set(ranked["head"])
    assert ranked["rows"][0][:3] == ["ref", "full reference", "1.00"] and "buzz paper" in [r[1] for r in ranked["rows"]]
    conf = [t for t in p.tables if "simulator: retrieves" in t["head"]]
    assert len(conf) == 2 and [r[0] for r in conf[0]["rows"]] == ["model retrieves", "model fails"]
    c = rep["prediction"]["confusion"]
    assert [int(x) for x in conf[0]["rows"][0][1:]] == [c["model_ok_pred_ok"], c["model_ok_pred_fail"]]
    text = (tmp_path / "n.html").read_text(encoding="utf-8")
    assert "base rate" in text and "the model against itself on other seeds" in text
    pred = rep["prediction"]
    per = next(t for t in p.tables if t["head"][0] == "policy" and "MCC" in t["head"])
    assert per["head"][:5] == ["policy", "agreement", "base rate", "balanced accuracy", "MCC"]
    assert [r[0] for r in per["rows"]] == list(pred["per_policy"])
    by_len = next(t for t in p.tables if t["head"][0] == "context tokens")
    assert [r[0] for r in by_len["rows"]] == ["256", "512"]
    assert f"balanced accuracy {fmt3(pred['balanced_accuracy'])}, MCC {fmt3(pred['mcc'])}" in text


def test_needle_page_of_a_result_stored_before_balanced_accuracy(tmp_path):
    """Results stored before the prediction carried balanced accuracy and MCC still render: the overall scores from
    the confusion, the per-policy base rate from the accuracy, the rest left blank."""
    from gpu_validate.studies.needle.scores import confusion_scores

    rep, _ = _needle_report()
    pred = rep["prediction"]
    for k in ("base_rate", "balanced_accuracy", "mcc", "objective", "per_length", "train_balanced_accuracy"):
        pred.pop(k)
    pred["per_policy"] = {lab: {k: v[k] for k in ("agreement", "accuracy", "predicted_accuracy", "n")}
                          for lab, v in pred["per_policy"].items()}
    pred["candidates"] = {f: {k: v[k] for k in ("threshold", "train_agreement", "heldout_agreement")}
                          for f, v in pred["candidates"].items()}
    p = check_page(needle_page(rep, tmp_path / "old.html"), facts=HEADER + ("text", "prompts"))
    sc = confusion_scores(pred["confusion"])
    text = (tmp_path / "old.html").read_text(encoding="utf-8")
    assert f"balanced accuracy {fmt3(sc['balanced_accuracy'])}, MCC {fmt3(sc['mcc'])}" in text
    assert "by agreement" in text                                     # what such a result was fitted by
    per = next(t for t in p.tables if t["head"][0] == "policy" and "MCC" in t["head"])
    assert all(r[3] == "—" and r[4] == "—" and r[2] != "—" for r in per["rows"])
    assert not [t for t in p.tables if t["head"][0] == "context tokens"]


def test_fidelity_cli_writes_its_page(tmp_path, capsys):
    """The real command on the shipped tiny model: JSON, PNG and the page beside them, and where the page is."""
    from sim.cli import main

    out = tmp_path / "fid.json"
    assert main(["fidelity", "--model", "tiny", "--prompt", "32", "--decode", "40", "--policies", "window;h2o;snapkv",
                 "--budgets", "8,16", "--open-steps", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"page: {out.with_suffix('.html')}" in printed and "ΔNLL@8" in printed
    rep = json.loads(out.read_text())
    assert rep["pair_agreement"]["n_pairs"] + rep["pair_agreement"]["ties"] == 6 and rep["kvsim"] and rep["text"]
    p = check_page(out.with_suffix(".html"), facts=HEADER + ("text", "tokens", "command"), n_images=1)
    assert p.facts["command"].startswith("kvsim fidelity --model tiny")
