"""kvpress's readings of ChunkKV and LagKV as parameters (chunkkv: scope, chunk_reduce, kernel_size, pooling,
window_pad; lagkv: cross_scoring, partial_reference, std_ddof): hand-checked kept sets and independent numpy
references of kvpress's rules (ChunkKVPress over SnapKVPress, LagKVPress) on tiny inputs, and the budget and
protection properties of the new modes on synthetic traces. benchmarks/kvpress_parity.py compares them with
kvpress itself on SmolLM2."""
from __future__ import annotations

import numpy as np
import pytest

from policies.lagkv import lag_scores
from sim.replay.policy_replay import replay
from sim.experiments.specs import parse_policy
from traces.synthetic import make_synthetic_trace

KVPRESS_CHUNKKV = "chunkkv:n_sink=0,n_recent=0,scope=layer,chunk_reduce=mean,kernel_size={ks},pooling=avg,window_pad=true"
KVPRESS_LAGKV = "lagkv:n_recent=0,cross_scoring=false,partial_reference=false,std_ddof=1"


def step(spec, base, positions, budgets):
    """One decode step of a chunkkv spec on explicit slot scores: base [Hkv, n] are the accumulated scores
    (slot_state[..., 0]; the step adds zero attention), positions [Hkv, n] the slots' positions (-1: an empty
    slot after the head's last). Returns the kept positions per head."""
    pol = parse_policy(spec)
    base = np.asarray(base, np.float64)
    positions = np.asarray(positions, np.int64)
    hkv, n = base.shape
    lengths = (positions >= 0).sum(1).astype(np.int64)
    st = np.zeros((hkv, n, pol.slot_fields))
    st[..., 0] = base
    keep = np.zeros((hkv, n), np.uint8)
    for h in range(hkv):
        keep[h, :lengths[h]] = 1
    keys = np.ones((hkv, n, 2), np.float32)
    pol.kernels()[0](pol.param_vector(), 0, int(positions.max()), np.asarray(budgets, np.int64), lengths,
                     np.zeros((hkv, 1, n)), keys, keys.copy(), np.ascontiguousarray(positions), st,
                     np.zeros((hkv, pol.head_fields)), keep, np.full((hkv, n), -1, np.int64), np.ones((hkv, n)))
    return [set(positions[h, :lengths[h]][keep[h, :lengths[h]] == 1].tolist()) for h in range(hkv)]


def prefill(spec, q, k, v, budgets, scale=1.0):
    """The prefill kernel on explicit q [P, Hq, d], k, v [P, Hkv, d]; returns the kept positions per head."""
    pol = parse_policy(spec)
    q, k, v = (np.ascontiguousarray(x, np.float32) for x in (q, k, v))
    P, hkv, _ = k.shape
    keep = np.ones((hkv, P), np.uint8)
    pol.kernels()[1](pol.param_vector(), 0, np.asarray(budgets, np.int64), q, k, v, scale, keep,
                     np.zeros((hkv, P, pol.slot_fields)), np.zeros((hkv, pol.head_fields)))
    return [set(np.flatnonzero(row).tolist()) for row in keep]


def keep_top(score, pos, budget):
    """kvsim's rule: evict the lowest scores down to ``budget``, the older token first among equal scores."""
    order = np.lexsort((pos, score))
    return set(np.asarray(pos)[np.sort(order[len(pos) - budget:])].tolist()) if budget < len(pos) else set(pos)


# ---------------------------------------------------------------- chunkkv

def test_chunkkv_layer_scope_keeps_the_same_chunks_in_every_head():
    # chunks of 2: head 0 sums 10, 0, 2, 0; head 1 sums 0, 8, 7, 0; over the layer 10, 8, 9, 0
    base = [[5, 5, 0, 0, 1, 1, 0, 0], [0, 0, 4, 4, 3.5, 3.5, 0, 0]]
    pos = [list(range(8))] * 2
    head = step("chunkkv:n_recent=0,chunk_length=2", base, pos, [4, 4])
    layer = step("chunkkv:n_recent=0,chunk_length=2,scope=layer", base, pos, [4, 4])
    assert head == [{0, 1, 4, 5}, {2, 3, 4, 5}]
    assert layer == [{0, 1, 4, 5}, {0, 1, 4, 5}]


def test_chunkkv_mean_ranks_a_partial_chunk_by_its_mean():
    # chunks of 3: {0,1,2} sum 3 mean 1; {3,4,5} sum 2.7 mean 0.9; {6} sum = mean 2.5
    base = [[1, 1, 1, 0.9, 0.9, 0.9, 2.5]]
    pos = [list(range(7))]
    assert step("chunkkv:n_recent=0,chunk_length=3", base, pos, [4]) == [{0, 1, 2, 5}]   # {6} first, then 3, 4
    assert step("chunkkv:n_recent=0,chunk_length=3,chunk_reduce=mean", base, pos, [4]) == [{0, 1, 2, 6}]


def test_chunkkv_window_pad_keeps_the_last_window_at_decode():
    base = [[9, 8, 7, 6, 5, 4, 3, 0, 0, 0]]
    pos = [list(range(10))]
    spec = "chunkkv:n_recent=0,chunk_length=1,window_size=3"
    assert step(spec, base, pos, [5]) == [{0, 1, 2, 3, 4}]
    assert step(spec + ",window_pad=true", base, pos, [5]) == [{0, 1, 7, 8, 9}]


def chunk_stat_ref(base, pos, chunk, mean):
    """{chunk index: sum or mean of base over the slots of that chunk} for one head."""
    out = {}
    for c in sorted({p // chunk for p in pos}):
        vals = [b for b, p in zip(base, pos) if p // chunk == c]
        out[c] = float(np.mean(vals) if mean else np.sum(vals))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scope,reduce", [("head", "mean"), ("layer", "sum"), ("layer", "mean")])
def test_chunkkv_decode_matches_numpy_reference_with_uneven_cached_sets(seed, scope, reduce):
    """Heads holding different positions (earlier evictions): per head its own chunk statistic over its cached
    slots; layer scope sums them over the heads (a head without a slot in the chunk adds nothing)."""
    rng = np.random.default_rng(seed)
    T, chunk, hkv = 30, 4, 3
    pos = [np.sort(rng.choice(T - 1, 18, replace=False)).tolist() + [T - 1] for _ in range(hkv)]
    base = [rng.random(19).tolist() for _ in range(hkv)]
    budgets = [9, 11, 7]
    stats = [chunk_stat_ref(base[h], pos[h], chunk, reduce == "mean") for h in range(hkv)]
    expect = []
    for h in range(hkv):
        if scope == "head":
            score = [stats[h][p // chunk] for p in pos[h]]
        else:
            score = [sum(s.get(p // chunk, 0.0) for s in stats) for p in pos[h]]
        expect.append(keep_top(np.array(score), pos[h], budgets[h]))
    got = step(f"chunkkv:n_recent=0,chunk_length={chunk},scope={scope},chunk_reduce={reduce}", base, pos, budgets)
    assert got == expect


def kvpress_chunkkv_snapkv_ref(q, k, window, kernel, chunk, ratio, scale=1.0):
    """kvpress's ChunkKVPress(SnapKVPress(window, kernel), chunk) in numpy, written from its documented rule:
    the window queries' softmax attention (mean over the window) on the keys before the window, avg-pooled
    (zero padding counted), mean over each KV head's query group, the window padded with max + 1, summed over
    the KV heads; chunks (the last partial) ranked by their mean; the top int(n_chunks * (1 - ratio)) kept."""
    P, hq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    att = np.zeros((hq, P - window))
    for r in range(P - window, P):
        for qh in range(hq):
            logits = scale * (k[: r + 1, qh // g].astype(np.float64) @ q[r, qh].astype(np.float64))
            p = np.exp(logits - logits.max())
            att[qh] += (p / p.sum())[: P - window] / window
    pad = kernel // 2
    padded = np.pad(att, ((0, 0), (pad, pad)))
    pooled = np.stack([padded[:, i:i + kernel].sum(1) / kernel for i in range(P - window)], 1)
    per_kv = pooled.reshape(hkv, g, P - window).mean(1)
    tok = np.concatenate([per_kv, np.full((hkv, window), per_kv.max() + 1)], 1).sum(0)
    bounds = [(s, min(s + chunk, P)) for s in range(0, P, chunk)]
    means = np.array([tok[a:b].mean() for a, b in bounds])
    n_keep = max(1, int(len(bounds) * (1 - ratio)))
    order = np.argsort(-means, kind="stable")
    assert n_keep == len(order) or means[order[n_keep - 1]] > means[order[n_keep]]    # no tie at the cut
    top = order[:n_keep]
    return set(i for c in top for i in range(*bounds[c]))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_chunkkv_kvpress_reading_matches_kvpress_rule_at_prefill(seed):
    """P = 37, chunks of 5 (the last of 2), a 6-token window that starts inside a chunk: kvpress's kept set in
    every head, given kvpress's count."""
    rng = np.random.default_rng(seed)
    P, hq, hkv, d, w, ks, chunk = 37, 4, 2, 8, 6, 3, 5
    q = rng.standard_normal((P, hq, d)).astype(np.float32)
    k = rng.standard_normal((P, hkv, d)).astype(np.float32)
    expect = kvpress_chunkkv_snapkv_ref(q, k, w, ks, chunk, 0.5, scale=0.5)
    spec = KVPRESS_CHUNKKV.format(ks=ks) + f",chunk_length={chunk},window_size={w}"
    got = prefill(spec, q, k, k, [len(expect)] * hkv, scale=0.5)
    assert got == [expect] * hkv
    assert set(range(P - w, P)) <= expect               # the padded window's chunks are kept


# ---------------------------------------------------------------- lagkv

def kvpress_lagkv_ref(k, v, n_sink, lag):
    """kvpress's LagKVPress(n_sink, lag, cross_scoring=False).score for one head [P, d] in numpy: the sinks and
    the last complete partition plus the remainder score 1, the others their rank within the partition / lag
    of (softmax(std_key) + softmax(std_value)) / 2, std with Bessel's correction, no epsilon; a prompt shorter
    than n_sink + 2 lag scores by recency."""
    P = k.shape[0]
    if P < n_sink + 2 * lag:
        return np.concatenate([np.ones(n_sink), np.arange(P - n_sink) / (P - n_sink)])
    m = (P - n_sink) // lag
    score = np.ones(P)
    for j in range(m - 1):
        a, b, c = n_sink + j * lag, n_sink + (j + 1) * lag, n_sink + (j + 2) * lag
        tot = 0
        for x in (k, v):
            lo, hi = x[b:c].min(0), x[b:c].max(0)
            s = ((x[a:b] - lo) / (hi - lo)).std(1, ddof=1)
            tot = tot + np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        score[a:b] = np.argsort(np.argsort(tot / 2, kind="stable"), kind="stable") / lag
    return score


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("P,budget", [(25, 14), (25, 11), (31, 16), (12, 6)])
def test_lagkv_kvpress_defaults_match_kvpress_rule_at_prefill(seed, P, budget):
    """n_sink 2, lag 5: P = 25 = 2 + 4 x 5 + 3 scores 3 partitions (positions 2-16) and keeps 17-24 whole;
    P = 31 has no remainder; P = 12 < 2 + 2 x 5 is not scored (the newest kept). Budgets cut between equal
    ranks of different partitions: both sides evict the older first here."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((P, 1, 6)).astype(np.float32)
    v = rng.standard_normal((P, 1, 6)).astype(np.float32)
    score = kvpress_lagkv_ref(k[:, 0].astype(np.float64), v[:, 0].astype(np.float64), 2, 5)
    expect = {0, 1} | keep_top(score[2:], np.arange(2, P), budget - 2)
    assert prefill(KVPRESS_LAGKV + ",n_sink=2,lag_size=5", k, k, v, [budget], scale=1.0) == [expect]


def test_lagkv_kvpress_defaults_keep_every_partitions_top_share():
    rng = np.random.default_rng(7)
    P, lag = 2 + 6 * 8, 8                                 # 6 complete partitions: 5 scored, the last kept whole
    k = rng.standard_normal((P, 1, 4)).astype(np.float32)
    kept = prefill(KVPRESS_LAGKV + f",n_sink=2,lag_size={lag}", k, k, k, [2 + 8 + 5 * 3])[0]
    for j in range(5):
        assert len(kept & set(range(2 + j * lag, 2 + (j + 1) * lag))) == 3
    assert set(range(2 + 5 * lag, P)) <= kept


def test_lagkv_decode_ranks_from_each_partitions_top_and_waits_for_a_complete_reference():
    """lag_scores on cached slots after evictions: n_sink 2, lag 5; partition 0 (2-6) holds 3 slots, partition 1
    (7-11) all 5, partition 2 (12-16) only position 12 so far."""
    rng = np.random.default_rng(3)
    pos = np.array([0, 1, 3, 5, 6, 7, 8, 9, 10, 11, 12])
    n, d = pos.size, 4
    keys = rng.standard_normal((n, d)).astype(np.float32)
    vals = rng.standard_normal((n, d)).astype(np.float32)
    raw = np.empty(n)
    lag_scores(keys, vals, pos, n, 2, 5, raw)                       # kvsim's defaults: cross-scored, partial ref
    assert np.isinf(raw[[0, 1, 10]]).all() and np.isfinite(raw[2:10]).all()
    ranked = np.empty(n)
    lag_scores(keys, vals, pos, n, 2, 5, ranked, False, True, 0)
    for sl, m in ((slice(2, 5), 3), (slice(5, 10), 5)):
        order = np.argsort(raw[sl], kind="stable")
        want = np.empty(m)
        want[order] = (np.arange(m) - m + 1) / 5                    # the best of each partition scores 0
        np.testing.assert_allclose(ranked[sl], want)
    waits = np.empty(n)
    lag_scores(keys, vals, pos, n, 2, 5, waits, False, False, 0)    # partition 2 is incomplete: 1 is unscored
    np.testing.assert_allclose(waits[2:5], ranked[2:5])
    assert np.isinf(waits[5:]).all()


def test_lagkv_std_ddof_is_the_sample_std():
    rng = np.random.default_rng(5)
    pos = np.arange(12)
    k = rng.standard_normal((12, 5)).astype(np.float32)
    out = np.empty(12)
    lag_scores(k, k, pos, 12, 2, 5, out, True, True, 1)
    x, ref = k[2:7].astype(np.float64), k[7:12].astype(np.float64)
    s = ((x - ref.min(0)) / (ref.max(0) - ref.min(0) + 1e-6)).std(1, ddof=1)
    np.testing.assert_allclose(out[2:7], 2 * np.exp(s - s.max()) / np.exp(s - s.max()).sum(), rtol=1e-6)


# ---------------------------------------------------------------- properties of the new modes

MODES = [
    KVPRESS_CHUNKKV.format(ks=3) + ",chunk_length=4,window_size=8",
    "chunkkv:chunk_length=4,window_size=8,scope=layer,kernel_size=5,pooling=max",
    "chunkkv:chunk_length=3,window_size=6,chunk_reduce=mean,window_pad=true",
    KVPRESS_LAGKV + ",lag_size=8",
    "lagkv:lag_size=6,cross_scoring=false",
    "lagkv:lag_size=6,partial_reference=false,std_ddof=1",
    "ada(" + KVPRESS_LAGKV + ",lag_size=8)",
    "decoding(" + KVPRESS_CHUNKKV.format(ks=3) + ",chunk_length=4,window_size=8, every=3, target=12)",
]


@pytest.mark.parametrize("spec", MODES)
@pytest.mark.parametrize("kind,seed", [("mixed", 0), ("recall", 1)])
def test_new_modes_keep_budget_and_promises_and_full_budget_is_full_attention(spec, kind, seed):
    trace = make_synthetic_trace(kind, n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=64,
                                 n_prompt=24, seed=seed, recall_every=5, recall_window=6)
    policy = parse_policy(spec)
    P, T = trace.meta.n_prompt, trace.meta.n_tokens
    for budget in sorted({max(b, policy.min_budget()) for b in (12, 20, 33)}):
        res = replay(trace, policy, budget, record_kept=(P, T - P))
        if policy.head_adaptive:
            assert (res.slots.sum(axis=2) <= res.budgets.sum(axis=1)[:, None]).all()
        else:
            assert (res.slots <= res.budgets[:, None, :]).all()
        sinks, recent = policy.guarantees(budget)
        for layer in range(trace.n_layers):
            for r, t in enumerate(res.kept_steps):
                for h in range(2):
                    row = res.kept[layer, r, h]
                    promised = set(range(min(sinks, t + 1))) | set(range(max(0, t - recent + 1), t + 1))
                    assert promised <= set(row[row >= 0].tolist())
    if not policy.compresses_below_budget:
        np.testing.assert_array_equal(replay(trace, policy, T).metrics, replay(trace, parse_policy("full"), T).metrics)
