"""Simulator fidelity: does the simulator's loss rank policies × budgets the way the real model does?

For one model and text: record a teacher-forced trace, replay every policy × budget in the simulator, run
the same configurations closed-loop through the model (`gpu_validate.closedloop.runner`), and report Spearman's rho
between each simulated loss and the model's ΔNLL (equivalently ΔPPL: same ranking) and top-1 disagreement,
plus open-loop kept-set agreement on the first decode steps, and a sim-vs-model scatter plot.
"""
from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from scipy.stats import spearmanr
from tqdm.auto import tqdm

from gpu_validate.closedloop.chunked_forward import full_model_logits
from gpu_validate.closedloop.jobs import BatchJob
from gpu_validate.closedloop.model_metrics import compare_kept, metrics_of_run
from gpu_validate.closedloop.runner import run_batch
from gpu_validate.validate_error import ValidateError
from policies.core.base import Policy, reconstruction_chunk
from sim.replay.cells import replay_cells
from sim.replay.layer_inputs import load_layers
from sim.replay.metrics import Column, column
from sim.reports.plotting import agg_pyplot, save_figure
from traces.format import load_trace
from traces.recorder import record_trace

#: simulated losses (higher = worse) compared with the model's losses, labelled as sim.replay.metrics labels them
SIM_LOSSES = {key: column(key).label for key in ("err_mean", "err_p95", "kl_mean", "l1_mean", "miss_mass")}
MODEL_LOSSES = {"delta_nll": "ΔNLL (ranks as ΔPPL)", "top1_disagreement": "top-1 disagreement with the full cache"}


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho (scipy), NaN when either side is constant."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(spearmanr(x, y).statistic)


def correlations(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """rho[sim_loss][model_loss] over the rows."""
    return {s: {m: spearman([r[s] for r in rows], [r[m] for r in rows]) for m in MODEL_LOSSES} for s in SIM_LOSSES}


def within_budget_correlations(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean over budgets of rho among the lossy policies at one budget: does the simulator rank *policies*,
    not just budgets (pooled rho is dominated by the budget)? NaN where no budget has 3 lossy policies."""
    lossy = [r for r in rows if r["policy"] != "full"]
    budgets = sorted({r["budget"] for r in lossy})
    out: dict[str, dict[str, float]] = {}
    for s in SIM_LOSSES:
        out[s] = {}
        for m in MODEL_LOSSES:
            vals = [spearman([r[s] for r in lossy if r["budget"] == b], [r[m] for r in lossy if r["budget"] == b])
                    for b in budgets]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                out[s][m] = float(np.nanmean(vals)) if vals else float("nan")
    return out


def run_fidelity(model, ids: Sequence[int], policies: Sequence[Policy], budgets: Sequence[int], *,
                 n_prompt: int, n_open_steps: int = 16, backend: str = "torch", model_id: str = "model",
                 log=print, progress: bool = True, sliding: str = "keep", chunk: int = 1) -> dict[str, Any]:
    """All policies × budgets through the simulator and the model; returns the JSON-ready report."""
    ids = [int(x) for x in ids]
    n_decode = len(ids) - n_prompt
    if n_prompt < 1 or n_decode < 2:
        raise ValidateError(f"need n_prompt >= 1 and >= 2 tokens after it, got {n_prompt} of {len(ids)}")
    skipped = [p.label() for p in policies if p.is_oracle]
    for name in skipped:
        log(f"skipping {name}: the oracle cannot run closed-loop (it needs future attention)")
    policies = [p for p in policies if not p.is_oracle]
    if not policies:
        raise ValidateError("no policy left to compare after skipping the oracle")
    t_start = time.perf_counter()
    configs = [(p, int(b)) for p in policies for b in budgets]
    with tempfile.TemporaryDirectory(prefix="kvsim-fidelity-") as tmp:
        record_trace(model, ids, Path(tmp) / "trace", n_prompt=n_prompt, n_decode=n_decode, teacher_forced=True,
                     single_pass=True, progress=False, model_id=model_id,
                     reconstruction_chunk=reconstruction_chunk(policies))
        trace = load_trace(Path(tmp) / "trace")
        inputs = load_layers(trace)
        full = full_model_logits(model, ids, start=n_prompt)
        sims = [None] * len(configs)     # every configuration in one pass (`sim.replay.cells`), in order
        for i, res in replay_cells(trace, configs, inputs=inputs, record_kept=(n_prompt, n_open_steps),
                                   sliding=sliding, chunk=chunk):
            sims[i] = res
        n_open = int(min(n_open_steps, n_decode))
        with tqdm(total=2 * len(configs), desc="fidelity", unit="run", disable=not progress) as bar:
            def kept_done(i: int, res) -> None:
                bar.update(1)

            opened = run_batch(model, [BatchJob(p, b, ids[:n_prompt], continuation=ids[n_prompt:n_prompt + n_open + 1],
                                                chunk=chunk)
                                       for p, b in configs], backend=backend, open_loop=True,
                               record_kept=(n_prompt, n_open), on_result=kept_done, sliding=sliding)
            rows: list[dict[str, Any] | None] = [None] * len(configs)

            def closed_done(i: int, res) -> None:
                policy, budget = configs[i]
                s = sims[i].summary()
                m = metrics_of_run(res, model, ids, n_prompt, full)
                a = compare_kept(opened[i].kept[sims[i].layer_index], sims[i].kept, n_open)
                row = {"policy": policy.name, "label": policy.label(), "budget": budget,
                       **{k: s[k] for k in ("err_mean", "err_p95", "kl_mean", "l1_mean", "mass_mean", "slots_mean",
                                            "miss_mass")}, **m, "top1_disagreement": 1.0 - m["top1_agreement"],
                       **a, "elapsed_seconds": time.perf_counter() - t_start}
                rows[i] = row
                bar.update(1)
                bar.write(f"{policy.label():>24s} @ {budget:>4d}: sim err {row['err_mean']:.4f}  ΔPPL "
                          f"{row['delta_ppl']:+.3f}  top-1 {row['top1_agreement']:.3f}  kept-set "
                          f"{row['kept_agreement']:.3f}")
                sys.stdout.flush()

            run_batch(model, [BatchJob(p, b, ids[:n_prompt], continuation=ids[n_prompt:], chunk=chunk)
                              for p, b in configs],
                      backend=backend, on_result=closed_done, sliding=sliding)
    rho = correlations(rows)
    best = {m: max(SIM_LOSSES, key=lambda s: -np.inf if np.isnan(rho[s][m]) else rho[s][m]) for m in MODEL_LOSSES}
    n_cmp = sum(r["n_compared"] for r in rows)
    agreement = sum(r["kept_agreement"] * r["n_compared"] for r in rows) / n_cmp
    return {
        "model": model_id, "backend": backend, "device": str(next(model.parameters()).device),
        "n_prompt": n_prompt, "n_decode": n_decode, "n_open_steps": n_open_steps,
        "policies": [p.label() for p in policies], "budgets": [int(b) for b in budgets], "skipped": skipped,
        "spearman": rho, "spearman_within_budget": within_budget_correlations(rows), "best_sim_metric": {m: {"metric": best[m], "rho": rho[best[m]][m]} for m in MODEL_LOSSES},
        "rho_primary": rho["err_mean"]["delta_nll"], "kept_agreement": agreement,
        "target": {"rho": 0.9, "kept_agreement": 0.99}, "rows": rows,
        "seconds": time.perf_counter() - t_start,
    }


def plot_fidelity(report: dict[str, Any], path: str | Path) -> Path:
    """Scatter of the best simulated loss vs the model's ΔPPL and top-1 disagreement, one colour per policy."""
    plt = agg_pyplot()

    rows = report["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    labels = sorted({r["label"] for r in rows})
    colours = plt.get_cmap("tab20")
    for ax, (mkey, mname), ykey in zip(axes, MODEL_LOSSES.items(), ("delta_ppl", "top1_disagreement")):
        skey = report["best_sim_metric"][mkey]["metric"]
        for i, lab in enumerate(labels):
            pts = [r for r in rows if r["label"] == lab]
            ax.scatter([r[skey] for r in pts], [r[ykey] for r in pts], color=colours(i % 20), label=lab, s=28,
                       marker="os^Dv"[i % 5])
            for r in pts:
                ax.annotate(str(r["budget"]), (r[skey], r[ykey]), fontsize=6, xytext=(2, 2),
                            textcoords="offset points")
        ax.set_xlabel(f"simulated {SIM_LOSSES[skey]} ({skey})")
        ax.set_ylabel("ΔPPL vs full cache" if ykey == "delta_ppl" else MODEL_LOSSES[mkey])
        ax.set_title(f"Spearman ρ = {report['spearman'][skey][mkey]:.3f}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(f"kvsim fidelity: simulator vs model ({report['model']}, {report['device']}, "
                 f"backend {report['backend']}; numbers = budget)", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def split_half_reliability(table: np.ndarray, n_splits: int = 200, seed: int = 0) -> dict[str, float]:
    """Reliability of the policy ranking by mean loss over segments. ``table`` is [segments, policies]; each
    random split of the segments into two disjoint halves ranks the policies by each half's mean, and the
    Spearman rho of the two rankings is averaged over splits; the Spearman-Brown step-up estimates the
    reliability of the mean over all segments (what a comparison with the simulator is bounded by)."""
    table = np.asarray(table, float)
    rng = np.random.default_rng(seed)
    n = table.shape[0]
    rhos = []
    for _ in range(n_splits):
        perm = rng.permutation(n)
        a, b = perm[:n // 2], perm[n // 2:2 * (n // 2)]
        rhos.append(spearman(table[a].mean(0), table[b].mean(0)))
    r = float(np.nanmean(rhos))
    return {"split_half_rho": r, "spearman_brown": 2 * r / (1 + r) if r > -1 else float("nan"),
            "n_segments": int(n), "n_splits": int(n_splits)}


# ----- what a reader compares the simulator's numbers with -----

#: the model-side columns of a fidelity result as summary columns (short header, label, direction, doc) for the
#: page's tables and legend, beside `sim.replay.metrics.COLUMNS` for the simulator's
MODEL_COLUMNS = {
    "delta_nll": Column("delta_nll", "ΔNLL", MODEL_LOSSES["delta_nll"], "lower",
                        "the model's mean next-token NLL over the scored tokens with the policy's cache minus with "
                        "the full cache, closed loop and teacher-forced (exp of it is the perplexity ratio)"),
    "top1_disagreement": Column("top1_disagreement", "top-1 ≠", MODEL_LOSSES["top1_disagreement"], "lower",
                                "share of the scored tokens whose greedy prediction differs from the full cache's"),
    "kept_agreement": Column("kept_agreement", "kept =", "open-loop kept-set agreement", "higher",
                             "share of (layer, decode step, KV head) where the model's cache holds exactly the "
                             "simulator's kept set, both fed the same tokens"),
}


def block_means(per_token: Sequence[float], block: int) -> np.ndarray:
    """Means of consecutive blocks of ``block`` per-token values (a partial last block is dropped): the units of
    the model-side statistics, since neighbouring tokens share their errors."""
    x = np.asarray(per_token, float)
    n = len(x) // block
    return x[:n * block].reshape(n, block).mean(1)


def token_reliability(rows: Sequence[dict[str, Any]], block: int = 8, n_splits: int = 200,
                      seed: int = 0) -> dict[str, Any] | None:
    """How reproducible the model's own ranking is on this one text: the scored tokens are cut into blocks of
    ``block`` consecutive tokens (neighbouring tokens share their errors), and `split_half_reliability` ranks the
    lossy configurations by mean ΔNLL on random halves of the blocks (Spearman-Brown: the reliability of the mean
    over all of them). ``within_budget``: the mean over budgets of the policies' reliability at one budget (what
    the within-budget rho is bounded by); ``pooled``: over every (policy, budget). None without per-token ΔNLL
    (``nll_per_token``) in the rows, or with fewer than 4 blocks."""
    lossy = [r for r in rows if r.get("policy") != "full" and r.get("nll_per_token") is not None]
    if not lossy:
        return None
    n = min(len(r["nll_per_token"]) for r in lossy) // block
    if n < 4:
        return None

    def blocks(r: dict[str, Any]) -> np.ndarray:
        return block_means(r["nll_per_token"][:n * block], block)

    by_budget = {}
    for b in sorted({int(r["budget"]) for r in lossy}):
        part = sorted((r for r in lossy if int(r["budget"]) == b), key=lambda r: r["label"])
        if len(part) >= 3:
            rel = split_half_reliability(np.stack([blocks(r) for r in part], axis=1), n_splits, seed)
            by_budget[b] = rel["spearman_brown"]
    pooled = split_half_reliability(np.stack([blocks(r) for r in lossy], axis=1), n_splits, seed)["spearman_brown"]
    vals = [v for v in by_budget.values() if np.isfinite(v)]
    return {"block_tokens": block, "n_blocks": n, "n_splits": n_splits, "pooled": pooled,
            "within_budget": float(np.mean(vals)) if vals else float("nan"), "by_budget": by_budget}


def pair_agreement(rows: Sequence[dict[str, Any]], sim: str = "err_mean", model: str = "delta_nll") -> dict[str, Any]:
    """Does the simulator order two policies at the same budget as the model does? Every pair of lossy policies
    at each budget, in label order (A before B), is one case: the model says A loses more than B or less, and so
    does the simulated loss. Returns the 2 x 2 confusion matrix of those calls, the agreement, the base rate (the
    agreement of always answering the model's commoner call) and the pairs left out because one side ties."""
    lossy = [r for r in rows if r.get("policy") != "full"]
    conf = {"model_a_worse": {"sim_a_worse": 0, "sim_b_worse": 0},
            "model_b_worse": {"sim_a_worse": 0, "sim_b_worse": 0}}
    ties = 0
    for b in sorted({int(r["budget"]) for r in lossy}):
        part = sorted((r for r in lossy if int(r["budget"]) == b), key=lambda r: r["label"])
        for i, a in enumerate(part):
            for c in part[i + 1:]:
                dm, ds = a[model] - c[model], a[sim] - c[sim]
                if dm == 0 or ds == 0 or not (np.isfinite(dm) and np.isfinite(ds)):
                    ties += 1
                    continue
                conf["model_a_worse" if dm > 0 else "model_b_worse"]["sim_a_worse" if ds > 0 else "sim_b_worse"] += 1
    n = sum(v for row in conf.values() for v in row.values())
    agree = conf["model_a_worse"]["sim_a_worse"] + conf["model_b_worse"]["sim_b_worse"]
    a_worse = sum(conf["model_a_worse"].values())
    return {"sim": sim, "model": model, "n_pairs": n, "ties": ties, "confusion": conf,
            "agreement": agree / n if n else float("nan"),
            "base_rate": max(a_worse, n - a_worse) / n if n else float("nan")}
