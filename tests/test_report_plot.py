"""The budget plot stays readable with many policies: oracle, best few and paper policies in colour, rest grey."""
from __future__ import annotations

import pandas as pd

from sim.reports.report import _highlighted, plot_budget_curves


def _frame() -> pd.DataFrame:
    errs = {"oracle": 0.1, "full": 0.0, "tova": 0.2, "h2o": 0.3, "snapkv": 0.35, "window": 1.3, "random": 1.4,
            "d2o": 0.9, "buzz": 0.5, "ada_snapkv(floor_alpha=0.2)": 0.6}
    rows = [{"trace": "t", "label": lab, "budget": b, "err_mean": e / b, "mass_mean": 1 - e / b}
            for lab, e in errs.items() for b in (32, 64)]
    return pd.DataFrame(rows)


def test_highlighting_picks_oracle_best_lossy_and_paper_policies():
    coloured, grey = _highlighted(_frame(), "err_mean", best=2)
    assert coloured == ["oracle", "tova", "h2o", "buzz", "ada_snapkv(floor_alpha=0.2)", "d2o"]
    assert grey == ["full", "snapkv", "window", "random"]


def test_plot_is_written_with_a_model_title(tmp_path):
    png = plot_budget_curves(_frame(), tmp_path / "p.png", title="kvsim demo — SmolLM2-135M-Instruct")
    assert png.stat().st_size > 10_000
