"""Tables and plots users read: ranked policies per trace (built by `sim.reports.table`, the same for the terminal and the
page), loss-vs-budget curves, loss vs memory held (Pareto), occupancy maps and search plots."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sim.replay.metrics import column
from sim.reports.plotting import agg_pyplot, save_figure as _save
from sim.reports.table import PAPER_POLICIES, print_tables, ranked_tables


def split_sliding(df: pd.DataFrame) -> pd.DataFrame:
    """Rows replayed with ``--sliding compress`` under their own trace name (``NAME (sliding: compress)``), so that
    tables and plots never draw them over the default rows of the same trace: their metrics cover other layers."""
    if df.empty or "sliding" not in df or (df.sliding.fillna("keep") == "keep").all():
        return df
    other = df.sliding.fillna("keep") != "keep"
    return df.assign(trace=np.where(other, df.trace + " (sliding: " + df.sliding.fillna("keep") + ")", df.trace))


def print_ranked(df: pd.DataFrame, metric: str = "err_mean", title: str = "kvsim results") -> None:
    """Print the ranked tables to the terminal (rich): one per trace, a column per budget, then the legend; the
    same tables the HTML page shows (`sim.reports.table`)."""
    print_tables(ranked_tables(df, metric), title)


def _highlighted(df: pd.DataFrame, metric: str, best: int) -> tuple[list[str], list[str]]:
    """(coloured labels: oracle, the ``best`` lowest-loss evicting policies and the paper policies; grey labels:
    the rest, the full cache included), each list in order of mean loss."""
    mean = df.groupby("label")[metric].mean().sort_values()
    others = [lab for lab in mean.index if lab != "oracle"]
    lossy = [lab for lab in others if lab != "full"]      # the full cache is the reference, never "best"
    keep = set(lossy[:best]) | {lab for lab in others if lab.split(":")[0].split("(")[0] in PAPER_POLICIES}
    coloured = (["oracle"] if "oracle" in mean.index else []) + [lab for lab in others if lab in keep]
    return coloured, [lab for lab in others if lab not in keep]


def plot_budget_curves(df: pd.DataFrame, path: str | Path, metrics: tuple[str, ...] = ("err_mean", "mass_mean"),
                       *, title: str | None = None, best: int = 3) -> Path:
    """Loss vs budget, one line per policy, one row per trace; saved as PNG (or SVG/PDF by suffix).

    Readable with many policies: the oracle (black, dashed), the ``best`` lowest-error policies and the paper
    policies are coloured and named in the legend in order of mean error; every other policy is a thin grey
    line under one "other" legend entry (they are all in the ranked table)."""
    plt = agg_pyplot()
    traces = list(dict.fromkeys(df.trace))
    fig, axes = plt.subplots(len(traces), len(metrics), figsize=(6.2 * len(metrics), 4.2 * len(traces)),
                             squeeze=False)
    coloured, grey = _highlighted(df, metrics[0], best)
    palette = plt.get_cmap("tab10")
    styles = {lab: dict(color=palette(i % 10), marker="os^vD<>ph*"[i % 10], linewidth=2.0, zorder=3)
              for i, lab in enumerate(x for x in coloured if x != "oracle")}
    styles["oracle"] = dict(color="black", linestyle="--", linewidth=2.0, zorder=4)
    for lab in grey:
        styles[lab] = dict(color="0.72", linewidth=1.0, zorder=1)
    for r, trace in enumerate(traces):
        part = df[df.trace == trace]
        for c, metric in enumerate(metrics):
            ax = axes[r][c]
            for lab in coloured + grey:
                line = part[part.label == lab].sort_values("budget")
                if not line.empty:
                    name = lab if lab in coloured else ("other policies" if lab == grey[0] else "_nolegend_")
                    ax.plot(line.budget, line[metric], label=name, markersize=5, **styles[lab])
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (slots per KV head)")
            head = "" if len(traces) == 1 and title else f"{trace}:\n"
            ax.set_title(head + column(metric).title, fontsize=10)
            ax.grid(True, alpha=0.3)
            budgets = sorted(part.budget.unique())
            ax.set_xticks(budgets, [str(b) for b in budgets])
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="center right", fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    return _save(fig, path, dpi=130)


def default_budgets(n_tokens: int, n: int = 5) -> list[int]:
    """Powers of two from 16 up to about half the sequence (at most n of them)."""
    top = max(16, n_tokens // 2)
    budgets = [int(b) for b in 2 ** np.arange(4, int(np.log2(top)) + 1)]
    return budgets[-n:]


def plot_search(trials: pd.DataFrame, pareto: pd.DataFrame, path: str | Path, objective: str) -> Path:
    """Search trials as loss vs KV memory, Pareto-optimal ones highlighted."""
    plt = agg_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(trials.kv_bytes_mean / 1024, trials.loss, s=18, alpha=0.5, color="tab:gray", label="trial")
    front = pareto.sort_values("kv_bytes_mean")
    ax.plot(front.kv_bytes_mean / 1024, front.loss, "o-", color="tab:red", label="best / Pareto front")
    ax.set_xlabel("KV memory held per step (KiB, all layers and heads)")
    ax.set_ylabel(f"loss ({objective}) ↓")
    ax.grid(True, alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    return _save(fig, path, dpi=130)


def plot_pareto(df: pd.DataFrame, path: str | Path, metric: str = "err_mean") -> Path:
    """Loss vs memory held per trace: every configuration, with each trace's non-dominated set joined."""
    plt = agg_pyplot()
    traces = list(dict.fromkeys(df.trace))
    policies = sorted(df.policy.unique())
    ncol = 1 if len(policies) <= 18 else 2
    fig, axes = plt.subplots(1, len(traces), figsize=(6.5 * len(traces) + 1.6 * ncol, 4.8), squeeze=False,
                             layout="constrained")
    cmap = plt.get_cmap("tab20")
    for ax, trace in zip(axes[0], traces):
        part = df[(df.trace == trace) & (df.policy != "full")]
        for i, pol in enumerate(policies):
            pts = part[part.policy == pol]
            if not pts.empty:
                ax.scatter(pts.kv_bytes_mean / 1024, pts[metric], s=22, color=cmap(i % 20), label=pol,
                           marker="os^vD<>"[i % 7])      # 7 markers x 20 colours: no two policies alike below 140
        front = pareto_front(part, metric)
        ax.plot(front.kv_bytes_mean / 1024, front[metric], "-", color="black", linewidth=1, label="Pareto front")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set_xlabel("KV memory held per step (KiB)")
        ax.set_ylabel(column(metric).title)
        ax.set_title(trace, fontsize=10)
        ax.grid(True, alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right upper", fontsize=8, frameon=False, ncol=ncol)
    return _save(fig, path, dpi=130)


def pareto_front(df: pd.DataFrame, metric: str = "err_mean") -> pd.DataFrame:
    """Rows not dominated in (kv_bytes_mean, metric), sorted by memory (the oracle excluded: not realisable);
    the metric's direction (``sim.replay.metrics``) says which way is better."""
    sign = 1.0 if column(metric).direction == "lower" else -1.0
    cand = df[df.policy != "oracle"].assign(_loss=sign * df[metric]).sort_values(["kv_bytes_mean", "_loss"])
    best = np.inf
    keep = []
    for idx, row in cand.iterrows():
        if row["_loss"] < best:
            keep.append(idx)
            best = row["_loss"]
    return cand.loc[keep].drop(columns="_loss")


def plot_occupancy(kept: np.ndarray, steps: np.ndarray, n_tokens: int, title: str, path: str | Path) -> Path:
    """Cache occupancy map: which positions (y) are held at each step (x), shaded by the share of heads holding them.

    ``kept``: [L, R, Hkv, cap] cached positions (-1 padded) from ``replay(..., record_kept=...)``, or a list of
    such arrays (one panel each, e.g. one per policy) with ``title`` a list of panel titles.
    """
    plt = agg_pyplot()
    panels = kept if isinstance(kept, list) else [kept]
    titles = title if isinstance(title, list) else [title]
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    for ax, arr, ttl in zip(axes.flat, panels, titles):
        L, R, H, _ = arr.shape
        grid = np.zeros((n_tokens, R))
        for r in range(R):
            pos = arr[:, r].reshape(-1)
            pos = pos[pos >= 0]
            np.add.at(grid[:, r], pos, 1.0 / (L * H))
        ax.imshow(grid, aspect="auto", origin="lower", cmap="magma", vmin=0, vmax=1,
                  extent=(steps[0], steps[-1] + 1, 0, n_tokens), interpolation="nearest")
        ax.plot([steps[0], steps[-1]], [steps[0], steps[-1]], color="cyan", linewidth=0.6, alpha=0.6)
        ax.set_title(ttl, fontsize=10)
        ax.set_xlabel("decode step (position of the newest token)")
        ax.set_ylabel("cached token position")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    return _save(fig, path, dpi=120)


def occupancy_figure(trace, policies, budget: int, path: str | Path, *, sliding: str = "keep") -> Path:
    """`plot_occupancy` of the given policies (those that keep every token, such as the full cache, have no map and
    are left out) replayed on ``trace`` at one budget, one panel each."""
    from sim.replay.layer_inputs import load_layers   # the replay engine (numba) stays out of reading results
    from sim.replay.policy_replay import replay

    drawn = [pol for pol in policies if not pol.unbounded]
    if not drawn:
        raise ValueError(f"no policy to draw among {', '.join(p.label() for p in policies)} (policies that keep "
                         "every token, such as full, have no occupancy map)")
    inputs = load_layers(trace)
    P, T = trace.meta.n_prompt, trace.meta.n_tokens
    panels, titles, steps = [], [], None
    for pol in drawn:
        res = replay(trace, pol, budget, inputs=inputs, record_kept=(P, T - P), sliding=sliding)
        panels.append(res.kept)
        titles.append(f"{pol.label()} @ {budget}")
        steps = res.kept_steps
    return plot_occupancy(panels, steps, T, titles, path)
