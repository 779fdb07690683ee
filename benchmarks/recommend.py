"""How far `kvsim recommend` can be trusted: its choices made on one text, judged on another text it never saw
against an exhaustive closed-loop grid there.

1. ``--stage grid``: every configuration of `gpu_validate.recommend_grid.FAMILY_GRID` (7 families x 4
   hyperparameter values + TOVA) at every budget, closed loop, on ``--segments`` segments of each of two shipped
   texts (resumable store; a segment of each text per round, so a stopped run is balanced).
2. ``--stage report``: the simulator on the same cells; `gpu_validate.recommend.recommend` run on each text's
   segments (its simulations and its own few closed-loop runs), then judged on the other text's grid: whether
   its first choice per budget is among the model's three best, its regret against the paper default, whether the
   budget it recommends meets the target there and how it compares with the smallest budget that does, and how
   many model runs it used; within-family Spearman rho per family; the model's own split-half reliability.
   Writes benchmarks/results/recommend_<model>.json.

    python -m benchmarks.recommend --model smollm2-135m --stage grid
    python -m benchmarks.recommend --model smollm2-135m --stage report
"""
from __future__ import annotations

import argparse
import sys
import time

TEXTS = ("default", "idle")
#: per model: segments per text (evenly spaced, so 5 on SmolLM2 and 7 on Gemma-3 keep the windows of the earlier
#: 3-segment grids: the model's own split-half reliability on Gemma-3 was 0.34-0.71 with 2 segments a text; from 4
#: segments a text the report also judges recommendations that saw half of them), prompt and scored tokens, budgets
MODELS = {
    "smollm2-135m": {"segments": 5, "prompt": 512, "decode": 128, "budgets": "64,128,192,256,384",
                     "target": "dnll=0.05"},
    "gemma3-270m": {"segments": 7, "prompt": 1024, "decode": 128, "budgets": "64,128,256,384",
                    "target": "dnll=0.05"},
}


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    ap.add_argument("--stage", choices=("grid", "report"), required=True)
    ap.add_argument("--segments", type=int, default=None, help="segments per text (default: the model's)")
    ap.add_argument("--store", default=None, help="closed-loop store (default results/recommend_<model>)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the closed loop")
    args = ap.parse_args(argv)
    d = MODELS[args.model]
    args.segments = args.segments or d["segments"]
    args.prompt, args.decode, args.budgets, args.target = d["prompt"], d["decode"], d["budgets"], d["target"]
    args.store = args.store or f"results/recommend_{args.model}"
    return args


def load(args):
    """(model, tokenizer, segments by text) of the benchmark's model and texts."""
    import torch

    from gpu_validate.segments import make_segments
    from traces.model import read_text
    from traces.models import load_model

    torch.set_grad_enabled(False)
    model, tok = load_model(args.model, device="cpu")
    texts = {name: tok(read_text(name)[0], verbose=False)["input_ids"] for name in TEXTS}
    segs = make_segments(texts, args.segments, args.prompt + args.decode)
    return model, tok, {t: [s for s in segs if s.text == t] for t in TEXTS}


def grid(args) -> int:
    from gpu_validate.recommend_grid import budget_ladder, candidates
    from gpu_validate.segments import closed_loop
    from sim.store import ResultStore
    from sim.threads import limit_threads

    import torch  # noqa: F401  (first, so limit_threads caps its pool)

    limit_threads(args.threads)
    t0 = time.perf_counter()
    model, _, by_text = load(args)
    configs = [(c.policy, b) for c in candidates() for b in budget_ladder(args.prompt, args.budgets)]
    store = ResultStore(args.store)
    for i in range(args.segments):
        closed_loop(model, [by_text[t][i] for t in TEXTS], configs, store, n_prompt=args.prompt, model_id=args.model,
                    max_rows=64)
        print(f"round {i + 1}/{args.segments} done at {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


def main(argv: list[str]) -> int:
    args = _args(argv)
    if args.stage == "grid":
        return grid(args)
    from benchmarks.recommend_report import report

    return report(args, load)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
