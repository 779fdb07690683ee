"""The ranked table of a result, built once and drawn twice: in the terminal (rich) and in the HTML page.

A `RankedTable` holds, per policy, one column per budget of the ranking metric and their mean, then the mean of a
few other metrics; each row knows whether it is a reference (the oracle: the most attention mass a cache of that
size can hold; the full cache: loss-free) or a paper policy, and each cell whether it is the best of its budget
among the evicting policies. Headers, directions and the legend come from `sim.replay.metrics` (one definition per
metric), and every number is written by `fmt3` (3 significant digits), so the terminal and the page cannot
disagree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from sim.replay.metrics import Column, column

#: the seed papers' policies: marked in tables, always drawn in colour in the budget plot
PAPER_POLICIES = ("buzz", "buzz_logn", "bumblebee", "cascading", "ada_snapkv", "ada_pyramidkv", "ada_h2o", "d2o")

#: reference rows, never ranked nor "best": what each one is
REFERENCES = {
    "full": "the full cache: every token kept, the loss-free reference (and the most memory)",
    "oracle": "the future-attention oracle: at every step the tokens the true attention row weighs most; an upper "
              "bound on retained attention mass that no online policy reaches (for the other metrics a strong "
              "reference, not a bound)",
}

#: summary columns shown after the ranking metric, as their mean over the budgets
DEFAULT_EXTRAS = ("mass_mean", "err_gap", "slots_mean")

#: memory columns: lower is smaller, not better, so no cell of theirs is ever highlighted as the best
MEMORY_COLUMNS = frozenset({"slots_mean", "slots_peak", "kv_bytes_mean"})

ROLE_DOCS = {
    "reference": "a reference, not a policy to choose: " + "; ".join(f"{k} is {v}" for k, v in REFERENCES.items()),
    "paper": "a policy from one of the seed papers (BUZZ, BumbleBee, Ada-KV, Cascading KV cache, D2O)",
    "best": "the best evicting policy at that budget (references excluded; ties all marked)",
}


def base_name(label: str) -> str:
    """The policy name of a label: ``ada_snapkv(floor_alpha=0.2)`` -> ``ada_snapkv``, ``h2o:recent_ratio=..`` ->
    ``h2o``."""
    return label.split(":")[0].split("(")[0].strip()


def role(label: str) -> str:
    """``reference`` (oracle, full cache), ``paper`` (a seed paper's policy) or ``""``."""
    name = base_name(label)
    if name in REFERENCES and label in REFERENCES:
        return "reference"
    return "paper" if name in PAPER_POLICIES else ""


def fmt3(x: float) -> str:
    """A number to 3 significant digits, readable: ``0.0445``, ``1.26e-7``, ``32,800``, ``—`` for a missing value."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    x = float(x)
    if math.isinf(x):
        return "∞" if x > 0 else "−∞"
    if x == 0:
        return "0"
    x = float(f"{x:.3g}")                       # round first: 999.7 -> 1000 changes the exponent
    e = math.floor(math.log10(abs(x)))
    if -3 <= e < 6:
        return f"{x:,.{max(0, 2 - e)}f}"
    mant, exp = f"{x:.2e}".split("e")
    return f"{mant}e{int(exp)}"


@dataclass(frozen=True)
class TableColumn:
    """One value column: ``key`` is unique in the table (``err_mean@64``, ``err_mean``), ``metric`` the
    `sim.replay.metrics.Column` it shows, ``budget`` the budget (None: mean over the budgets), ``highlight`` whether its
    best cell is marked."""

    key: str
    header: str
    metric: Column
    budget: int | None = None
    highlight: bool = True


@dataclass(frozen=True)
class Row:
    """One policy: its label, role (``reference``, ``paper`` or ``""``), mean rank over the budgets among the
    evicting policies (NaN for a reference), its values in column order and which of them are the best."""

    label: str
    role: str
    rank: float
    values: tuple[float, ...]
    best: tuple[bool, ...]


@dataclass
class RankedTable:
    """A ranked table of one trace (and one ``sliding`` mode): references first, then policies by mean rank."""

    trace: str
    metric: Column
    budgets: list[int]
    columns: list[TableColumn]
    rows: list[Row]
    sliding: str = "keep"
    n_layers_compressed: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ranking_columns(self) -> list[TableColumn]:
        """The ranking metric's columns: one per budget, then the mean."""
        return [c for c in self.columns if c.metric.key == self.metric.key]

    def legend(self) -> list[tuple[str, Column]]:
        """(header, metric column) of every metric the table shows, in column order, each once."""
        seen: dict[str, Column] = {}
        for c in self.columns:
            seen.setdefault(c.metric.key, c.metric)
        return [(m.short, m) for m in seen.values()]


def _as_column(metric: str | Column) -> Column:
    return metric if isinstance(metric, Column) else column(metric)


def ranked_tables(df: pd.DataFrame, metric: str | Column = "err_mean",
                  extras: Sequence[str | Column] = DEFAULT_EXTRAS) -> list[RankedTable]:
    """One `RankedTable` per trace (and per ``sliding`` mode, whose metrics cover different layers) of a results
    table with columns trace, label, budget and the metric (sweep rows; any frame with those columns).

    Rank: at each budget the evicting policies are ranked by the metric (1 = best, ties share the lowest rank),
    and a policy's rank is its mean over the budgets it ran at. The best cell of each budget (and of the mean) is
    marked among the evicting policies; references (full cache, oracle) are listed first and never ranked.
    """
    metric = _as_column(metric)
    if df.empty:
        return []
    df = df.copy()
    if "sliding" not in df:
        df["sliding"] = "keep"
    df["sliding"] = df["sliding"].fillna("keep")
    extras = [c for c in map(_as_column, extras)                  # those the results hold (err_gap needs an oracle)
              if c.key in df and c.key != metric.key and df[c.key].notna().any()]
    lower = metric.direction == "lower"
    tables = []
    for (trace, sliding), part in df.groupby(["trace", "sliding"], sort=False):
        budgets = sorted(int(b) for b in part.budget.unique())
        shade = metric.key not in MEMORY_COLUMNS
        cols = [TableColumn(f"{metric.key}@{b}", str(b), metric, b, shade) for b in budgets]
        cols.append(TableColumn(metric.key, "mean", metric, None, shade))
        cols += [TableColumn(e.key, e.short, e, None, highlight=e.key not in MEMORY_COLUMNS) for e in extras]
        wide = part.pivot_table(index="label", columns="budget", values=metric.key, aggfunc="mean")
        means = part.groupby("label")[[metric.key, *[e.key for e in extras]]].mean()
        roles = {lab: role(lab) for lab in wide.index}
        lossy = [lab for lab in wide.index if roles[lab] != "reference"]
        ranks = wide.loc[lossy].rank(axis=0, method="min", ascending=lower).mean(axis=1)
        values = {lab: [wide.at[lab, b] if b in wide.columns else np.nan for b in budgets]
                  + [means.at[lab, metric.key]] + [means.at[lab, e.key] for e in extras] for lab in wide.index}
        best = _best(values, lossy, cols)
        order = (sorted((lab for lab in wide.index if roles[lab] == "reference"), key=lambda x: x != "full")
                 + sorted(lossy, key=lambda lab: (ranks[lab], _oriented(means.at[lab, metric.key], lower))))
        rows = [Row(lab, roles[lab], float(ranks.get(lab, np.nan)), tuple(float(v) for v in values[lab]),
                    tuple(best[lab])) for lab in order]
        n_comp = int(part["n_layers_compressed"].max()) if "n_layers_compressed" in part else None
        tables.append(RankedTable(str(trace), metric, budgets, cols, rows, str(sliding), n_comp))
    return tables


def _oriented(value: float, lower: bool) -> float:
    return (value if lower else -value) if np.isfinite(value) else np.inf


def _best(values: dict[str, list[float]], lossy: list[str], cols: list[TableColumn]) -> dict[str, list[bool]]:
    """Per label, per column: is it the best evicting policy's value there (ties all best)?"""
    out = {lab: [False] * len(cols) for lab in values}
    for j, c in enumerate(cols):
        if not c.highlight:
            continue
        vals = np.array([values[lab][j] for lab in lossy], float)
        if len(np.unique(vals[np.isfinite(vals)])) < 2:       # nothing to choose between
            continue
        target = np.nanmin(vals) if c.metric.direction == "lower" else np.nanmax(vals)
        for lab, v in zip(lossy, vals):
            out[lab][j] = bool(np.isfinite(v) and v == target)
    return out


def legend_items(table: RankedTable) -> list[tuple[str, str]]:
    """(term, meaning) of every metric the table shows (from `sim.replay.metrics`), then of the rank."""
    items = [(head, f"{m.label} ({m.direction} is better {m.arrow}): {m.doc}") for head, m in table.legend()]
    items.append(("rank", f"mean over the budgets of each policy's rank by {table.metric.short} among the evicting "
                          "policies (1 = best)"))
    return items


def print_tables(tables: Sequence[RankedTable], title: str = "kvsim results", *, console=None) -> None:
    """Draw ranked tables in the terminal (rich): the same rows, columns, marks and numbers as the page, and a
    short legend (the page has each metric's full definition)."""
    wide = Console(width=400)
    for t in tables:
        m = t.metric
        head = title if t.trace in title else f"{title} — {t.trace}"
        head += f" — sliding layers: {t.sliding}" if t.sliding != "keep" else ""
        table = Table(title=escape(head), box=box.SIMPLE_HEAD,
                      caption=escape(f"{m.short} per budget (slots per KV head), then means over the budgets; "
                                     "* paper policy"))
        table.add_column("rank", justify="right")
        table.add_column("policy", justify="left", no_wrap=True)
        for c in t.columns:
            name = f"{m.short}@{c.header}" if c.budget is not None else (
                f"{m.short} mean" if c.metric.key == m.key else c.header)
            table.add_column(escape(name), justify="right", no_wrap=True)
        for r in t.rows:
            cells = [fmt3(v) if not b else f"[bold green]{fmt3(v)}[/]" for v, b in zip(r.values, r.best)]
            ref = r.role == "reference"
            table.add_row("ref" if ref else fmt3(r.rank), escape(r.label + (" *" if r.role == "paper" else "")),
                          *cells, style="dim italic" if ref else None)
        need = Measurement.get(wide, wide.options, table).maximum        # never squeeze a number into "0.4…"
        out = console or Console(width=max(100, Console().width, need))
        out.print(table)
    if tables:
        lines = [f"{head}: {m.label} {m.arrow}" for head, m in tables[0].legend()]
        lines += [f"rank: {legend_items(tables[0])[-1][1]}",
                  "bold green: best at that budget · ref: reference rows (full cache: loss-free; oracle: the most "
                  "attention mass any cache of that size holds) · *: a seed paper's policy"]
        (console or Console(width=max(100, Console().width))).print(escape("\n".join(lines)), style="dim")
