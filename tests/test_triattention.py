"""TriAttention: its scores, statistics and selection against a literal NumPy transcription of the released code's
formulas (github.com/WeianMao/triattention, ``methods/pruning_utils.py`` and ``methods/triattention.py``: RoPE
inverted on the keys, the trigonometric series over the geometric offset grid, the z-scores, the per-layer per-head
selection, the slack trigger), the whole decode against that code's schedule, the prompt rules, the closed loop
against the simulator, and the fuzzer on small schedules."""
from __future__ import annotations

import numpy as np
import pytest

from policies import get_policy
from policies.core.kvpress_press import NoKvpressPress, export
from policies.triattention import BLOCK, MAX_HALF, STATS, calibrate, frequencies, head_scores, raw_scores
from sim.experiments.fuzz import fuzz_policy
from sim.replay.policy_replay import replay
from traces.format import InMemoryTrace, LayerArrays, LayerAttention, ModelInfo, TraceMeta
from traces.reference import full_attention_reference

THETA = 1e4


# ---------------------------------------------------------------- the released formulas, written out in NumPy

def _rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def _cos_sin(pos, d, theta):
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = np.outer(np.asarray(pos, np.float64), inv)
    emb = np.concatenate([ang, ang], -1)
    return np.cos(emb), np.sin(emb)


def _apply_rope(x, pos, theta):
    c, s = _cos_sin(pos, x.shape[-1], theta)
    return x * c + _rotate_half(x) * s


def _invert_rope(y, pos, theta):
    c, s = _cos_sin(pos, y.shape[-1], theta)
    return y * c - _rotate_half(y) * s


def _pairs(x):
    h = x.shape[-1] // 2
    return x[..., :h] + 1j * x[..., h:]


def released_stats(q_rot, theta):
    """A query head's (mean complex pair, mean modulus) over rows [n, d] at positions 0..n-1 (calibrate.py)."""
    z = _pairs(_invert_rope(np.asarray(q_rot, np.float64), np.arange(len(q_rot)), theta))
    return z.mean(0), np.abs(z).mean(0)


def released_scores(k_rot, pos, r0, qmean, qabs, theta, max_length=65536, agg="mean", mlr=True, trig=True):
    """``score_keys_for_round`` after ``compute_frequency_statistics_from_means`` on the un-rotated keys."""
    d = k_rot.shape[-1]
    K = _pairs(_invert_rope(np.asarray(k_rot, np.float64), pos, theta))
    amp = np.abs(qmean) * np.abs(K)
    phi = np.angle(qmean * np.conj(K))
    extra = ((qabs - np.abs(qmean)) if mlr else qabs) * np.abs(K)
    omega = theta ** (-np.arange(0, d, 2) / d)
    offs = 2.0 ** np.arange(int(np.log2(max_length)) + 1)
    delta = (r0 - np.asarray(pos, np.float64))[:, None] + offs[None, :]
    base = (amp[:, None, :] * np.cos(delta[:, :, None] * omega + phi[:, None, :])).sum(-1)
    comb = extra.sum(-1, keepdims=True) + (base if trig else 0.0)
    return comb.mean(1) if agg == "mean" else comb.max(1)


def _z(s):
    return (s - s.mean()) / max(s.std(), 1e-6)


def released_decode(k_rot, q_rot, P, B, dl, theta, prefill_protected=True):
    """The released Hugging Face path at its experiment defaults, per-layer per-head pruning (one layer): kept
    positions of every KV head after each decode step. Its statistics are taken from the prompt's queries, as kvsim's
    (the released code reads them from a calibration file)."""
    T, hkv, _ = k_rot.shape
    g_n = q_rot.shape[1] // hkv
    stats = [released_stats(q_rot[:P, hq], theta) for hq in range(q_rot.shape[1])]
    prefix = P if prefill_protected else 0
    cache = [list(range(P)) for _ in range(hkv)]
    kept = []
    for t in range(P, T):
        for c in cache:
            c.append(t)
        n = len(cache[0])
        if n >= B + dl:                                            # the slack trigger, prompt counted
            start = min(prefix, n)
            budget_dec = max(0, B - start)
            if n - start == 0 or budget_dec == 0:
                cache = [c[:min(B, start)] for c in cache]
            else:
                keep_n = min(budget_dec, n - start)
                for h in range(hkv):
                    dec = np.array(cache[h][start:])
                    rows = [_z(released_scores(k_rot[dec, h], dec, t + 1, *stats[h * g_n + g], theta))
                            for g in range(g_n)]
                    agg = np.max(rows, axis=0)
                    top = np.argsort(-agg, kind="stable")[:keep_n]
                    cache[h] = cache[h][:start] + sorted(dec[top].tolist())
        kept.append([sorted(c) for c in cache])
    return kept


# ---------------------------------------------------------------- a small RoPE trace with concentrated queries

def rope_trace(T=72, P=12, hq=4, hkv=2, d=16, seed=0, theta=THETA):
    """Random pre-RoPE queries around a fixed non-zero centre per head (the paper's Q concentration) and random
    keys, both rotated at their positions; full-attention reference for the metrics."""
    rng = np.random.default_rng(seed)
    centre = rng.standard_normal((hq, d)) * 2.0
    q = centre[None] + 0.5 * rng.standard_normal((T, hq, d))
    k = rng.standard_normal((T, hkv, d)) + 0.5 * rng.standard_normal((1, hkv, d))
    pos = np.arange(T)
    q = np.stack([_apply_rope(q[:, h], pos, theta) for h in range(hq)], 1).astype(np.float32)
    k = np.stack([_apply_rope(k[:, h], pos, theta) for h in range(hkv)], 1).astype(np.float32)
    v = rng.standard_normal((T, hkv, d)).astype(np.float32)
    lse, o = full_attention_reference(q, k, v, d ** -0.5)
    model = ModelInfo("rope-test", 1, hq, hkv, d, attention=(LayerAttention(rope_theta=theta),))
    return InMemoryTrace(TraceMeta(model, T, P, kind="synthetic"), [LayerArrays(q, k, v, lse, o)])


@pytest.fixture(scope="module")
def trace():
    return rope_trace()


def _layer(trace):
    arr = trace.layer(0)
    return np.asarray(arr.q, np.float32), np.asarray(arr.k, np.float32)


def _kept(res, step, h):
    row = res.kept[0, step, h]
    return sorted(row[row >= 0].tolist())


# ---------------------------------------------------------------- the formulas

def test_calibration_equals_the_released_statistics(trace):
    q, _ = _layer(trace)
    P, hq, d = 12, q.shape[1], q.shape[2]
    hs = np.zeros((2, STATS + 8 * BLOCK))
    calibrate(np.ascontiguousarray(q[:P]), frequencies(d, THETA), 2, hs)
    assert (hs[:, 0] == P).all() and (hs[:, 1] == 1).all()
    for g in range(hq):
        mean, ab = released_stats(q[:P, g], THETA)
        base = STATS + (g % 2) * BLOCK
        row = hs[g // 2]
        np.testing.assert_allclose(row[base:base + d // 2] + 1j * row[base + MAX_HALF:base + MAX_HALF + d // 2],
                                   mean, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(row[base + 2 * MAX_HALF:base + 2 * MAX_HALF + d // 2], ab, rtol=1e-10)


@pytest.mark.parametrize("opts", [{}, {"offset_agg": "max"}, {"disable_mlr": True}, {"disable_trig": True},
                                  {"offset_max_length": 1000}])
def test_scores_equal_the_released_series_over_the_offset_grid(trace, opts):
    """kvsim scores the cached (post-RoPE) keys with one complex factor per frequency; the released code un-rotates
    them and sums the series at every offset: the same numbers."""
    q, k = _layer(trace)
    P, d = 12, q.shape[2]
    pol = get_policy("triattention", rope_theta=THETA, **opts)
    params = pol.param_vector()
    hs = np.zeros((2, pol.head_fields))
    calibrate(np.ascontiguousarray(q[:P]), frequencies(d, THETA), 2, hs)
    pos = np.arange(5, 60)
    r0 = 61
    ml = opts.get("offset_max_length", 65536)
    for g in range(4):
        h = g // 2
        keys = np.ascontiguousarray(k[:, h])
        out = np.empty(pos.size)
        raw_scores(params, frequencies(d, THETA), float(r0), hs[h], g % 2, keys, pos, out)
        want = released_scores(keys[pos], pos, r0, *released_stats(q[:P, g], THETA), THETA, max_length=ml,
                               agg=opts.get("offset_agg", "mean"), mlr=not opts.get("disable_mlr", False),
                               trig=not opts.get("disable_trig", False))
        np.testing.assert_allclose(out, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


def test_group_reduction_and_standardisation(trace):
    q, k = _layer(trace)
    P, d = 12, q.shape[2]
    hs = np.zeros((2, STATS + 8 * BLOCK))
    calibrate(np.ascontiguousarray(q[:P]), frequencies(d, THETA), 2, hs)
    pos = np.arange(20, 50)
    keys = np.ascontiguousarray(k[:, 1])
    raw = [released_scores(keys[pos], pos, 50, *released_stats(q[:P, 2 + g], THETA), THETA) for g in range(2)]
    for opts, want in [({}, np.maximum(_z(raw[0]), _z(raw[1]))), ({"group_agg": "mean"}, (_z(raw[0]) + _z(raw[1])) / 2),
                       ({"normalize": False}, np.maximum(raw[0], raw[1]))]:
        out = np.empty(pos.size)
        head_scores(get_policy("triattention", rope_theta=THETA, **opts).param_vector(), frequencies(d, THETA), 50.0,
                    hs[1], 2, keys, pos, out)
        np.testing.assert_allclose(out, want, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- the decode, against the released schedule

@pytest.mark.parametrize("protect", [True, False])
@pytest.mark.parametrize("B,dl", [(20, 8), (30, 5), (12, 1)])
def test_decode_equals_the_released_code_when_the_prompt_fits(trace, B, dl, protect):
    """Prompt (12 tokens) within the size kept: every kept set after every decode step equals the released code's
    (per-layer per-head pruning, slack trigger at B + divide_length, prompt counted; ``protect_prefill`` is its
    ``allow_prefill_compression=False``), at kvsim's budget B + divide_length - 1."""
    q, k = _layer(trace)
    P, T = trace.meta.n_prompt, trace.meta.n_tokens
    pol = get_policy("triattention", divide_length=dl, protect_prefill=protect)
    res = replay(trace, pol, B + dl - 1, record_kept=(P, T - P))
    want = released_decode(k, q, P, B, dl, THETA, prefill_protected=protect)
    for s in range(T - P):
        for h in range(2):
            assert _kept(res, s, h) == want[s][h], f"step {P + s} head {h}"
    assert res.slots.max() == B + dl - 1


def test_schedule_grows_to_the_budget_then_compresses(trace):
    P, T, dl, budget = 12, trace.meta.n_tokens, 8, 27
    res = replay(trace, get_policy("triattention", divide_length=dl), budget, record_kept=(P, T - P))
    sizes = [len(_kept(res, s, 0)) for s in range(T - P)]
    want, n = [], P
    for _ in range(T - P):
        n += 1
        n = budget - dl + 1 if n > budget else n
        want.append(n)
    assert sizes == want
    assert res.slots.max() <= budget


def test_a_protected_prompt_over_the_size_keeps_its_first_tokens(trace):
    """The released ``decode_budget == 0`` branch: the prompt's first tokens stay, every generated token goes at the
    next compression."""
    P, T, dl, budget = 12, trace.meta.n_tokens, 4, 9        # size after a compression: 6 < P
    res = replay(trace, get_policy("triattention", divide_length=dl), budget, record_kept=(P, T - P))
    for s in range(T - P):
        t = P + s
        for h in range(2):
            kept = _kept(res, s, h)
            gen = [x for x in kept if x >= P]
            assert [x for x in kept if x < P] == list(range(6))
            assert gen == list(range(t - len(gen) + 1, t + 1)) and len(kept) <= budget


def test_unprotected_prompt_competes_at_the_prefill(trace):
    """``protect_prefill=false`` and a prompt over the budget: compressed at the prefill by the scores of a next query
    at position P, every prompt token a candidate."""
    q, k = _layer(trace)
    P, dl, budget = 12, 4, 9
    res = replay(trace, get_policy("triattention", divide_length=dl, protect_prefill=False), budget,
                 record_kept=(P, 1))
    for h in range(2):
        rows = [_z(released_scores(k[:P, h], np.arange(P), P, *released_stats(q[:P, 2 * h + g], THETA), THETA))
                for g in range(2)]
        top = sorted(np.argsort(-np.max(rows, 0), kind="stable")[:budget - dl + 1].tolist())
        assert _kept(res, 0, h) == top + [P]


def test_recent_window_is_kept_and_budget_below_the_slack_is_refused(trace):
    P, T = 12, trace.meta.n_tokens
    pol = get_policy("triattention", divide_length=4, n_recent=3, protect_prefill=False)
    assert pol.min_budget() == 6
    res = replay(trace, pol, 8, record_kept=(P, T - P))
    for s in range(T - P):
        assert {P + s - 2, P + s - 1, P + s} <= set(_kept(res, s, 0))
    with pytest.raises(Exception, match="below its minimum 128"):
        replay(trace, get_policy("triattention"), 64)


def test_without_a_prompt_every_score_ties_and_the_oldest_go():
    tr = rope_trace(P=0, T=30)
    res = replay(tr, get_policy("triattention", divide_length=3, protect_prefill=False), 8, record_kept=(0, 30))
    assert _kept(res, 29, 0) == list(range(24, 30))


def test_no_kvpress_counterpart_and_export_refuses():
    pol = get_policy("triattention")
    with pytest.raises(NoKvpressPress, match="ships no TriAttention press"):
        pol.kvpress_press()
    with pytest.raises(NoKvpressPress, match="ships no TriAttention press"):
        export(pol, 256, 1024)


@pytest.mark.parametrize("params", [{"divide_length": 4}, {"divide_length": 2, "protect_prefill": False},
                                    {"divide_length": 3, "n_recent": 2, "offset_agg": "max", "group_agg": "mean"}])
def test_survives_fuzzing_on_small_schedules(params):
    report = fuzz_policy("triattention", params=params, max_examples=150, seed=0)
    assert report.failure is None, report.failure
    assert report.effective >= 0.9 * report.cases


# ---------------------------------------------------------------- closed loop = simulator

def test_closed_loop_kept_sets_equal_the_simulator(tmp_path):
    import torch

    from gpu_validate.closedloop.model_metrics import kept_set_agreement
    from tests.random_models import random_llama
    from traces.format import load_trace
    from traces.recorder import record_trace

    torch.set_num_threads(1)
    model = random_llama()
    ids = torch.randint(0, 101, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    record_trace(model, ids, tmp_path / "t", n_prompt=16, n_decode=32, teacher_forced=True, single_pass=True,
                 progress=False)
    tr = load_trace(tmp_path / "t")
    assert tr.meta.model.attention[0].rope_theta == 10000.0       # the layer's own base, read by rope_theta=-1
    for spec, budget in [({"divide_length": 4}, 20), ({"divide_length": 4, "protect_prefill": False}, 8),
                         ({"divide_length": 3, "protect_prefill": False, "offset_agg": "max"}, 12)]:
        out = kept_set_agreement(model, tr, get_policy("triattention", **spec), budget, 24)
        assert out["kept_agreement"] == 1.0, (spec, out)
