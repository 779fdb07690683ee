"""Serving DES: hand-computed schedule, queueing theory (M/D/1, Little's law), preemption, invariants,
and equality of the aggregated and per-iteration modes."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.serving import (CostModel, ModelMemory, SchedulerConfig, Workload, memory_tables, poisson_workload,
                         simulate, summarize)
from sim.serving.run_summary import latencies

# 1 layer, 1 KV head, head_dim 1, 1-byte dtype: one slot = 2 bytes (K and V), so byte counts are easy by hand.
TINY = ModelMemory("tiny", n_layers=1, n_q_heads=1, n_kv_heads=1, head_dim=1, n_params=1.0, dtype_bytes=1)


def hand_cost(step: float = 0.01, per_byte: float = 0.001, prefill_fixed: float = 0.1,
              per_token: float = 0.01) -> CostModel:
    """decode = step + per_byte * bytes read; prefill = prefill_fixed + per_token * prompt tokens."""
    return CostModel(step_overhead_s=step, weight_time_s=0.0, kv_seconds_per_byte=per_byte,
                     prefill_overhead_s=prefill_fixed, flops_per_token=per_token, attn_flops_coef=0.0,
                     seconds_per_flop=1.0)


def run(w, fp=lambda n: n, cost=None, model=TINY, **cfg):
    tables = memory_tables(fp, model, w.max_context, prefill_peak=cfg.pop("prefill_peak", "full"),
                           accounting=cfg.pop("accounting", "varlen"), block_size=cfg.pop("block_size", 16))
    return simulate(w, tables, cost or hand_cost(), SchedulerConfig(**cfg))


@pytest.mark.parametrize("agg", [1, 1024])
def test_hand_computed_schedule_infinite_memory(agg):
    # A: t=0, P=10, O=3.  B: t=0.15, P=20, O=2.  Full cache, infinite memory.
    # t=0     prefill A: 0.1 + 0.01*10 = 0.2            -> A token 1 at 0.2 (TTFT 0.2), cache 10
    # t=0.2   B waiting since 0.15, prefill B: 0.1 + 0.2 -> B token 1 at 0.5 (TTFT 0.35), cache 20
    # t=0.5   decode A,B: caches 11, 21 -> 64 bytes -> 0.01 + 0.064 = 0.074 -> 0.574: B done (2 tokens)
    # t=0.574 decode A: cache 12 -> 24 bytes -> 0.034 -> 0.608: A done (3 tokens)
    w = Workload(np.array([0.0, 0.15]), np.array([10, 20]), np.array([3, 2]))
    r = run(w, aggregate_steps=agg)
    np.testing.assert_allclose(r.admitted, [0.0, 0.2])
    np.testing.assert_allclose(r.first_token, [0.2, 0.5])
    np.testing.assert_allclose(r.finish, [0.608, 0.574])
    lat = latencies(r)
    np.testing.assert_allclose(lat["ttft"], [0.2, 0.35])
    np.testing.assert_allclose(lat["tpot"], [(0.608 - 0.2) / 2, 0.074])
    assert (r.decode_iterations, r.prefill_iterations) == (2, 2)
    assert r.preemptions.sum() == 0 and not r.rejected.any()
    # held bytes: prefill A 20 B for 0.2 s; prefill B (A holds 20, B peaks 40) 0.3 s; 64 B 0.074 s; 24 B 0.034 s
    assert r.byte_seconds == pytest.approx(20 * 0.2 + 60 * 0.3 + 64 * 0.074 + 24 * 0.034)
    assert r.peak_bytes == 64


def test_hand_computed_schedule_bounded_footprint():
    # Same requests, footprint min(n, 5): decodes read 2*(5+5)=20 B (0.03 s) then 10 B (0.02 s).
    w = Workload(np.array([0.0, 0.15]), np.array([10, 20]), np.array([3, 2]))
    r = run(w, fp=lambda n: min(n, 5), aggregate_steps=1024)
    np.testing.assert_allclose(r.finish, [0.55, 0.53])


def test_md1_mean_wait_matches_pollaczek_khinchine():
    # One server (max_batch 1), every request only prefills (output 1) for exactly D seconds: M/D/1.
    lam, d = 0.7, 1.0
    w = poisson_workload(60_000, rate=lam, prompt_mean=100, output_mean=1, seed=3)
    cost = hand_cost(prefill_fixed=d, per_token=0.0)
    r = run(w, cost=cost, max_batch=1)
    rho = lam * d
    wq_theory = lam * d * d / (2 * (1 - rho))  # Pollaczek–Khinchine with E[S^2] = D^2
    wq = latencies(r)["queue"]
    assert wq.mean() == pytest.approx(wq_theory, rel=0.05)
    np.testing.assert_allclose(latencies(r)["ttft"] - wq, d)


def test_littles_law_on_long_run():
    # L (time-sampled number in system) = lambda * W on a long, stable, memory-limited run.
    w = poisson_workload(20_000, rate=6.0, prompt_mean=40, prompt_cv=0.5, output_mean=30, output_cv=0.8, seed=5)
    cost = hand_cost(step=0.02, per_byte=1e-5, prefill_fixed=0.01, per_token=1e-4)
    r = run(w, cost=cost, pool_bytes=2 * 1500, sample_interval=0.37, max_batch=64)
    assert np.isfinite(r.finish).all()
    t = r.samples[:, 0]
    horizon = w.arrival[-1]
    l_sampled = r.samples[t <= horizon, 1].mean()
    lam = len(w) / horizon
    w_mean = (r.finish - w.arrival).mean()
    assert l_sampled == pytest.approx(lam * w_mean, rel=0.03)
    s = summarize(r)
    assert s["mean_in_system"] == pytest.approx(l_sampled, rel=0.03)


def test_preemption_when_memory_runs_out():
    # 4 requests of P=10 admitted together (peak 80 B of a 120 B pool); each decode adds 8 B in total, so after
    # 5 iterations (120 B) the next one would not fit: the most recently admitted request is preempted.
    w = Workload(np.zeros(4), np.full(4, 10), np.full(4, 20))
    r = run(w, pool_bytes=120, admit_watermark=0.0, max_batch=8)
    assert r.preemptions.sum() > 0
    assert r.preemptions[3] >= 1 and r.preemptions[0] == 0
    assert np.isfinite(r.finish).all() and r.peak_bytes <= 120
    # a preempted request keeps its first TTFT and recomputes its context
    assert r.first_token[3] < r.finish[3]


def test_no_preemption_with_bounded_footprint():
    # The same workload fits without preemption when the policy caps the cache at 12 slots.
    w = Workload(np.zeros(4), np.full(4, 10), np.full(4, 20))
    r = run(w, fp=lambda n: min(n, 12), pool_bytes=120, admit_watermark=0.0, prefill_peak="compressed")
    assert r.preemptions.sum() == 0 and r.peak_bytes <= 120


def test_request_larger_than_pool_is_rejected():
    w = Workload(np.array([0.0, 1.0]), np.array([10, 100]), np.array([5, 5]))
    r = run(w, pool_bytes=100, admit_watermark=0.0)
    assert r.rejected.tolist() == [False, True]
    assert np.isfinite(r.finish[0]) and np.isnan(r.finish[1])
    assert summarize(r)["rejected"] == 1


def test_block_accounting_rounds_up():
    t = memory_tables(lambda n: min(n, 5), TINY, 20, accounting="block", block_size=4, prefill_peak="compressed")
    assert t.held[1] == 8 and t.held[5] == 16 and t.held[20] == 16   # ceil(slots/4)*4 slots * 2 B
    assert t.read[5] == 10                                            # attention reads only real slots
    full = memory_tables(lambda n: min(n, 5), TINY, 20, prefill_peak="full")
    assert full.peak[20] == 40 and full.held[20] == 10


@st.composite
def cases(draw):
    n = draw(st.integers(1, 25))
    gaps = draw(st.lists(st.floats(0, 0.3), min_size=n, max_size=n))
    prompt = draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    output = draw(st.lists(st.integers(1, 25), min_size=n, max_size=n))
    budget = draw(st.integers(2, 60))
    family = draw(st.sampled_from(["min", "sawtooth", "log_growth"]))
    pool = draw(st.integers(20, 300))
    peak = draw(st.sampled_from(["full", "compressed"]))
    acct = draw(st.sampled_from(["varlen", "block"]))
    max_batch = draw(st.integers(1, 8))
    w = Workload(np.cumsum(gaps), np.array(prompt), np.array(output))
    return w, footprint_family(family, budget), pool, peak, acct, max_batch


def footprint_family(family, b):
    """Footprint shapes policies produce: capped (most), sawtooth (BUZZ threshold buffering: fill to b, sample
    down to b/2, refill), slowly growing (BUZZ log-n / Cascading-like coverage)."""
    if family == "min":
        return lambda n: min(n, b)
    if family == "sawtooth":
        h = b // 2
        return lambda n: n if n <= b else h + (n - b) % (b - h + 1)
    return lambda n: min(n, b + int(np.log2(n)))


@given(cases())
@settings(max_examples=80, deadline=None)
def test_invariants_and_aggregation_equivalence(case):
    w, fp, pool, peak, acct, max_batch = case
    kw = dict(fp=fp, pool_bytes=pool, prefill_peak=peak, accounting=acct, block_size=4,
              max_batch=max_batch, max_batched_tokens=40)
    per_step = run(w, aggregate_steps=1, **kw)
    agg = run(w, aggregate_steps=1000, **kw)
    for name in ("admitted", "first_token", "finish", "preemptions", "rejected"):
        np.testing.assert_array_equal(getattr(per_step, name), getattr(agg, name), err_msg=name)
    assert per_step.decode_iterations == agg.decode_iterations
    assert per_step.byte_seconds == pytest.approx(agg.byte_seconds)
    assert agg.events <= per_step.events
    for r in (per_step, agg):
        assert r.peak_bytes <= pool                     # memory never exceeds the pool
        ok = ~r.rejected
        assert np.isfinite(r.finish[ok]).all()           # every admissible request completes
        assert np.all(w.arrival[ok] <= r.admitted[ok])
        assert np.all(r.admitted[ok] < r.first_token[ok])
        assert np.all(r.first_token[ok] <= r.finish[ok])


def test_aggregation_reduces_events_on_long_decodes():
    w = poisson_workload(300, rate=0.2, prompt_mean=50, output_mean=200, seed=1)
    cost = hand_cost(step=0.02, per_byte=1e-5, prefill_fixed=0.01, per_token=1e-4)
    a = run(w, cost=cost, aggregate_steps=1, pool_bytes=10_000)
    b = run(w, cost=cost, aggregate_steps=4096, pool_bytes=10_000)
    np.testing.assert_array_equal(a.finish, b.finish)
    assert b.events * 5 < a.events


def test_metrics_do_not_depend_on_the_trace_epoch():
    # A replayed trace with Unix-epoch timestamps gives the same throughput and latencies as one starting at 0.
    w = poisson_workload(200, rate=3.0, prompt_mean=20, output_mean=10, seed=2)
    cost = hand_cost(step=0.02, per_byte=1e-5, prefill_fixed=0.01, per_token=1e-4)
    shifted = Workload(w.arrival - w.arrival[0] + 1.7e9, w.prompt, w.output)
    a, b = summarize(run(w, cost=cost)), summarize(run(shifted, cost=cost))
    for key in ("throughput_rps", "e2e_p99_s", "ttft_mean_s", "mean_running"):
        assert a[key] == pytest.approx(b[key], rel=1e-4)
