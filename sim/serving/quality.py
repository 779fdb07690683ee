"""Join serving results with the replay simulator's quality loss for the same policy and budget."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from sim.experiments.store import ResultStore
from sim.replay.metrics import COLUMNS, METRICS
from sim.serving.hardware import ServingConfigError

#: loss/quality columns looked for in a sweep results store, in display order (the first present is plotted): every
#: metric's mean, losses (lower is better) first, then the gaps to the oracle and the percentiles (sim.replay.metrics)
QUALITY_COLUMNS = tuple([f"{m.name}_mean" for m in sorted(METRICS, key=lambda m: m.direction == "higher")]
                        + [k for k in COLUMNS if k.endswith("_gap")]
                        + [f"{m.name}_p{p}" for m in METRICS for p in m.percentiles])


def _read(path: Path) -> pd.DataFrame:
    if path.is_dir():
        df = ResultStore(path).load()
        if df.empty:
            raise ServingConfigError(f"{path}: results store has no rows")
        return df
    try:
        return pd.read_parquet(path)
    except FileNotFoundError:
        raise ServingConfigError(f"{path}: no such quality results file or store") from None
    except Exception as e:  # pyarrow raises several types for non-Parquet input
        raise ServingConfigError(f"{path}: cannot read as Parquet ({e})") from None


def load_quality(path: str | Path) -> pd.DataFrame:
    """Per (policy key, budget) means of the quality columns of a sweep store (directory) or Parquet file.

    The key is the policy ``label`` (name plus non-default hyperparameters) when the store has one, else the
    policy name. Rows sharing key and budget (different traces) are averaged; ``quality_rows`` counts them.
    Oracle gaps (``err_gap``, ``mass_gap``) are added when the store holds oracle rows.
    """
    path = Path(path)
    df = _read(path)
    missing = [c for c in ("policy", "budget") if c not in df.columns]
    if missing:
        raise ServingConfigError(f"{path}: missing column(s) {missing}; need policy, budget and loss columns")
    if {"label", "trace_id", "err_mean", "mass_mean"} <= set(df.columns) and (df["policy"] == "oracle").any():
        from sim.experiments.sweep import with_oracle_gap   # the sweep's policy registry, for oracle rows only
        df = with_oracle_gap(df)
    cols = [c for c in QUALITY_COLUMNS if c in df.columns]
    if not cols:
        raise ServingConfigError(f"{path}: none of the quality columns {list(QUALITY_COLUMNS)} present")
    key = "label" if "label" in df.columns else "policy"
    df = df.assign(quality_key=df[key].astype(str), budget=pd.to_numeric(df["budget"], errors="coerce"))
    g = df.groupby(["quality_key", "budget"], dropna=False)
    out = g[cols].mean()
    out["quality_rows"] = g.size()
    out = out.reset_index()
    out.attrs["key"] = key
    return out


def join_quality(summary: pd.DataFrame, quality: pd.DataFrame) -> pd.DataFrame:
    """Left join on (policy key, budget); a row without budget (unbounded policy) takes the mean over budgets.

    ``summary`` needs ``policy``, ``policy_label`` (the policy's label without budget) and ``budget``.
    """
    key = quality.attrs.get("key", "policy")
    s = summary.assign(quality_key=summary["policy_label" if key == "label" else "policy"].astype(str),
                       budget=pd.to_numeric(summary["budget"], errors="coerce"))
    cols = [c for c in quality.columns if c not in ("quality_key", "budget")]
    bounded = s.merge(quality, on=["quality_key", "budget"], how="left")
    any_budget = quality.groupby("quality_key")[cols].agg(
        {**{c: "mean" for c in cols if c != "quality_rows"}, "quality_rows": "sum"}).reset_index()
    unb = s.merge(any_budget, on="quality_key", how="left")
    nan_budget = s["budget"].isna().to_numpy()
    bounded.loc[nan_budget, cols] = unb.loc[nan_budget, cols].to_numpy()
    return bounded.drop(columns="quality_key")
