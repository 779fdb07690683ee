"""How far `kvsim recommend` can be trusted: its choices made on some segments of two texts, judged on segments it
never saw against an exhaustive closed-loop grid there.

1. ``--stage grid``: every configuration of `FAMILIES` (a fixed subset of ``--policies all``, for cost: 7 families
   x 4 hyperparameter values + TOVA, each family's own ``search_grid``) at every budget, closed loop, on
   ``--segments`` segments of each of two shipped texts (resumable store; a segment of each text per round, so a
   stopped run is balanced).
2. ``--stage report``: the simulator on the same cells; `gpu_validate.studies.recommendation.recommender.recommend`
   run on the seen segments of each split (benchmarks/recommend_report.py: random draws of ``seen`` segments, folds,
   cross-text; its simulations and its own closed-loop runs, the refined budgets between rungs included -- those are
   new runs, stored in the grid's store, and the configurations confirmed there also run on every segment so that the
   held-out segments judge them), then judged on the held-out segments: whether the budget it recommends meets the
   target there and how it compares with the smallest budget that does, the coverage of its guarantee, how often each
   confidence level held, whether its first choice per budget is among the model's three best, its regret against the
   paper default, and how many model runs it used. Writes benchmarks/results/recommend_<model>.json. CPU-heavy where
   refinement asks for budgets the store lacks: run it under the heavy lock.

``--seen N`` with ``--out`` judges a variant whose random splits see N segments (Gemma-3 with 8 seen:
benchmarks/results/recommend_gemma3-270m_seen8.json).

3. ``--stage summary``: the recorded report's confidence re-levelled with today's rule (from each recommendation's
   recorded margin, claim and certificate) and its confidence summaries, the draw's difficulty and the fixed-answer
   ceiling recomputed from the grid's store, in seconds (no model or simulator run).

    python -m benchmarks.recommend --model smollm2-135m --stage grid
    python -m benchmarks.recommend --model smollm2-135m --stage report
    python -m benchmarks.recommend --model smollm2-135m --stage summary

Refinement's budgets (``refine_points`` between two rungs) cost most as the report's own runs: a recommendation
confirms a few configurations at a time, and each small batch pays the whole prompt (on Gemma-3, 1 024 tokens: about
25 s a run, against 4.7 s in the grid's batches of 64). Where the answers land on a few rungs, run the refined budgets
below them as a grid first, so that the report finds them in the store; Gemma-3's answers land on 192-512, whose
refined budgets are 160, 224, 312 and 440:

    python -m benchmarks.recommend --model gemma3-270m --stage grid --budgets 160,224,312,440
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks.recommend_report import report, resummarise

TEXTS = ("default", "idle")
#: the grid's families (each with its own search grid): a fixed subset of the candidates, for cost
FAMILIES = ("h2o", "snapkv", "streaming_llm", "buzz", "d2o", "cascading", "expected_attention", "tova")
#: per model: segments per text (evenly spaced, so 5 on SmolLM2 and 7 on Gemma-3 keep the windows of the earlier
#: 3-segment grids: the model's own split-half reliability on Gemma-3 was 0.34-0.71 with 2 segments a text; from 4
#: segments a text the report also judges recommendations that saw half of them), prompt and scored tokens, budgets,
#: and the random splits: how many segments a recommendation sees (six: `kvsim recommend --segments 3` on two texts)
#: and how many draws. Gemma-3's ladder reaches half its prompt (512; 384 left ΔNLL 0.05 out of reach on most
#: segments: 30% of those answers met it held out) and has SmolLM2's step at 192
MODELS = {
    "smollm2-135m": {"segments": 5, "prompt": 512, "decode": 128, "budgets": "64,128,192,256,384",
                     "target": "dnll=0.05", "seen": 6, "splits": 120},
    "gemma3-270m": {"segments": 7, "prompt": 1024, "decode": 128, "budgets": "64,128,192,256,384,512",
                    "target": "dnll=0.05", "seen": 6, "splits": 120},
}


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    ap.add_argument("--stage", choices=("grid", "report", "summary"), required=True,
                    help="grid: the exhaustive closed-loop grid; report: the recommendations judged on it; summary: "
                         "the recorded report's confidence and draw summaries recomputed (no model run)")
    ap.add_argument("--segments", type=int, default=None, help="segments per text (default: the model's)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="grid stage: run only the first ROUNDS segments of each text (default: all)")
    ap.add_argument("--budgets", default=None, help="the budget ladder (default: the model's)")
    ap.add_argument("--store", default=None, help="closed-loop store (default results/recommend_<model>)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the closed loop")
    ap.add_argument("--splits", type=int, default=None, help="random splits (default: the model's)")
    ap.add_argument("--seen", type=int, default=None,
                    help="segments a random split's recommendation sees (default: the model's; with --out for a "
                         "variant)")
    ap.add_argument("--verbose", action="store_true", help="the recommendations' own progress lines")
    ap.add_argument("--refine", type=float, default=None,
                    help="report stage: the refinement ratio (default: "
                         "gpu_validate.studies.recommendation.recommend_search.REFINE; 0: rungs only)")
    ap.add_argument("--margin-z", type=float, default=None,
                    help="report stage: the bound's level (default: "
                         "gpu_validate.studies.recommendation.recommend_statistics.MARGIN_Z)")
    ap.add_argument("--out", default=None, help="report stage: the JSON (default benchmarks/results/recommend_<model>"
                                                ".json; another path for a variant)")
    args = ap.parse_args(argv)
    d = MODELS[args.model]
    args.segments = args.segments or d["segments"]
    args.prompt, args.decode, args.target = d["prompt"], d["decode"], d["target"]
    args.budgets = args.budgets or d["budgets"]
    args.seen, args.splits, args.families = args.seen or d["seen"], args.splits or d["splits"], FAMILIES
    args.store = args.store or f"results/recommend_{args.model}"
    return args


def load(args):
    """(model, tokenizer, segments by text) of the benchmark's model and texts."""
    import torch

    from gpu_validate.studies.fidelity.segments import make_segments
    from traces.model import read_text
    from traces.models import load_model

    torch.set_grad_enabled(False)
    model, tok = load_model(args.model, device="cpu")
    texts = {name: tok(read_text(name)[0], verbose=False)["input_ids"] for name in TEXTS}
    segs = make_segments(texts, args.segments, args.prompt + args.decode)
    return model, tok, {t: [s for s in segs if s.text == t] for t in TEXTS}


def grid(args) -> int:
    from gpu_validate.studies.recommendation.candidates import budget_ladder, candidates
    from gpu_validate.studies.fidelity.segments import closed_loop
    from sim.experiments.store import ResultStore
    from sim.replay.threads import limit_threads

    import torch  # noqa: F401  (first, so limit_threads caps its pool)

    limit_threads(args.threads)
    t0 = time.perf_counter()
    model, _, by_text = load(args)
    configs = [(c.policy, b) for c in candidates(";".join(FAMILIES)) for b in budget_ladder(args.prompt, args.budgets)]
    store = ResultStore(args.store)
    rounds = min(args.segments, args.rounds or args.segments)
    for i in range(rounds):
        closed_loop(model, [by_text[t][i] for t in TEXTS], configs, store, n_prompt=args.prompt, model_id=args.model,
                    max_rows=64)
        print(f"round {i + 1}/{rounds} done at {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


def main(argv: list[str]) -> int:
    args = _args(argv)
    if args.stage == "summary":
        return resummarise(args)
    return grid(args) if args.stage == "grid" else report(args, load)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
