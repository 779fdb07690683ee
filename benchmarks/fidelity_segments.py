"""Fidelity at equal budget on a real model: 14 policies x 3 budgets, many segments of two different shipped
texts; the model side's own reliability first. SmolLM2-135M (default): budgets 32/64/128, 512 prompt + 128 decode
tokens. Gemma-3-270M (``--model gemma3-270m``): its own defaults below (longer segments, so that the 512-token
sliding window matters and the 3 global layers, the only ones a policy compresses by default, hold more).

1. Closed loop (resumable store): every segment x policy x budget through the model, ΔNLL and top-1
   disagreement against the full cache.
2. Simulator: one teacher-forced trace per segment, every configuration replayed; losses per cell.
3. Report: per text and budget, the split-half reliability of the model's policy ranking (mean ΔNLL over
   segments), and Spearman's rho of every simulated loss against it, within each budget and pooled. A
   predictor fitted on one text (per-layer weights of the error) is judged on the other.
Writes benchmarks/results/fidelity_<model>.json, .png and .html, the page (fidelity_smollm2, fidelity_gemma3).

    python -m benchmarks.fidelity_segments [--model gemma3-270m] [--segments 8] [--store results/fidelity_segments]
"""
from __future__ import annotations

import argparse
import sys
import time


POLICIES = ("streaming_llm;h2o;tova;cascading;d2o;snapkv:window_size=16;pyramidkv:window_size=16;"
            "ada_snapkv:window_size=16;ada_h2o;bumblebee;buzz;knorm;keydiff;{ea}")
TEXTS = ("default", "idle")
#: per model: the result name, its defaults, and expected attention's spec (SmolLM2's committed store names its RoPE
#: base explicitly, as it had to before bases were read from the trace; the value is the same)
MODELS = {
    "smollm2-135m": {"name": "smollm2", "segments": 8, "prompt": 512, "decode": 128, "budgets": "32,64,128",
                     "ea": "expected_attention:rope_theta=100000"},
    "gemma3-270m": {"name": "gemma3", "segments": 6, "prompt": 1024, "decode": 128, "budgets": "64,128,256",
                    "ea": "expected_attention"},
}


def main(argv: list[str]) -> int:
    import torch  # noqa: F401  (loaded first, so limit_threads caps its pool too)

    from gpu_validate.studies.fidelity.segments import closed_loop, make_segments
    from sim.experiments.specs import parse_policy_list
    from sim.experiments.store import ResultStore
    from sim.replay.threads import limit_threads
    from traces.model import read_text
    from traces.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    ap.add_argument("--segments", type=int, default=None, help="segments per text (default: the model's)")
    ap.add_argument("--prompt", type=int, default=None)
    ap.add_argument("--decode", type=int, default=None)
    ap.add_argument("--budgets", default=None)
    ap.add_argument("--policies", default=None)
    ap.add_argument("--store", default="results/fidelity_segments")
    ap.add_argument("--name", default=None,
                    help="results name: benchmarks/results/fidelity_NAME.json (default: the model's, e.g. smollm2)")
    ap.add_argument("--closed-loop-only", action="store_true", help="stop after the model runs (stage 1)")
    ap.add_argument("--report-only", action="store_true",
                    help="skip the model runs; report on the segments whose cells are all in the store")
    args = ap.parse_args(argv)
    defaults = MODELS[args.model]
    for key in ("segments", "prompt", "decode", "budgets"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    args.policies = args.policies or POLICIES.format(ea=defaults["ea"])
    args.name = args.name or defaults["name"]
    limit_threads(1)   # one thread, through the API sweep workers use
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    model, tok = load_model(args.model, device="cpu")
    model_id = args.model   # the store's keys carry it
    texts = {name: tok(read_text(name)[0], verbose=False)["input_ids"] for name in TEXTS}
    segments = make_segments(texts, args.segments, args.prompt + args.decode)
    policies = parse_policy_list(args.policies)
    budgets = [int(b) for b in args.budgets.split(",")]
    configs = [(p, b) for p in policies for b in budgets]
    store = ResultStore(args.store)
    by_index = [[s for s in segments if s.text == name] for name in TEXTS]
    for i in range(0 if args.report_only else args.segments):   # a segment of each text per round: balanced
        closed_loop(model, [segs[i] for segs in by_index], configs, store, n_prompt=args.prompt,
                    model_id=model_id, max_rows=64)
        print(f"round {i + 1}/{args.segments} done at {time.perf_counter() - t0:.0f} s", flush=True)
    if args.closed_loop_only:
        return 0
    return report(model, segments, configs, store, args=args, model_id=model_id, t0=t0)


def report(model, segments, configs, store, *, args, model_id: str, t0: float) -> int:
    """Stages 2 and 3: simulate every cell, join with the closed-loop rows, write the JSON and the plot."""
    import pandas as pd

    from benchmarks._util import RESULTS, machine, write_result
    from gpu_validate.studies.fidelity.fidelity_page import segments_page
    from sim.reports.runinfo import kvsim_version, now
    from gpu_validate.studies.fidelity.rank_fidelity import MODEL_LOSSES, SIM_LOSSES
    from sim.experiments.store import ResultStore
    from gpu_validate.studies.fidelity.segments import (fidelity_by_text, fit_layer_weights, plot_segment_fidelity, simulated,
                                       weighted_error)

    closed = store.load()
    closed = closed[closed.model == model_id]
    complete = closed.groupby("segment").size()
    segments = [s for s in segments if complete.get(s.name, 0) >= len(configs)]
    print(f"reporting on {len(segments)} segments with every cell run: {[s.name for s in segments]}", flush=True)
    sim = pd.DataFrame(simulated(model, segments, configs, n_prompt=args.prompt, model_id=model_id,
                                 store=ResultStore(args.store + "-sim")))
    merged = closed.drop(columns=["text", "key"]).merge(sim.drop(columns=["key"]), on=["segment", "label", "budget"])
    if len(merged) < len(sim):
        print(f"note: {len(sim) - len(merged)} cells have no closed-loop row yet (run again to finish them)")
    weights = {}
    for base, name in (("err_by_layer", "layerfit_err"), ("err_wo_by_layer", "layerfit_wo")):
        for fit_text in TEXTS:   # per-layer weights fitted on one text, applied to both
            w = fit_layer_weights(merged[merged.text == fit_text], base)
            weights[f"{name}@{fit_text}"] = w.tolist()
            score = weighted_error(merged, w, base)
            same = merged.text == fit_text
            merged.loc[same, f"{name}_insample"] = score[same]
            merged.loc[~same, f"{name}_heldout"] = score[~same]
    losses = [*SIM_LOSSES, "err_wo_mean", "layerfit_err_insample", "layerfit_err_heldout", "layerfit_wo_insample",
              "layerfit_wo_heldout"]
    res = fidelity_by_text(merged, losses, list(MODEL_LOSSES))
    out = {"model": model_id, "policies": [p.label() for p, _ in configs[::len(set(b for _, b in configs))]],
           "budgets": sorted({int(b) for _, b in configs}), "n_prompt": args.prompt, "n_decode": args.decode,
           "texts": {t: read_id(t) for t in res},
           "segments_per_text": {t: sum(s.text == t for s in segments) for t in TEXTS}, "backend": "torch",
           "device": "cpu", "sim_losses": losses, "model_losses": MODEL_LOSSES, "by_text": res,
           "layer_weights": weights,
           "rows": merged.drop(columns=["nll_per_token", "err_by_layer", "err_wo_by_layer"]).to_dict("records"),
           "seconds": time.perf_counter() - t0, "machine": machine(),
           "kvsim": kvsim_version(), "date": now(), "command": "python -m benchmarks.fidelity_segments "
                                                               + " ".join(sys.argv[1:])}
    path = write_result(f"fidelity_{args.name}", out)
    png = plot_segment_fidelity(res, RESULTS / f"fidelity_{args.name}.png",
                                title=f"simulator vs closed loop on {model_id}")
    print(f"page: {segments_page(out, path.with_suffix('.html'), plot=png)}")
    for text, r in res.items():
        for b, v in r["by_budget"].items():
            rel = v["reliability"]["delta_nll"]
            print(f"{text:>8s} b={b:<4d} model reliability (split-half, Spearman-Brown) {rel['split_half_rho']:.3f} / "
                  f"{rel['spearman_brown']:.3f}; rho(err_mean, ΔNLL) {v['rho']['err_mean']['delta_nll']:+.3f}")
        print(f"{text:>8s} within-budget rho vs ΔNLL: " + ", ".join(
            f"{s} {r['within_budget_rho'][s]['delta_nll']:+.3f}" for s in losses))
    print(f"wrote {path}")
    return 0


def read_id(name: str) -> str:
    from traces.model import SHIPPED_TEXTS

    return SHIPPED_TEXTS[name][1]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
