"""`traces.reference.full_attention_reference` with ``start``: the rows from ``start`` on are the full computation's,
the rows before are zero (the shortcut a long synthetic trace takes when only its last rows are read, e.g.
benchmarks/sim_cost.py)."""
from __future__ import annotations

import numpy as np

from traces.reference import full_attention_reference


def test_reference_of_the_measured_rows_only():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((40, h, 8)).astype(np.float32) for h in (4, 2, 2))
    lse, o = full_attention_reference(q, k, v, 0.3)
    lse2, o2 = full_attention_reference(q, k, v, 0.3, start=25)
    np.testing.assert_allclose(lse2[25:], lse[25:], rtol=1e-6)
    np.testing.assert_allclose(o2[25:], o[25:], rtol=1e-6, atol=1e-7)
    assert not lse2[:25].any() and not o2[:25].any()
