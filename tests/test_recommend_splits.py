"""The recommend benchmarks' splits (`gpu_validate.studies.recommendation.recommend_evaluation`): what a
recommendation sees and what it is judged on never overlap; the random draws are distinct and seeded; the
guarantee's and the confidence's summaries count what they say."""
from __future__ import annotations

import math

import pytest

from gpu_validate.studies.recommendation.recommend_evaluation import (confidence_calibration, coverage, random_splits,
                                                                      relevel, splits)


@pytest.mark.parametrize("n", [3, 4, 6])
def test_splits_are_disjoint_and_cover_each_kind(n):
    segs = {t: [f"{t}@{i}" for i in range(n)] for t in ("a", "b")}
    every = {s for v in segs.values() for s in v}
    out = splits(segs, 4, 30)
    kinds = [sp["kind"] for sp in out]
    assert kinds.count("fold") == n and kinds.count("cross_text") == 2
    assert kinds.count("random") == min(30, math.comb(2 * n, 4))
    for sp in out:
        seen, held = set(sp["seen"]), set(sp["held"])
        assert seen and held and not seen & held
        if sp["kind"] != "cross_text":
            assert seen | held == every
        if sp["kind"] == "random":
            assert len(seen) == 4
    draws = [tuple(sp["seen"]) for sp in out if sp["kind"] == "random"]
    assert len(set(draws)) == len(draws)                                   # distinct
    assert random_splits(sorted(every), 4, 30) == random_splits(sorted(every), 4, 30)   # seeded


def test_coverage_and_confidence_count_the_judged_answers():
    def j(held, gheld, level, ratio=1.0, certified=True, met=True):
        return {"held_out_met": held, "confidence": {"level": level}, "budget_ratio": ratio,
                "answer": {"met": met, "budget": 64},
                "guarantee": {"alpha": 0.1, "budget": 64 if certified else None, "cost_ratio": 1.5,
                              "held_out_met": gheld, "held_out_units_met_share": 1.0 if gheld else 0.5,
                              "budget_ratio": 2.0}}

    judged = [j(True, True, "high"), j(True, True, "high", 1.5), j(False, True, "low"), j(True, False, "medium"),
              j(False, False, "low", certified=False), j(True, True, "low", met=False),
              j(False, True, "low", met=False)]
    cov = coverage(judged[:5])
    assert cov["certified"]["n"] == 5 and cov["certified"]["share"] == 0.8
    assert cov["coverage"]["n"] == 4 and cov["coverage"]["share"] == 0.75
    assert cov["coverage"]["ci95"][0] < 0.75 < cov["coverage"]["ci95"][1]
    conf = confidence_calibration(judged)
    assert (conf["high"]["n"], conf["high"]["share"], conf["high"]["budget_ratio_median"]) == (2, 1.0, 1.25)
    assert (conf["low"]["n"], conf["low"]["share"]) == (2, 0.0)          # the claims only
    # the two answers that claimed nothing: one whose held-out segments missed the target too
    assert (conf["unclaimed"]["n"], conf["unclaimed"]["share"]) == (2, 0.5)


def test_relevel_applies_todays_rule_to_recorded_judgements():
    def rec(met, margin, certified, budget=128):
        return {"answer": {"met": met, "budget": budget}, "confidence": {"level": "stale", "margin_t": margin},
                "guarantee": {"budget": certified}}

    assert relevel(rec(True, 9.0, 128)) == "high"
    assert relevel(rec(True, 9.0, 192)) == "medium"      # certified only above the answer's budget
    assert relevel(rec(True, 9.0, None)) == "low"        # certified nowhere
    assert relevel(rec(True, 1.0, 128)) == "low"
    assert relevel(rec(False, 9.0, 128)) == "low"
