"""Hybrid attention (sliding-window + global layers) and per-layer attention in the trace format: the format's
version 2 and its version-1 compatibility, the windowed reference, and replay semantics for both ways a policy
may treat a sliding layer (keep its window / compress under it), the engine against the numpy reference."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from policies import PolicyError, get_policy, list_policies
from tests.short_schedules import short_policy
from sim.replay.numpy_reference import reference_head_state, reference_replay_layer
from sim.replay.layer_inputs import load_layers
from sim.replay.oracle_replay import replay_oracle
from sim.replay.policy_replay import replay
from sim.replay.plan import compressed_layers
from traces.format import LayerAttention, TraceError, load_trace
from traces.reference import full_attention_reference
from traces.synthetic import make_synthetic_trace

V1 = Path(__file__).parent / "data" / "trace_v1"
WINDOW = 6


def hybrid(T: int = 40, P: int = 24, seed: int = 0):
    """Three layers: sliding (window 6), global, sliding: Gemma-3's pattern in miniature."""
    return make_synthetic_trace("mixed", n_layers=3, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=T,
                                n_prompt=P, seed=seed, windows=[WINDOW, None, WINDOW])


# ----- format -----------------------------------------------------------------------------------------------

def test_version_1_trace_still_loads_and_replays():
    trace = load_trace(V1)
    attn = trace.meta.attention(0)
    assert attn == LayerAttention("global", None, None, trace.meta.softmax_scale)
    res = replay(trace, get_policy("h2o"), 8)
    assert res.metrics.shape[0] == 1 and np.isfinite(res.metrics).all()
    # its RoPE base is unknown: expected attention says so and takes an explicit one
    with pytest.raises(PolicyError, match="rope_theta=-1 means the layer's own rope_theta"):
        replay(trace, get_policy("expected_attention"), 8)
    assert np.isfinite(replay(trace, get_policy("expected_attention", rope_theta=1e4), 8).metrics).all()


def test_per_layer_attention_round_trips(tmp_path):
    trace = hybrid()
    trace.save(tmp_path / "t")
    loaded = load_trace(tmp_path / "t")
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["version"] == 2
    assert [a["kind"] for a in manifest["model"]["attention"]] == ["sliding", "global", "sliding"]
    assert loaded.meta.model.attention == trace.meta.model.attention and loaded.meta.model.hybrid
    assert loaded.meta.attention(0).describe() == "sliding 6, no RoPE"


@pytest.mark.parametrize("entry, message", [
    ({"kind": "sliding"}, "sliding layer needs an integer window"),
    ({"kind": "global", "window": 8}, "global layer has no window"),
    ({"kind": "local"}, "attention.kind must be one of"),
    ({"kind": "global", "rope_theta": -3}, "rope_theta must be"),
    ({"kind": "global", "softcap": 0}, "softcap must be"),
])
def test_bad_attention_entries_are_named(tmp_path, entry, message):
    shutil.copytree(V1, tmp_path / "t")
    path = tmp_path / "t" / "manifest.json"
    m = json.loads(path.read_text())
    m["version"], m["model"]["attention"] = 2, [entry]
    path.write_text(json.dumps(m))
    with pytest.raises(TraceError, match=message):
        load_trace(tmp_path / "t", verify=False)


def test_attention_list_must_match_layers(tmp_path):
    shutil.copytree(V1, tmp_path / "t")
    path = tmp_path / "t" / "manifest.json"
    m = json.loads(path.read_text())
    m["version"], m["model"]["attention"] = 2, [{"kind": "global"}, {"kind": "global"}]
    path.write_text(json.dumps(m))
    with pytest.raises(TraceError, match="2 entries for 1 stored layers"):
        load_trace(tmp_path / "t", verify=False)


# ----- the windowed reference -------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 3, 7, 300])
def test_windowed_reference_equals_brute_force(window):
    rng = np.random.default_rng(window)
    T, hq, hkv, d = 300, 4, 2, 8           # more rows than one block of the blocked computation
    q, k, v = (rng.standard_normal((T, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    lse, o = full_attention_reference(q, k, v, 0.4, window=window)
    for t in (0, 1, window - 1, window, 150, T - 1):
        t = min(max(t, 0), T - 1)
        lo = max(0, t - window + 1)
        for hh in range(hq):
            logits = (k[lo:t + 1, hh // 2].astype(np.float64) @ q[t, hh]) * 0.4
            m = logits.max()
            p = np.exp(logits - m)
            assert lse[t, hh] == pytest.approx(m + np.log(p.sum()), rel=1e-6)
            np.testing.assert_allclose(o[t, hh], (p / p.sum()) @ v[lo:t + 1, hh // 2], rtol=1e-5, atol=1e-6)


# ----- replay semantics -------------------------------------------------------------------------------------

def test_keep_mode_compresses_global_layers_and_counts_windows_as_held():
    trace = hybrid()
    assert compressed_layers(trace) == [1] and compressed_layers(trace, "compress") == [0, 1, 2]
    res = replay(trace, get_policy("h2o"), 10)
    assert list(res.layer_index) == [1] and res.metrics.shape[0] == 1
    t = np.arange(24, 40) + 1
    np.testing.assert_array_equal(res.held_elsewhere, 2 * 2 * np.minimum(t, WINDOW - 1))
    s = res.summary()
    held = res.slots.sum(axis=(0, 2)) + res.held_elsewhere
    assert s["kv_bytes_mean"] == pytest.approx(held.mean() * 2 * 16 * 2)
    assert s["n_layers_compressed"] == 1
    full = replay(trace, get_policy("full"), 10, sliding="compress")
    assert np.abs(full.metric("err")).max() < 1e-5        # the full cache is exact on sliding layers too


def test_compress_mode_holds_nothing_outside_the_window():
    trace = hybrid()
    T, P = 40, 24
    res = replay(trace, get_policy("h2o"), 20, sliding="compress", record_kept=(P, T - P))
    for j, layer in enumerate(res.layer_index):
        kept = res.kept[j]
        if trace.meta.attention(layer).sliding:
            for r, t in enumerate(range(P, T)):
                held = kept[r][kept[r] >= 0]
                assert held.min() > t + 1 - WINDOW        # what the next query sees, and nothing older
            assert res.slots[j].max() <= WINDOW - 1


POLICIES = [n for n in list_policies() if not get_policy(n).is_oracle]


@pytest.mark.parametrize("name", POLICIES)
def test_engine_matches_reference_under_a_window(name):
    trace = hybrid(seed=5)
    T, P = 40, 24
    policy = short_policy(name)
    budget = max(policy.min_budget(), 10)
    res = replay(trace, policy, budget, sliding="compress", record_kept=(P, T - P))
    inputs = load_layers(trace)
    for j, layer in enumerate(res.layer_index):
        li = inputs[layer]
        head = reference_head_state(policy, trace, inputs, [int(x) for x in res.layer_index], j)
        metrics, slots, kept = reference_replay_layer(policy, int(layer), li, res.budgets[j], P, li.attention.scale,
                                                      head_state=head)
        np.testing.assert_allclose(res.metrics[j][..., :4], metrics[..., :4], rtol=1e-4, atol=5e-5)
        np.testing.assert_array_equal(res.slots[j], slots)
        offset = len(kept) - (T - P)
        for r in range(T - P):
            for h in range(2):
                row = res.kept[j, r, h]
                np.testing.assert_array_equal(row[row >= 0], kept[offset + r][h])


def test_oracle_on_a_sliding_layer_ranks_the_windowed_attention():
    trace = hybrid()
    T, P = 40, 24
    (res,) = replay_oracle(trace, [3], sliding="compress", record_kept=(P, T - P))
    assert (res.metric("mass") <= 1 + 1e-9).all()
    for j, layer in enumerate(res.layer_index):
        if trace.meta.attention(layer).sliding:
            for r, t in enumerate(range(P, T)):
                held = res.kept[j, r][res.kept[j, r] >= 0]
                assert held.min() > t - WINDOW
    # a budget as large as the window holds all the windowed attention: exact on sliding layers
    (wide,) = replay_oracle(trace, [WINDOW], sliding="compress")
    sliding = [j for j, layer in enumerate(wide.layer_index) if trace.meta.attention(layer).sliding]
    assert np.abs(wide.metrics[sliding][..., 1]).max() < 1e-6


def test_only_sliding_layers_need_compress():
    trace = make_synthetic_trace("mixed", n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=16, n_tokens=20,
                                 n_prompt=8, windows=[4])
    with pytest.raises(ValueError, match="only sliding-window layers"):
        replay(trace, get_policy("h2o"), 4)
    assert replay(trace, get_policy("h2o"), 4, sliding="compress").metrics.shape[0] == 1


def test_expected_attention_reads_each_layers_rope_base():
    """-1 (default) takes the layer's base from the trace: the same as passing that base explicitly."""
    trace = hybrid()
    layers = load_layers(trace)
    theta = {0: 1e4, 1: 1e6, 2: 1e4}
    for i, li in enumerate(layers):
        li.attention = LayerAttention(**{**li.attention.__dict__, "rope_theta": theta[i]})
    auto = replay(trace, get_policy("expected_attention"), 10, inputs=layers, sliding="compress")
    for base in (1e4, 1e6):
        fixed = replay(trace, get_policy("expected_attention", rope_theta=base), 10, inputs=layers,
                       sliding="compress")
        same = [j for j, layer in enumerate(auto.layer_index) if theta[int(layer)] == base]
        np.testing.assert_array_equal(auto.metrics[same], fixed.metrics[same])
