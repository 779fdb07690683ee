"""D2O evaluation: D2O vs H2O vs D2O without merging (and without layer allocation) at several budgets, then a
grid search of the EMA beta per budget, on a real-model trace (if given or recordable) and a synthetic trace.

Budgets are the paper's compression ratios rho = budget / prompt length (0.2, 0.4, 0.8) plus a tight one. The
question (paper Section 4.2.2): does merging reduce the attention-output error ||o_full - o_cache|| / ||o_full||
compared with dropping the same tokens? Writes benchmarks/results/eval_d2o.json and .png.

    PYTHONPATH=. python benchmarks/eval_d2o.py [--trace DIR] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from policies import get_policy
from sim.replay import load_layers, replay
from traces.format import Trace, load_trace
from traces.synthetic import make_synthetic_trace

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {
    "h2o": ("h2o", {}),
    "d2o": ("d2o", {}),
    "d2o_no_merge": ("d2o", {"merge": False}),
    "d2o_no_layer": ("d2o", {"layer_alloc": False}),
    "d2o_no_layer_no_merge": ("d2o", {"layer_alloc": False, "merge": False}),
}
BETAS = (0.5, 0.6, 0.7, 0.8, 0.9)
RHOS = (0.05, 0.2, 0.4, 0.8)


def evaluate(name: str, trace: Trace) -> tuple[list[dict], list[dict]]:
    """Rows for every variant and budget, and the beta grid per budget (merging on, paper defaults otherwise)."""
    inputs = load_layers(trace)
    P = trace.meta.n_prompt
    budgets = sorted({max(8, int(round(r * P))) for r in RHOS})
    rows, grid = [], []
    for b in budgets:
        for var, (pname, params) in VARIANTS.items():
            pol = get_policy(pname, **params)
            s = replay(trace, pol, b, inputs=inputs).summary()
            rows.append(dict(trace=name, budget=b, rho=b / P, variant=var, err=s["err_mean"], err_p95=s["err_p95"],
                             mass=s["mass_mean"], kl=s["kl_mean"], err_by_layer=s["err_by_layer"]))
            print(f"{name:>22} B={b:>4} {var:>22} err {s['err_mean']:.4f} mass {s['mass_mean']:.4f} "
                  f"kl {s['kl_mean']:.4f}", flush=True)
        for layer_alloc in (True, False):
            for beta in BETAS:
                res = replay(trace, get_policy("d2o", beta=beta, layer_alloc=layer_alloc), b, inputs=inputs)
                s = res.summary()
                grid.append(dict(trace=name, budget=b, layer_alloc=layer_alloc, beta=beta, err=s["err_mean"],
                                 mass=s["mass_mean"], kl=s["kl_mean"], layer_budgets=res.budgets[:, 0].tolist()))
    return rows, grid


def best_betas(grid: list[dict]) -> list[dict]:
    """Lowest mean output error per (trace, budget, layer_alloc) over the beta grid."""
    out = []
    for key in sorted({(g["trace"], g["budget"], g["layer_alloc"]) for g in grid}):
        sel = [g for g in grid if (g["trace"], g["budget"], g["layer_alloc"]) == key]
        best = min(sel, key=lambda g: g["err"])
        errs = [g["err"] for g in sel]
        out.append(dict(trace=key[0], budget=key[1], layer_alloc=key[2], best_beta=best["beta"], best_err=best["err"],
                        spread=max(errs) - min(errs)))
    return out


def plot(rows: list[dict], grid: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = sorted({r["trace"] for r in rows})
    fig, axes = plt.subplots(2, len(traces), figsize=(5.5 * len(traces), 8), squeeze=False)
    for c, tr in enumerate(traces):
        ax = axes[0, c]
        for var in VARIANTS:
            sel = sorted((r for r in rows if r["trace"] == tr and r["variant"] == var), key=lambda r: r["budget"])
            ax.plot([r["budget"] for r in sel], [r["err"] for r in sel], "o-", label=var)
        ax.set(xscale="log", yscale="log", xlabel="budget (slots per KV head)", ylabel="mean rel. output error",
               title=tr)
        ax.legend(fontsize=8)
        ax = axes[1, c]
        for b in sorted({g["budget"] for g in grid if g["trace"] == tr}):
            for la, ls in ((True, "-"), (False, "--")):
                sel = [g for g in grid if g["trace"] == tr and g["budget"] == b and g["layer_alloc"] == la]
                ax.plot([g["beta"] for g in sel], [g["err"] for g in sel], "o" + ls,
                        label=f"B={b}" + ("" if la else " uniform"))
        ax.set(xlabel="beta", ylabel="mean rel. output error", yscale="log", title="EMA beta grid (merging on)")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="a recorded real-model trace directory (default: the shipped model's, if any)")
    ap.add_argument("--quick", action="store_true", help="shorter synthetic trace")
    args = ap.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    t0 = time.time()
    T, P = (768, 512) if args.quick else (1536, 1024)
    traces: dict[str, Trace] = {
        "synthetic-mixed": make_synthetic_trace("mixed", n_layers=4, n_q_heads=8, n_kv_heads=2, head_dim=32,
                                                n_tokens=T, n_prompt=P, seed=0),
    }
    real = args.trace
    tmpdir = None
    if real is None:
        try:
            from traces.model import record_default_trace  # type: ignore[import-not-found]
            tmpdir = tempfile.TemporaryDirectory()
            real = str(record_default_trace(Path(tmpdir.name) / "trace", n_prompt=P, n_decode=T - P))
        except ImportError as e:
            print(f"no real-model trace ({e}); synthetic traces only")
    if real:
        tr = load_trace(real)
        traces["real:" + tr.meta.model.model_id] = tr
    rows, grid = [], []
    for name, tr in traces.items():
        r, g = evaluate(name, tr)
        rows += r
        grid += g
    best = best_betas(grid)
    for b in best:
        print(f"{b['trace']:>22} B={b['budget']:>4} layer_alloc={b['layer_alloc']!s:>5} best beta {b['best_beta']} "
              f"err {b['best_err']:.4f} (spread over grid {b['spread']:.2e})")
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = dict(traces={n: dict(n_tokens=t.meta.n_tokens, n_prompt=t.meta.n_prompt, model=t.meta.model.model_id,
                                   n_layers=t.n_layers, n_kv_heads=t.meta.model.n_kv_heads) for n, t in traces.items()},
                   variants={k: dict(policy=p, params=q) for k, (p, q) in VARIANTS.items()}, betas=BETAS, rows=rows,
                   beta_grid=grid, best_beta=best, seconds=time.time() - t0)
    out = RESULTS / "eval_d2o.json"
    with tempfile.NamedTemporaryFile("w", dir=RESULTS, delete=False, suffix=".tmp") as f:
        json.dump(payload, f, indent=1)
    os.replace(f.name, out)
    plot(rows, grid, RESULTS / "eval_d2o.png")
    print(f"wrote {out} in {time.time() - t0:.0f} s")
    if tmpdir is not None:
        tmpdir.cleanup()


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
