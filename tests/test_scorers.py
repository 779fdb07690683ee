"""Scorers on the scorer base and the ada()/decoding() combinators: worked examples with exact kept sets,
combinator identities, spec round trips and numba's disk cache for the composed kernels."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from policies import PolicyError, get_policy
from policies.core.combinators import ada, decoding
from policies.core.scorer import ScorerPolicy
from sim.replay.policy_replay import replay
from sim.experiments.specs import parse_policy, policy_spec
from traces.synthetic import make_synthetic_trace

SCORERS = ["knorm", "keydiff", "lagkv:lag_size=8", "chunkkv:chunk_length=4,window_size=8"]


def run_step(spec, keys, budget, slot_state=None, values=None):
    """One decode step on explicit cached keys [Hkv, n, d] at positions 0..n-1; returns the keep mask."""
    pol = parse_policy(spec)
    keys = np.ascontiguousarray(keys, np.float32)
    hkv, n, _ = keys.shape
    values = keys.copy() if values is None else np.ascontiguousarray(values, np.float32)
    st = np.zeros((hkv, n, pol.slot_fields)) if slot_state is None else np.ascontiguousarray(slot_state, np.float64)
    keep = np.ones((hkv, n), np.uint8)
    pol.kernels()[0](pol.param_vector(), 0, n - 1, np.full(hkv, budget, np.int64), np.full(hkv, n, np.int64),
                     np.zeros((hkv, 1, n)), keys, values, np.tile(np.arange(n), (hkv, 1)), st,
                     np.zeros((hkv, pol.head_fields)), keep, np.full((hkv, n), -1, np.int64), np.ones((hkv, n)))
    return keep


def run_prefill(spec, k, budget, q=None, v=None):
    """The prefill kernel on explicit prompt keys [P, Hkv, d]; returns the keep mask [Hkv, P]."""
    pol = parse_policy(spec)
    k = np.ascontiguousarray(k, np.float32)
    P, hkv, _ = k.shape
    q = k.copy() if q is None else np.ascontiguousarray(q, np.float32)
    v = k.copy() if v is None else np.ascontiguousarray(v, np.float32)
    keep = np.ones((hkv, P), np.uint8)
    pol.kernels()[1](pol.param_vector(), 0, np.full(hkv, budget, np.int64), q, k, v, 1.0, keep,
                     np.zeros((hkv, P, pol.slot_fields)), np.zeros((hkv, pol.head_fields)))
    return keep


def kept(mask):
    return [set(np.flatnonzero(row).tolist()) for row in mask]


def test_knorm_keeps_lowest_norms_and_the_newest():
    norms = [3.0, 1.0, 2.0, 5.0, 4.0]
    keys = np.array([[[x, 0.0] for x in norms]])
    assert kept(run_step("knorm", keys, 3)) == [{1, 2, 4}]             # 4 is the newest: protected
    assert kept(run_prefill("knorm", keys.transpose(1, 0, 2), 3)) == [{1, 2, 4}]
    assert kept(run_step("knorm:n_sink=1", keys, 3)) == [{0, 1, 4}]    # sink 0 kept despite its norm


def test_keydiff_keeps_the_distinct_key():
    keys = np.array([[[1, 0], [1, 0.05], [0, 1], [1, -0.05], [1, 0]]], np.float64)
    assert kept(run_step("keydiff", keys, 2)) == [{2, 4}]
    assert kept(run_prefill("keydiff", keys.transpose(1, 0, 2), 2)) == [{2, 4}]


def test_chunkkv_evicts_whole_chunks_by_summed_score():
    base = np.array([1, 1, 5, 0, 0, 0, 3, 3], np.float64)           # chunks {0,1}=2 {2,3}=5 {4,5}=0 {6,7}=6
    st = base.reshape(1, 8, 1)
    keep = run_step("chunkkv:chunk_length=2", np.ones((1, 8, 2)), 4, slot_state=st)
    assert kept(keep) == [{2, 3, 6, 7}]


def lagkv_reference(k, v, n_sink, lag):
    """Independent numpy LagKV scores for one head's prompt [P, d] (sinks and the tail +inf)."""
    P = k.shape[0]
    out = np.full(P, np.inf)
    starts = list(range(n_sink, P, lag))
    for a, b in zip(starts, starts[1:]):
        ref = slice(b, min(b + lag, P))
        total = 0
        for x in (k, v):
            lo, hi = x[ref].min(0), x[ref].max(0)
            s = ((x[a:b] - lo) / (hi - lo + 1e-6)).std(1)
            total = total + np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        out[a:b] = total
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lagkv_prompt_matches_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    P, d, budget = 27, 6, 12
    k = rng.standard_normal((P, 1, d)).astype(np.float32)
    v = rng.standard_normal((P, 1, d)).astype(np.float32)
    score = lagkv_reference(k[:, 0].astype(np.float64), v[:, 0].astype(np.float64), 2, 5)
    cand = [i for i in np.argsort(score, kind="stable") if 2 <= i < P - 1]
    expect = set(range(P)) - set(int(i) for i in cand[:P - budget])
    assert kept(run_prefill("lagkv:n_sink=2,lag_size=5", k, budget, v=v)) == [expect]


def _kept_per_step(res):
    return [[[set(r[r >= 0].tolist()) for r in step] for step in layer] for layer in res.kept]


@pytest.fixture(scope="module")
def trace():
    return make_synthetic_trace("mixed", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=96,
                                n_prompt=48, seed=3)


@pytest.mark.parametrize("spec", SCORERS)
def test_decoding_every_one_is_per_step_eviction(trace, spec):
    wrapped = f"decoding({spec}, every=1)"
    a = replay(trace, parse_policy(spec), 20, record_kept=(48, 48))
    b = replay(trace, parse_policy(wrapped), 20, record_kept=(48, 48))
    assert _kept_per_step(a) == _kept_per_step(b)


@pytest.mark.parametrize("spec", SCORERS)
def test_ada_with_uniform_safeguard_is_the_scorer(trace, spec):
    a = replay(trace, parse_policy(spec), 20, record_kept=(48, 48))
    b = replay(trace, parse_policy(f"ada({spec}, floor_alpha=1)"), 20, record_kept=(48, 48))
    assert _kept_per_step(a) == _kept_per_step(b)


@pytest.mark.parametrize("spec, name", [("ada(snapkv:window_size=8, floor_alpha=0.3)", "ada_snapkv"),
                                        ("ada(pyramidkv:window_size=8, decode_alloc=flat)", "ada_pyramidkv"),
                                        ("ada(h2o:recent_ratio=0.25, floor_alpha=0.2)", "ada_h2o")])
def test_the_ada_names_are_ada_over_the_scorer(trace, spec, name):
    pol = parse_policy(spec)
    alias = get_policy(name, **pol.params)
    assert isinstance(alias, type(pol)) and alias.label() != pol.label()
    a = replay(trace, pol, 20, record_kept=(0, 96))
    b = replay(trace, alias, 20, record_kept=(0, 96))
    assert _kept_per_step(a) == _kept_per_step(b)
    assert parse_policy(policy_spec(alias)).label() == alias.label()


def test_ada_reallocates_across_heads_within_the_layer_budget(trace):
    res = replay(trace, parse_policy("ada(knorm, floor_alpha=0)"), 20)
    assert (res.slots.sum(axis=2) <= 40).all()
    assert (res.slots[:, :, 0] != res.slots[:, :, 1]).any()          # heads hold different sizes


def test_decoding_grows_then_compresses_to_target(trace):
    pol = parse_policy("decoding(knorm, every=4, target=10)")
    assert pol.min_budget() == 13
    res = replay(trace, pol, 13)
    slots = res.slots[0, :, 0]
    assert slots.max() == 13 and slots.min() == 10
    assert slots[:8].tolist() == [11, 12, 13, 10, 11, 12, 13, 10]
    with pytest.raises(PolicyError, match="minimum 13"):
        replay(trace, pol, 12)


def test_specs_round_trip_and_python_api():
    for spec in ["knorm", "lagkv:lag_size=16", "ada(knorm)", "ada(chunkkv:chunk_length=10, floor_alpha=0.2)",
                 "decoding(keydiff:n_sink=4, every=8, target=32)"]:
        pol = parse_policy(spec)
        assert parse_policy(policy_spec(pol)).params == pol.params
        again = get_policy(pol.name, **pol.params)                  # how sweep workers rebuild it
        assert again.params == pol.params and type(again) is type(pol)
    api = ada(get_policy("knorm", n_sink=2), floor_alpha=0.3)
    assert api.name == "ada(knorm)" and api.params == {"n_sink": 2, "n_recent": 1, "floor_alpha": 0.3,
                                                       "decode_alloc": "fixed", "rounding": "largest_remainder"}
    assert decoding("knorm", every=2).label() == "decoding(knorm, every=2)"
    assert get_policy("ada(knorm)").head_adaptive and isinstance(get_policy("decoding(knorm)"), ScorerPolicy)


@pytest.mark.parametrize("bad, msg", [("ada(cascading)", "not a scorer"),
                                      ("ada(ada(knorm))", "appears twice"),
                                      ("ada(knorm", "unbalanced"), ("wrap(knorm)", "unknown combinator"),
                                      ("ada(knorm, floor_alpha=2)", "above the maximum"),
                                      ("ada(knorm:floor_alpha=0.1, floor_alpha=0.2)", "given twice"),
                                      ("decoding(knorm, every=2, target=0.5)", "not an integer")])
def test_bad_specs_are_named(bad, msg):
    with pytest.raises(PolicyError, match=msg):
        parse_policy(bad)


def test_composed_kernels_load_from_disk_cache():
    code = ("import policies.knorm as m; from policies import get_policy; p = type(get_policy('ada(knorm)'));"
            "fs = [k.dispatcher for k in (m.Knorm.step_fn, m.Knorm.prefill_fn, p.step_fn, p.prefill_fn)];"
            "print(sum(sum(f.stats.cache_hits.values()) for f in fs),"
            " sum(sum(f.stats.cache_misses.values()) for f in fs))")
    for _ in range(2):   # the first run may compile; the second must load all four from disk
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["4", "0"]


def rope_matrix(pos, d, theta):
    """RoPE at ``pos`` as a d x d matrix, rotate-half layout: cos I + sin J (J maps x_j -> -x_{j+d/2})."""
    inv = theta ** (-np.arange(0, d, 2) / d)
    c, s = np.tile(np.cos(pos * inv), 2), np.tile(np.sin(pos * inv), 2)
    J = np.zeros((d, d))
    J[d // 2:, :d // 2], J[:d // 2, d // 2:] = np.eye(d // 2), -np.eye(d // 2)
    return np.diag(c) + s[:, None] * J


def expected_attention_reference(q, k, v, n_sink, n_future, theta):
    """Independent numpy Expected Attention prompt scores [Hkv, P] (sinks +inf)."""
    P, hq, d = q.shape
    hkv = k.shape[1]
    g_n = hq // hkv
    rbar = np.mean([rope_matrix(p, d, theta) for p in range(P, P + n_future)], axis=0)
    out = np.full((hkv, P), np.inf)
    for h in range(hkv):
        acc = 0
        for g in range(g_n):
            pre = np.stack([rope_matrix(r, d, theta).T @ q[r, h * g_n + g] for r in range(n_sink, P)])
            mu, cov = pre.mean(0), np.cov(pre.T, bias=True)
            mu, cov = rbar @ mu, rbar @ cov @ rbar.T
            kk = k[n_sink:, h].astype(np.float64)
            logits = kk @ mu / np.sqrt(d) + np.einsum("ni,ij,nj->n", kk, cov, kk) / d / 2
            acc = acc + np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum() / g_n
        out[h, n_sink:] = acc * np.linalg.norm(v[n_sink:, h].astype(np.float64), axis=1)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_expected_attention_prompt_matches_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    P, d, budget = 30, 8, 12
    q = rng.standard_normal((P, 4, d)).astype(np.float32)
    k = rng.standard_normal((P, 2, d)).astype(np.float32)
    v = rng.standard_normal((P, 2, d)).astype(np.float32)
    score = expected_attention_reference(q, k, v, 4, 16, 1e4)
    expect = []
    for h in range(2):
        cand = [i for i in np.argsort(score[h], kind="stable") if 4 <= i < P - 1]
        expect.append(set(range(P)) - set(int(i) for i in cand[:P - budget]))
    got = run_prefill("expected_attention:n_future_positions=16,rope_theta=10000", k, budget, q=q, v=v)
    assert kept(got) == expect


# ----- critical(): CriticalKV's W_O rescaling -----

def test_critical_projected_norm_and_two_stages_worked_example():
    from policies.core.stage_critical import critical_stages, wo_l1

    pol = parse_policy("critical(knorm)")
    # one KV head, two query heads, d = 2, hidden = 2: W_O^(0) = I, W_O^(1) = [[2, 0], [0, 0]]
    wo = np.array([[1.0, 0.0, 2.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    hs = pol.head_state_init(1, 2, wo)
    off = pol.head_offsets["critical"]
    assert hs.shape == (1, pol.head_fields + 2 * 4 // 2)          # W_O as float32 pairs in float64 slots
    assert hs[0, off:off + 3].tolist() == [pol.slot_fields - 1, 4, 2]   # its slot field, G*d, hidden
    # mean over the group of ||W_O^(j) v||_1: [1, 1] -> (2 + 2) / 2, [0, 1] -> (1 + 0) / 2
    assert wo_l1(hs, off, 0, np.array([[1.0, 1.0], [0.0, 1.0]], np.float32)) == pytest.approx([2.0, 0.5])
    odd = pol.head_state_init(1, 1, np.array([[1.0, -3.0, 0.5]]))  # 3 query heads of d = 1: one float32 of padding
    assert wo_l1(odd, off, 0, np.array([[2.0]], np.float32)) == pytest.approx([(2.0 + 6.0 + 1.0) / 3])
    # stage 1 keeps the top 0.5 x budget by plain score; the rest compete on (score + eps) * norm
    scores = np.array([[0.9, 0.5, 0.4, 0.3]])
    critical_stages(1e-4, 0.5, 2, 0, 4, np.arange(4), 0, 4, scores, np.array([1.0, 0.1, 1.0, 2.0]))
    assert scores[0, 0] == np.inf
    assert scores[0, 1:] == pytest.approx([(0.5 + 1e-4) * 0.1, (0.4 + 1e-4) * 1.0, (0.3 + 1e-4) * 2.0])


def test_critical_flips_a_choice_exactly_and_needs_wo():
    """knorm keeps the two smallest keys; critical(knorm) keeps the first stage (the smallest key) and then the
    token whose value W_O shrinks most, since (-norm + eps) * ||W_O v|| is closest to zero there (kvpress's
    rescaling of a negative score)."""
    pol = parse_policy("critical(knorm:n_recent=0)")
    k = np.array([[[a, 0.0]] for a in (1.0, 2.0, 3.0, 4.0)], np.float32)            # [P, Hkv=1, d=2]
    v = np.array([[[1.0, 0.0]], [[1.0, 0.0]], [[1.0, 0.0]], [[0.05, 0.0]]], np.float32)
    wo = np.array([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]])                     # two query heads
    keep = np.ones((1, 4), np.uint8)
    st = np.zeros((1, 4, pol.slot_fields))
    pol.kernels()[1](pol.param_vector(), 0, np.array([2]), np.repeat(k, 2, axis=1), k, v, 1.0, keep, st,
                     pol.head_state_init(1, 2, wo))
    assert kept(keep) == [{0, 3}]
    assert kept(run_prefill("knorm:n_recent=0", k, 2)) == [{0, 1}]
    assert st[0, :, -1] == pytest.approx([1.0, 1.0, 1.0, 0.05])                     # norms kept per slot
    with pytest.raises(PolicyError, match="needs the layer's output projection W_O"):
        pol.head_state_init(1, 2, None)


def test_critical_runs_on_a_trace_with_wo_and_is_refused_without(tmp_path):
    from traces.format import load_trace

    trace = make_synthetic_trace("mixed", n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=32, n_tokens=96,
                                 n_prompt=64)
    res = replay(trace, parse_policy("critical(expected_attention:use_vnorm=False)"), 24, threads=1)
    assert res.slots.max() <= 24
    plain = make_synthetic_trace("mixed", n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=32, n_tokens=96,
                                 n_prompt=64)
    path = plain.save(tmp_path / "t")
    import json
    m = json.loads((path / "manifest.json").read_text())
    assert m["has_wo"] is True
    # drop the W_O arrays the way an old trace lacks them
    m["has_wo"] = False
    m["arrays"] = {k: v for k, v in m["arrays"].items() if not k.endswith("wo.npy")}
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PolicyError, match="needs the layer's output projection W_O"):
        replay(load_trace(path), parse_policy("critical(knorm)"), 24, threads=1)


# ----- every score-based policy on the scorer base; combinators that nest -----

PORTED = ["h2o:recent_ratio=0.25", "tova", "tova:scope=head", "streaming_llm:n_sinks=2", "snapkv:window_size=8",
          "pyramidkv:window_size=8"]


@pytest.mark.parametrize("spec", SCORERS + PORTED)
def test_every_baseline_is_a_scorer_and_decoding_every_one_is_itself(trace, spec):
    assert isinstance(parse_policy(spec), ScorerPolicy)
    a = replay(trace, parse_policy(spec), 20, record_kept=(0, 96))
    b = replay(trace, parse_policy(f"decoding({spec}, every=1)"), 20, record_kept=(0, 96))
    assert _kept_per_step(a) == _kept_per_step(b)


@pytest.mark.parametrize("spec", SCORERS + [s for s in PORTED if not s.startswith("streaming")]
                         + ["ada(knorm, floor_alpha=0.2)", "ada_snapkv:window_size=8"])
def test_critical_with_first_stage_ratio_one_is_the_policy_inside(trace, spec):
    a = replay(trace, parse_policy(spec), 20, record_kept=(0, 96))
    b = replay(trace, parse_policy(f"critical({spec}, first_stage_ratio=1)"), 20, record_kept=(0, 96))
    assert _kept_per_step(a) == _kept_per_step(b)


NESTED = ["critical(ada(knorm))", "decoding(ada(snapkv:window_size=16), every=8)",
          "ada(critical(expected_attention:use_vnorm=False))", "decoding(critical(ada(knorm, floor_alpha=0.2)), every=4)",
          "ada(tova)", "decoding(snapkv, every=12)", "decoding(ada_snapkv:window_size=8, every=4)",
          "critical(ada_h2o:recent_ratio=0.25, first_stage_ratio=0.3)", "decoding(streaming_llm:n_sinks=2, every=5)"]


@pytest.mark.parametrize("spec", NESTED)
def test_nested_chains_run_within_budget_and_round_trip(trace, spec):
    pol = parse_policy(spec)
    assert policy_spec(pol) == spec and pol.label() == spec
    again = parse_policy(policy_spec(pol))
    assert type(again) is type(pol) and again.params == pol.params
    assert get_policy(pol.name, **pol.params).params == pol.params          # how sweep workers rebuild it
    budget = max(24, pol.min_budget())
    res = replay(trace, pol, budget)
    total = res.slots.sum(axis=2) if pol.head_adaptive else res.slots
    assert (total <= budget * (res.slots.shape[2] if pol.head_adaptive else 1)).all()
    assert 0 < res.summary()["mass_mean"] <= 1


def test_critical_over_ada_rescales_within_the_allocation_ada_over_critical_allocates_the_rescaled(trace):
    """critical(ada(x)) (kvpress's CriticalAdaKVPress) allocates on x's own scores: its heads hold exactly ada(x)'s
    sizes; ada(critical(x)) allocates on the rescaled scores, so its sizes differ."""
    plain = replay(trace, parse_policy("ada(knorm, floor_alpha=0)"), 20)
    outer = replay(trace, parse_policy("critical(ada(knorm, floor_alpha=0))"), 20)
    inner = replay(trace, parse_policy("ada(critical(knorm), floor_alpha=0)"), 20)
    np.testing.assert_array_equal(outer.slots, plain.slots)
    assert not np.array_equal(inner.slots, plain.slots)
    assert (outer.slots.sum(axis=2) <= 40).all() and (inner.slots.sum(axis=2) <= 40).all()


@pytest.mark.parametrize("bad, msg", [("decoding(decoding(knorm))", "appears twice"),
                                      ("critical(critical(knorm))", "appears twice"),
                                      ("ada(ada_snapkv)", "appears twice"),
                                      ("ada(decoding(knorm))", "must be the outermost"),
                                      ("critical(decoding(snapkv))", "must be the outermost"),
                                      ("ada(streaming_llm)", "position only"),
                                      ("critical(streaming_llm)", "position only"),
                                      ("decoding(cascading)", "not a scorer"),
                                      ("ada(bumblebee)", "not a scorer")])
def test_chains_that_make_no_sense_are_refused_with_the_reason(bad, msg):
    with pytest.raises(PolicyError, match=msg):
        parse_policy(bad)
