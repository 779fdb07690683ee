"""Cascading KV cache: worked examples with exact buffer contents, the effective-context claim (eq. 4),
capacity, footprint and the special cases the paper names (one cascade / base 1 = StreamingLLM)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import get_policy
from policies.core.base import PolicyError
from policies.cascading import _step, approximate_context_length, paper_gamma, pe_indices, sub_cache_sizes
from sim.replay.policy_replay import replay
from traces.synthetic import make_synthetic_trace


def drive(policy, budget, T, weight, hkv=2, g=2):
    """Call the jitted step as the engine does (append, step, compact) with attention ``weight(positions, t)``
    (unnormalised, identical for every head). Returns per step the held positions and the buffers' contents."""
    params = policy.param_vector()
    cap = budget + 1
    pos = np.full((hkv, cap), -1, np.int64)
    st_ = np.zeros((hkv, cap, policy.slot_fields))
    hs = np.zeros((hkv, policy.head_fields))
    kv = np.zeros((hkv, cap, 2), np.float32)
    keep = np.ones((hkv, cap), np.uint8)
    merge_to = np.full((hkv, cap), -1, np.int64)
    merge_w = np.ones((hkv, cap))
    n, out = 0, []
    for t in range(T):
        pos[:, n] = t
        st_[:, n] = 0.0
        n += 1
        w = np.asarray(weight(pos[0, :n].copy(), t), np.float64)
        probs = np.zeros((hkv, g, cap))
        probs[:, :, :n] = w / w.sum()
        _step(params, 0, t, np.full(hkv, budget, np.int64), np.full(hkv, n, np.int64), probs, kv, kv, pos, st_, hs,
              keep, merge_to, merge_w)
        assert (keep[:, :n] == keep[0, :n]).all(), "heads of a layer must take the same decision"
        assert (keep[0, :n] == 0).sum() <= 1
        idx = np.flatnonzero(keep[0, :n])
        n = len(idx)
        pos[:, :n] = pos[:, idx]
        st_[:, :n] = st_[:, idx]
        keep[:] = 1
        tags = st_[0, :n, 0]
        buffers = {"sinks": pos[0, :n][tags == 1].tolist()}
        for k in range(policy.params["n_cascades"]):
            buffers[f"C{k}"] = pos[0, :n][tags == 2 + k].tolist()
        out.append((pos[0, :n].tolist(), buffers))
    return out


uniform = lambda pos, t: np.ones(len(pos))


def test_paper_numbers():
    # Appendix B, Table 6: gamma 0.991 for |C|/N = 2048/4 and 0.995 for 4096/4; eq. 4: 7680 for |C| = 2048, N = 4
    # (the table truncates: 0.99551 is printed as 0.995)
    assert math.floor(paper_gamma(2048 + 4, 4, 4) * 1000) / 1000 == 0.991
    assert math.floor(paper_gamma(4096 + 4, 4, 4) * 1000) / 1000 == 0.995
    assert approximate_context_length(2048 + 4, 4, 4) == 7680
    assert approximate_context_length(1024 + 4, 4, 4) == 3840
    assert get_policy("cascading").gamma(2052) == pytest.approx(math.exp(-4 * math.log(100) / 2048))


def test_sizes_rounding():
    assert sub_cache_sizes(40, 4, 4) == [9, 9, 9, 9]
    assert sub_cache_sizes(38, 4, 4) == [9, 9, 8, 8]       # remainder to the newest sub-caches
    assert sum(sub_cache_sizes(1000, 4, 7)) == 996


def test_algorithm1_worked_example_uniform():
    # 1 sink, two sub-caches of 2; uniform attention: an older token always has the higher EMA, so the
    # token offered to a non-accepting C1 loses against C1's newest token (cases 3-4 of Figure 4)
    p = get_policy("cascading", n_sinks=1, n_cascades=2, warmup="algorithm1")
    out = drive(p, 5, 9, uniform)
    buf = [b for _, b in out]
    assert buf[0] == {"sinks": [0], "C0": [], "C1": []}
    assert buf[2] == {"sinks": [0], "C0": [1, 2], "C1": []}
    assert buf[3] == {"sinks": [0], "C0": [2, 3], "C1": [1]}      # t=3 odd: C1 not accepting but empty
    assert buf[4] == {"sinks": [0], "C0": [3, 4], "C1": [1, 2]}   # t=4 even: C1 accepts, has room
    assert buf[5] == {"sinks": [0], "C0": [4, 5], "C1": [1, 2]}   # 3 loses against 2
    assert buf[6] == {"sinks": [0], "C0": [5, 6], "C1": [2, 4]}   # accepts 4, 1 falls off the end
    assert buf[7] == {"sinks": [0], "C0": [6, 7], "C1": [2, 4]}   # 5 loses against 4
    assert buf[8] == {"sinks": [0], "C0": [7, 8], "C1": [4, 6]}
    assert out[8][0] == [0, 4, 6, 7, 8]


def test_algorithm1_worked_example_important_token_wins():
    # token 3 draws 10x the attention: offered to non-accepting C1 at t=5 it replaces C1's newest (2)
    p = get_policy("cascading", n_sinks=1, n_cascades=2, warmup="algorithm1")
    out = drive(p, 5, 9, lambda pos, t: np.where(pos == 3, 10.0, 1.0))
    buf = [b for _, b in out]
    assert buf[5] == {"sinks": [0], "C0": [4, 5], "C1": [1, 3]}
    assert buf[6] == {"sinks": [0], "C0": [5, 6], "C1": [3, 4]}
    assert buf[7] == {"sinks": [0], "C0": [6, 7], "C1": [3, 4]}
    assert buf[8] == {"sinks": [0], "C0": [7, 8], "C1": [4, 6]}   # the last sub-cache still ages 3 out


def test_keep_all_warmup_worked_example():
    # nothing is dropped until the cache overflows at t=5; the held tokens are then split by position
    p = get_policy("cascading", n_sinks=1, n_cascades=2)
    out = drive(p, 5, 9, uniform)
    assert [kept for kept, _ in out[:5]] == [list(range(t + 1)) for t in range(5)]
    assert out[4][1] == {"sinks": [], "C0": [], "C1": []}          # unassigned while warming up
    assert out[5][1] == {"sinks": [0], "C0": [4, 5], "C1": [1, 2]}  # 3 left C0 and lost against 2
    assert out[6][1] == {"sinks": [0], "C0": [5, 6], "C1": [2, 4]}
    assert out[7][1] == {"sinks": [0], "C0": [6, 7], "C1": [2, 4]}
    assert out[8][0] == [0, 4, 6, 7, 8]


def test_offers_clock_worked_example():
    # C1 accepts every other token offered to it (offers 0, 2, 4...) instead of on even steps
    p = get_policy("cascading", n_sinks=1, n_cascades=2, warmup="algorithm1", clock="offers")
    buf = [b for _, b in drive(p, 5, 9, uniform)]
    assert buf[3]["C1"] == [1]
    assert buf[4]["C1"] == [1]           # offer 1: 2 loses against 1
    assert buf[5]["C1"] == [1, 3]
    assert buf[6]["C1"] == [1, 3]
    assert buf[7]["C1"] == [3, 5]
    assert buf[8] == {"sinks": [0], "C0": [7, 8], "C1": [3, 5]}


def test_head_reduce_decides_for_all_heads():
    # one of four query heads attends strongly to token 3: enough under max and mean, not under the median
    # (the median ties 2 and 3, and a tie keeps the resident)
    def two_views(policy):
        params = policy.param_vector()
        budget, hkv, cap = 5, 2, 6
        pos = np.tile(np.array([0, 1, 2, 3, 4, 5, -1]), (hkv, 1))[:, :cap].copy()
        st_ = np.zeros((hkv, cap, 2))
        st_[:, :5, 0] = [1, 3, 3, 2, 2]      # sink, C1 = [1, 2], C0 = [3, 4]; 5 is new
        st_[:, :5, 1] = 0.1
        probs = np.full((hkv, 2, cap), 0.1)
        probs[1, 0, 3] = 5.0                   # head 1 looks at token 3
        keep = np.ones((hkv, cap), np.uint8)
        _step(params, 0, 5, np.full(hkv, budget, np.int64), np.full(hkv, cap, np.int64), probs,
              np.zeros((hkv, cap, 2), np.float32), np.zeros((hkv, cap, 2), np.float32), pos, st_,
              np.zeros((hkv, policy.head_fields)), keep, np.full((hkv, cap), -1, np.int64), np.ones((hkv, cap)))
        assert (keep[0] == keep[1]).all()
        return pos[0, keep[0] == 1].tolist()

    assert two_views(get_policy("cascading", n_sinks=1, n_cascades=2, head_reduce="max")) == [0, 1, 3, 4, 5]
    assert two_views(get_policy("cascading", n_sinks=1, n_cascades=2, head_reduce="mean")) == [0, 1, 3, 4, 5]
    assert two_views(get_policy("cascading", n_sinks=1, n_cascades=2, head_reduce="median")) == [0, 1, 2, 4, 5]


def test_pe_indices_paper_example():
    # Positional Encoding paragraph: cached [0, 1, 3, 5, 7, 8] get encodings [0, 1, 2, 3, 4, 5]
    assert pe_indices(np.array([0, 1, 3, 5, 7, 8])).tolist() == [0, 1, 2, 3, 4, 5]


def test_bad_parameters_are_named():
    with pytest.raises(PolicyError, match="cascading.n_cascades"):
        get_policy("cascading", n_cascades=0)
    with pytest.raises(PolicyError, match="cascading.head_reduce"):
        get_policy("cascading", head_reduce="sum")
    with pytest.raises(PolicyError, match="below its minimum 8"):
        get_policy("cascading").check_budget(7)


configs = st.tuples(st.integers(0, 4), st.integers(1, 4), st.integers(1, 5), st.integers(1, 3))


@settings(max_examples=25, deadline=None)
@given(cfg=configs, seed=st.integers(0, 2**16), kind=st.sampled_from(["uniform", "random", "recency"]),
       warmup=st.sampled_from(["keep_all", "algorithm1"]), clock=st.sampled_from(["step", "offers"]))
def test_capacity_never_exceeded(cfg, seed, kind, warmup, clock):
    n_sinks, n_casc, size, base = cfg
    budget = n_sinks + n_casc * size + (seed % n_casc)
    p = get_policy("cascading", n_sinks=n_sinks, n_cascades=n_casc, accept_base=base, warmup=warmup, clock=clock)
    r = np.random.default_rng(seed).random(400) * 10 + 0.01
    weight = {"uniform": uniform, "random": lambda pos, t: r[pos], "recency": lambda pos, t: np.exp(0.3 * (pos - t))}
    sizes = p.sizes(budget)
    for t, (kept, buf) in enumerate(drive(p, budget, 120, weight[kind], hkv=1, g=1)):
        assert len(kept) <= budget and len(kept) == p.footprint(budget, t + 1)
        assert len(buf["sinks"]) <= n_sinks
        assert all(len(buf[f"C{k}"]) <= sizes[k] for k in range(n_casc))
        assert set(range(min(t + 1, n_sinks))) <= set(kept)
        assert set(range(max(0, t - sizes[0] + 1), t + 1)) <= set(kept)


@settings(max_examples=25, deadline=None)
@given(cfg=configs, seed=st.integers(0, 2**16), kind=st.sampled_from(["uniform", "random", "recency"]))
def test_effective_context(cfg, seed, kind):
    """Eq. 4: once warm, the non-sink tokens span exactly up to L~ = sum_k |C_k| base^k positions back and never
    more, whatever the scores; token selection can shorten it by at most 2 (base^(N-1) - 1). StreamingLLM with
    the same total size spans |C| = budget - n_sinks <= L~."""
    n_sinks, n_casc, size, base = cfg
    budget = n_sinks + n_casc * size + (seed % n_casc)
    p = get_policy("cascading", n_sinks=n_sinks, n_cascades=n_casc, accept_base=base)
    L = approximate_context_length(budget, n_sinks, n_casc, base)
    slack = 2 * (base ** (n_casc - 1) - 1)
    r = np.random.default_rng(seed).random(4 * L + 2 * budget) * 10 + 0.01
    weight = {"uniform": uniform, "random": lambda pos, t: r[pos], "recency": lambda pos, t: np.exp(0.3 * (pos - t))}
    T = 4 * L + 2 * budget
    spans = []
    for t, (kept, _) in enumerate(drive(p, budget, T, weight[kind], hkv=1, g=1)):
        oldest = min(x for x in kept if x >= n_sinks) if t >= n_sinks else t
        span = t - oldest + 1
        assert span <= L                                    # no non-sink token survives beyond L~
        if t >= 2 * L + budget:
            spans.append(span)
            assert L - slack <= span <= L
    if kind == "uniform":   # the fixed heuristic pattern (an offered token never wins) reaches eq. 4 exactly
        assert max(spans) == L
    assert L >= budget - n_sinks                            # never shorter than the sink cache's window


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), n_casc=st.integers(1, 4), kind=st.sampled_from(["mixed", "passkey", "zipf"]))
def test_sink_cache_is_a_special_case(seed, n_casc, kind):
    # Section 3.1: one cascade (or every cascade accepting every token) is exactly the sink cache
    trace = make_synthetic_trace(kind, n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=90,
                                 n_prompt=10, seed=seed)
    budget = 4 + 3 * n_casc + seed % 5
    ref = replay(trace, get_policy("streaming_llm", n_sinks=4), budget)
    for params in ({"n_cascades": 1}, {"n_cascades": n_casc, "accept_base": 1}):
        res = replay(trace, get_policy("cascading", **params), budget)
        np.testing.assert_array_equal(res.metrics, ref.metrics)


@pytest.mark.parametrize("warmup", ["keep_all", "algorithm1"])
def test_footprint_matches_replay(warmup):
    trace = make_synthetic_trace("mixed", n_layers=1, n_tokens=160, n_prompt=0, head_dim=16, seed=3)
    p = get_policy("cascading", warmup=warmup)
    res = replay(trace, p, 40)
    want = [p.footprint(40, t + 1) for t in range(160)]
    assert (res.slots[0, :, 0] == want).all() and (res.slots[0, :, 1] == want).all()
    if warmup == "algorithm1":
        assert want[39] < 40        # the literal pseudocode under-fills: it drops tokens before the budget is used



@pytest.mark.parametrize("warmup", ["keep_all", "algorithm1"])
def test_window_prefill_worked_example(warmup):
    # 40 prompt tokens, budget 20 = 4 sinks + 4 x 4: the prefill keeps 0-3 and 24-39 (C0 = 36-39 ... C3 = 24-27);
    # at t = 40 every sub-cache accepts (40 is a multiple of 8): 36, 32, 28 move down one level and 24 drops
    trace = make_synthetic_trace("mixed", n_layers=1, n_tokens=48, n_prompt=40, head_dim=16, seed=0)
    res = replay(trace, get_policy("cascading", prefill="window", warmup=warmup), 20, record_kept=(40, 2))
    kept = lambda r: sorted(x for x in res.kept[0, r, 0].tolist() if x >= 0)
    assert kept(0) == [0, 1, 2, 3] + list(range(25, 41))
    assert (res.kept[0, :, 0] == res.kept[0, :, 1]).all()
    # t = 41 (odd): 37 leaves C0 and competes with C1's newest (36); whichever wins, 25-35 and 38-41 stay
    assert set([0, 1, 2, 3] + list(range(25, 36)) + list(range(38, 42))) <= set(kept(1))
    assert len(kept(1)) == 20


@pytest.mark.parametrize("params", [{"prefill": "window"}, {"warmup": "algorithm1", "clock": "offers"},
                                    {"head_reduce": "median", "n_cascades": 3, "accept_base": 3}])
def test_variants_match_numpy_reference_engine(params):
    from sim.replay.numpy_reference import reference_replay_layer
    from sim.replay.layer_inputs import load_layers

    trace = make_synthetic_trace("mixed", n_layers=1, n_tokens=80, n_prompt=30, head_dim=16, seed=5)
    p = get_policy("cascading", **params)
    res = replay(trace, p, 20)
    metrics, slots, _ = reference_replay_layer(p, 0, load_layers(trace)[0], res.budgets[0], 30,
                                               trace.meta.softmax_scale)
    np.testing.assert_array_equal(res.slots[0], slots)
    np.testing.assert_allclose(res.metrics[0][..., :4], metrics[..., :4], rtol=1e-4, atol=5e-5)


# --- the released code (jeffwillette/cascading_cache_2, cascade/models/cascading_cache.py) as preset=reference ---

def released_port(n_sinks, sub, n_casc, scores, gamma=0.9999):
    """A plain step-by-step reading of the released per-head cascade (written from the code, for these tests):
    per KV head, sinks first; every sub-cache accepts while t <= n_sinks + |C| (eager fill), afterwards
    sub-cache i accepts when (t - n_sinks) % 2^i == 0; an accepting full sub-cache takes the token and passes its
    oldest on; a non-accepting one overwrites its newest token when the incoming EMA is >= (ties: incoming).
    As in the released attention, every cached token's EMA and the new token's take this step's score
    scores[t][h][position] before the placement. Returns per step and head the sorted held positions."""
    T, H = len(scores), len(scores[0])
    cap = sub * n_casc
    out = []
    state = [dict(sinks=[], casc=[[] for _ in range(n_casc)], ema={}) for _ in range(H)]
    for t in range(T):
        row = []
        for h, s in enumerate(state):
            s["ema"][t] = 0.0
            for p in s["sinks"] + [p for c in s["casc"] for p in c] + [t]:
                s["ema"][p] = gamma * s["ema"][p] + (1 - gamma) * scores[t][h][p]
            if len(s["sinks"]) < n_sinks:
                s["sinks"].append(t)
            else:
                item = t
                for i in range(n_casc):
                    if t <= n_sinks + cap or (t - n_sinks) % 2 ** i == 0:
                        s["casc"][i].append(item)
                        if len(s["casc"][i]) <= sub:
                            break
                        item = s["casc"][i].pop(0)
                    elif not s["casc"][i]:
                        s["casc"][i].append(item)
                        break
                    else:
                        if s["ema"][item] >= s["ema"][s["casc"][i][-1]]:
                            s["casc"][i][-1] = item
                        break
            row.append(sorted(s["sinks"] + [p for c in s["casc"] for p in c]))
        out.append(row)
    return out


def drive_heads(policy, budget, scores, g=2):
    """The engine's loop (append, step, compact) with per-KV-head scores: every query head of KV head h gets
    scores[t][h][position] (so a group mean or max is that score). Returns per step and head the held positions."""
    hkv = len(scores[0])
    params = policy.param_vector()
    cap = budget + 1
    pos = np.full((hkv, cap), -1, np.int64)
    st_ = np.zeros((hkv, cap, policy.slot_fields))
    hs = np.zeros((hkv, policy.head_fields))
    kv = np.zeros((hkv, cap, 2), np.float32)
    lengths = np.zeros(hkv, np.int64)
    out = []
    for t in range(len(scores)):
        for h in range(hkv):
            pos[h, lengths[h]] = t
            st_[h, lengths[h]] = 0.0
        lengths += 1
        probs = np.zeros((hkv, g, cap))
        for h in range(hkv):
            probs[h, :, :lengths[h]] = np.asarray(scores[t][h])[pos[h, :lengths[h]]]
        keep = np.ones((hkv, cap), np.uint8)
        _step(params, 0, t, np.full(hkv, budget, np.int64), lengths.copy(), probs, kv, kv, pos, st_, hs, keep,
              np.full((hkv, cap), -1, np.int64), np.ones((hkv, cap)))
        row = []
        for h in range(hkv):
            idx = np.flatnonzero(keep[h, :lengths[h]])
            n = len(idx)
            pos[h, :n] = pos[h, idx]
            st_[h, :n] = st_[h, idx]
            lengths[h] = n
            row.append(pos[h, :n].tolist())
        out.append(row)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n_sinks,sub,n_casc", [(2, 2, 3), (4, 3, 4), (1, 4, 2), (3, 5, 3)])
def test_reference_preset_matches_the_released_cascade_every_step(seed, n_sinks, sub, n_casc):
    rng = np.random.default_rng(seed)
    T, H = 90, 2
    # scores on a coarse grid so that equal EMAs (ties) happen; heads differ, so they decide differently
    scores = rng.integers(0, 4, size=(T, H, T)).astype(np.float64) / 4
    pol = get_policy("cascading", preset="reference", n_sinks=n_sinks, n_cascades=n_casc)
    got = drive_heads(pol, n_sinks + sub * n_casc, scores)
    want = released_port(n_sinks, sub, n_casc, scores)
    assert got == want
    assert any(a[0] != a[1] for a in got)                            # the heads did decide on their own


def test_reference_pieces_each_matter():
    rng = np.random.default_rng(7)
    scores = rng.integers(0, 4, size=(90, 2, 90)).astype(np.float64) / 4
    want = released_port(2, 2, 3, scores)
    base = dict(preset="reference", n_sinks=2, n_cascades=3)
    for change in (dict(decision="layer"), dict(clock_phase="t"), dict(eager_fill=False), dict(ties="resident")):
        assert drive_heads(get_policy("cascading", **{**base, **change}), 8, scores) != want, change


def test_reference_worked_example_clock_phase_and_ties():
    # 1 sink, 2 sub-caches of 1 slot (budget 3), one KV head; every token gets the same score, so the token
    # cached longer has the higher EMA. t = 0: sink. t = 1, 2: fill C0, C1. t = 3 (= budget, first overflow):
    # eager, all accept: 3 -> C0, 2 -> C1, 1 dropped. t = 4: C0 takes 4, C1 accepts when (4 - 1) % 2 == 0:
    # no, so 3 (scored at t = 3, 4) competes with C1's 2 (scored at t = 2, 3, 4): 2 stays. t = 5: (5 - 1) % 2 == 0:
    # C1 accepts 4, drops 2.
    flat = np.ones((8, 1, 8))
    got = [row[0] for row in drive_heads(get_policy("cascading", preset="reference", n_sinks=1, n_cascades=2),
                                         3, flat)]
    assert got[:6] == [[0], [0, 1], [0, 1, 2], [0, 2, 3], [0, 2, 4], [0, 4, 5]]
    # an exact tie at t = 4 with gamma = 0.5: token 2 scores 0 at t = 2, then 1 (EMA .5 (.5 * .5 * 0 + .5) + .5),
    # token 3 scores 1 at t = 3, 4 (EMA .5 * .5 + .5): both .75; the incoming 3 wins (released `>=`)
    tie = np.ones((8, 1, 8))
    tie[2, 0, 2] = 0.0
    ref = dict(preset="reference", n_sinks=1, n_cascades=2, ema_gamma=0.5)
    assert drive_heads(get_policy("cascading", **ref), 3, tie)[4][0] == [0, 3, 4]
    assert drive_heads(get_policy("cascading", **ref, ties="resident"), 3, tie)[4][0] == [0, 2, 4]


@given(st.floats(min_value=-7e4, max_value=7e4, allow_nan=False) | st.floats(min_value=-1e-3, max_value=1e-3))
def test_round_to_float16_is_numpys_float16(x):
    from policies.cascading import round_to_float16

    with np.errstate(over="ignore"):          # beyond 65504 float16 is inf, as round_to_float16 says
        expect = float(np.float16(x))
    assert round_to_float16(x) == expect


def test_float16_score_store_freezes_small_increments_as_the_released_jobs():
    """At gamma = 0.9999 an update of a score of 0.5 by (1 - gamma) * 1.0 is below half a float16 step (2^-12):
    the stored score does not move; in float64 it does."""
    from policies.cascading import round_to_float16

    mu = 0.5
    step = 0.9999 * mu + 0.0001 * 1.0
    assert step != mu and round_to_float16(step) == mu
    trace = make_synthetic_trace("zipf", n_tokens=160, n_prompt=40, n_layers=1, head_dim=16, seed=1)
    a = replay(trace, get_policy("cascading", preset="reference"), 24, record_kept=(40, 120))
    b = replay(trace, get_policy("cascading", preset="reference", score_dtype="float16"), 24, record_kept=(40, 120))
    assert (b.slots <= 24).all() and not np.array_equal(a.kept, b.kept)
