"""benchmarks/recommend_report.py's splits: what a recommendation sees and what it is judged on never overlap."""
from __future__ import annotations

import math

import pytest

from benchmarks.recommend_report import splits


@pytest.mark.parametrize("n", [3, 4, 6])
def test_splits_are_disjoint_and_cover_each_kind(n):
    segs = {t: [f"{t}@{i}" for i in range(n)] for t in ("a", "b")}
    every = {s for v in segs.values() for s in v}
    out = splits(segs)
    kinds = [sp["kind"] for sp in out]
    assert kinds.count("fold") == n and kinds.count("cross_text") == 2
    assert kinds.count("halves") == (math.comb(n, n // 2) if n >= 4 else 0)
    for sp in out:
        seen, held = set(sp["seen"]), set(sp["held"])
        assert seen and held and not seen & held
        if sp["kind"] != "cross_text":
            assert seen | held == every
        if sp["kind"] == "halves":      # the same indices of every text, half of each
            assert sorted(s.split("@")[1] for s in sp["seen"] if s.startswith("a")) == \
                sorted(s.split("@")[1] for s in sp["seen"] if s.startswith("b"))
            assert len(seen) == 2 * (n // 2)
