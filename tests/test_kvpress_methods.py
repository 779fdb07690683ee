"""kvpress's leaderboard methods as kvsim policies: ``observed_attention``, ``cur``, ``qfilter``, ``duo_attention``
and the ``threshold(...)`` combinator (DMSPress), each against a numpy reference written here.

Prefill selections are checked by calling the policy's prefill kernel on a tiny random prompt; decode rules by a
numpy simulation of the whole cache (append, score, evict the lowest candidates, ties the older) compared with
the engine's kept sets at every step.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from policies import PolicyError, get_policy, list_policies, policy_class
from policies.core.combinators import threshold
from policies.core.stage_threshold import threshold_evict
from policies.cur import projection
from sim.replay.policy_replay import replay
from sim.experiments.specs import parse_policy, policy_spec
from traces.format import InMemoryTrace, LayerArrays, LayerAttention, ModelInfo, TraceMeta
from traces.reference import full_attention_reference
from traces.synthetic import random_output_projection

NEW = ["observed_attention", "cur", "qfilter", "duo_attention"]


# ----------------------------------------------------------------------------- helpers

def rope(x: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE of x [T, H, d] at positions 0..T-1 (as Hugging Face's Llama)."""
    T, _, d = x.shape
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = np.arange(T)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=1)[:, None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=1)[:, None, :]
    half = d // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def make_trace(T=40, P=24, hq=4, hkv=2, d=8, n_layers=1, seed=0, theta=0.0, bias=0.0):
    """A random trace (queries and keys with per-head mean offsets ``bias``), RoPE'd at ``theta`` (0: none).
    Returns the trace and the pre-RoPE (q, k) of each layer."""
    rng = np.random.default_rng(seed)
    layers, pre = [], []
    for _ in range(n_layers):
        qp = rng.standard_normal((T, hq, d)) + bias * rng.standard_normal((1, hq, d))
        kp = rng.standard_normal((T, hkv, d)) + bias * rng.standard_normal((1, hkv, d))
        q = (rope(qp, theta) if theta else qp).astype(np.float32)
        k = (rope(kp, theta) if theta else kp).astype(np.float32)
        v = rng.standard_normal((T, hkv, d)).astype(np.float32)
        lse, o = full_attention_reference(q, k, v, d ** -0.5)
        layers.append(LayerArrays(q, k, v, lse, o, random_output_projection(hq, d, seed + len(pre))))
        pre.append((qp, kp))
    attn = (LayerAttention(rope_theta=float(theta)),) * n_layers
    meta = TraceMeta(ModelInfo("test-kvpress", n_layers, hq, hkv, d, rope="rope" if theta else "none",
                               hidden_size=hq * d, attention=attn), T, P, kind="synthetic",
                     source={"generator": "test"})
    return InMemoryTrace(meta, layers), pre


def prefill_keep(policy, q, k, v, budget, layer=0):
    """Run the policy's prefill kernel on one prompt: (keep [Hkv, P], slot_state, head_state)."""
    hkv, d = k.shape[1], k.shape[2]
    keep = np.ones((hkv, k.shape[0]), np.uint8)
    slot = np.zeros((hkv, k.shape[0], policy.slot_fields))
    head = policy.head_state_init(hkv, d)
    budgets = np.full(hkv, budget, np.int64)
    policy.kernels()[1](policy.param_vector(), layer, budgets, np.ascontiguousarray(q), np.ascontiguousarray(k),
                        np.ascontiguousarray(v), d ** -0.5, keep, slot, head)
    return keep, slot, head


def top_kept(scores: np.ndarray, size: int, lo: int, hi: int) -> set[int]:
    """Positions of one head kept when scores [n] (positions 0..n-1) are evicted, lowest first and the older on
    ties, among candidates [lo, hi), down to ``size``."""
    n = len(scores)
    kept = set(range(n))
    cand = sorted((scores[i], i) for i in range(lo, hi))
    for _, i in cand[:max(0, n - size)]:
        kept.discard(i)
    return kept


def evict_to(kept: set[int], scores: dict[int, float], size: int, lo: int, hi: int) -> set[int]:
    """``top_kept`` over a cache given as a set of positions and their scores."""
    kept = set(kept)
    cand = sorted((scores[p], p) for p in kept if lo <= p < hi)
    for _, p in cand[:max(0, len(kept) - size)]:
        kept.discard(p)
    return kept


def kept_sets(res, layer=0):
    """{t: [set per head]} of a replay's recorded kept positions."""
    out = {}
    for r, t in enumerate(res.kept_steps):
        out[int(t)] = [set(int(p) for p in row if p >= 0) for row in res.kept[layer, r]]
    return out


def causal_probs(q, k, scale):
    """[Hq, P, P] causal softmax attention (float64) of a prompt, GQA by q head // G."""
    P, hq, _ = q.shape
    g = hq // k.shape[1]
    out = np.zeros((hq, P, P))
    for j in range(hq):
        lg = (q[:, j, :].astype(np.float64) @ k[:, j // g, :].astype(np.float64).T) * scale
        lg[np.triu_indices(P, 1)] = -np.inf
        lg -= lg.max(axis=1, keepdims=True)
        e = np.exp(lg)
        out[j] = e / e.sum(axis=1, keepdims=True)
    return out


# ----------------------------------------------------------------------------- registry

def test_new_policies_are_listed_with_their_combinators():
    names = set(list_policies())
    for n in NEW:
        assert n in names
    for n in ("observed_attention", "cur", "qfilter"):
        for w in ("ada", "decoding", "critical", "threshold"):
            assert f"{w}({n})" in names
    assert "threshold(knorm)" in names and "threshold(streaming_llm)" not in names
    assert not any(f"({'duo_attention'})" in n for n in names)          # not a scorer: no combinator applies


# ----------------------------------------------------------------------------- observed_attention

def test_observed_attention_prompt_is_the_average_attention_received():
    trace, _ = make_trace(T=300, P=300, hq=4, hkv=2, d=8, seed=1)          # several 128-row blocks
    la = trace.layer(0)
    q, k, v = la.q, la.k, la.v
    pol = get_policy("observed_attention")
    keep, slot, _ = prefill_keep(pol, q, k, v, budget=40)
    probs = causal_probs(q, k, 8 ** -0.5)
    P = q.shape[0]
    avg = probs.sum(axis=1) / np.arange(P, 0, -1)[None, :]            # per query head, over the queries seeing it
    for h in range(2):
        ref = avg[2 * h:2 * h + 2].mean(axis=0)                       # mean over the GQA group
        np.testing.assert_allclose(slot[h, :, 0] / slot[h, :, 1], ref, rtol=1e-5)
        np.testing.assert_array_equal(slot[h, :, 1], np.arange(P, 0, -1))
        assert set(np.flatnonzero(keep[h])) == top_kept(ref, 40, 0, P - 1)


@pytest.mark.parametrize("rule", ["average", "accumulated", "frozen"])
def test_observed_attention_decode_rules(rule):
    from policies.observed_attention import score_step

    pol = get_policy("observed_attention", decode_rule=rule)
    hkv, g, n = 1, 2, 3
    probs = np.zeros((hkv, g, 4))
    probs[0, :, :n] = [[0.2, 0.3, 0.5], [0.4, 0.1, 0.5]]
    slot = np.zeros((hkv, 4, 2))
    slot[0, 0] = [1.0, 4.0]          # a prompt token: 1.0 over 4 queries
    slot[0, 1] = [0.6, 2.0]
    scores = np.zeros((hkv, 4))
    score_step(pol.param_vector(), 0, 9, np.array([n]), probs, np.zeros((1, 4, 2), np.float32),
               np.zeros((1, 4, 2), np.float32), np.array([[0, 1, 9, 0]]), slot, np.zeros((1, 0)),
               np.array([9]), scores)
    step = probs[0].mean(axis=0)[:n]                                  # group mean: 0.3, 0.2, 0.5
    if rule == "average":
        np.testing.assert_allclose(scores[0, :n], [(1.0 + 0.3) / 5, (0.6 + 0.2) / 3, 0.5 / 1])
    elif rule == "accumulated":
        np.testing.assert_allclose(scores[0, :n], [1.3, 0.8, 0.5])
    else:                                                             # prompt scores kept, the new one scored once
        np.testing.assert_allclose(scores[0, :n], [1.0 / 4, 0.6 / 2, step[2]])
        np.testing.assert_allclose(slot[0, 2], [0.5, 1.0])


def test_observed_attention_decode_matches_numpy_simulation():
    T, P, B = 36, 16, 7
    trace, _ = make_trace(T=T, P=P, hq=4, hkv=2, d=8, seed=2)
    la = trace.layer(0)
    q, k = la.q.astype(np.float64), la.k.astype(np.float64)
    scale = 8 ** -0.5
    res = replay(trace, get_policy("observed_attention"), B, record_kept=(P, T - P))
    got = kept_sets(res)
    probs = causal_probs(la.q[:P], la.k[:P], scale)
    for h in range(2):
        sums = probs[2 * h:2 * h + 2].sum(axis=1).mean(axis=0)
        state = {p: [sums[p], P - p] for p in range(P)}
        kept = top_kept(sums / np.arange(P, 0, -1), B, 0, P - 1)
        for t in range(P, T):
            kept = kept | {t}
            state[t] = [0.0, 0]
            pos = sorted(kept)
            row = np.zeros(len(pos))
            for j in (2 * h, 2 * h + 1):
                lg = k[pos, h, :] @ q[t, j, :] * scale
                e = np.exp(lg - lg.max())
                row += e / e.sum() / 2
            for p, a in zip(pos, row):
                state[p][0] += a
                state[p][1] += 1
            kept = evict_to(kept, {p: state[p][0] / state[p][1] for p in kept}, B, 0, t)
            assert got[t][h] == kept, (t, h)


# ----------------------------------------------------------------------------- cur

def cur_reference(k, v, w=4, kind="kv_product", sinks=4, g=None, local=True):
    """kvpress's CURPress score of one head's keys/values [n, d] (numpy)."""
    if g is not None:
        k, v = k @ g, v @ g
    k2, v2 = (k.astype(np.float64) ** 2).sum(1), (v.astype(np.float64) ** 2).sum(1)
    if local:
        for w0 in range(0, len(k2), w):
            k2[w0:w0 + w] = k2[w0:w0 + w] / k2[w0:w0 + w].sum()
            v2[w0:w0 + w] = v2[w0:w0 + w] / v2[w0:w0 + w].sum()
    s = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[kind]
    s = s / s.sum()
    s[:sinks] = 1.0
    return s


@pytest.mark.parametrize("params", [{}, {"leverage_type": "kv_avg", "use_local_approximation": False},
                                    {"use_random_leverage": True, "sketch_dim": 5, "seed": 3},
                                    {"leverage_type": "value", "num_sinks": 2}])
def test_cur_prompt_scores_are_kvpress_leverage(params):
    trace, _ = make_trace(T=22, P=22, hq=2, hkv=2, d=8, seed=4)
    la = trace.layer(0)
    pol = get_policy("cur", local_window_size=4, **params)
    p = pol.params
    g = projection(p["seed"], 0, 8, p["sketch_dim"]) if p["use_random_leverage"] else None
    from policies.cur import score_prompt

    scores = np.zeros((2, 22))
    score_prompt(pol.param_vector(), 0, la.q, la.k, la.v, 1.0, np.array([21, 21]), scores,
                 np.zeros((2, 22, pol.slot_fields)), np.zeros((2, pol.head_fields)))
    keep, _, _ = prefill_keep(pol, la.q, la.k, la.v, budget=10)
    for h in range(2):
        ref = cur_reference(la.k[:, h], la.v[:, h], 4, p["leverage_type"], p["num_sinks"], g,
                            p["use_local_approximation"])
        np.testing.assert_allclose(scores[h], ref, rtol=1e-9)
        assert set(np.flatnonzero(keep[h])) == top_kept(ref, 10, p["num_sinks"], 21)


def test_cur_zero_window_scores_zero_not_nan():
    from policies.cur import score_prompt

    pol = get_policy("cur", local_window_size=4, num_sinks=1)
    k = np.zeros((8, 1, 4), np.float32)
    k[4:, 0] = 1.0
    scores = np.zeros((1, 8))
    score_prompt(pol.param_vector(), 0, k, k, k, 1.0, np.array([7]), scores, np.zeros((1, 8, 5)), np.zeros((1, 4)))
    np.testing.assert_array_equal(scores[0], [1.0, 0, 0, 0, 0.25, 0.25, 0.25, 0.25])


def test_cur_projection_is_gaussian_with_variance_one_over_r():
    g = projection(0, 0, 256, 64)
    assert abs(g.mean()) < 0.01 and abs(g.var() * 64 - 1.0) < 0.05
    np.testing.assert_array_equal(g, projection(0, 0, 256, 64))
    assert not np.array_equal(g, projection(0, 1, 256, 64))            # another layer, another draw


def test_cur_decode_windows_count_evicted_tokens():
    """At decode a token's score is kvpress's score of the whole sequence so far: windows by position, each
    normalised by all its tokens (evicted ones too), the last one by its running sum; the final division by the
    cached tokens' sum."""
    T, P, B, w = 45, 13, 9, 4
    trace, _ = make_trace(T=T, P=P, hq=2, hkv=2, d=8, seed=5)
    la = trace.layer(0)
    res = replay(trace, get_policy("cur", local_window_size=w), B, record_kept=(P, T - P))
    got = kept_sets(res)
    for h in range(2):
        k2 = (la.k[:, h].astype(np.float64) ** 2).sum(1)
        v2 = (la.v[:, h].astype(np.float64) ** 2).sum(1)
        kept = top_kept(cur_reference(la.k[:P, h], la.v[:P, h], w), B, 4, P - 1)
        for t in range(P, T):
            kept = kept | {t}
            nk, nv = {}, {}
            for p in kept:
                w0 = (p // w) * w
                w1 = min(w0 + w, t + 1)
                nk[p], nv[p] = k2[p] / k2[w0:w1].sum(), v2[p] / v2[w0:w1].sum()
            s = {p: nk[p] * nv[p] for p in kept}
            tot = sum(s.values())
            s = {p: (1.0 if p < 4 else s[p] / tot) for p in kept}
            kept = evict_to(kept, s, B, 4, t)
            assert got[t][h] == kept, (t, h)


# ----------------------------------------------------------------------------- qfilter

def qfilter_reference(q, g_n, h):
    """The authors' Q-Filter of KV head h from queries q [n, Hq, d] by numpy's SVD."""
    fs = []
    for j in range(h * g_n, (h + 1) * g_n):
        u, _, vt = np.linalg.svd(q[:, j, :].astype(np.float64), full_matrices=False)
        eps = 1.0 if (u[:, 0] > 0).mean() > 0.5 else -1.0
        fs.append(-eps * vt[0])
    return np.mean(fs, axis=0)


def test_qfilter_matches_numpy_svd_and_keeps_its_filter():
    trace, _ = make_trace(T=30, P=30, hq=4, hkv=2, d=8, seed=6, bias=1.5)
    la = trace.layer(0)
    pol = get_policy("qfilter")
    keep, _, head = prefill_keep(pol, la.q, la.k, la.v, budget=9)
    for h in range(2):
        f = qfilter_reference(la.q, 2, h)
        np.testing.assert_allclose(head[h, 1:9], f, atol=1e-6)
        assert head[h, 0] == 1.0
        score = -(la.k[:, h].astype(np.float64) @ f)
        assert set(np.flatnonzero(keep[h])) == top_kept(score, 9, 0, 29)
        # the score is the key's projection on the queries' signed principal direction
        u, _, vt = np.linalg.svd(la.q[:, 2 * h].astype(np.float64), full_matrices=False)
        eps = 1.0 if (u[:, 0] > 0).mean() > 0.5 else -1.0
        assert (la.q[:, 2 * h].astype(np.float64) @ (eps * vt[0]) > 0).mean() > 0.5


def test_qfilter_decode_scores_with_the_prompt_filter_and_none_without_prompt():
    from policies.qfilter import score_step

    T, P, B = 40, 20, 8
    trace, _ = make_trace(T=T, P=P, hq=4, hkv=2, d=8, seed=7, bias=1.5)
    la = trace.layer(0)
    res = replay(trace, get_policy("qfilter"), B, record_kept=(P, T - P))
    got = kept_sets(res)
    for h in range(2):
        s = -(la.k[:, h].astype(np.float64) @ qfilter_reference(la.q[:P], 2, h))
        kept = top_kept(s[:P], B, 0, P - 1)
        for t in range(P, T):
            kept = evict_to(kept | {t}, {p: s[p] for p in kept | {t}}, B, 0, t)
            assert got[t][h] == kept
    scores = np.ones((1, 3))                                          # no prompt, no filter: every key scores 0
    score_step(get_policy("qfilter").param_vector(), 0, 2, np.array([3]), np.zeros((1, 1, 3)),
               np.ones((1, 3, 8), np.float32), np.ones((1, 3, 8), np.float32), np.array([[0, 1, 2]]),
               np.zeros((1, 3, get_policy("qfilter").slot_fields)), np.zeros((1, 257)), np.array([2]), scores)
    np.testing.assert_array_equal(scores, 0.0)


# ----------------------------------------------------------------------------- duo_attention

def duo_reference(qp, kp, n_pos, theta, g_n):
    """kvpress's on-the-fly DuoAttention score of each KV head from pre-RoPE q [P, Hq, d], k [P, Hkv, d]."""
    d = qp.shape[2]
    qm = np.repeat(qp.mean(axis=0)[None], n_pos, axis=0)
    km = np.repeat(kp.mean(axis=0)[None], n_pos, axis=0)
    Q, K = rope(qm, theta), rope(km, theta)
    out = np.zeros(kp.shape[1])
    for j in range(qp.shape[1]):
        lg = K[:, j // g_n, :] @ Q[-1, j, :] / np.sqrt(d)
        a = np.exp(lg - lg.max())
        a /= a.sum()
        out[j // g_n] += np.cumsum(a).mean() / g_n
    return out


def test_duo_head_scores_split_and_budgets():
    T, P, L, hkv = 40, 32, 3, 2
    trace, pre = make_trace(T=T, P=P, hq=4, hkv=hkv, d=8, n_layers=L, seed=8, theta=10000.0, bias=2.0)
    pol = get_policy("duo_attention", sink_size=2, recent_size=4, pattern_len=50, head_compression_ratio=0.5)
    prompt = [(trace.layer(i).q[:P], trace.layer(i).k[:P]) for i in range(L)]
    pol_theta = get_policy("duo_attention", sink_size=2, recent_size=4, pattern_len=50, rope_theta=10000.0)
    scores = pol_theta.head_scores(prompt)
    ref = np.array([duo_reference(qp[:P], kp[:P], 50, 10000.0, 2) for qp, kp in pre])
    np.testing.assert_allclose(scores, ref, rtol=1e-4)
    assert np.unique(np.round(ref, 6)).size == L * hkv                  # the heads do differ
    res = replay(trace, pol, 16, record_kept=(P, T - P))                 # rope_theta read from the trace
    stream = np.zeros(L * hkv, bool)
    stream[np.argsort(ref, axis=None, kind="stable")[:round(L * hkv * 0.5)]] = True
    np.testing.assert_array_equal(res.budgets, np.where(stream.reshape(L, hkv), 6, 16))
    got = kept_sets(res, layer=0)
    for t in range(P, T):
        for h in range(hkv):
            b = res.budgets[0, h]
            assert got[t][h] == {0, 1} | set(range(t - (b - 2) + 1, t + 1))   # 2 sinks + the most recent
    # memory: (1 - r) B + r min(S, B) slots per head once every head is full
    assert res.slots.mean() == pytest.approx(0.5 * 16 + 0.5 * 6)
    # at a budget of the whole sequence: kvpress's compression ratio r (1 - S / n)
    full = replay(trace, pol, T)
    assert 1 - full.slots[:, -1].mean() / T == pytest.approx(0.5 * (1 - 6 / T))


def test_duo_split_changes_nothing_at_small_budgets_and_ties_follow_head_order():
    trace, _ = make_trace(T=30, P=20, hq=4, hkv=2, d=8, n_layers=2, seed=9)        # no RoPE: every head ties
    pol = get_policy("duo_attention", sink_size=3, recent_size=5)
    res = replay(trace, pol, 8)
    np.testing.assert_array_equal(res.budgets, 8)                   # S = 8 >= budget: StreamingLLM everywhere
    res = replay(trace, pol, 12)
    np.testing.assert_array_equal(res.budgets, [[8, 8], [12, 12]])   # ties: the lower layer and head stream first
    sinks, recent = pol.guarantees(12)
    assert (sinks, recent) == (3, 5)
    assert get_policy("duo_attention", head_compression_ratio=0.0).guarantees(12) == (11, 1)
    with pytest.raises(PolicyError, match="not a scorer"):
        policy_class("ada(duo_attention)")


def test_duo_needs_a_rope_base_it_can_read():
    pol = get_policy("duo_attention", sink_size=1, recent_size=2)
    q = np.zeros((4, 2, 4), np.float32)
    np.testing.assert_array_equal(pol.allocate(8, 1, [(q, q[:, :1])], 0.5), [[8]])   # round(0.5) = 0 streaming
    with pytest.raises(PolicyError, match="rope_theta"):
        pol.allocate(8, 1, [(q, q[:, :1])] * 2, 0.5)                 # a plain list says nothing about RoPE
    out = get_policy("duo_attention", sink_size=1, recent_size=2, rope_theta=0.0).allocate(8, 1, [(q, q[:, :1])] * 2,
                                                                                           0.5)
    np.testing.assert_array_equal(out, [[3], [8]])


# ----------------------------------------------------------------------------- threshold (DMSPress)

def knorm_threshold_simulation(k, P, T, budget, tau, window, on_decode=True):
    """kept sets {t: set} of threshold(knorm, tau, window) on one head with keys k [T, d] (numpy)."""
    s = -np.sqrt((k.astype(np.float64) ** 2).sum(1))
    judged = max(min(P - window, P - 1), 0)
    kept = {p for p in range(P) if not (p < judged and s[p] < tau)}
    kept = evict_to(kept, {p: s[p] for p in kept}, budget, 0, P - 1)
    out = {}
    for t in range(P, T):
        kept = kept | {t}
        if on_decode:
            d1 = min(t - window + 1, t)
            kept = {p for p in kept if not (judged <= p < d1 and s[p] < tau)}
            judged = max(judged, d1)
        kept = evict_to(kept, {p: s[p] for p in kept}, budget, 0, t)
        out[t] = kept
    return out


@pytest.mark.parametrize("budget,on_decode", [(60, True), (9, True), (60, False)])
def test_threshold_memory_varies_with_the_text(budget, on_decode):
    T, P, tau, window = 60, 20, -2.9, 6
    trace, _ = make_trace(T=T, P=P, hq=2, hkv=2, d=8, seed=10)
    pol = parse_policy(f"threshold(knorm, tau={tau}, sliding_window_size={window}, on_decode={on_decode})")
    res = replay(trace, pol, budget, record_kept=(P, T - P))
    got = kept_sets(res)
    la = trace.layer(0)
    for h in range(2):
        ref = knorm_threshold_simulation(la.k[:, h], P, T, budget, tau, window, on_decode)
        for t in range(P, T):
            assert got[t][h] == ref[t], (t, h)
            assert res.slots[0, t - P, h] == len(ref[t])
    if budget == 60 and on_decode:
        assert res.slots[0, -1, 0] != res.slots[0, -1, 1]            # the heads hold what their text calls for
        assert res.summary()["slots_mean"] < budget                  # reported like any policy's memory


def test_threshold_inside_decoding_judges_at_each_compression():
    T, P, B, every, tau, window = 50, 16, 12, 4, -2.9, 5
    trace, _ = make_trace(T=T, P=P, hq=2, hkv=2, d=8, seed=13)
    pol = parse_policy(f"decoding(threshold(knorm, tau={tau}, sliding_window_size={window}), every={every})")
    res = replay(trace, pol, B, record_kept=(P, T - P))
    got = kept_sets(res)
    target = B - every + 1
    for h in range(2):
        s = -np.sqrt((trace.layer(0).k[:, h].astype(np.float64) ** 2).sum(1))
        judged = P - window
        kept = {p for p in range(P) if not (p < judged and s[p] < tau)}
        kept = evict_to(kept, {p: s[p] for p in kept}, target, 0, P - 1)
        for i, t in enumerate(range(P, T)):
            kept = kept | {t}
            if (i + 1) % every == 0:
                d1 = t - window + 1
                kept = {p for p in kept if not (judged <= p < d1 and s[p] < tau)}
                judged = d1
                kept = evict_to(kept, {p: s[p] for p in kept}, target, 0, t)
            assert got[t][h] == kept, (t, h)


def test_threshold_selects_the_prompt_at_once_even_over_a_streaming_scorer():
    trace, _ = make_trace(T=30, P=30, hq=4, hkv=2, d=8, seed=14)
    la = trace.layer(0)
    assert not get_policy("h2o").has_prefill and get_policy("threshold(h2o)").has_prefill
    keep, _, _ = prefill_keep(get_policy("threshold(h2o)"), la.q, la.k, la.v, budget=10)
    probs = causal_probs(la.q, la.k, 8 ** -0.5)
    for h in range(2):
        sums = probs[2 * h:2 * h + 2].sum(axis=1).mean(axis=0)      # H2O's prompt score: accumulated attention
        assert set(np.flatnonzero(keep[h])) == top_kept(sums, 10, 0, 30 - 5)   # recent window: half the budget


def test_threshold_at_minus_inf_is_the_scorer_within_budget():
    trace, _ = make_trace(T=40, P=16, hq=4, hkv=2, d=8, seed=11)
    for inner in ("knorm", "qfilter"):
        a = replay(trace, get_policy(inner), 10, record_kept=(16, 24))
        b = replay(trace, threshold(inner), 10, record_kept=(16, 24))
        np.testing.assert_array_equal(a.kept, b.kept)
        np.testing.assert_array_equal(a.metrics, b.metrics)
    big = replay(trace, parse_policy("threshold(knorm, tau=-inf, sliding_window_size=0)"), 40)
    assert (big.slots == np.arange(17, 41)[None, :, None]).all()     # keeps everything the budget allows


def test_threshold_judges_once_and_waits_for_protection():
    """A token is judged when it leaves the window and not again; one still protected (recent window wider than
    the sliding window) is judged when its protection ends."""
    n = 6
    scores = np.array([[-5.0, 0.0, -5.0, -5.0, -5.0, 1.0]])            # equal to tau: kept (kvpress: < masked)
    positions = np.arange(n)[None, :].astype(np.int64)
    keep = np.ones((1, n), np.uint8)
    head = np.array([[1.0]])                       # position 0 already judged (kept): not judged again
    threshold_evict(0.0, 2, True, 5, np.array([10]), np.array([0]), np.array([3]), np.array([n]), positions,
                         scores, head, 0, keep)
    # leaves the window: positions < 5 - 2 + 1 = 4, but protected from 3 on: judged [1, 3)
    np.testing.assert_array_equal(keep[0], [1, 1, 0, 1, 1, 1])
    assert head[0, 0] == 3.0
    keep[:] = 1
    threshold_evict(0.0, 2, False, 5, np.array([10]), np.array([0]), np.array([3]), np.array([n]), positions,
                         scores, head, 0, keep)
    np.testing.assert_array_equal(keep[0], 1)                        # on_decode=False: nothing judged at decode


def test_threshold_composes_only_where_it_makes_sense():
    for bad, why in [("ada(threshold(knorm))", "only decoding"), ("threshold(ada(knorm))", "size rule"),
                     ("critical(threshold(knorm))", "only decoding"), ("threshold(critical(knorm))", "size rule"),
                     ("threshold(streaming_llm)", "position"), ("threshold(decoding(knorm))", "outermost")]:
        with pytest.raises(PolicyError, match=why):
            policy_class(bad)
    pol = parse_policy("decoding(threshold(cur:num_sinks=2, tau=-inf), every=4)")
    assert policy_spec(pol) == "decoding(threshold(cur:num_sinks=2), every=4)"
    pol = parse_policy("threshold(knorm, tau=-2.5)")
    assert pol.params["tau"] == -2.5 and policy_spec(pol) == "threshold(knorm, tau=-2.5)"
    assert math.isinf(get_policy("threshold(knorm)").params["tau"])
    assert get_policy("threshold(knorm)").compresses_below_budget


@pytest.mark.parametrize("name", ["observed_attention", "cur", "qfilter"])
def test_combinator_identities_hold_for_the_new_scorers(name):
    trace, _ = make_trace(T=36, P=14, hq=4, hkv=2, d=8, seed=15)
    base = replay(trace, get_policy(name), 10, record_kept=(14, 22))
    for spec in (f"decoding({name}, every=1)", f"ada({name}, floor_alpha=1)",
                 f"critical({name}, first_stage_ratio=1)"):
        other = replay(trace, parse_policy(spec), 10, record_kept=(14, 22))
        assert kept_sets(other) == kept_sets(base), spec


@pytest.mark.parametrize("spec", ["ada(observed_attention)", "critical(qfilter)", "decoding(cur, every=4)",
                                  "threshold(observed_attention, tau=0.05, sliding_window_size=4)"])
def test_combinators_over_the_new_scorers_hold_the_budget(spec):
    trace, _ = make_trace(T=36, P=14, hq=4, hkv=2, d=8, seed=12)
    pol = parse_policy(spec)
    res = replay(trace, pol, 10)
    held = res.slots.sum(axis=2) if pol.head_adaptive else res.slots
    cap = res.budgets.sum(axis=1)[:, None] if pol.head_adaptive else res.budgets[:, None, :]
    assert (held <= cap).all() and 0 < res.summary()["mass_mean"] <= 1
