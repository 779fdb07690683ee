"""How far `kvsim recommend --target retrieval=X` can be trusted: its answers made on some pass-key prompts, judged
on prompts they never saw against an exhaustive closed-loop grid there -- the retrieval counterpart of
benchmarks/recommend.py, with its measures.

1. ``--stage grid``: the full cache on every pass-key prompt laid into the two shipped texts
   (`gpu_validate.studies.recommendation.retrieval.needle_units`: ``--seeds`` seeds per text at 5 depths), then every
   configuration of `FAMILIES` at every budget of the model's ladder on each prompt the full cache answers
   (greedy decoding, closed loop; a resumable store, one prompt at a time, so ``--prompts a:b`` splits the work
   into pieces that each take the heavy lock).
2. ``--stage report``: the simulator's features of the same cells; `gpu_validate.studies.recommendation.retrieval`'s
   recommender run on random subsets of the solved prompts (``--seen`` of them) and judged on the rest: whether the
   failure share of its choice at its budget met the target there, the ratio of its budget to the smallest grid
   budget at which some configuration met the target there, its model runs, the coverage of its Clopper-Pearson
   guarantee, and how often each confidence level held. Writes benchmarks/results/recommend_retrieval_<model>.json.

The grid is a fixed subset of the candidates, for cost (a needle run decodes, about 5 s a cell on this machine): the
paper default of each family of benchmarks/recommend.py and SnapKV with the 8-token window (the simulator's first
at every rung of both models' example runs). Refinement between rungs is off here (the grid holds the ladder's
rungs only), so the budget ratio is a whole rung's.

    python -m benchmarks.recommend_retrieval --model smollm2-135m --stage grid
    python -m benchmarks.recommend_retrieval --model smollm2-135m --stage report
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks.recommend_retrieval_report import report

TEXTS = ("default", "idle")
#: the grid's configurations: each family's paper default, and SnapKV with an 8-token window
SPECS = ("h2o", "snapkv", "snapkv:window_size=8", "streaming_llm", "buzz", "d2o", "cascading", "expected_attention",
         "tova")
#: per model: pass-key prompt length, seeds per text (x 5 depths x 2 texts prompts), the ladder, the targets
MODELS = {
    "smollm2-135m": {"prompt": 512, "seeds": 4, "budgets": "128,192,256,384", "targets": ("retrieval=0.8",
                                                                                           "retrieval=0.7")},
    # Gemma-3-270M (a base model) answers 12 of the 40 single pass-key prompts with its full cache: 6 seen prompts
    # certify at most 60.7% (`certifiable`), so its targets are lower
    "gemma3-270m": {"prompt": 512, "seeds": 4, "budgets": "128,192,256,384", "targets": ("retrieval=0.6",
                                                                                          "retrieval=0.5")},
}


def grid_candidates() -> list:
    """`SPECS` as recommendation candidates, one configuration each (a bare name here is its paper default, not its
    family's search grid), each of the family of its policy."""
    from gpu_validate.studies.recommendation.candidates import Candidate
    from sim.experiments.specs import parse_policy

    pols = [parse_policy(s) for s in SPECS]
    return [Candidate(p.name, p, p.params == type(p)().params) for p in pols]


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    ap.add_argument("--stage", choices=("grid", "report"), required=True)
    ap.add_argument("--prompts", default=None, metavar="A:B", help="grid stage: only the solved prompts A..B-1")
    ap.add_argument("--store", default=None, help="closed-loop store (default results/recommend_retrieval_<model>)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the closed loop")
    ap.add_argument("--splits", type=int, default=120, help="report stage: random seen/held-out splits")
    args = ap.parse_args(argv)
    d = MODELS[args.model]
    args.prompt, args.seeds, args.budgets, args.targets = d["prompt"], d["seeds"], d["budgets"], d["targets"]
    args.store = args.store or f"results/recommend_retrieval_{args.model}"
    return args


def load(args):
    """(model, tokenizer, model id, every prompt, the prompts the full cache answers)."""
    import torch

    from gpu_validate.studies.recommendation.retrieval import needle_units, solved_prompts
    from sim.experiments.store import ResultStore
    from traces.model import read_text
    from traces.models import load_model, model_id

    torch.set_grad_enabled(False)
    model, tok = load_model(args.model, device="cpu", progress=False)
    mid = model_id(args.model)
    prompts = needle_units(tok, {t: read_text(t)[0] for t in TEXTS}, args.prompt, args.seeds)
    solved = solved_prompts(model, prompts, ResultStore(args.store), model_id=mid, backend="torch",
                            decode=tok.decode, progress=False)
    return model, tok, mid, prompts, solved


def grid(args) -> int:
    from gpu_validate.studies.needle.runs import run_needle
    from gpu_validate.studies.recommendation.candidates import budget_ladder
    from sim.experiments.store import ResultStore
    from sim.replay.threads import limit_threads

    import torch  # noqa: F401  (first, so limit_threads caps its pool)

    limit_threads(args.threads)
    t0 = time.perf_counter()
    model, tok, mid, prompts, solved = load(args)
    print(f"{len(solved)} of {len(prompts)} prompts answered by the full cache", flush=True)
    lo, _, hi = (args.prompts or "0:").partition(":")
    part = solved[int(lo or 0):int(hi) if hi else None]
    configs = [(c.policy, b) for c in grid_candidates() for b in budget_ladder(args.prompt, args.budgets)]
    store = ResultStore(args.store)
    for i, p in enumerate(part):
        run_needle(model, [p], configs, store, model_id=mid, decode=tok.decode, progress=False, log=lambda s: None)
        print(f"prompt {p.prompt_id} ({i + 1}/{len(part)}) done at {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


def main(argv: list[str]) -> int:
    args = _args(argv)
    return grid(args) if args.stage == "grid" else report(args, load, grid_candidates())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
