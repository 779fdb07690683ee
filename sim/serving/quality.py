"""Join serving results with the replay simulator's quality loss for the same policy and budget."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from sim.serving.hardware import ServingConfigError

#: loss/quality columns looked for in a sweep results store, in display order
QUALITY_COLUMNS = ("err_mean", "mass_mean", "kl_mean", "oracle_gap_mean", "err_p95", "err_max")


def load_quality(path: str | Path) -> pd.DataFrame:
    """Per (policy, budget) means of the quality columns present in a sweep Parquet, with a row count.

    Rows of the same policy and budget (different traces, layers or hyperparameters) are averaged: the join
    answers "what does this policy at this budget lose on the swept traces", not per-hyperparameter detail.
    """
    path = Path(path)
    try:
        df = pd.read_parquet(path)
    except FileNotFoundError:
        raise ServingConfigError(f"{path}: no such quality results file") from None
    except Exception as e:  # pyarrow raises several types for non-Parquet input
        raise ServingConfigError(f"{path}: cannot read as Parquet ({e})") from None
    missing = [c for c in ("policy", "budget") if c not in df.columns]
    if missing:
        raise ServingConfigError(f"{path}: missing column(s) {missing}; need policy, budget and loss columns")
    cols = [c for c in QUALITY_COLUMNS if c in df.columns]
    if not cols:
        raise ServingConfigError(f"{path}: none of the quality columns {list(QUALITY_COLUMNS)} present")
    df = df[["policy", "budget", *cols]].copy()
    df["budget"] = pd.to_numeric(df["budget"], errors="coerce")
    g = df.groupby(["policy", "budget"], dropna=False)
    out = g[cols].mean()
    out["quality_rows"] = g.size()
    return out.reset_index()


def join_quality(summary: pd.DataFrame, quality: pd.DataFrame) -> pd.DataFrame:
    """Left join on (policy, budget); unbounded policies (budget NaN) match quality rows with any budget NaN."""
    s = summary.copy()
    s["budget"] = pd.to_numeric(s["budget"], errors="coerce")
    return s.merge(quality, on=["policy", "budget"], how="left")
