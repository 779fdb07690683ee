"""The head-pattern analysis names heads correctly on hand-built attention with a known target."""
from __future__ import annotations

import numpy as np

from traces.format import InMemoryTrace, LayerArrays, ModelInfo, TraceMeta
from traces.model.analyze_heads import attention_rows, induction_scores, label, pattern_scores

T, BLOCK = 16, 8


def _trace(targets: list[np.ndarray]) -> InMemoryTrace:
    """One layer, one query head per target map t -> attended position; keys are one-hot positions."""
    hq = len(targets)
    k = np.repeat(np.eye(T, dtype=np.float32)[:, None, :], hq, axis=1)      # [T, Hq, d=T], one KV head per q head
    q = np.stack([60.0 * np.eye(T, dtype=np.float32)[tg] for tg in targets], axis=1)
    meta = TraceMeta(model=ModelInfo("toy", 1, hq, hq, T), n_tokens=T, n_prompt=4, softmax_scale=1.0)
    return InMemoryTrace(meta, [LayerArrays(q, k, k.copy())])


def test_attention_rows_are_causal_softmax():
    tr = _trace([np.zeros(T, int)])
    p = attention_rows(tr.layer(0).q, tr.layer(0).k, 1.0, np.arange(T))
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-9)
    assert np.all(p[np.triu_indices(T, 1)[0], 0, np.triu_indices(T, 1)[1]] == 0)


def test_sink_prev_and_local_heads_are_named():
    t = np.arange(T)
    tr = _trace([np.zeros(T, int), np.maximum(t - 1, 0), t])
    scores = {s["head"]: s for s in pattern_scores(tr, min_pos=2, window=4)}
    for s in scores.values():
        s["induction"] = 0.0
    assert scores[0]["sink"] > 0.99 and label(scores[0]) == "sink"
    assert scores[1]["prev"] > 0.99 and label(scores[1]) == "local+prev-token"
    assert scores[2]["local"] > 0.99 and scores[2]["prev"] < 0.01 and label(scores[2]) == "local"


def test_induction_head_attends_to_successor_of_previous_occurrence():
    t = np.arange(T)
    ind = np.where(t > BLOCK, t - BLOCK + 1, 0)
    tr = _trace([ind, t])
    got = induction_scores(tr, BLOCK)
    assert got[(0, 0)] > 0.99 and got[(0, 1)] < 0.01
