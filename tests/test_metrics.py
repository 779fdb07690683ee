"""The metric table (sim/replay/metrics.py): one measurement for every executor, summary columns that match it."""
from __future__ import annotations

import numpy as np
import pytest

from policies import get_policy
from sim.replay.metrics import COLUMNS, METRICS, M, N_METRICS, NAMES, column, measure, metric
from sim.replay.oracle_replay import replay_oracle
from sim.replay.policy_replay import replay
from traces.synthetic import make_synthetic_trace


def test_measure_hand_example():
    out = np.zeros(N_METRICS)
    # o_ref = (3, 4), cache output = 0.5 * (2, 4) = (1, 2): diff (2, 2)
    measure(1.2, -0.1, np.array([3.0, 4.0], np.float32), np.array([2.0, 4.0]), 0.5, 3.0, out)
    assert out[M.mass] == 1.0                       # clamped into [0, 1]
    assert out[M.err] == pytest.approx(np.sqrt(8.0) / 5.0)
    assert out[M.kl] == 0.0 and out[M.l1] == 4.0 and out[M.l1_bound] == 0.0
    measure(0.25, 0.5, np.zeros(2, np.float32), np.array([3.0, 4.0]), 1.0, 2.0, out)
    assert out[M.err] == 5.0                        # absolute error when the reference output is zero
    assert out[M.l1_bound] == 2.0 * 0.75 * 2.0


def test_every_metric_and_column_is_described_and_oriented():
    assert NAMES == tuple(m.name for m in METRICS) and tuple(M._fields) == NAMES
    for m in METRICS:
        assert m.label and m.doc and m.direction in ("lower", "higher")
        assert m.loss(m.ideal) == 0.0
    assert metric("mass").loss(0.8) == pytest.approx(0.2) and metric("err").loss(0.3) == 0.3
    with pytest.raises(ValueError, match="unknown metric"):
        metric("nope")
    with pytest.raises(ValueError, match="unknown result column"):
        column("nope")
    assert column("mass_mean").direction == "higher" and column("err_p95").direction == "lower"


def test_summary_has_a_column_entry_for_every_number():
    trace = make_synthetic_trace("mixed", n_tokens=80, n_prompt=40, n_layers=1, head_dim=16)
    s = replay(trace, get_policy("h2o"), 16, threads=1).summary()
    numbers = {k for k, v in s.items() if isinstance(v, (int, float))
               and k not in ("budget", "n_steps", "n_layers_compressed")}
    assert numbers <= set(COLUMNS), numbers - set(COLUMNS)
    assert {f"{m}_mean" for m in NAMES} <= numbers


def test_oracle_and_engine_measure_alike_at_the_full_budget():
    trace = make_synthetic_trace("zipf", n_tokens=64, n_prompt=32, n_layers=1, head_dim=16)
    full = replay(trace, get_policy("full"), 64, threads=1)
    orc = replay_oracle(trace, [64], threads=1)[0]
    np.testing.assert_allclose(orc.metrics[..., :M.l1 + 1], full.metrics[..., :M.l1 + 1], atol=1e-5)
