"""The simulate stage's replay of many cells at once (`sim.replay.cells`) gives every registered policy exactly the
results of replaying each (policy, budget) on its own: metrics, slots, allocations and kept sets, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from policies import get_policy, list_policies
from sim.replay.layer_inputs import load_layers
from sim.replay.policy_replay import replay
from sim.replay.cells import replay_cells
from sim.replay.plan import effective_chunk
from traces.synthetic import make_synthetic_trace

ALL = list_policies()


@pytest.fixture(scope="module")
def trace():
    # a hybrid model (a sliding layer between global ones), GQA groups of two, a prompt the budgets cut into
    return make_synthetic_trace("mixed", n_tokens=72, n_prompt=40, n_layers=3, n_q_heads=4, n_kv_heads=2,
                                head_dim=16, seed=11, windows=[None, 12, None], recall_every=5, recall_window=6,
                                segment=12, n_needle_queries=3, passkey_pos=1)


def assert_same(a, b):
    assert a.label == b.label and a.budget == b.budget
    np.testing.assert_array_equal(a.metrics, b.metrics)
    np.testing.assert_array_equal(a.slots, b.slots)
    np.testing.assert_array_equal(a.budgets, b.budgets)
    np.testing.assert_array_equal(a.layer_index, b.layer_index)
    assert (a.kept is None) == (b.kept is None)
    if a.kept is not None:
        np.testing.assert_array_equal(a.kept, b.kept)
        np.testing.assert_array_equal(a.kept_steps, b.kept_steps)
    assert a.summary() == b.summary()


def budgets_of(policy, trace):
    lo = policy.min_budget()
    return [b for b in sorted({lo, lo + 3, 20, 33}) if lo <= b <= trace.meta.n_tokens]


@pytest.mark.parametrize("sliding", ["keep", "compress"])
def test_every_policy_as_replayed_alone(trace, sliding):
    inputs = load_layers(trace)
    P, T = trace.meta.n_prompt, trace.meta.n_tokens
    cells = [(get_policy(name), b) for name in ALL for b in budgets_of(get_policy(name), trace)]
    done = {}
    for i, res in replay_cells(trace, cells, inputs=inputs, record_kept=(P - 2, T - P + 2), sliding=sliding):
        assert i not in done
        done[i] = res
    assert sorted(done) == list(range(len(cells)))
    for i, (policy, b) in enumerate(cells):
        alone = replay(trace, policy, b, inputs=load_layers(trace), record_kept=(P - 2, T - P + 2), sliding=sliding,
                       threads=1)
        assert_same(done[i], alone)


def test_small_batches_threads_and_chunks(trace):
    """One cell a batch, two threads over a layer's cells, a chunked prompt: still the one-by-one results."""
    inputs = load_layers(trace)
    chunkable = [name for name in ALL if effective_chunk(get_policy(name), 8) == 8 and not get_policy(name).is_oracle]
    cells = [(get_policy(name), b) for name in chunkable for b in budgets_of(get_policy(name), trace)[:2]]
    ticks = []
    got = dict(replay_cells(trace, cells, inputs=inputs, chunk=8, threads=2, batch_bytes=1,
                            on_progress=ticks.append))
    assert sum(ticks) == pytest.approx(len(cells))
    for i, (policy, b) in enumerate(cells):
        assert_same(got[i], replay(trace, policy, b, chunk=8, threads=1))


def test_bad_cell_fails_before_any_replay(trace):
    from sim.replay.plan import BudgetError

    cells = [(get_policy("h2o"), 8), (get_policy("h2o"), trace.meta.n_tokens + 1)]
    with pytest.raises(BudgetError):
        next(replay_cells(trace, cells))


def test_replay_budgets_of_every_step_policy_in_one_pass(trace):
    from sim.replay.policy_replay import replay_budgets, strategy_of

    P, T = trace.meta.n_prompt, trace.meta.n_tokens
    for name in ALL:
        policy = get_policy(name)
        if strategy_of(policy).one_pass:
            continue
        budgets = budgets_of(policy, trace)[::-1]             # any order: results come back in the order asked
        got = replay_budgets(trace, policy, budgets, record_kept=(P, T - P), threads=1)
        for b, res in zip(budgets, got):
            assert_same(res, replay(trace, policy, b, record_kept=(P, T - P), threads=1))


def test_an_in_process_sweep_hands_a_policys_budgets_over_together():
    from sim.experiments.executors import TraceRef, coalesce
    from sim.experiments.sweep import parse_policy_grid, plan

    ref = TraceRef("synthetic:mixed", n_tokens=64, n_prompt=16, n_layers=1, seed=1)
    jobs = plan([ref], parse_policy_grid("h2o;oracle;window"), [8, 16, 32])
    merged = coalesce(jobs)
    assert sorted((j.policy, j.budgets) for j in merged) == [("h2o", (8, 16, 32)), ("oracle", (8, 16, 32)),
                                                              ("window", (8, 16, 32))]
    assert sorted(k for j in merged for k in j.keys) == sorted(k for j in jobs for k in j.keys)


def test_engine_entry_points_are_keyed_by_everything_typeof_reads():
    """`sim.replay.engine.call_replay_layer` skips numba's per-call typing by keying compiled entry points on the arguments'
    fingerprint: arrays that numba types differently must never share one."""
    from collections import namedtuple

    from sim.replay.engine import _fingerprint

    a = np.zeros((4, 3), np.float32)
    ro = a.copy()
    ro.setflags(write=False)
    variants = [a, a.astype(np.float64), a[:, :2], np.asfortranarray(a), ro, a[None], a.ravel()]
    assert len({_fingerprint(x) for x in variants}) == len(variants)
    A, B = namedtuple("A", "x"), namedtuple("B", "x")
    assert _fingerprint(A(1)) != _fingerprint(B(1)) != _fingerprint((1,))
    assert _fingerprint(A(1)) != _fingerprint(A(1.0)) and _fingerprint(A(a)) == _fingerprint(A(a.copy()))


#: configurations whose budgets share the prompt's scores (plain scorers and chains around them)
SHARING = ("knorm", "qfilter", "expected_attention", "chunkkv", "ada(expected_attention)",
           "critical(expected_attention)", "ada(qfilter)", "critical(knorm)", "critical(lagkv)",
           "snapkv:window_size=8", "ada_pyramidkv:window_size=8", "critical(snapkv:window_size=8)")


def test_budgets_share_the_prompt_scores_with_the_same_results(trace):
    """The cells of one configuration score its prompt once per layer (``ScorerPolicy.with_prompt_scores``), and
    the prefill that copies those scores leaves what scoring the prompt itself leaves: the same kept sets, slot
    state and head fields, hence the same results as replaying each budget alone (whose prefill scores it)."""
    from sim.experiments.specs import parse_policy
    from sim.replay.step_plan import StepPlan, engine_kernels

    inputs = load_layers(trace)
    P = trace.meta.n_prompt
    snap = get_policy("snapkv", window_size=8)                     # its pooling reads the budget's window
    assert snap.prompt_bounds([9, 9]) == (8, 8) == snap.prompt_bounds([20, 33])
    assert snap.prompt_bounds([5, 20]) == (4, 8)
    assert get_policy("knorm").prompt_bounds([5, 20]) == ()         # reads no bound: every budget shares
    assert not get_policy("h2o").shares_prompt_scores()            # streams its prompt
    assert not get_policy("buzz").shares_prompt_scores()           # not a scorer
    for spec in SHARING:
        policy = parse_policy(spec)
        assert policy.shares_prompt_scores(), spec
        budgets = [b for b in budgets_of(policy, trace) if b < P]
        plan = StepPlan.make(trace, policy, budgets[-1], inputs=inputs)
        field = type(policy).scorer.given_field
        for j, layer in enumerate(plan.layers):
            own, shared = plan.head_init(j), plan.head_init(j, shared=True)
            assert own[0, field] == 0 and shared[0, field] == own.shape[1], spec
            li = inputs[layer]
            prefill = engine_kernels(policy)[1][0]
            outs = []
            for head in (own, shared):
                keep = np.ones((li.k.shape[1], P), np.uint8)
                slot = np.zeros((li.k.shape[1], P, policy.slot_fields))
                head = head.copy()
                prefill(policy.param_vector(li.attention), layer, plan.budgets[j], li.q[:P], li.k[:P], li.v[:P],
                        float(li.attention.scale), keep, slot, head)
                head = head[:, :own.shape[1]].copy()
                head[:, field] = 0          # the given field aside, the head state is the one scoring leaves
                outs.append((keep, slot, head))
            for a, b in zip(*outs):
                np.testing.assert_array_equal(a, b)
        got = dict(replay_cells(trace, [(policy, b) for b in budgets], inputs=inputs))
        for i, b in enumerate(budgets):
            assert_same(got[i], replay(trace, policy, b, inputs=load_layers(trace), threads=1))
