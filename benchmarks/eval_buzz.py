"""BUZZ evaluation: (a) BUZZ and BUZZ-log-n vs H2O, StreamingLLM and the oracle at equal peak cache size;
(b) Theorem 3.1 as an experiment: at s = 5 and a fixed cache, sweep T/w and find where the loss is lowest.

Writes benchmarks/results/eval_buzz.json and eval_buzz.png. Run: python -m benchmarks.eval_buzz
(--quick for a smoke run). Real-model part: SmolLM2-135M through the model registry (or --trace DIR), on the layers given by --layers.
At length: --trace DIR --real-only --fractions 0.1,0.2,0.4 (budgets as the paper's "cache budget": fractions of the
full cache's mean size over the decode steps) writes eval_buzz_<model>_<context>k.json, the real trace alone.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._util import (RESULTS, add_real_trace_args, machine, real_model_trace, result_name, trace_fields,
                              write_result)
from policies._buzz_model import held_trajectory, old_sequence, predicted_ratio
from policies.core.registry import get_policy
from sim.replay.layer_inputs import load_layers
from sim.replay.oracle_replay import replay_oracle
from sim.replay.policy_replay import replay
from sim.replay.threads import limit_threads
from traces.format import Trace
from traces.synthetic import make_synthetic_trace

KINDS = ("mixed", "recall", "topic_shift", "zipf")
BASELINES = ("h2o", "streaming_llm")
RATIOS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 10 / 3, 3.5, 4.0, 13 / 3, 4.5, 5.0, 5.5, 6.5, 8.0)
PAPER_OBSERVED = 4.5
SWEEP_SEEDS = (1, 2, 3)


def synthetic(kind: str, n_tokens: int, n_prompt: int, seed: int = 0) -> Trace:
    return make_synthetic_trace(kind, n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=32, n_tokens=n_tokens,
                                n_prompt=n_prompt, seed=seed)


def mean_matched_budget(n_tokens: int, n_prompt: int, target: int) -> int:
    """Smallest BUZZ budget whose mean held slots over the decode steps reach ``target`` (memory-matched view)."""
    pol = get_policy("buzz")
    lo, hi = target, n_tokens
    while lo < hi:
        mid = (lo + hi) // 2
        held = held_trajectory(pol.rule(*pol.window_threshold(mid)), n_tokens, n_prompt)[n_prompt:]
        if np.mean(held) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def compare(name: str, trace: Trace, budgets: list[int]) -> list[dict]:
    """Every policy at every budget on one trace (summary rows), plus the oracle and the log-n-only row."""
    inputs = load_layers(trace)
    T, P = trace.meta.n_tokens, trace.meta.n_prompt
    rows = []

    def add(policy: str, budget: int, res, **extra) -> None:
        s = res.summary()
        rows.append({"trace": name, "policy": policy, "budget": budget, "err": s["err_mean"], "kl": s["kl_mean"],
                     "mass": s["mass_mean"], "slots_mean": float(res.slots.mean()),
                     "slots_peak": int(res.slots.max()), **extra})

    for b in budgets:
        for pol in ("buzz", "buzz_logn") + BASELINES:
            add(pol, b, replay(trace, get_policy(pol), b, inputs=inputs))
        bm = mean_matched_budget(T, P, b)
        add("buzz_mean_matched", b, replay(trace, get_policy("buzz"), bm, inputs=inputs), buzz_budget=bm)
    for b, res in zip(budgets, replay_oracle(trace, budgets, inputs=inputs)):
        add("oracle", b, res)
    add("buzz_logn_no_eviction", T, replay(trace, get_policy("buzz_logn"), T, inputs=inputs))
    return rows


def theorem_sweep(name: str, trace: Trace, budget: int, stride: int) -> list[dict]:
    """Loss vs T/w at fixed stride and peak cache, for both threshold countings."""
    inputs = load_layers(trace)
    rows = []
    for on in ("total", "new"):
        for r in RATIOS:
            pol = get_policy("buzz", stride=stride, t_over_w=r, threshold_on=on)
            w, T = pol.window_threshold(budget)
            s = replay(trace, pol, budget, inputs=inputs).summary()
            steady = old_sequence(pol.rule(w, T), 60)[-1]
            rows.append({"trace": name, "threshold_on": on, "ratio": r, "w": w, "T": T, "actual_ratio": T / w,
                         "steady_old": steady, "err": s["err_mean"], "kl": s["kl_mean"], "mass": s["mass_mean"],
                         "slots_mean": s["slots_mean"]})
    return rows


def best_ratios(rows: list[dict], metric: str) -> dict:
    """Per counting mode: the T/w with the lowest loss per trace and for the mean of per-trace normalised loss."""
    out = {}
    for on in ("total", "new"):
        sub = [r for r in rows if r["threshold_on"] == on]
        names = sorted({r["trace"] for r in sub})
        per = {}
        norm = np.zeros(len(RATIOS))
        for n in names:
            vals = np.array([r[metric] for r in sub if r["trace"] == n])
            per[n] = RATIOS[int(np.argmin(vals))]
            norm += vals / vals.min()
        out[on] = {"per_trace": per, "mean_normalised": RATIOS[int(np.argmin(norm))],
                   "mean_normalised_curve": (norm / len(names)).tolist(), "predicted": predicted_ratio(5, on == "new")}
    return out


def mean_table(rows: list[dict]) -> dict:
    """policy -> budget -> metric means over traces (the numbers behind panel (a))."""
    out: dict = {}
    for pol in sorted({r["policy"] for r in rows}):
        for b in sorted({r["budget"] for r in rows if r["policy"] == pol}):
            sel = [r for r in rows if r["policy"] == pol and r["budget"] == b]
            out.setdefault(pol, {})[b] = {m: float(np.mean([r[m] for r in sel])) for m in ("err", "kl", "mass",
                                                                                           "slots_mean")}
    return out


def plot(cmp_rows: list[dict], sweep: list[dict], fp: dict, path: Path) -> None:
    from sim.reports.plotting import agg_pyplot, save_figure

    plt = agg_pyplot()

    fig, ax = plt.subplots(2, 3, figsize=(17, 9.5))
    names = sorted({r["trace"] for r in cmp_rows})
    pols = ("buzz", "buzz_logn", "buzz_mean_matched", "h2o", "streaming_llm", "oracle")
    for j, metric in enumerate(("err", "mass")):
        a = ax[0, j]
        for pol in pols:
            bs = sorted({r["budget"] for r in cmp_rows if r["policy"] == pol})
            ys = [np.mean([r[metric] for r in cmp_rows if r["policy"] == pol and r["budget"] == b]) for b in bs]
            a.plot(bs, ys, "o-", label=pol)
        a.set_xscale("log", base=2)
        a.set_xlabel("budget (peak slots per KV head)")
        a.set_ylabel(f"{metric} (mean over {len(names)} traces)")
        a.set_title(f"(a) {metric} vs budget")
        a.legend(fontsize=8)
    a = ax[0, 2]
    for label, ys in fp.items():
        a.plot(ys, label=label, ls=":" if label == "budget_line" else "-", lw=2 if label.startswith("h2o") else 1.2)
    a.set_xlabel("token")
    a.set_ylabel("slots held per KV head")
    a.set_title("footprint over time (budget %d)" % fp["budget_line"][0])
    a.legend(fontsize=8)
    for j, on in enumerate(("total", "new")):
        a = ax[1, j]
        sub = [r for r in sweep if r["threshold_on"] == on]
        for kind in sorted({r["trace"].split("/")[0] for r in sub}):
            curves = [np.array([r["err"] for r in sub if r["trace"] == n])
                      for n in sorted({r["trace"] for r in sub if r["trace"].split("/")[0] == kind})]
            a.plot(RATIOS, np.mean([c / c.min() for c in curves], axis=0), "o-", alpha=0.7,
                   label=f"{kind} (mean of {len(curves)})")
        a.axvline(predicted_ratio(5, on == "new"), color="k", ls="--", label="prediction (implementation)")
        a.axvline(13 / 3, color="r", ls=":", label="Theorem 3.1: 4.33")
        a.axvline(PAPER_OBSERVED, color="g", ls=":", label="paper observed: 4.5")
        a.set_xlabel("T / w")
        a.set_ylabel("err / min err per trace (mean over seeds)")
        a.set_title(f"(b) T/w sweep, s=5, threshold_on={on}")
        a.legend(fontsize=7)
    a = ax[1, 2]
    for on in ("total", "new"):
        sub = [r for r in sweep if r["threshold_on"] == on and r["trace"] == sweep[0]["trace"]]
        a.plot(RATIOS, [r["steady_old"] / r["w"] for r in sub], "o-", label=f"{on}")
    a.axhline(1.0, color="k", ls="--")
    a.set_xlabel("T / w")
    a.set_ylabel("steady-state old tokens / w")
    a.set_title("Appendix D.1 criterion: old = w")
    a.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small traces and one budget (smoke run)")
    ap.add_argument("--fractions", default=None,
                    help="comparison budgets as fractions of the full cache's mean size over the real trace's decode "
                         "steps (the paper's 'cache budget'), e.g. 0.1,0.2,0.4 (default: 32,64,128,256 slots)")
    add_real_trace_args(ap)
    args = ap.parse_args()
    limit_threads(1)   # one thread per replay, through the API sweep workers use
    t0 = time.time()
    n_cmp, n_sweep, p = (384, 640, 64) if args.quick else (1024, 2048, 256)
    budgets = [64] if args.quick else [32, 64, 128, 256]
    sweep_budget = 200
    with tempfile.TemporaryDirectory() as tmp:
        real = real_model_trace(args, Path(tmp)) if not args.quick else None
        if args.fractions and real is not None:
            mean_full = real.meta.n_prompt + (real.meta.n_tokens - real.meta.n_prompt + 1) / 2
            budgets = [int(round(float(f) * mean_full)) for f in args.fractions.split(",")]
        synth = not (args.real_only and real is not None)
        cmp_traces = {k: synthetic(k, n_cmp, p) for k in KINDS} if synth else {}
        sweep_traces = ({f"{k}/seed{sd}": synthetic(k, n_sweep, p, seed=sd) for k in KINDS for sd in SWEEP_SEEDS}
                        if synth else {})
        if real is not None:
            cmp_traces["real"] = real
            sweep_traces["real"] = real
        cmp_rows = [row for n, tr in cmp_traces.items() for row in compare(n, tr, budgets)]
        sweep = [row for n, tr in sweep_traces.items() for row in theorem_sweep(n, tr, sweep_budget, 5)]
    fp_budget = 128 if not args.quick else 64
    pol = get_policy("buzz")
    fp = {"buzz": held_trajectory(pol.rule(*pol.window_threshold(fp_budget)), n_cmp, p),
          "buzz (threshold_on=new)": held_trajectory(
              get_policy("buzz", threshold_on="new").rule(
                  *get_policy("buzz", threshold_on="new").window_threshold(fp_budget)), n_cmp, p),
          "h2o / streaming_llm": [min(t + 1, fp_budget) if t >= p else min(p, fp_budget) for t in range(n_cmp)],
          "budget_line": [fp_budget] * n_cmp}
    result = {
        **(trace_fields(real) if real is not None else {}),
        "machine": machine(),
        "setup": {"compare_traces": {n: [tr.meta.n_tokens, tr.meta.n_prompt] for n, tr in cmp_traces.items()},
                  "sweep_traces": {n: [tr.meta.n_tokens, tr.meta.n_prompt] for n, tr in sweep_traces.items()},
                  "budgets": budgets, "fractions": args.fractions, "sweep_budget": sweep_budget, "stride": 5, "real_model_trace": None if real is None else {
                      "model": real.meta.model.model_id, "T": real.meta.n_tokens, "P": real.meta.n_prompt,
                      "layers": list(real.meta.model.layer_ids)},
                  "buzz_window_threshold": {b: get_policy("buzz").window_threshold(b) for b in budgets}},
        "compare_mean": mean_table(cmp_rows),
        "compare": cmp_rows,
        "theorem_sweep": sweep,
        "best_ratio_err": best_ratios(sweep, "err"),
        "best_ratio_kl": best_ratios(sweep, "kl"),
        "seconds": round(time.time() - t0, 1),
    }
    name = "eval_buzz_quick" if args.quick else result_name("eval_buzz", real, args.real_only)
    write_result(name, result)
    plot(cmp_rows, sweep, fp, RESULTS / f"{name}.png")
    print(json.dumps({k: result[k] for k in ("best_ratio_err", "seconds")}, indent=1))


if __name__ == "__main__":
    main()
