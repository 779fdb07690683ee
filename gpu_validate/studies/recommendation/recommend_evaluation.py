"""How a recommendation is judged on units it never saw (``benchmarks/recommend.py`` on text segments,
``benchmarks/recommend_retrieval.py`` on pass-key prompts): the seen/held-out splits (`splits`, `random_splits`),
one answer judged on the held-out units (`judge`: did its configuration meet the target there at its budget, how
far its budget is from the smallest that did, did the guarantee hold), and the summaries over many answers: the
guarantee's coverage (`coverage`), how often each stated confidence level held (`confidence_calibration`) and the
margin as a predictor of the outcome threshold by threshold (`threshold_scan`). Shares come with their count and
95% Clopper-Pearson interval (`share_interval`): the counts are small."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from scipy.stats import beta

from gpu_validate.studies.recommendation.recommend_statistics import confidence_level

#: seed of the random splits
SPLIT_SEED = 0


def random_splits(units: Sequence, n_seen: int, n: int, seed: int = SPLIT_SEED) -> list[tuple[list, list]]:
    """``n`` distinct random (seen, held-out) splits of ``units``, ``n_seen`` seen (all of them when there are
    fewer distinct ones), in a seeded order."""
    units = list(units)
    total = math.comb(len(units), n_seen)
    rng = np.random.default_rng(seed)
    picks: list[tuple[int, ...]] = []
    seen_sets: set[tuple[int, ...]] = set()
    while len(picks) < min(n, total):
        idx = tuple(sorted(int(i) for i in rng.choice(len(units), n_seen, replace=False)))
        if idx not in seen_sets:
            seen_sets.add(idx)
            picks.append(idx)
    return [([units[i] for i in idx], [u for j, u in enumerate(units) if j not in idx]) for idx in picks]


def splits(segs: dict[str, list], n_seen: int, n_random: int) -> list[dict[str, Any]]:
    """The random splits (``n_random`` draws of ``n_seen`` segments from all texts, the rest held out), the folds
    (segment i of each text seen, the rest held out) and the cross-text splits."""
    every = [s for v in segs.values() for s in v]
    out = [{"name": f"random {i}", "kind": "random", "seen": seen, "held": held}
           for i, (seen, held) in enumerate(random_splits(every, n_seen, n_random))]
    n = min(len(v) for v in segs.values())
    out += [{"name": f"fold {i}", "kind": "fold", "seen": [v[i] for v in segs.values()],
             "held": [s for v in segs.values() for j, s in enumerate(v) if j != i]} for i in range(n)]
    texts = list(segs)
    out += [{"name": f"{a} -> {b}", "kind": "cross_text", "seen": segs[a], "held": segs[b]}
            for a in texts for b in texts if a != b]
    return out


def smallest_meeting(held: dict[tuple[str, int], np.ndarray], budgets: Sequence[int], tg) -> int | None:
    """The smallest of ``budgets`` at which some configuration's mean held-out loss (``held``: (label, budget) ->
    losses per held-out unit) meets the target."""
    return next((b for b in sorted(budgets) if any(tg.met(float(v.mean())) for (_, bb), v in held.items() if bb == b)),
                None)


def judge(rec: dict[str, Any], held: dict[tuple[str, int], np.ndarray], tg, grid_budgets: Sequence[int],
          fine_budgets: Sequence[int], grid_runs: int) -> dict[str, Any]:
    """One recommendation (its report ``rec``) judged on the held-out units: ``held`` maps (label, budget) to the
    losses of each held-out unit. The answer's held-out loss and whether it met the target; the budget ratio to the
    smallest grid budget some configuration met it at there (and to the smallest of the grid's and the refined
    budgets, ``_fine``); the guarantee's coverage (the held-out mean, and the share of held-out units, at the
    certified budget meeting the target); the confidence level and margin it stated."""
    a, g = rec["answer"], rec["guarantee"]
    lab, b = a["choice"]["label"], a["budget"]
    loss = held[lab, b]
    ref = smallest_meeting(held, grid_budgets, tg)
    ref_fine = smallest_meeting(held, [*grid_budgets, *fine_budgets], tg)
    out = {"target": str(tg), "answer": {"met": a["met"], "budget": b, "label": lab,
                                         "refined": b not in grid_budgets},
           "held_out_loss": float(loss.mean()), "held_out_met": tg.met(float(loss.mean())),
           "held_out_units_met_share": float(np.mean([tg.met(x) for x in loss])),
           "smallest_grid_budget_meeting_target": ref, "budget_ratio": b / ref if ref else float("nan"),
           "smallest_budget_meeting_target_fine": ref_fine,
           "budget_ratio_fine": b / ref_fine if ref_fine else float("nan"),
           "model_runs": rec["model_runs"], "model_runs_share": rec["model_runs"] / grid_runs,
           "confidence": {k: rec["confidence"][k] for k in ("level", "margin_t", "pair_agreement",
                                                             "calibration_rms_log")},
           "margin": a["margin"], "calibration_rms_log": rec["calibration"]["rms_log"]}
    gb = g["budget"]
    cert = {"alpha": g["alpha"], "n_units": g["n_units"], "budget": gb, "cost_ratio": g["cost_ratio"]}
    if gb is not None:
        gl = held[g["label"], gb]
        cert.update(held_out_loss=float(gl.mean()), held_out_met=tg.met(float(gl.mean())),
                    held_out_units_met_share=float(np.mean([tg.met(x) for x in gl])),
                    budget_ratio=gb / ref if ref else float("nan"))
    out["guarantee"] = cert
    return out


def share_interval(xs: Sequence[bool]) -> dict[str, Any]:
    """A share with its count and 95% Clopper-Pearson interval (small counts are common here)."""
    n, k = len(xs), int(np.sum(xs))
    if not n:
        return {"n": 0, "share": float("nan"), "ci95": [float("nan"), float("nan")]}
    lo = 0.0 if k == 0 else float(beta.ppf(0.025, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(0.975, k + 1, n - k))
    return {"n": n, "share": k / n, "ci95": [lo, hi]}


def coverage(judged: Sequence[dict]) -> dict[str, Any]:
    """The guarantee over the judged recommendations: the share whose certification succeeded, and of those the
    share whose held-out mean loss met the target at the certified budget (``coverage``; goal >= 1 - alpha), the
    share of held-out units that did (what the guarantee is about: one new unit), the median cost of the
    certified budget over the answer's and over the smallest grid budget meeting the target held out."""
    cert = [j for j in judged if j["guarantee"]["budget"] is not None]
    alphas = sorted({round(j["guarantee"]["alpha"], 6) for j in judged})
    return {"recommendations": len(judged), "alpha": alphas[0] if len(alphas) == 1 else alphas,
            "certified": share_interval([j["guarantee"]["budget"] is not None for j in judged]),
            "coverage": share_interval([j["guarantee"]["held_out_met"] for j in cert]),
            "coverage_per_unit": float(np.mean([j["guarantee"]["held_out_units_met_share"] for j in cert]))
            if cert else float("nan"),
            "cost_ratio_median": float(np.median([j["guarantee"]["cost_ratio"] for j in cert])) if cert else None,
            "budget_ratio_median": float(np.nanmedian([j["guarantee"]["budget_ratio"] for j in cert]))
            if cert else None,
            "goal": "coverage >= 1 - alpha"}


def confidence_calibration(judged: Sequence[dict]) -> dict[str, Any]:
    """Per confidence level stated with an answer that claims the target: how many, the share that held out (with
    its Clopper-Pearson interval) and their median budget ratio (to the grid's smallest budget meeting the target).
    An answer that meets the target at no budget tried claims nothing a confidence could predict (it is "low" by
    rule); those are counted apart (``unclaimed``), with the share whose held-out segments missed the target too."""
    claimed = [j for j in judged if j["answer"]["met"]]
    out = {}
    for level in ("high", "medium", "low"):
        part = [j for j in claimed if j["confidence"]["level"] == level]
        out[level] = {**share_interval([j["held_out_met"] for j in part]),
                      "budget_ratio_median": float(np.nanmedian([j["budget_ratio"] for j in part]))
                      if part and np.isfinite([j["budget_ratio"] for j in part]).any() else float("nan")}
    out["unclaimed"] = share_interval([not j["held_out_met"] for j in judged if not j["answer"]["met"]])
    out["goal"] = ("of the answers claiming the target, high holds in >= 95% of cases; low only where answers fail "
                   "more often")
    return out


def relevel(j: dict[str, Any]) -> str:
    """The confidence level today's rule (`recommend_statistics.confidence_level`) gives a judged recommendation
    ``j`` (`judge`'s record: its claim, margin, answer budget and certified budget), for judgements recorded under an
    earlier rule."""
    return confidence_level(j["answer"]["met"], j["confidence"]["margin_t"], j["guarantee"]["budget"],
                            j["answer"]["budget"])


def threshold_scan(judged: Sequence[dict], thresholds: Sequence[float] = (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8)
                   ) -> list[dict[str, Any]]:
    """The margin (``confidence.margin_t``) as a predictor of the outcome, threshold by threshold: of the answers
    that claimed the target, how many had at least that margin and the share of them that held out, and the same
    below it. `gpu_validate.studies.recommendation.recommend_statistics.CONFIDENCE` was chosen from this scan on
    SmolLM2 and is judged on Gemma-3."""
    claimed = [j for j in judged if j["answer"]["met"]]
    out = []
    for t in thresholds:
        above = [j["held_out_met"] for j in claimed if j["confidence"]["margin_t"] >= t]
        below = [j["held_out_met"] for j in claimed if j["confidence"]["margin_t"] < t]
        out.append({"threshold": t, "above": share_interval(above), "below": share_interval(below)})
    return out
