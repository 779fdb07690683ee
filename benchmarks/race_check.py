"""Does racing the candidates on the first segment change what `kvsim recommend` confirms? Measured on the
simulations the recommend benchmark stored (`benchmarks/recommend.py`: every configuration of its fixed subset at
every grid budget on every segment of the two shipped texts).

`kvsim recommend` simulates every candidate on the first segment it sees and only those among the ``keep`` best at
some budget there (`gpu_validate.studies.recommendation.recommend_search.race_survivors`) on the others. The
search then confirms, at each budget, the simulator's shortlist (the ``validate`` best over the segments seen, at
most ``per_family`` of one family). Racing changes a recommendation only if a label of some budget's shortlist over
all the seen segments was raced out on the first: then (and only then) the shortlist among the survivors differs.
For every split the recommend benchmark draws (random draws of six seen segments, folds, cross-text), and every
grid budget, this counts the shortlists racing would change, for several ``keep``, and the worst rank on the
first segment (best over budgets) of a shortlisted label. No model runs; seconds.

    python -m benchmarks.race_check [--models smollm2-135m,gemma3-270m] [--keep 4,8,12,16]

Writes benchmarks/results/race_check.json.
"""
from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import pandas as pd

from benchmarks._util import write_result


def shortlist_changes(sim: pd.DataFrame, seen: list[str], budgets: list[int], keep: int, sim_loss: str,
                      validate: int, per_family: int, family: dict[str, str]) -> tuple[int, float]:
    """How many of ``budgets``' shortlists racing on ``seen[0]`` with ``keep`` changes, and the worst best-rank
    on ``seen[0]`` of a label shortlisted at some budget."""
    from gpu_validate.studies.recommendation.recommend_search import race_survivors, shortlist

    first = sim[sim.segment == seen[0]]
    survivors = race_survivors(first, sim_loss, keep)
    rank = first.sort_values([sim_loss, "label"]).groupby("budget").cumcount() + 1
    best_rank = rank.groupby(first.label).min()
    mean = sim[sim.segment.isin(seen)].groupby(["budget", "label"])[sim_loss].mean()
    changed, worst = 0, 0.0
    for b in budgets:
        ranked = mean.loc[b].reset_index().sort_values([sim_loss, "label"]).label.tolist()
        top = shortlist(ranked, family, validate, per_family)
        changed += not set(top) <= survivors
        worst = max(worst, float(best_rank[top].max()))
    return changed, worst


def check_model(model: str, keeps: list[int]) -> dict[str, Any]:
    from benchmarks.recommend import FAMILIES, MODELS
    from benchmarks.recommend_report import VALIDATE
    from gpu_validate.studies.recommendation.candidates import budget_ladder, candidates
    from gpu_validate.studies.recommendation.recommend_evaluation import splits
    from gpu_validate.studies.recommendation.recommend_search import SIM_LOSS
    from sim.experiments.store import ResultStore

    d = MODELS[model]
    cands = candidates(";".join(FAMILIES))
    family = {c.label: c.family for c in cands}
    budgets = budget_ladder(d["prompt"], d["budgets"])
    sim = ResultStore(f"results/recommend_{model}-sim").load()
    sim = sim[sim.label.isin(family) & sim.budget.isin(budgets)]
    full = sim.groupby("segment").size()
    names = sorted(full[full == full.max()].index, key=lambda s: (s.split("@")[0], int(s.split("@")[1])))
    segs: dict[str, list[str]] = {}
    for s in names:
        segs.setdefault(s.split("@")[0], []).append(s)
    every = splits(segs, d["seen"], d["splits"])
    out: dict[str, Any] = {"candidates": len(cands), "budgets": budgets, "segments": len(names),
                           "splits": len(every), "validate": VALIDATE, "per_family": 2, "by_keep": {}}
    for keep in keeps:
        res = [shortlist_changes(sim, sp["seen"], budgets, keep, SIM_LOSS, VALIDATE, 2, family) for sp in every]
        changed = np.array([c for c, _ in res])
        out["by_keep"][str(keep)] = {
            "shortlists": len(every) * len(budgets), "shortlists_changed": int(changed.sum()),
            "splits_changed": int((changed > 0).sum()),
            "worst_first_segment_rank": max(w for _, w in res)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--keep", default="4,8,12,16")
    args = ap.parse_args(argv)
    from gpu_validate.studies.recommendation.recommend_search import RACE

    keeps = [int(k) for k in args.keep.split(",")]
    out = {"race_default": RACE, "models": {m: check_model(m, keeps) for m in args.models.split(",")}}
    for m, r in out["models"].items():
        for k, v in r["by_keep"].items():
            print(f"{m} keep {k}: {v['shortlists_changed']} of {v['shortlists']} shortlists changed "
                  f"({v['splits_changed']} of {r['splits']} splits); worst first-segment rank "
                  f"{v['worst_first_segment_rank']:.0f} of {r['candidates']}")
    write_result("race_check", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
