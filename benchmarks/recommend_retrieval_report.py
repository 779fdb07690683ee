"""Stage 2 of benchmarks/recommend_retrieval.py: retrieval recommendations made on random subsets of the pass-key
prompts the full cache answers, judged on the others against the exhaustive grid (see that file's docstring), with
the measures of benchmarks/recommend.py (`gpu_validate.studies.recommendation.recommend_evaluation` and
benchmarks/recommend_report.py's `signal_analysis`)."""
from __future__ import annotations

import sys
import tempfile
import time
from typing import Any

import numpy as np


def report(args, load, cands: list) -> int:
    """The report stage on the grid of ``cands`` (benchmarks/recommend_retrieval.py's `grid_candidates`), with the
    model and prompts ``load(args)`` gives."""
    from benchmarks._util import machine, write_result
    from benchmarks.recommend_report import signal_analysis
    from gpu_validate.studies.needle.runs import config_key
    from gpu_validate.studies.recommendation.candidates import Target, budget_ladder
    from gpu_validate.studies.recommendation.recommend_evaluation import (confidence_calibration, coverage, judge,
                                                                          random_splits, threshold_scan)
    from gpu_validate.studies.recommendation.recommend_search import (ExecutionSettings, GuaranteeSettings,
                                                                      SearchSettings)
    from gpu_validate.studies.recommendation.recommend_statistics import MARGIN_Z
    from gpu_validate.studies.recommendation.retrieval import RetrievalRecommender, certifiable
    from sim.reports.runinfo import kvsim_version, now
    from sim.experiments.store import ResultStore
    from sim.replay.threads import limit_threads

    import torch  # noqa: F401  (first, so limit_threads caps its pool)

    limit_threads(args.threads)
    t0 = time.perf_counter()
    model, tok, mid, prompts, solved = load(args)
    budgets = budget_ladder(args.prompt, args.budgets)
    grid_store, sim_store = ResultStore(args.store), ResultStore(args.store + "-sim")
    known = grid_store.load()
    success = dict(zip(known.key, known.success.astype(bool)))
    # the prompts whose whole grid ran (the grid stage may have been stopped early)
    units = [p for p in solved if all(config_key(p, c.policy, b, mid) in success for c in cands for b in budgets)]
    print(f"{len(units)} of {len(solved)} solved prompts ({len(prompts)} made) have the whole grid", flush=True)
    failed = {(c.label, b): {p.prompt_id: float(not success[config_key(p, c.policy, b, mid)]) for p in units}
              for c in cands for b in budgets}
    n_seen = len(units) // 2
    targets = [Target.parse(t) for t in args.targets]
    judged: list[dict[str, Any]] = []
    refused = {str(tg): 0 for tg in targets}
    for i, (seen, held) in enumerate(random_splits(units, n_seen, args.splits)):
        for tg in targets:
            if tg.value > certifiable(len(seen), MARGIN_Z):
                refused[str(tg)] += 1
                continue
            with tempfile.TemporaryDirectory() as tmp:
                rec = RetrievalRecommender(model, seen, cands, budgets, tg, decode=tok.decode, n_prompt=args.prompt,
                                           model_id=mid, out=tmp, search=SearchSettings(refine=None),
                                           guarantee=GuaranteeSettings(margin_z=MARGIN_Z),
                                           execution=ExecutionSettings(progress=False, log=lambda s: None,
                                                                       closed_store=grid_store,
                                                                       sim_store=sim_store)).run()
            table = {k: np.array([v[p.prompt_id] for p in held]) for k, v in failed.items()}
            j = judge(rec, table, tg, budgets, [], len(cands) * len(budgets) * len(held))
            j.update(split=f"random {i}", kind="random", n_seen=len(seen))
            judged.append(j)
        made = [f"{j['target']} -> {j['answer']['label']} @ {j['answer']['budget']}" for j in judged
                if j["split"] == f"random {i}"]
        print(f"[{i + 1}/{args.splits}] {'; '.join(made) or 'every target refused'} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)

    def share(xs) -> float:
        return float(np.mean(xs)) if len(xs) else float("nan")

    summary: dict[str, Any] = {
        "target_met_share": share([j["held_out_met"] for j in judged]),
        "claimed_met_share": share([j["answer"]["met"] for j in judged]),
        "target_met_share_of_claimed": share([j["held_out_met"] for j in judged if j["answer"]["met"]]),
        "budget_ratio_median": float(np.nanmedian([j["budget_ratio"] for j in judged])) if judged else float("nan"),
        "model_runs_share": share([j["model_runs_share"] for j in judged]),
        "by_target": {str(tg): {"recommendations": len(part := [j for j in judged if j["target"] == str(tg)]),
                                "refused_splits": refused[str(tg)],
                                "target_met_share": share([j["held_out_met"] for j in part]),
                                "budget_ratio_median": float(np.nanmedian([j["budget_ratio"] for j in part]))
                                if part else float("nan")} for tg in targets},
        "coverage": {**coverage(judged), "by_target": {str(tg): coverage([j for j in judged if j["target"] == str(tg)])
                                                       for tg in targets}},
        "confidence_calibration": confidence_calibration(judged), "confidence_signals": signal_analysis(judged),
        "confidence_threshold_scan": threshold_scan(judged),
        "goals": {"target_met_share": ">= 0.9", "budget_ratio_median": "<= 1.25 (whole rungs here: no refinement)",
                  "coverage": ">= 1 - alpha", "confidence_calibration": "high holds >= 0.95"}}
    grid_means = [{"label": lab, "budget": b, "failure_share": float(np.mean(list(v.values())))}
                  for (lab, b), v in failed.items()]
    out = {"model": args.model, "model_id": mid, "texts": ["default", "idle"], "n_prompt": args.prompt,
           "prompts": len(prompts), "prompts_solved_by_full": len(solved), "units": len(units), "seen": n_seen,
           "split_note": f"{args.splits} random draws of {n_seen} of the {len(units)} solved prompts seen, the rest "
                         "held out",
           "targets": [str(t) for t in targets],
           "grid": {"configurations": [c.label for c in cands], "budgets": budgets,
                    "closed_loop_runs": len(cands) * len(budgets) * len(units) + len(prompts),
                    "subset_note": "each family's paper default and SnapKV with an 8-token window: a fixed subset "
                                   "of the candidates, for cost; no refinement between rungs"},
           "summary": summary, "recommendations": judged, "grid_failure_shares": grid_means,
           "seconds": time.perf_counter() - t0, "machine": machine(), "kvsim": kvsim_version(), "date": now(),
           "command": "python -m benchmarks.recommend_retrieval " + " ".join(sys.argv[1:])}
    path = write_result(f"recommend_retrieval_{args.model}", out)
    for k in ("target_met_share", "budget_ratio_median", "claimed_met_share", "model_runs_share"):
        print(f"{k}: {summary[k]}")
    print("coverage:", {k: v for k, v in summary["coverage"].items() if k != "by_target"})
    print(f"wrote {path}")
    return 0
