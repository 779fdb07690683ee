"""Cascading KV cache vs StreamingLLM (same total slots), H2O and the oracle on synthetic traces and on a
real-model trace (SmolLM2-135M through the model registry, or --trace DIR; a subset of layers, see --layers).

Two parts: (1) retained attention mass and output error per trace kind and budget over long traces;
(2) a passkey sweep: one early token is recalled by the last queries; how often each policy still holds
it (and how much of the needle queries' attention it retains) as a function of its distance, against the
sink cache's window |C| and the cascade's approximate context length L~ (eq. 4).
(3) on the real trace: the reach of every cache, from the positions it holds at each decode step -- the share of
its non-sink slots beyond the sink cache's window |C| = budget - n_sinks, their largest age, against L~.
Run: python -m benchmarks.eval_cascading [--trace DIR] [--layers 0,10,20,29] [--budgets 64,128,256] [--real-only]
(writes benchmarks/results/eval_cascading.{json,png}; with --real-only only the real trace, to
eval_cascading_<model>_<context>k.json)
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._util import (RESULTS, add_real_trace_args, machine, real_model_trace, result_name,
                              trace_fields, write_result)
from policies import get_policy
from policies.cascading import approximate_context_length
from sim.replay.layer_inputs import load_layers
from sim.replay.oracle_replay import replay_oracle
from sim.replay.policy_replay import replay
from traces.synthetic import make_synthetic_trace

KINDS = ("mixed", "zipf", "recall", "topic_shift", "local", "passkey")
BUDGETS = (64, 128, 256)
POLICIES = ("cascading", "streaming_llm", "h2o")
T, P, LAYERS = 2048, 64, 2
N_NEEDLE = 16
SWEEP_BUDGET = 64
SWEEP_SEEDS = 12


def reach(res, budget: int, n_sinks: int = 4, n_cascades: int = 4) -> dict:
    """How far back a cache reaches, from the positions it held at every recorded step (``res.kept``): over
    (layer, step, KV head), the share of non-sink slots at least |C| = budget - n_sinks tokens old (a sink cache
    of the same slots holds ages 0..|C|-1 only), the mean and largest age of the oldest one, and the share at least
    L~ (eq. 4) old."""
    kept = res.kept                                   # [L, steps, Hkv, cap], -1 padded
    t = res.kept_steps[None, :, None, None]
    age = np.where(kept >= n_sinks, t - kept, -1)     # non-sink slots only
    window, L = budget - n_sinks, approximate_context_length(budget, n_sinks, n_cascades)
    n = max(1, int((age >= 0).sum()))
    oldest = age.max(axis=-1)
    return {"sink_window": window, "L_tilde": L, "share_older_than_window": float((age >= window).sum() / n),
            "share_older_than_L_tilde": float((age >= L).sum() / n), "oldest_age_mean": float(oldest.mean()),
            "oldest_age_max": int(oldest.max())}


def quality_rows(kind: str, trace, budgets=BUDGETS, with_reach: bool = False) -> list[dict]:
    """Mean retained mass / error (all steps, and the last N_NEEDLE steps) of every policy and budget on a trace;
    ``with_reach``: each cache's reach over the decode steps (`reach`)."""
    inputs = load_layers(trace)
    rec = (trace.meta.n_prompt, trace.meta.n_tokens - trace.meta.n_prompt) if with_reach else None
    results = [(name, replay(trace, get_policy(name), b, inputs=inputs, threads=1, record_kept=rec))
               for b in budgets for name in POLICIES]
    results += [("oracle", r) for r in replay_oracle(trace, list(budgets), inputs=inputs, threads=1)]
    rows = []
    for name, res in results:
        s = res.summary()
        rows.append({"kind": kind, "policy": name, "budget": res.budget, "mass": s["mass_mean"],
                     "err": s["err_mean"], "kl": s["kl_mean"],
                     "mass_last16": float(res.metric("mass")[:, -N_NEEDLE:].mean()),
                     "err_last16": float(res.metric("err")[:, -N_NEEDLE:].mean()),
                     **({"reach": reach(res, res.budget)} if with_reach and name != "oracle" else {})})
    return rows


def quality_grid() -> list[dict]:
    """quality_rows of every synthetic kind (passkey traces: the last steps are the needle queries)."""
    return [row for kind in KINDS for row in quality_rows(kind, make_synthetic_trace(
        kind, n_layers=LAYERS, n_tokens=T, n_prompt=P, seed=0, n_needle_queries=N_NEEDLE, passkey_pos=P + 32))]


def passkey_sweep() -> dict:
    """Share of (seed, layer, KV head) holding the passkey when the first needle query (``distance`` tokens
    after it) attends, and the needle queries' retained mass, per distance."""
    n_sinks, n_casc = 4, 4
    window = SWEEP_BUDGET - n_sinks
    L = approximate_context_length(SWEEP_BUDGET, n_sinks, n_casc)
    distances = sorted(set(np.linspace(window // 2, int(1.25 * L), 16).astype(int).tolist()))
    out: dict = {"budget": SWEEP_BUDGET, "sink_window": window, "L_tilde": L, "distances": distances}
    for name in POLICIES:
        held, mass = [], []
        for dist in distances:
            h, m = [], []
            for seed in range(SWEEP_SEEDS):
                pos = 40 + seed         # consecutive positions: the acceptance phase differs between them
                n = pos + dist + N_NEEDLE
                trace = make_synthetic_trace("passkey", n_layers=1, n_tokens=n, n_prompt=0, seed=seed,
                                             passkey_pos=pos, n_needle_queries=N_NEEDLE)
                # cache contents the first needle query attends over: those held after the step before it
                res = replay(trace, get_policy(name), SWEEP_BUDGET, record_kept=(n - N_NEEDLE - 1, 1), threads=1)
                h.append(float((res.kept[:, 0] == pos).any(axis=-1).mean()))
                m.append(float(res.metric("mass")[:, -N_NEEDLE:].mean()))
            held.append(float(np.mean(h)))
            mass.append(float(np.mean(m)))
        out[name] = {"held": held, "needle_mass": mass}
    return out


def plot(rows: list[dict], sweep: dict, path: Path) -> None:
    from sim.reports.plotting import agg_pyplot, save_figure

    plt = agg_pyplot()

    names = POLICIES + ("oracle",)
    fig, axes = plt.subplots(2, 4, figsize=(17, 7.5))
    for ax, kind in zip(axes.flat, KINDS):
        for name in names:
            pts = sorted((r["budget"], r["err"]) for r in rows if r["kind"] == kind and r["policy"] == name)
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{kind} (T={T})")
        ax.set_xlabel("budget (slots per KV head)")
        ax.set_ylabel("mean relative output error")
    axes.flat[0].legend()
    ax = axes.flat[6]
    for name in POLICIES:
        ax.plot(sweep["distances"], sweep[name]["held"], marker="o", label=name)
    ax.axvline(sweep["sink_window"], color="grey", ls="--", label="|C| (sink window)")
    ax.axvline(sweep["L_tilde"], color="black", ls=":", label="L~ (eq. 4)")
    ax.set_xlabel("passkey distance (tokens)")
    ax.set_ylabel("share of heads holding the passkey")
    ax.set_title(f"passkey survival, budget {sweep['budget']}")
    ax.legend(fontsize=7)
    ax = axes.flat[7]
    for name in POLICIES:
        ax.plot(sweep["distances"], sweep[name]["needle_mass"], marker="o", label=name)
    ax.axvline(sweep["sink_window"], color="grey", ls="--")
    ax.axvline(sweep["L_tilde"], color="black", ls=":")
    ax.set_xlabel("passkey distance (tokens)")
    ax.set_ylabel("retained mass, needle queries")
    ax.set_title("needle queries' attention mass")
    fig.tight_layout()
    save_figure(fig, path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_real_trace_args(ap)
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)),
                    help="total slots per KV head on the real trace (sinks included), comma-separated")
    args = ap.parse_args()
    t0 = time.perf_counter()
    budgets = tuple(int(x) for x in args.budgets.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        real = real_model_trace(args, Path(tmp))
        real_name = f"real:{real.meta.model.model_id}"
        rows = quality_rows(real_name, real, budgets, with_reach=True)
        if not args.real_only:
            rows += quality_grid()
    sweep = None if args.real_only else passkey_sweep()
    name = result_name("eval_cascading", real, args.real_only)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if sweep is not None:
        plot(rows, sweep, RESULTS / f"{name}.png")
    wins = [r["err"] < s["err"] for r in rows if r["policy"] == "cascading"
            for s in rows if s["policy"] == "streaming_llm" and s["kind"] == r["kind"] and s["budget"] == r["budget"]]
    write_result(name, {**trace_fields(real), "machine": machine(), "seconds": round(time.perf_counter() - t0, 1),
                        "trace": None if args.real_only else {"T": T, "P": P, "layers": LAYERS},
                        "real_trace": {"name": real_name, "T": real.meta.n_tokens, "P": real.meta.n_prompt,
                                       "layers": list(real.meta.model.layer_ids), "budgets": list(budgets)},
                        "grid": rows, "passkey_sweep": sweep,
                        "cascading_beats_streaming_err": f"{sum(wins)}/{len(wins)}"})
    for r in rows:
        extra = "" if "reach" not in r else (f" older than |C| {r['reach']['share_older_than_window']:.3f} oldest "
                                             f"{r['reach']['oldest_age_mean']:.0f}/{r['reach']['oldest_age_max']} "
                                             f"(|C| {r['reach']['sink_window']}, L~ {r['reach']['L_tilde']})")
        print(f"{r['kind']:12s} {r['policy']:14s} {r['budget']:4d} mass {r['mass']:.4f} err {r['err']:.4f} "
              f"needle mass {r['mass_last16']:.4f}{extra}")
    print("cascading < streaming_llm in error:", f"{sum(wins)}/{len(wins)}")
    if sweep is not None:
        for pol in POLICIES:
            print(pol, "held", [round(x, 2) for x in sweep[pol]["held"]])
        print("distances", sweep["distances"], "|C|", sweep["sink_window"], "L~", sweep["L_tilde"])


if __name__ == "__main__":
    main()
