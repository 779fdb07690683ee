"""`benchmarks/race_check.py`: a shortlist changes exactly when one of its labels was raced out on the first
segment."""
import pandas as pd

from benchmarks.race_check import shortlist_changes


def _sim(first: dict[str, float], second: dict[str, float]) -> pd.DataFrame:
    rows = [{"segment": seg, "label": lab, "budget": 16, "l1_mean": v}
            for seg, losses in (("s@0", first), ("s@1", second)) for lab, v in losses.items()]
    return pd.DataFrame(rows)


def test_a_shortlist_changes_only_when_a_shortlisted_label_is_raced_out():
    family = {"a": "f", "b": "g", "c": "h"}
    # c is the best over both segments but only third on the first: raced out at keep 2, kept at 3
    sim = _sim({"a": 0.1, "b": 0.2, "c": 0.3}, {"a": 0.9, "b": 0.9, "c": 0.0})
    assert shortlist_changes(sim, ["s@0", "s@1"], [16], 2, "l1_mean", 1, 2, family) == (1, 3.0)
    assert shortlist_changes(sim, ["s@0", "s@1"], [16], 3, "l1_mean", 1, 2, family) == (0, 3.0)
    # the shortlist's label is first on the raced segment: nothing changes
    assert shortlist_changes(sim, ["s@1", "s@0"], [16], 1, "l1_mean", 1, 2, family) == (0, 1.0)
