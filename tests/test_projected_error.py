"""The error after W_O, recomputed from kept sets, against the engine's per-head error."""
import numpy as np
import pytest

from policies.core.registry import get_policy
from sim.replay.projected_error import projected_errors
from sim.replay.layer_inputs import load_layers
from sim.replay.policy_replay import replay
from traces.synthetic import make_synthetic_trace


def _run(trace, policy, budget):
    P, R = trace.meta.n_prompt, trace.meta.n_tokens - trace.meta.n_prompt
    inputs = load_layers(trace)
    res = replay(trace, policy, budget, inputs=inputs, record_kept=(P, R), threads=1)
    return inputs, res, P, R


def test_full_cache_has_no_error():
    trace = make_synthetic_trace("mixed", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=32, n_tokens=96, n_prompt=48)
    inputs, res, P, R = _run(trace, get_policy("full"), 96)
    wo = [np.random.default_rng(l).normal(size=(16, 4 * 32)) for l in range(2)]
    assert np.allclose(projected_errors(inputs, res.kept, wo, P, trace.meta.softmax_scale), 0.0, atol=1e-5)


@pytest.mark.parametrize("policy", ["h2o", "streaming_llm", "snapkv"])
def test_identity_projection_of_one_head_is_the_engines_error(policy):
    """With one query head and W_O = I, ||W_O e|| / ||W_O o|| is the engine's per-head relative error."""
    trace = make_synthetic_trace("mixed", n_layers=2, n_q_heads=1, n_kv_heads=1, head_dim=32, n_tokens=128,
                                 n_prompt=64)
    inputs, res, P, R = _run(trace, get_policy(policy), 24)
    got = projected_errors(inputs, res.kept, [np.eye(32)] * 2, P, trace.meta.softmax_scale)
    steps = res.steps
    want = res.metric("err")[:, (steps >= P + 1) & (steps < P + R), 0].mean(axis=1)
    assert got == pytest.approx(want, rel=2e-3, abs=1e-5)
    assert (got > 0).all()


def test_shapes_are_checked():
    trace = make_synthetic_trace("mixed", n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=32, n_tokens=80, n_prompt=64)
    inputs, res, P, R = _run(trace, get_policy("h2o"), 16)
    with pytest.raises(ValueError, match="W_O must be"):
        projected_errors(inputs, res.kept, [np.eye(32)], P, trace.meta.softmax_scale)
