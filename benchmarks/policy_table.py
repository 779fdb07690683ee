"""All policies on one trace at a few budgets: a markdown table (for the README) and a JSON result from a
``kvsim sweep`` results store.

    kvsim sweep TRACE --budgets 64,128,256 --out STORE --policies all
    python -m benchmarks.policy_table STORE --name policies_smollm2

The sweep runs before this script, so its command, wall time and the machine's load around it are passed in
(``--command``, ``--seconds``, ``--loadavg-before/--loadavg-after`` as ``/proc/loadavg`` lines) and recorded.
"""
from __future__ import annotations

import argparse

import pandas as pd

from benchmarks._util import machine, write_result
from sim.experiments.store import ResultStore


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


def sweep_record(args: argparse.Namespace) -> dict:
    """What the caller says about the sweep that made the store: its command, wall seconds, and the 1-minute load
    before and after it (the first field of each ``/proc/loadavg`` line); only the fields given."""
    out = {"sweep_command": args.command, "sweep_seconds": args.seconds,
           "load_avg_1min_before": float(args.loadavg_before.split()[0]) if args.loadavg_before else None,
           "load_avg_1min_after": float(args.loadavg_after.split()[0]) if args.loadavg_after else None}
    return {k: v for k, v in out.items() if v is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--name", default="policies_smollm2")
    ap.add_argument("--command", help="the kvsim sweep command that wrote the store")
    ap.add_argument("--seconds", type=float, help="the sweep's wall seconds")
    ap.add_argument("--loadavg-before", help="/proc/loadavg read just before the sweep")
    ap.add_argument("--loadavg-after", help="/proc/loadavg read just after the sweep")
    ap.add_argument("--merge", metavar="NOTE", help="add the store's rows to the existing result (a row of the same "
                    "label is replaced) instead of writing a new one; NOTE says why (e.g. which trace, re-recorded "
                    "how), recorded with the sweep in the result's 'merged' list")
    args = ap.parse_args()
    df = ResultStore(args.store).load()
    md, rows = table(df)
    print(md)
    if args.merge:
        path = merge(args.name, rows, {"note": args.merge, "labels": [r["label"] for r in rows],
                                       "n_configs": len(df), **sweep_record(args), "machine": machine()})
        print(f"merged {len(rows)} rows into {path}")
        return
    extra = {"sliding": sorted(df.sliding.unique().tolist())} if "sliding" in df else {}
    extra.update(sweep_record(args))
    path = write_result(args.name, {"trace": sorted(df.trace.unique().tolist()), "rows": rows,
                                    "n_configs": len(df), **extra, "machine": machine()})
    print(f"wrote {path}")


def merge(name: str, rows: list[dict], record: dict):
    """Rows added to the committed result ``name`` (same label: replaced), re-sorted by the error at its largest
    budget, with ``record`` appended to its ``merged`` list."""
    import json

    from benchmarks._util import RESULTS

    old = json.loads((RESULTS / f"{name}.json").read_text())
    new = {r["label"]: r for r in rows}
    merged = [r for r in old["rows"] if r["label"] not in new] + list(new.values())
    last = max(int(k.split("@")[1]) for k in merged[0] if k.startswith("err@"))
    merged.sort(key=lambda r: r.get(f"err@{last}", float("inf")))
    old.update(rows=merged, merged=old.get("merged", []) + [record])
    return write_result(name, old)


if __name__ == "__main__":
    main()
