"""Fidelity at equal budget over many text segments: the model's closed-loop losses and the simulator's losses of
every (segment, policy, budget), as two tables that join on (segment, label, budget).

The closed-loop side is the expensive one (every configuration through the model, batched), so it lives in a
resumable `sim.experiments.store.ResultStore`: a rerun, or a new simulator metric, never repeats a model run. The simulator
side records one teacher-forced trace per segment and replays every configuration on it (seconds).
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import torch
from scipy.optimize import nnls
from tqdm.auto import tqdm

from gpu_validate.closedloop.chunked_forward import full_model_logits
from gpu_validate.closedloop.jobs import BatchJob
from gpu_validate.closedloop.model_metrics import metrics_of_run
from gpu_validate.closedloop.runner import run_batch
from gpu_validate.studies.fidelity.rank_fidelity import spearman, split_half_reliability
from gpu_validate.validate_error import ValidateError
from policies import get_policy
from policies.core.base import Policy, reconstruction_chunk
from sim.experiments.executors import ray_map
from sim.replay.cells import replay_cells
from sim.replay.layer_inputs import load_layers
from sim.replay.metrics import Column
from sim.replay.projected_error import ProjectedReference
from sim.reports.plotting import agg_pyplot, save_figure
from traces.format import load_trace
from traces.models import load_model
from traces.recorder import record_trace

#: simulated losses of the segment study that are not `sim.replay.metrics` columns (header, label, direction, doc)
SEGMENT_COLUMNS = {
    "err_wo_mean": Column("err_wo_mean", "err after W_O", "attention error after the output projection W_O",
                          "lower", "relative error of the layer's attention output after W_O, all heads summed as the "
                                   "residual stream sees them (sim/replay/projected_error.py)"),
    "layerfit_err_insample": Column("layerfit_err_insample", "layer-fit err (in sample)",
                                    "per-layer weighted error, fitted on this text", "lower",
                                    "sum over layers of a non-negative weight times the layer's mean error, weights "
                                    "fitted (ridge) on this text's cells"),
    "layerfit_err_heldout": Column("layerfit_err_heldout", "layer-fit err (held out)",
                                   "per-layer weighted error, fitted on the other text", "lower",
                                   "the same weighted error with weights fitted on the other text"),
    "layerfit_wo_insample": Column("layerfit_wo_insample", "layer-fit W_O (in sample)",
                                   "per-layer weighted error after W_O, fitted on this text", "lower",
                                   "per-layer weights of the error after W_O, fitted on this text's cells"),
    "layerfit_wo_heldout": Column("layerfit_wo_heldout", "layer-fit W_O (held out)",
                                  "per-layer weighted error after W_O, fitted on the other text", "lower",
                                  "per-layer weights of the error after W_O, fitted on the other text"),
}


@dataclass(frozen=True)
class Segment:
    """``ids`` = n_prompt prompt tokens + the continuation scored teacher-forced; ``text`` names its source."""

    text: str
    start: int
    ids: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.text}@{self.start}"


def make_segments(texts: dict[str, Sequence[int]], n_per_text: int, n_tokens: int) -> list[Segment]:
    """``n_per_text`` evenly spaced, non-overlapping windows of ``n_tokens`` token ids from each named text."""
    out = []
    for name, ids in texts.items():
        ids = [int(x) for x in ids]
        if len(ids) < n_per_text * n_tokens:
            raise ValidateError(f"text {name!r} has {len(ids)} tokens: too few for {n_per_text} disjoint segments "
                                f"of {n_tokens}")
        for s in np.linspace(0, len(ids) - n_tokens, n_per_text).astype(int):
            out.append(Segment(name, int(s), tuple(ids[s:s + n_tokens])))
    return out


def cell_key(model_id: str, seg: Segment, n_prompt: int, policy: Policy, budget: int) -> str:
    """Stable store key of one closed-loop (model, segment, prompt split, policy with params, budget) cell."""
    payload = json.dumps([model_id, seg.name, len(seg.ids), hashlib.sha256(str(seg.ids).encode()).hexdigest()[:16],
                          n_prompt, policy.name, policy.params, int(budget)], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class RayTarget:
    """Where closed-loop batches run on Ray (``closed_loop``): ``address`` (``ray://host:10001``, ``auto``, or
    ``local`` to start one here), the model every worker loads itself (a registry name, HF folder or .gguf that
    must exist on each node, as on this one), its device, and the threads of each task. A CUDA task declares one
    GPU to Ray's scheduler, so a node runs as many batches at once as it has GPUs."""

    address: str
    model: str
    device: str = "cpu"
    threads: int = 1


@dataclass(frozen=True)
class _RemoteBatch:
    """One batch of closed-loop cells for a Ray worker: segments and policies by value (name and parameters)."""

    target: RayTarget
    cells: tuple[tuple[Segment, str, tuple[tuple[str, Any], ...], int], ...]
    n_prompt: int
    model_id: str
    backend: str
    max_rows: int


@lru_cache(maxsize=1)
def _worker_model(spec: str, device: str):
    """A Ray worker's model, loaded once per worker process (the tokenizer is not needed: segments are ids)."""
    torch.set_grad_enabled(False)
    return load_model(spec, device=device, progress=False)[0]


def _run_remote_batch(batch: _RemoteBatch) -> list[dict[str, Any]]:
    """A Ray task: the rows of one batch, run on the worker's own copy of the model."""
    model = _worker_model(batch.target.model, batch.target.device)
    chunk = [(seg, get_policy(name, **dict(params)), b) for seg, name, params, b in batch.cells]
    return _batch_rows(model, chunk, n_prompt=batch.n_prompt, model_id=batch.model_id, backend=batch.backend,
                       max_rows=batch.max_rows, fulls={})


def _batch_rows(model, chunk: Sequence[tuple[Segment, Policy, int]], *, n_prompt: int, model_id: str, backend: str,
                max_rows: int, fulls: dict[str, np.ndarray], on_row: Callable[[], None] = lambda: None
                ) -> list[dict[str, Any]]:
    """The store rows of one batch of (segment, policy, budget) cells, run together through ``model``; ``fulls``
    caches each segment's full-cache logits across batches."""
    for seg, _, _ in chunk:
        if seg.name not in fulls:
            fulls[seg.name] = full_model_logits(model, seg.ids, start=n_prompt)
    rows: list[dict[str, Any]] = []

    def finished(i: int, res) -> None:
        seg, pol, b = chunk[i]
        m = metrics_of_run(res, model, seg.ids, n_prompt, fulls[seg.name])
        rows.append({"key": cell_key(model_id, seg, n_prompt, pol, b), "model": model_id, "text": seg.text,
                     "start": seg.start, "segment": seg.name, "n_prompt": n_prompt,
                     "n_decode": len(seg.ids) - n_prompt, "policy": pol.name, "label": pol.label(),
                     "params": pol.params, "budget": int(b), "delta_nll": m["delta_nll"],
                     "top1_disagreement": 1.0 - m["top1_agreement"],
                     "nll_per_token": json.dumps(m["nll_per_token"])})
        on_row()

    run_batch(model, [BatchJob(p, b, s.ids[:n_prompt], continuation=s.ids[n_prompt:]) for s, p, b in chunk],
              max_rows=max_rows, on_result=finished, backend=backend)
    return rows


def closed_loop(model, segments: Sequence[Segment], configs: Sequence[tuple[Policy, int]], store, *, n_prompt: int,
                model_id: str, max_rows: int = 48, progress: bool = True, backend: str = "torch",
                log: Callable[[str], None] = print, ray: RayTarget | None = None,
                fulls: dict[str, np.ndarray] | None = None) -> "Any":
    """ΔNLL and top-1 disagreement (vs the full cache) of every segment × (policy, budget) not yet in ``store``,
    run batched through the model (``backend``: the runner's cache kernels), here or, with ``ray``, as one Ray
    task per batch on workers that load the model themselves; each batch is stored as soon as it finishes.
    ``fulls``: the segments' full-cache logits by segment name, filled as they are computed, so that a caller
    that calls again (a search confirming a few cells at a time) runs each segment's full forward once.
    Returns the store's table."""
    done = store.keys()
    todo = [(s, p, b) for s in segments for p, b in configs if cell_key(model_id, s, n_prompt, p, b) not in done]
    if len(todo) < len(segments) * len(configs):
        log(f"resuming: {len(segments) * len(configs) - len(todo)} cells already in {store.root}")
    # batch rows must agree on streaming (and length): group, then cut into batches
    todo.sort(key=lambda c: (BatchJob(c[1], c[2], c[0].ids[:n_prompt]).streams, c[2]))
    chunks = [todo[c:c + max_rows] for c in range(0, len(todo), max_rows)]
    with tqdm(total=len(todo), desc="closed loop", unit="run", disable=not progress) as bar:
        if ray is None:
            fulls = {} if fulls is None else fulls
            batches = (_batch_rows(model, chunk, n_prompt=n_prompt, model_id=model_id, backend=backend,
                                   max_rows=max_rows, fulls=fulls, on_row=lambda: bar.update(1)) for chunk in chunks)
        else:
            remote = [_RemoteBatch(ray, tuple((s, p.name, tuple(sorted(p.params.items())), int(b))
                                              for s, p, b in chunk), n_prompt, model_id, backend, max_rows)
                      for chunk in chunks]
            batches = ray_map(_run_remote_batch, remote, address=ray.address, threads=ray.threads,
                              gpus=1 if ray.device.startswith("cuda") else 0)
        for rows in batches:
            store.add(rows)
            if ray is not None:
                bar.update(len(rows))
            if progress:
                bar.write(f"batch of {len(rows)}: mean ΔNLL {np.mean([r['delta_nll'] for r in rows]):.4f}")
                sys.stdout.flush()
    return store.load()


#: the simulated losses `simulated` reads off the engine's summary (free with every replay)
ENGINE_LOSSES = ("err_mean", "err_p95", "kl_mean", "l1_mean", "miss_mass")
#: every simulated loss `simulated` can give: the engine's and the error after W_O (`sim.replay.projected_error`), which
#: needs every cell's kept sets and a numpy pass of its own (most of a search's simulate stage when asked for)
SIMULATED_LOSSES = (*ENGINE_LOSSES, "err_wo_mean")


def simulated(model, segments: Sequence[Segment], configs: Sequence[tuple[Policy, int]], *, n_prompt: int,
              model_id: str, store=None, progress: bool = True,
              losses: Sequence[str] = SIMULATED_LOSSES, threads: int | None = None,
              trace_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """The simulator's losses of every segment × (policy, budget): one teacher-forced trace per segment, every
    configuration replayed on it in one pass (`sim.replay.cells.replay_cells`: layer by layer, results those of
    replaying each alone). One row per cell, with the engine's losses (`ENGINE_LOSSES`), the per-layer mean error
    (``err_by_layer``) and the K/V bytes held; with ``err_wo_mean`` in ``losses``, also the error after the output
    projection W_O (`sim.replay.projected_error`; ``err_wo_mean``, ``err_wo_by_layer``), the only loss that costs more
    than the replay. With a ``store`` (a `sim.experiments.store.ResultStore`), segments already simulated (with the losses
    asked for) are read back, new ones added. The progress bar counts configurations. ``threads``: the cells of a
    layer replayed side by side (default: this process's share of the cores, `sim.replay.plan.replay_threads`).
    ``trace_dir``: where each segment's trace is kept between calls (a search that simulates new budgets later
    records each segment once, not once per call); None: a temporary folder removed on return."""
    unknown = sorted(set(losses) - set(SIMULATED_LOSSES))
    if unknown:
        raise ValidateError(f"unknown simulated loss(es) {unknown}; choose from {SIMULATED_LOSSES}")
    want_wo = "err_wo_mean" in losses
    rows: list[dict[str, Any]] = []
    known = _stored_cells(store, want_wo)
    chunk = reconstruction_chunk([pol for pol, _ in configs])
    with tempfile.TemporaryDirectory(prefix="kvsim-segments-") as tmp, \
            tqdm(total=len(segments) * len(configs), desc="simulate", unit="cfg", disable=not progress) as bar:
        for si, seg in enumerate(segments):
            keys = [cell_key(model_id, seg, n_prompt, pol, b) for pol, b in configs]
            if known is not None and set(keys) <= set(known.index):
                part = known.loc[keys].reset_index()
                rows += [_row_lists(r) for r in part.drop(columns=["model"]).to_dict("records")]
                bar.update(len(configs))
                continue
            path = Path(trace_dir or tmp) / _trace_name(model_id, seg, n_prompt, chunk)
            if not (path / "manifest.json").is_file():     # a trace folder is renamed into place when complete
                bar.set_postfix_str(f"segment {si + 1}/{len(segments)}: recording")
                record_segment(model, seg, path, n_prompt=n_prompt, model_id=model_id, reconstruction_chunk=chunk)
            trace = load_trace(path)
            bar.set_postfix_str(f"segment {si + 1}/{len(segments)}")
            seg_rows = _segment_rows(trace, load_layers(trace), seg, configs, keys, want_wo, _Ticker(bar), threads)
            if store is not None:
                store.add([{**r, "model": model_id} for r in seg_rows])
            rows += seg_rows
    return rows


def record_segment(model, seg: Segment, path: str | Path, *, n_prompt: int, model_id: str,
                   reconstruction_chunk: int | None) -> None:
    """The teacher-forced trace `simulated` replays a segment on: its text in one causal pass, KVzip's
    reconstruction pass where a configuration needs it, and no prompt-position predictions (nothing reads them;
    the LM head then runs on the decoded positions alone)."""
    record_trace(model, list(seg.ids), path, n_prompt=n_prompt, n_decode=len(seg.ids) - n_prompt,
                 teacher_forced=True, single_pass=True, progress=False, model_id=model_id, prompt_scores=False,
                 reconstruction_chunk=reconstruction_chunk)


class _Ticker:
    """A tqdm bar advanced by fractions of a configuration (a cell's layer), shown in whole configurations."""

    def __init__(self, bar) -> None:
        self.bar, self.done, self.shown = bar, 0.0, 0

    def __call__(self, x: float) -> None:
        self.done += x
        whole = int(self.done + 1e-9)
        if whole > self.shown:
            self.bar.update(whole - self.shown)
            self.shown = whole


def _trace_name(model_id: str, seg: Segment, n_prompt: int, chunk: int | None) -> str:
    """The folder name of a segment's trace: everything the recording depends on (the model, the segment's tokens,
    the prompt split, the reconstruction chunk that KVzip-style policies need recorded)."""
    payload = json.dumps([model_id, seg.name, hashlib.sha256(str(seg.ids).encode()).hexdigest()[:16], n_prompt,
                          chunk], default=str)
    return "trace-" + hashlib.sha256(payload.encode()).hexdigest()[:16]


def _segment_rows(trace, inputs, seg: Segment, configs: Sequence[tuple[Policy, int]], keys: Sequence[str],
                  want_wo: bool, tick: Callable[[float], None], threads: int | None) -> list[dict[str, Any]]:
    """The rows of one segment's trace: every configuration replayed in one pass, in the order of ``configs``."""
    P = trace.meta.n_prompt
    n_dec = trace.meta.n_tokens - P
    wo = trace.wo() if want_wo else None
    refs: dict[tuple[int, ...], ProjectedReference] = {}
    rows: list[dict[str, Any] | None] = [None] * len(configs)
    for i, res in replay_cells(trace, [(pol, int(b)) for pol, b in configs], inputs=inputs,
                               record_kept=(P, n_dec) if want_wo else None, on_progress=tick, threads=threads):
        pol, b = configs[i]
        s = res.summary()
        row = {"key": keys[i], "segment": seg.name, "text": seg.text, "label": pol.label(), "budget": int(b),
               **{k: s[k] for k in ENGINE_LOSSES}, "err_by_layer": s["err_by_layer"],
               "kv_bytes_mean": s["kv_bytes_mean"]}
        if want_wo:
            idx = tuple(int(x) for x in res.layer_index)     # the layers the policy compresses
            if idx not in refs:
                refs[idx] = ProjectedReference([inputs[l] for l in idx], [wo[l] for l in idx], P,
                                               trace.meta.softmax_scale)
            err_wo = refs[idx].errors(res.kept)
            row.update(err_wo_mean=float(err_wo.mean()), err_wo_by_layer=err_wo.tolist())
        rows[i] = row
    return rows


def _stored_cells(store, want_wo: bool):
    """The simulated rows of ``store`` indexed by key (None without a store), one per key: where a key was
    written with and without the error after W_O, the row that has it."""
    if store is None:
        return None
    df = store.load(dedupe=False)
    if not len(df):
        return df
    has_wo = df["err_wo_mean"].notna() if "err_wo_mean" in df else np.zeros(len(df), bool)
    if want_wo:
        df = df[has_wo]
    else:
        df = df.assign(_wo=has_wo).sort_values("_wo", ascending=False, kind="stable").drop(columns="_wo")
    return df.drop_duplicates("key").set_index("key")


def _row_lists(r: dict[str, Any]) -> dict[str, Any]:
    """A stored row as `simulated` returns it: per-layer columns as lists, the error after W_O only where known."""
    out = {k: v for k, v in r.items() if not (k.startswith("err_wo") and _missing(v))}
    for k in ("err_by_layer", "err_wo_by_layer"):
        if k in out:
            out[k] = list(out[k])
    return out


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and np.isnan(v))


# ----- analysis: the model's own reliability, then the simulator against it -----

def cell_table(df, value: str, labels: Sequence[str], segments: Sequence[str]) -> np.ndarray:
    """[segments, policies] of one column of ``df`` (rows keyed by segment and label; one budget, one text)."""
    idx = {(r.segment, r.label): getattr(r, value) for r in df.itertuples()}
    missing = [(s, lab) for s in segments for lab in labels if (s, lab) not in idx]
    if missing:
        raise ValidateError(f"{len(missing)} cells missing from the table, e.g. {missing[0]}")
    return np.array([[idx[s, lab] for lab in labels] for s in segments], float)


def fidelity_by_text(merged, sim_losses: Sequence[str], model_losses: Sequence[str]) -> dict[str, Any]:
    """Per text and budget: split-half reliability of the model's policy ranking (mean over segments) and the
    Spearman rho of each simulated loss's policy means with each model loss's; plus rho pooled over budgets.
    ``merged`` joins closed-loop and simulated rows (columns text, segment, label, budget and the losses)."""
    out: dict[str, Any] = {}
    for text, part in merged.groupby("text"):
        labels = sorted(part.label.unique())
        segs = sorted(part.segment.unique())
        per_budget, pooled_x, pooled_y = {}, {s: [] for s in sim_losses}, {m: [] for m in model_losses}
        for b, cell in part.groupby("budget"):
            tables = {k: cell_table(cell, k, labels, segs) for k in (*sim_losses, *model_losses)}
            means = {k: t.mean(0) for k, t in tables.items()}
            per_budget[int(b)] = {
                "reliability": {m: split_half_reliability(tables[m]) for m in model_losses},
                "rho": {s: {m: spearman(means[s], means[m]) for m in model_losses} for s in sim_losses},
                "policy_means": {lab: {k: float(means[k][i]) for k in means} for i, lab in enumerate(labels)}}
            for s in sim_losses:
                pooled_x[s] += list(means[s])
            for m in model_losses:
                pooled_y[m] += list(means[m])
        within = {s: {m: float(np.nanmean([v["rho"][s][m] for v in per_budget.values()])) for m in model_losses}
                  for s in sim_losses}
        pooled = {s: {m: spearman(pooled_x[s], pooled_y[m]) for m in model_losses} for s in sim_losses}
        out[text] = {"n_segments": len(segs), "policies": labels, "within_budget_rho": within,
                     "pooled_rho": pooled, "by_budget": per_budget}
    return out


def plot_segment_fidelity(res: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """One panel per (text, budget): each policy's mean simulated error against its mean closed-loop ΔNLL
    over the segments, with the within-budget rho and the model's own split-half reliability in the title."""
    plt = agg_pyplot()
    texts = list(res)
    budgets = sorted({int(b) for r in res.values() for b in r["by_budget"]})
    fig, axes = plt.subplots(len(texts), len(budgets), figsize=(4.2 * len(budgets), 3.6 * len(texts)),
                             squeeze=False, constrained_layout=True)
    labels = sorted({lab for r in res.values() for lab in r["policies"]})
    cmap = plt.get_cmap("tab20")
    for i, text in enumerate(texts):
        for j, b in enumerate(budgets):
            ax = axes[i, j]
            v = res[text]["by_budget"].get(b) or res[text]["by_budget"].get(str(b))
            if v is None:
                ax.set_axis_off()
                continue
            for k, lab in enumerate(labels):
                m = v["policy_means"].get(lab)
                if m is None:
                    continue
                ax.scatter(m["err_mean"], m["delta_nll"], color=cmap(k % 20), marker="os^Dv"[k % 5], s=30,
                           label=lab if (i, j) == (0, 0) else None)
            rel = v["reliability"]["delta_nll"]["spearman_brown"]
            ax.set_title(f"{text}, budget {b}: ρ = {v['rho']['err_mean']['delta_nll']:+.2f} "
                         f"(model reliability {rel:.2f})", fontsize=8)
            ax.set_xlabel("simulated mean attention error", fontsize=8)
            ax.set_ylabel("closed-loop ΔNLL", fontsize=8)
            ax.grid(alpha=0.3)
    fig.legend(loc="outside right center", fontsize=7)
    fig.suptitle(title or "simulator vs closed loop at equal budget", fontsize=10)
    return save_figure(fig, path, dpi=110)


def fit_layer_weights(merged, by_layer: str = "err_by_layer", target: str = "delta_nll",
                      ridge: float = 1e-2) -> np.ndarray:
    """Non-negative per-layer weights w with ``sum_l w_l * err_l`` ≈ the model loss, fitted on the (label, budget)
    means over segments of ``merged`` (one text). Ridge ``ridge`` x mean squared feature keeps the 30 weights
    of a 30-layer model determined by ~40 cells; fixed a priori, not tuned."""
    cells = merged.groupby(["label", "budget"])
    X = np.array([np.mean(np.stack([np.asarray(v, float) for v in part[by_layer]]), axis=0) for _, part in cells])
    y = np.array([part[target].mean() for _, part in cells])
    lam = ridge * float((X ** 2).mean()) * len(X)
    A = np.vstack([X, np.sqrt(lam) * np.eye(X.shape[1])])
    w, _ = nnls(A, np.concatenate([y, np.zeros(X.shape[1])]))
    return w


def weighted_error(merged, w: np.ndarray, by_layer: str = "err_by_layer"):
    """``sum_l w_l * err_l`` of every row (a pandas Series aligned with ``merged``)."""
    return pd.Series([float(np.dot(w, np.asarray(v, float))) for v in merged[by_layer]], index=merged.index)
