"""sim/replay/kept_sets.py: kept-position records as masks, the Jaccard index of kept sets, and the step-by-step
agreement of two records (the simulator against the closed loop; kvpress's presses against kvsim's policies)."""
from __future__ import annotations

import numpy as np

from sim.replay.kept_sets import compare_kept, jaccard, kept_mask


def test_jaccard_of_kept_sets():
    a = np.array([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]], bool)
    b = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0]], bool)
    assert jaccard(a, b).tolist() == [1.0, 1 / 3, 1.0]      # identical, {0,2} vs {1,2}, two empty sets


def test_kept_mask_from_padded_positions():
    pos = np.array([[[3, 0, -1], [1, -1, -1]]])
    assert kept_mask(pos, 4).astype(int).tolist() == [[[1, 0, 0, 1], [0, 1, 0, 0]]]


def test_compare_kept_counts_equal_sets_overlap_and_the_worst_difference():
    """Records of different widths and orders; only the first n_steps steps count."""
    gpu = np.full((2, 3, 2, 4), -1)
    sim = np.full((2, 3, 2, 3), -1)
    for l in range(2):
        for r in range(3):
            for h in range(2):
                gpu[l, r, h, :3] = [r, 5, 7 + h]
                sim[l, r, h, :3] = [7 + h, r, 5]             # the same sets, another order
    sim[1, 0, 1, :3] = [0, 5, 9]                             # {0, 5, 8} vs {0, 5, 9}: Jaccard 2/4
    sim[0, 2, 0, :3] = [6, 6, 6]                             # step 2 is not compared
    got = compare_kept(gpu, sim, 2)
    assert got == {"kept_agreement": 7 / 8, "kept_jaccard": (7 + 0.5) / 8, "symmetric_difference_max": 2,
                   "n_compared": 8, "n_steps": 2}
