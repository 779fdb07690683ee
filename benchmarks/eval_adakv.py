"""Ada-KV evaluation: Ada-SnapKV vs SnapKV, Ada-PyramidKV vs PyramidKV (and Ada-H2O vs its uniform twin) at
budgets 128-2048 on synthetic traces with heterogeneous heads and on a real-model trace.

Each (trace, policy, budget) is replayed over the decode steps after the prompt; we report the mean eviction loss
``l1`` (= ||o_full - o_cache||_1, Ada-KV's loss without W^O), its Theorem 2 bound, the relative output error and
the retained attention mass, plus the layer-scope oracle at the same memory. Writes
benchmarks/results/eval_adakv.json and .png.

    python -m benchmarks.eval_adakv [--trace DIR] [--quick] [--real-only]

(--real-only: the real trace alone, written to eval_adakv_<model>_<context>k.json.)
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._util import add_real_trace_args, machine, real_model_trace, result_name, trace_fields, write_result
from policies import get_policy
from sim.replay.layer_inputs import load_layers
from sim.replay.oracle_replay import replay_oracle
from sim.replay.policy_replay import replay
from sim.replay.threads import limit_threads
from traces.format import InMemoryTrace, LayerArrays, ModelInfo, Trace, TraceMeta
from traces.synthetic import make_synthetic_trace

RESULTS = Path(__file__).resolve().parent / "results"
#: family -> (uniform policy, params), (adaptive policy, params); ada_h2o with floor_alpha = 1 is its exact
#: uniform twin (H2O's accumulated score with a one-shot prefill selection)
FAMILIES = {
    "snapkv": (("snapkv", {}), ("ada_snapkv", {})),
    "pyramidkv": (("pyramidkv", {}), ("ada_pyramidkv", {})),
    "h2o": (("ada_h2o", {"floor_alpha": 1.0}), ("ada_h2o", {})),
    "snapkv_flat": (("snapkv", {}), ("ada_snapkv", {"decode_alloc": "flat"})),
}
#: heads of a layer cycle through these recipes: concentrated (sinks, recall) next to diffuse (random, zipf)
HETERO_KINDS = ("sinks", "random", "recall", "zipf")


def hetero_trace(n_layers: int, n_kv_heads: int, group: int, head_dim: int, n_tokens: int, n_prompt: int,
                 seed: int) -> InMemoryTrace:
    """A trace whose KV heads in each layer follow different synthetic recipes (some concentrated, some diffuse).

    Heads are independent, so each head is generated as a one-KV-head synthetic trace (with its own exact
    reference) and the heads are stacked."""
    layers = []
    for layer in range(n_layers):
        parts = []
        for h in range(n_kv_heads):
            kind = HETERO_KINDS[(h + layer) % len(HETERO_KINDS)]
            parts.append(make_synthetic_trace(kind, n_layers=1, n_q_heads=group, n_kv_heads=1, head_dim=head_dim,
                                              n_tokens=n_tokens, n_prompt=n_prompt,
                                              seed=seed * 1000 + layer * 100 + h).layer(0))
        layers.append(LayerArrays(*(np.concatenate([getattr(p, f) for p in parts], axis=1)
                                    for f in ("q", "k", "v", "lse", "o"))))
    model = ModelInfo("synthetic-hetero", n_layers, n_kv_heads * group, n_kv_heads, head_dim, rope="none",
                      layer_ids=tuple(range(n_layers)))
    meta = TraceMeta(model, n_tokens, n_prompt, dtype="float32", softmax_scale=head_dim ** -0.5, kind="synthetic",
                     source={"generator": "benchmarks.eval_adakv.hetero_trace", "kinds": HETERO_KINDS, "seed": seed})
    return InMemoryTrace(meta, layers)


def evaluate(name: str, trace: Trace, budgets: list[int]) -> list[dict]:
    """Every pair at every budget on one trace, with the layer-scope oracle; rows of summary metrics."""
    inputs = load_layers(trace)
    for li in inputs:   # memory-mapped traces arrive read-only, which the engine's signature rejects
        for f in ("q", "k", "v", "lse", "o"):
            if not getattr(li, f).flags.writeable:
                setattr(li, f, np.array(getattr(li, f)))
    budgets = [b for b in budgets if b < trace.meta.n_prompt]
    rows = []
    oracle = {r.budget: r.summary() for r in replay_oracle(trace, budgets, scope="layer", inputs=inputs)}
    for b in budgets:
        for family, pair in FAMILIES.items():
            for role, (pname, par) in zip(("uniform", "ada"), pair):
                pol = get_policy(pname, **par)
                t0 = time.perf_counter()
                res = replay(trace, pol, b, inputs=inputs)
                s = res.summary()
                rows.append(dict(trace=name, budget=b, family=family, role=role, policy=pol.label(), l1=s["l1_mean"], l1_bound=s["l1_bound_mean"],
                                 err=s["err_mean"], mass=s["mass_mean"], kl=s["kl_mean"],
                                 slots_per_layer=float(res.slots.sum(axis=2).mean()),
                                 head_slots_min=int(res.slots.min()), head_slots_max=int(res.slots.max()),
                                 oracle_layer_mass=oracle[b]["mass_mean"], oracle_layer_l1=oracle[b]["l1_mean"],
                                 seconds=time.perf_counter() - t0))
    return rows


def improvement_table(rows: list[dict]) -> list[dict]:
    """Per (trace, family, budget): Ada's relative change of loss, bound and error vs its uniform twin."""
    out = []
    key = lambda r: (r["trace"], r["family"], r["budget"])
    by = {}
    for r in rows:
        by.setdefault(key(r), {})[r["role"]] = r
    for (tr, fam, b), d in sorted(by.items()):
        u, a = d["uniform"], d["ada"]
        out.append(dict(trace=tr, family=fam, budget=b,
                        l1_change=(a["l1"] - u["l1"]) / u["l1"] if u["l1"] else 0.0,
                        bound_change=(a["l1_bound"] - u["l1_bound"]) / u["l1_bound"] if u["l1_bound"] else 0.0,
                        err_change=(a["err"] - u["err"]) / u["err"] if u["err"] else 0.0,
                        mass_uniform=u["mass"], mass_ada=a["mass"], mass_oracle=u["oracle_layer_mass"]))
    return out


def plot(rows: list[dict], table: list[dict], path: Path) -> None:
    """Top: loss curves of each pair (log scale); bottom: Ada's relative change of loss and bound per trace."""
    from sim.reports.plotting import agg_pyplot, save_figure

    plt = agg_pyplot()

    traces = sorted({r["trace"] for r in rows})
    fig, axes = plt.subplots(2, len(traces), figsize=(4.6 * len(traces), 7.0), squeeze=False)
    colors = dict(zip(FAMILIES, ("C0", "C1", "C2", "C3")))
    for i, tr in enumerate(traces):
        top, bottom = axes[0, i], axes[1, i]
        drawn: set[str] = set()
        for fam, col in colors.items():
            for role, style in (("uniform", "o--"), ("ada", "s-")):
                sel = sorted((r for r in rows if r["trace"] == tr and r["family"] == fam and r["role"] == role),
                             key=lambda r: r["budget"])
                if not sel or sel[0]["policy"] in drawn:     # a uniform twin shared by two families
                    continue
                drawn.add(sel[0]["policy"])
                top.plot([r["budget"] for r in sel], [r["l1"] for r in sel], style, color=col,
                         label=sel[0]["policy"], ms=4)
            sel = sorted((r for r in table if r["trace"] == tr and r["family"] == fam), key=lambda r: r["budget"])
            x = [r["budget"] for r in sel]
            bottom.plot(x, [100 * r["l1_change"] for r in sel], "s-", color=col, label=f"{fam}: loss", ms=4)
            bottom.plot(x, [100 * r["bound_change"] for r in sel], "^:", color=col, label=f"{fam}: bound", ms=4)
        orc = sorted({(r["budget"], r["oracle_layer_l1"]) for r in rows if r["trace"] == tr})
        top.plot([b for b, _ in orc], [v for _, v in orc], "k:", label="oracle (layer, max mass)")
        top.set(xscale="log", yscale="log", title=tr, xlabel="budget (slots per KV head)",
                ylabel="mean ||o - o'||_1 over decode steps")
        top.set_xscale("log", base=2)
        bottom.axhline(0, color="grey", lw=0.8)
        bottom.set_xscale("log", base=2)
        bottom.set(xlabel="budget (slots per KV head)", ylabel="Ada vs uniform (%)")
        top.legend(fontsize=6)
        bottom.legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_real_trace_args(ap)
    ap.add_argument("--quick", action="store_true", help="small traces, for a smoke run")
    args = ap.parse_args()
    limit_threads(1)   # one thread, through the API sweep workers use (torch too, if a replay loads it)
    t_start = time.perf_counter()
    budgets = [128, 256, 512, 1024, 2048]
    T, P = (640, 512) if args.quick else (2432, 2176)
    traces: dict[str, Trace] = {} if args.real_only else {
        "synthetic-hetero": hetero_trace(3, 4, 2, 32, T, P, seed=0),
        "synthetic-mixed": make_synthetic_trace("mixed", n_layers=3, n_q_heads=8, n_kv_heads=4, head_dim=32,
                                                n_tokens=T, n_prompt=P, seed=0),
    }
    tmpdir = tempfile.TemporaryDirectory(prefix="eval_adakv_")
    real = real_model_trace(args, Path(tmpdir.name), n_prompt=1536, n_decode=512)
    traces["real:" + real.meta.model.model_id] = real
    rows = []
    for name, tr in traces.items():
        t0 = time.perf_counter()
        rows += evaluate(name, tr, budgets)
        print(f"{name}: {time.perf_counter() - t0:.1f}s", flush=True)
    table = improvement_table(rows)
    for r in table:
        print(f"{r['trace']:>24} {r['family']:>10} B={r['budget']:>5}  loss {100 * r['l1_change']:+6.1f}%  "
              f"bound {100 * r['bound_change']:+6.1f}%  err {100 * r['err_change']:+6.1f}%  "
              f"mass {r['mass_uniform']:.3f} -> {r['mass_ada']:.3f} (oracle {r['mass_oracle']:.3f})")
    name = result_name("eval_adakv", real, args.real_only)
    payload = dict(**trace_fields(real), machine=machine(), seconds=round(time.perf_counter() - t_start, 1),
                   budgets=budgets, traces={k: dict(n_tokens=v.meta.n_tokens, n_prompt=v.meta.n_prompt,
                                                    model=v.meta.model.model_id, n_layers=v.n_layers,
                                                    layers=list(v.meta.model.layer_ids),
                                                    n_kv_heads=v.meta.model.n_kv_heads) for k, v in traces.items()},
                   rows=rows, improvement=table)
    out = write_result(name, payload)
    plot(rows, table, RESULTS / f"{name}.png")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
