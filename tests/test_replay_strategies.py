"""Replay strategies: the oracle is replayed by its own strategy (no caller special-cases it), honours
``record_kept``, and the kept sets it records are exactly the ones its metrics were computed from."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from policies import PolicyError, get_policy
from policies.core.base import Policy
from sim.replay.layer_inputs import load_layers
from sim.replay.oracle_replay import replay_oracle
from sim.replay.policy_replay import STRATEGIES, replay, replay_budgets, strategy_of
from traces.synthetic import make_synthetic_trace

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trace():
    return make_synthetic_trace("zipf", n_tokens=80, n_prompt=16, n_layers=2, n_q_heads=4, n_kv_heads=2,
                                head_dim=16, seed=5)


def _probs(li, scale: float, t: int) -> np.ndarray:
    """float64 full-attention row of step t: [Hq, t + 1]."""
    logits = np.einsum("qd,iqd->qi", li.q[t].astype(np.float64),
                       np.repeat(li.k[: t + 1].astype(np.float64), li.q.shape[1] // li.k.shape[1], axis=1)) * scale
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("scope", ["head", "layer"])
def test_oracle_records_the_kept_sets_its_metrics_come_from(trace, scope):
    P, T = trace.meta.n_prompt, trace.meta.n_tokens
    budget = 6
    res = replay(trace, get_policy("oracle", scope=scope), budget, record_kept=(P, T - P))
    hkv, hq = trace.meta.model.n_kv_heads, trace.meta.model.n_q_heads
    assert res.kept.shape[:3] == (trace.n_layers, T - P, hkv)
    assert list(res.kept_steps) == list(range(P, T))
    inputs = load_layers(trace)
    for layer, li in enumerate(inputs):
        for r, t in enumerate(range(P, T)):
            kept = res.kept[layer, r]
            sizes = (kept >= 0).sum(axis=1)
            if scope == "head":
                assert (sizes == min(budget, t) + 1).all()
            else:
                assert sizes.sum() == min(budget * hkv, hkv * t) + hkv
            p = _probs(li, trace.meta.softmax_scale, t)
            for q in range(hq):
                pos = kept[q // (hq // hkv)]
                pos = pos[pos >= 0]
                assert t in pos and (np.diff(pos) > 0).all()
                assert p[q, pos].sum() == pytest.approx(res.metric("mass")[layer, r, q], abs=1e-9)


def test_oracle_record_kept_before_the_prompt_end(trace):
    res = replay(trace, get_policy("oracle"), 4, record_kept=(0, 6))
    assert res.kept.shape[1] == 6
    assert (res.kept[:, 0, :, 0] == 0).all() and ((res.kept[:, 0] >= 0).sum(axis=-1) == 1).all()
    assert ((res.kept[:, 5] >= 0).sum(axis=-1) == 5).all()         # t=5: 4 past tokens + the newest


def test_the_oracle_strategy_is_one_pass_and_matches_single_budgets(trace):
    oracle = get_policy("oracle")
    assert strategy_of(oracle) is STRATEGIES["oracle"] and strategy_of(oracle).one_pass
    assert strategy_of(get_policy("h2o")) is STRATEGIES["step"] and not strategy_of(get_policy("h2o")).one_pass
    curve = replay_budgets(trace, oracle, [16, 4, 8])
    assert [r.budget for r in curve] == [16, 4, 8]
    for r in curve:
        np.testing.assert_array_equal(r.metrics, replay(trace, oracle, r.budget).metrics)
    np.testing.assert_array_equal(curve[1].metrics, replay_oracle(trace, [4])[0].metrics)


def test_step_strategy_budgets_match_single_replays(trace):
    pol = get_policy("tova")
    for r in replay_budgets(trace, pol, [8, 12]):
        np.testing.assert_array_equal(r.metrics, replay(trace, pol, r.budget).metrics)


def test_an_unknown_strategy_is_a_named_error(trace):
    class Odd(Policy):
        name = "odd"
        replay_strategy = "teleport"

    with pytest.raises(PolicyError, match="unknown replay strategy 'teleport'"):
        replay(trace, Odd(), 8)


def test_callers_no_longer_special_case_the_oracle():
    for rel in ("sim/experiments/executors.py", "sim/experiments/sweep.py", "sim/commands/report_cmd.py"):
        text = (ROOT / rel).read_text()
        assert "is_oracle" not in text and '"scope"' not in text, rel
    assert '"scope"' not in (ROOT / "sim/replay/policy_replay.py").read_text()
    oracle_src = (ROOT / "sim/replay/oracle_replay.py").read_text()
    assert oracle_src.count('params["scope"]') == 1          # read once, by the oracle strategy


def test_long_traces_replay_a_layer_at_a_time(monkeypatch):
    """Above EAGER_INPUT_BYTES the engine inputs are read layer by layer from the trace (LayerLoader), with the
    same results as the inputs prepared whole."""
    import sim.replay.layer_inputs as sl

    trace = make_synthetic_trace("mixed", n_layers=3, n_tokens=96, n_prompt=64, seed=4)
    eager = replay(trace, get_policy("d2o"), 16, inputs=sl.load_layers(trace))
    monkeypatch.setattr(sl, "EAGER_INPUT_BYTES", 0)
    assert isinstance(sl.layer_inputs(trace), sl.LayerLoader)
    lazy = replay(trace, get_policy("d2o"), 16)
    np.testing.assert_array_equal(eager.metrics, lazy.metrics)
    np.testing.assert_array_equal(eager.budgets, lazy.budgets)


def test_a_lazy_replay_prepares_each_layer_once(monkeypatch):
    """Read a layer at a time, a replay prepares each layer's inputs once, for its head state (BUZZ's table) and
    its engine run alike (``LayerLoader`` hands out the copy a caller still holds): a second copy was another
    0.34 GB per Gemma-3 layer at 32 k in flight."""
    import sim.replay.layer_inputs as sl

    trace = make_synthetic_trace("mixed", n_layers=3, n_tokens=96, n_prompt=64, seed=4)
    eager = replay(trace, get_policy("buzz"), 16, inputs=sl.load_layers(trace))
    monkeypatch.setattr(sl, "EAGER_INPUT_BYTES", 0)
    prepared = []
    real = sl.LayerInputs.from_arrays
    monkeypatch.setattr(sl.LayerInputs, "from_arrays", staticmethod(lambda *a: prepared.append(1) or real(*a)))
    lazy = replay(trace, get_policy("buzz"), 16)
    assert len(prepared) == 3
    np.testing.assert_array_equal(eager.metrics, lazy.metrics)
