"""BumbleBee vs H2O (and SnapKV when registered) and the oracle on a real-model trace (SmolLM2-135M through the
model registry, or --trace DIR, on a subset of layers: --layers) and on synthetic traces, each synthetic one also
in a variant with near-duplicate keys (runs of jittered copies of one token's key and value).

Run: python -m benchmarks.eval_bumblebee -> benchmarks/results/eval_bumblebee.{json,png}
(--trace DIR --real-only: the real trace alone, to eval_bumblebee_<model>_<context>k.{json,png}. The prompt's
exact greedy holds a P x P similarity per layer being replayed: 12 B x P^2, 1.9 GB at P = 8 k, 12.7 GB at 32 k.)
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._util import (RESULTS, add_real_trace_args, machine, real_model_trace, result_name, trace_fields,
                              write_result)
from policies import get_policy, list_policies
from sim.replay.layer_inputs import load_layers
from sim.replay.oracle_replay import replay_oracle
from sim.replay.policy_replay import replay
from traces.format import InMemoryTrace, LayerArrays, Trace
from traces.reference import full_attention_reference
from traces.synthetic import make_synthetic_trace

POLICIES = [("bumblebee", {}), ("bumblebee", {"concave": "log", "lam": 0.2}), ("bumblebee", {"recent_ratio": 0.0}),
            ("bumblebee", {"lam": 0.0}), ("h2o", {}), ("snapkv", {})]
FRACTIONS = (0.05, 0.1, 0.2, 0.3)


def with_near_duplicates(trace: Trace, run: int = 4, jitter: float = 0.05, seed: int = 0) -> InMemoryTrace:
    """Every ``run`` consecutive tokens share the first one's key and value plus ``jitter`` x their spread of
    Gaussian noise (repeated text); queries are untouched and the reference attention is recomputed."""
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(trace.n_layers):
        la = trace.layer(i)
        k, v = np.array(la.k, np.float32), np.array(la.v, np.float32)
        src = (np.arange(k.shape[0]) // run) * run
        k = k[src] + jitter * k.std() * rng.standard_normal(k.shape).astype(np.float32)
        v = v[src] + jitter * v.std() * rng.standard_normal(v.shape).astype(np.float32)
        q = np.array(la.q, np.float32)
        lse, o = full_attention_reference(q, k, v, trace.meta.softmax_scale)
        layers.append(LayerArrays(q, k, v, lse, o))
    source = dict(trace.meta.source, near_duplicates={"run": run, "jitter": jitter, "seed": seed})
    return InMemoryTrace(dataclasses.replace(trace.meta, source=source), layers)


def evaluate(traces: dict[str, Trace]) -> list[dict]:
    known = set(list_policies())
    rows = []
    for tname, trace in traces.items():
        T = trace.meta.n_tokens
        budgets = [max(4, int(round(f * T))) for f in FRACTIONS]
        inputs = load_layers(trace)
        for b, res in zip(budgets, replay_oracle(trace, budgets, inputs=inputs)):
            rows.append(dict(res.summary(), trace=tname, label="oracle", fraction=b / T, seconds=None))
        for name, params in POLICIES:
            if name not in known:
                continue
            pol = get_policy(name, **params)
            for b in budgets:
                t0 = time.perf_counter()
                res = replay(trace, pol, b, inputs=inputs)
                s = res.summary()
                rows.append(dict(s, trace=tname, label=pol.label(), fraction=b / T,
                                 seconds=time.perf_counter() - t0))
                print(f"{tname:>18} {pol.label():>36} b={b:4d} err={s['err_mean']:.4f} mass={s['mass_mean']:.4f}")
    return rows


def plot(rows: list[dict], path) -> None:
    from sim.reports.plotting import agg_pyplot, save_figure

    plt = agg_pyplot()

    tnames = list(dict.fromkeys(r["trace"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = plt.subplots(2, len(tnames), figsize=(4.2 * len(tnames), 6.5), squeeze=False)
    for c, tn in enumerate(tnames):
        for r_, metric in enumerate(("err_mean", "mass_mean")):
            ax = axes[r_, c]
            for lab in labels:
                pts = sorted((r["fraction"], r[metric]) for r in rows if r["trace"] == tn and r["label"] == lab)
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, label=lab, ls="--" if lab == "oracle" else "-")
            ax.set_title(tn, fontsize=9)
            ax.set_xlabel("budget / T")
            ax.set_ylabel({"err_mean": "attention output rel. error", "mass_mean": "attention mass kept"}[metric])
            if metric == "err_mean":
                ax.set_yscale("log")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=512)
    add_real_trace_args(ap)
    a = ap.parse_args()
    t0 = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="eval_bumblebee_")
    real = real_model_trace(a, Path(tmp.name), n_prompt=a.prompt, n_decode=a.tokens - a.prompt)
    traces: dict[str, Trace] = {f"real:{real.meta.model.model_id}": real}
    for kind in () if a.real_only else ("mixed", "recall"):
        base = make_synthetic_trace(kind, n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=32, n_tokens=a.tokens,
                                    n_prompt=a.prompt, seed=0)
        traces[kind] = base
        traces[f"{kind}+near-dup"] = with_near_duplicates(base)
    rows = evaluate(traces)
    name = result_name("eval_bumblebee", real, a.real_only)
    plot(rows, RESULTS / f"{name}.png")
    write_result(name, {**trace_fields(real), "machine": machine(), "seconds": round(time.perf_counter() - t0, 1),
                                    "tokens": a.tokens, "prompt": a.prompt,
                                    "real_trace": {"T": real.meta.n_tokens, "P": real.meta.n_prompt,
                                                   "layers": list(real.meta.model.layer_ids)},
                                    "rows": rows})


if __name__ == "__main__":
    main()
