"""PNG plots of serving runs: latency CDFs per policy/budget and throughput/latency/quality vs budget."""
from __future__ import annotations

from pathlib import Path
import os
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from sim.replay.metrics import column  # noqa: E402


def _save(fig, path: Path) -> Path:
    """Atomic PNG write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def latency_cdf(curves: dict[str, dict[str, np.ndarray]], path: str | Path) -> Path:
    """Empirical CDFs of TTFT, TPOT and end-to-end latency; ``curves[label][metric]`` are seconds."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    cmap = plt.get_cmap("tab10" if len(curves) <= 10 else "tab20")
    styles = ("-", "--", ":", "-.")
    policies = list(dict.fromkeys(label.split("@")[0] for label in curves))
    drawn = False
    for i, (label, lat) in enumerate(curves.items()):
        ls = styles[policies.index(label.split("@")[0]) % len(styles)]
        for ax, key, scale in zip(axes, ("ttft", "tpot", "e2e"), (1.0, 1e3, 1.0)):
            x = np.sort(lat[key])
            if len(x):
                ax.step(x * scale, np.arange(1, len(x) + 1) / len(x), where="post", color=cmap(i % cmap.N),
                        ls=ls, label=label, lw=1.6)
                drawn = True
    for ax, title, unit in zip(axes, ("time to first token", "time per output token", "end-to-end latency"),
                               ("s", "ms", "s")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} [{unit}]")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    if drawn:
        axes[-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=9, title="policy@budget")
    else:
        axes[1].text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=axes[1].transAxes)
    fig.suptitle("Latency CDF per policy and budget")
    return _save(fig, Path(path))


def throughput_vs_budget(df: pd.DataFrame, path: str | Path, quality_col: str | None = None) -> Path:
    """Output tokens/s and p99 end-to-end latency vs budget per policy (unbounded policies as dashed lines);
    with ``quality_col``, a third panel puts that quality loss against throughput (the operator's trade-off)."""
    n_panels = 3 if quality_col else 2
    fig, axes = plt.subplots(1, n_panels, figsize=(5.8 * n_panels, 4.6), gridspec_kw={"wspace": 0.3})
    cmap = plt.get_cmap("tab10")
    markers = "osD^v<>ph*"
    for i, (policy, g) in enumerate(df.groupby("policy", sort=True)):
        color, mk = cmap(i % 10), markers[i % len(markers)]
        g = g.sort_values("budget")
        if g["budget"].isna().all():
            for ax, col in zip(axes[:2], ("output_tokens_per_s", "e2e_p99_s")):
                ax.axhline(float(g[col].iloc[0]), color=color, ls="--", label=f"{policy} (no budget)")
        else:
            ms = 9 - 1.5 * (i % 3)   # shrinking markers keep policies with equal footprints visible
            axes[0].plot(g["budget"], g["output_tokens_per_s"], marker=mk, ms=ms, color=color, label=policy)
            axes[1].plot(g["budget"], g["e2e_p99_s"], marker=mk, ms=ms, color=color, label=policy)
        if quality_col and g[quality_col].notna().any():
            axes[2].plot(g["output_tokens_per_s"], g[quality_col], marker=mk, color=color, label=policy)
            for _, row in g.dropna(subset=[quality_col]).iterrows():
                text = f"{int(row['budget'])}" if pd.notna(row["budget"]) else str(policy)
                axes[2].annotate(text, (row["output_tokens_per_s"], row[quality_col]),
                                 textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes[0].set_ylabel("output tokens / s")
    axes[0].set_title("throughput vs budget")
    axes[1].set_ylabel("p99 end-to-end latency [s]")
    axes[1].set_title("tail latency vs budget")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV budget (slots per head)")
    if quality_col:
        axes[2].set_xlabel("output tokens / s")
        axes[2].set_ylabel(column(quality_col).title)
        axes[2].set_title(f"quality ({quality_col}) vs throughput")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylim(bottom=0)
    axes[1].set_ylim(bottom=0)
    axes[0].legend(fontsize=9)
    return _save(fig, Path(path))
