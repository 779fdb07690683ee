"""All policies on one trace at a few budgets: a markdown table (for the README) and a JSON result from a
``kvsim sweep`` results store.

    kvsim sweep TRACE --budgets 64,128,256 --out STORE --policies all
    python -m benchmarks.policy_table STORE --name policies_smollm2
"""
from __future__ import annotations

import argparse

import pandas as pd

from benchmarks._util import machine, write_result
from sim.store import ResultStore


def table(df: pd.DataFrame) -> tuple[str, list[dict]]:
    """Rows per policy label (best mean error first at the largest budget): mean relative attention-output
    error and mean retained attention mass per budget (the markdown), and the mean K+V memory held over all
    stored layers in MB (the JSON)."""
    budgets = sorted(df.budget.unique())
    rows = []
    for label, g in df.groupby("label"):
        by = g.set_index("budget")
        rows.append({"label": label, **{f"err@{b}": float(by.err_mean.get(b, float("nan"))) for b in budgets},
                     **{f"mass@{b}": float(by.mass_mean.get(b, float("nan"))) for b in budgets},
                     **{f"kv_mb@{b}": float(by.kv_bytes_mean.get(b, float("nan"))) / 1e6 for b in budgets}})
    rows.sort(key=lambda r: r[f"err@{budgets[-1]}"])
    head = "| policy | " + " | ".join(f"err @{b}" for b in budgets) + " | " + \
        " | ".join(f"mass @{b}" for b in budgets) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(budgets))]
    for r in rows:
        lines.append(f"| `{r['label']}` | " + " | ".join(f"{r[f'err@{b}']:.3f}" for b in budgets) + " | " +
                     " | ".join(f"{r[f'mass@{b}']:.3f}" for b in budgets) + " |")
    return "\n".join(lines), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--name", default="policies_smollm2")
    args = ap.parse_args()
    df = ResultStore(args.store).load()
    md, rows = table(df)
    print(md)
    extra = {"sliding": sorted(df.sliding.unique().tolist())} if "sliding" in df else {}
    path = write_result(args.name, {"trace": sorted(df.trace.unique().tolist()), "rows": rows,
                                    "n_configs": len(df), **extra, "machine": machine()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
