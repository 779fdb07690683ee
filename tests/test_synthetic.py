"""Synthetic generators produce the attention structure they promise."""
from __future__ import annotations

import numpy as np
import pytest

from traces.synthetic import KINDS, make_synthetic_trace


def attention_rows(trace, layer=0, hq=0):
    """Full attention matrix [T, T] of one query head (small traces only)."""
    la = trace.layer(layer)
    g = trace.meta.model.group_size
    logits = trace.meta.softmax_scale * la.q[:, hq].astype(np.float64) @ la.k[:, hq // g].astype(np.float64).T
    T = logits.shape[0]
    logits[np.triu_indices(T, 1)] = -np.inf
    p = np.exp(logits - logits.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


def test_sinks_take_most_attention():
    tr = make_synthetic_trace("sinks", n_layers=1, n_tokens=200, n_prompt=10, n_sinks=4)
    p = attention_rows(tr)
    assert p[50:, :4].sum(1).mean() > 0.5


def test_zipf_heavy_hitters_are_stable_and_concentrated():
    tr = make_synthetic_trace("zipf", n_layers=1, n_tokens=300, n_prompt=10)
    p = attention_rows(tr)[200:]
    top = np.argsort(-p.sum(0))[:20]
    assert p[:, top].sum(1).mean() > 0.4          # 20 of 300 tokens hold a large share
    assert p[:, 4:].sum(0)[top[top >= 4]].min() > 0


def test_local_attention_is_recent():
    tr = make_synthetic_trace("local", n_layers=1, n_tokens=200, n_prompt=10)
    p = attention_rows(tr)
    recent = np.mean([p[t, t - 3:t + 1].sum() for t in range(50, 200)])
    assert recent > 0.3


def test_recall_queries_find_their_target():
    tr = make_synthetic_trace("recall", n_layers=1, n_tokens=200, n_prompt=10, recall_every=10, recall_window=20,
                              seed=1)
    p = attention_rows(tr)
    recall_steps = range(21, 200, 10)
    hits = [p[t, : t - 20].max() > 0.3 for t in recall_steps]
    assert np.mean(hits) > 0.8


def test_passkey_needle_dominates_last_queries():
    tr = make_synthetic_trace("passkey", n_layers=1, n_tokens=300, n_prompt=100, passkey_pos=7, n_needle_queries=8)
    p = attention_rows(tr)
    assert (p[-8:].argmax(1) == 7).all()
    assert p[150:-8, 7].max() < p[-8:, 7].min()


def test_topic_shift_prefers_current_segment():
    tr = make_synthetic_trace("topic_shift", n_layers=1, n_tokens=256, n_prompt=10, segment=64)
    p = attention_rows(tr)
    share = np.mean([p[t, (t // 64) * 64: t + 1].sum() for t in range(140, 256)])
    assert share > 0.5


def test_adversarial_flips_salience_half_way():
    tr = make_synthetic_trace("adversarial", n_layers=1, n_tokens=200, n_prompt=10)
    p = attention_rows(tr)
    early_heavy = np.argsort(-p[20:100].sum(0))[:10]
    assert p[150:, early_heavy].sum(1).mean() < p[50:100, early_heavy].sum(1).mean() / 5


@pytest.mark.parametrize("kind", KINDS)
def test_shapes_gqa_and_determinism(kind):
    a = make_synthetic_trace(kind, n_layers=2, n_q_heads=6, n_kv_heads=2, head_dim=16, n_tokens=40, n_prompt=5, seed=9)
    b = make_synthetic_trace(kind, n_layers=2, n_q_heads=6, n_kv_heads=2, head_dim=16, n_tokens=40, n_prompt=5, seed=9)
    la = a.layer(1)
    assert la.q.shape == (40, 6, 16) and la.k.shape == (40, 2, 16) and la.o.shape == (40, 6, 16)
    for x, y in zip(a.layer(1), b.layer(1)):
        np.testing.assert_array_equal(x, y)
    assert np.isfinite(la.lse).all()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown synthetic kind"):
        make_synthetic_trace("nope")
    with pytest.raises(ValueError, match="head_dim"):
        make_synthetic_trace("zipf", head_dim=4)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        make_synthetic_trace("zipf", n_q_heads=3, n_kv_heads=2)
