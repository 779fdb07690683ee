"""D2O evaluation: D2O vs H2O vs its ablations (no merging, no layer allocation, eviction only), the literal
eq. 4-5 allocation and the released-code preset at several budgets, then a grid search of the EMA beta per
budget, on a real-model trace (if given or recordable) and a synthetic trace.

Synthetic budgets are the paper's compression ratios rho = budget / prompt length (0.2, 0.4, 0.8) plus a tight
one; the real trace uses ``--budgets`` (default the same ratios). The questions (paper Section 4.2.2): does
merging reduce the attention-output error ||o_full - o_cache|| / ||o_full|| compared with dropping the same
tokens, and does the layer allocation help? Writes benchmarks/results/eval_d2o.json and .png, and the per-layer
budgets of each allocation reading to d2o_layer_budgets.png.

    python -m benchmarks.eval_d2o [--trace DIR] [--layers all] [--budgets 64,128,256 | --rhos 0.2,0.4,0.8]
        [--betas 0.5,0.6,0.7,0.8,0.9 | --betas ''] [--real-only] [--quick]

(--real-only: the real trace alone, written to eval_d2o_<model>_<context>k.json.)
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._util import add_real_trace_args, machine, real_model_trace, result_name, trace_fields, write_result
from policies import get_policy
from policies.d2o import UNCOMPRESSED
from sim.replay.layer_inputs import load_layers
from sim.replay.policy_replay import replay
from traces.format import Trace, load_trace
from traces.synthetic import make_synthetic_trace

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {
    "h2o": ("h2o", {}),
    "d2o": ("d2o", {}),
    "d2o_no_merge": ("d2o", {"merge": False}),
    "d2o_no_layer": ("d2o", {"layer_alloc": False}),
    "d2o_no_layer_no_merge": ("d2o", {"layer_alloc": False, "merge": False}),   # the eviction-only ablation
    "d2o_literal": ("d2o", {"alloc": "literal"}),
    "d2o_reference": ("d2o", {"preset": "reference"}),
    # the released token level at equal memory (every layer compressed)
    "d2o_reference_equal_mem": ("d2o", {"preset": "reference", "exempt_layers": False}),
}
#: variants whose per-layer budgets are plotted
ALLOC_PLOT = {"d2o": "normalized (default, released code)", "d2o_literal": "literal eq. 4-5",
              "d2o_reference": "preset=reference (layers 0, 1, L-1 uncompressed)"}
BETAS = (0.5, 0.6, 0.7, 0.8, 0.9)
RHOS = (0.05, 0.2, 0.4, 0.8)


def evaluate(name: str, trace: Trace, budgets: list[int] | None = None, rhos=RHOS,
             betas=BETAS) -> tuple[list[dict], list[dict]]:
    """Rows for every variant and budget (default: the ratios ``rhos`` of the prompt), and the beta grid per budget
    (merging on, paper defaults otherwise)."""
    inputs = load_layers(trace)
    P = trace.meta.n_prompt
    budgets = budgets or sorted({max(8, int(round(r * P))) for r in rhos})
    rows, grid = [], []
    for b in budgets:
        for var, (pname, params) in VARIANTS.items():
            pol = get_policy(pname, **params)
            res = replay(trace, pol, b, inputs=inputs)
            s = res.summary()
            layer_budgets = [None if x >= UNCOMPRESSED else int(x) for x in res.budgets[:, 0]]
            rows.append(dict(trace=name, budget=b, rho=b / P, variant=var, err=s["err_mean"], err_p95=s["err_p95"],
                             mass=s["mass_mean"], kl=s["kl_mean"], err_by_layer=s["err_by_layer"],
                             layer_budgets=layer_budgets))
            print(f"{name:>22} B={b:>4} {var:>22} err {s['err_mean']:.4f} mass {s['mass_mean']:.4f} "
                  f"kl {s['kl_mean']:.4f}", flush=True)
        for layer_alloc in (True, False):
            for beta in betas:
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
    from sim.reports.plotting import agg_pyplot, save_figure

    plt = agg_pyplot()

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
    save_figure(fig, path, dpi=110)


def plot_layer_budgets(rows: list[dict], path: Path) -> None:
    """Per-layer budgets of each allocation reading, one panel per budget (of the real-model trace if any);
    uncompressed layers (``exempt_layers``) are marked at the top."""
    from sim.reports.plotting import agg_pyplot, save_figure

    plt = agg_pyplot()

    real = [r for r in rows if r["trace"].startswith("real:")]
    keys = sorted({(r["trace"], r["budget"]) for r in (real or rows)})   # the real model's when there is one
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.6 * len(keys)), squeeze=False)
    for ax, (tr, b) in zip(axes[:, 0], keys):
        top = 0
        for var, label in ALLOC_PLOT.items():
            sel = [r for r in rows if (r["trace"], r["budget"], r["variant"]) == (tr, b, var)]
            if not sel:
                continue
            lb = sel[0]["layer_budgets"]
            y = np.array([np.nan if x is None else x for x in lb], float)
            top = max(top, np.nanmax(y))
            ax.plot(np.arange(len(y)), y, "o-", ms=3, label=f"{label}: err {sel[0]['err']:.3f}")
            full = [i for i, x in enumerate(lb) if x is None]
            if full:
                ax.plot(full, [top] * len(full), "k^", ms=6, label="uncompressed")
        ax.axhline(b, color="gray", ls=":", lw=1, label=f"uniform {b}")
        ax.set(yscale="log", xlabel="layer", ylabel="slots per KV head", title=f"{tr}, budget {b}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_real_trace_args(ap, layers="all")
    ap.add_argument("--budgets", help="comma-separated budgets for the real trace (default: the rho grid)")
    ap.add_argument("--rhos", default=",".join(map(str, RHOS)),
                    help="the real trace's budgets as the paper's ratios rho = budget / prompt length "
                         "(default %(default)s)")
    ap.add_argument("--betas", default=",".join(map(str, BETAS)),
                    help="EMA betas of the grid, comma-separated ('' skips the grid; default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="shorter synthetic trace")
    args = ap.parse_args()
    t0 = time.time()
    T, P = (768, 512) if args.quick else (1536, 1024)
    traces: dict[str, Trace] = {} if args.real_only else {
        "synthetic-mixed": make_synthetic_trace("mixed", n_layers=4, n_q_heads=8, n_kv_heads=2, head_dim=32,
                                                n_tokens=T, n_prompt=P, seed=0),
    }
    tmpdir = tempfile.TemporaryDirectory()
    tr = None
    if args.trace is not None:
        tr = real_model_trace(args, Path(tmpdir.name))
    else:
        try:
            from traces.model import record_default_trace  # type: ignore[import-not-found]
            tr = load_trace(record_default_trace(Path(tmpdir.name) / "trace", n_prompt=P, n_decode=T - P))
        except ImportError as e:
            print(f"no real-model trace ({e}); synthetic traces only")
    if tr is not None:
        traces["real:" + tr.meta.model.model_id] = tr
    rows, grid = [], []
    real_budgets = [int(x) for x in args.budgets.split(",")] if args.budgets else None
    rhos = tuple(float(x) for x in args.rhos.split(","))
    betas = tuple(float(x) for x in args.betas.split(",") if x.strip())
    for name, trace in traces.items():
        real = name.startswith("real:")
        r, g = evaluate(name, trace, real_budgets if real else None, rhos if real else RHOS, betas)
        rows += r
        grid += g
    best = best_betas(grid)
    for b in best:
        print(f"{b['trace']:>22} B={b['budget']:>4} layer_alloc={b['layer_alloc']!s:>5} best beta {b['best_beta']} "
              f"err {b['best_err']:.4f} (spread over grid {b['spread']:.2e})")
    name = result_name("eval_d2o", tr, args.real_only) if tr is not None else "eval_d2o"
    payload = dict(**(trace_fields(tr) if tr is not None else {}), machine=machine(),
                   traces={n: dict(n_tokens=t.meta.n_tokens, n_prompt=t.meta.n_prompt, model=t.meta.model.model_id,
                                   n_layers=t.n_layers, n_kv_heads=t.meta.model.n_kv_heads) for n, t in traces.items()},
                   variants={k: dict(policy=p, params=q) for k, (p, q) in VARIANTS.items()}, betas=betas, rows=rows,
                   beta_grid=grid, best_beta=best, seconds=time.time() - t0)
    out = write_result(name, payload)
    plot(rows, grid, RESULTS / f"{name}.png")
    plot_layer_budgets(rows, RESULTS / ("d2o_layer_budgets.png" if name == "eval_d2o" else f"{name}_layer_budgets.png"))
    print(f"wrote {out} in {time.time() - t0:.0f} s")
    tmpdir.cleanup()


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
