"""benchmarks/recommend_report.py's diagnostics of the recommendations' outcomes, on a synthetic grid whose answer is
known: `draw_difficulty` (held-out segments harder than the seen ones for every configuration) and
`fixed_answer_ceiling` (the smallest budget one configuration meets the target at in enough draws)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("sklearn")

from benchmarks.recommend_report import complete_tables, draw_difficulty, fixed_answer_ceiling  # noqa: E402

SEGS = [f"s{i}" for i in range(6)]
#: each segment's difficulty: s4 and s5 are hard for every configuration at every budget
HARD = {"s0": 0.0, "s1": 0.0, "s2": 0.0, "s3": 0.0, "s4": 1.0, "s5": 1.0}


def _losses() -> dict[str, pd.Series]:
    """ΔNLL by (label, budget, segment): configuration "good" halves "bad"; 0.2 at 64, 0.04 at 128, 0.01 at 256
    on an easy segment, four times that on a hard one."""
    base = {64: 0.2, 128: 0.04, 256: 0.01}
    idx, vals = [], []
    for lab, f in (("good", 0.5), ("bad", 1.0)):
        for b, v in base.items():
            for s in SEGS:
                idx.append((lab, b, s))
                vals.append(f * v * (1 + 3 * HARD[s]))
    loss = pd.Series(vals, index=pd.MultiIndex.from_tuples(idx, names=["label", "budget", "segment"]))
    return {"delta_nll": loss, "top1_disagreement": loss}


def _judged(splits: dict[str, dict], budget: int, smallest: int) -> list[dict]:
    loss = _losses()["delta_nll"]
    out = []
    for name, sp in splits.items():
        held = float(np.mean([loss["good", budget, s] for s in sp["held"]]))
        out.append({"kind": "random", "split": name, "target": "dnll=0.05", "answer": {"met": True, "budget": budget},
                    "held_out_met": held <= 0.05, "smallest_grid_budget_meeting_target": smallest})
    return out


def test_failures_come_from_draws_whose_held_out_segments_were_harder():
    splits = {"easy seen": {"seen": ["s0", "s1", "s2"], "held": ["s3", "s4", "s5"]},
              "hard seen": {"seen": ["s3", "s4", "s5"], "held": ["s0", "s1", "s2"]},
              "mixed 1": {"seen": ["s0", "s4", "s2"], "held": ["s3", "s1", "s5"]},
              "mixed 2": {"seen": ["s1", "s5", "s3"], "held": ["s0", "s4", "s2"]}}
    judged = _judged(splits, 128, 128)
    # good at 128: 0.02 on easy segments, 0.08 on hard: the held-out mean misses 0.05 only with both hard ones held
    assert [j["held_out_met"] for j in judged] == [False, True, True, True]
    dd = draw_difficulty(judged, splits, complete_tables(_losses()))
    assert dd["n"] == 4 and dd["auc_failure"] == 1.0        # the failing draw is the one with the hardest held-out
    assert sum(t["n"] for t in dd["by_tercile"]) == 4
    assert dd["by_tercile"][-1]["share"] < dd["by_tercile"][0]["share"]


def test_fixed_answer_ceiling_is_the_smallest_budget_one_configuration_meets_enough_draws():
    splits = {f"d{i}": {"seen": SEGS[:i] + SEGS[i + 3:], "held": SEGS[i:i + 3]} for i in range(4)}
    judged = _judged(splits, 128, 128)
    ceil = fixed_answer_ceiling(judged, splits, complete_tables(_losses()), level=0.9)["dnll=0.05"]
    # at 128 "good" misses whenever both hard segments are held out (d3); at 256 every draw meets it
    assert (ceil["budget"], ceil["held_out_met_share"]) == (256, 1.0)          # both configurations do
    assert ceil["budget_ratio_median"] == 2.0
    low = fixed_answer_ceiling(judged, splits, complete_tables(_losses()), level=0.75)["dnll=0.05"]
    assert (low["budget"], low["label"], low["held_out_met_share"]) == (128, "good", 0.75)
