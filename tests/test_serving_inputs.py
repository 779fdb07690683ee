"""Serving inputs: workloads (CSV replay errors), kernel-timing fit, footprint tables, cost model, quality join."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from sim.serving import (CostModel, KernelTimingError, ServingConfigError, WorkloadError, bursty_workload,
                         fit_kernel_timings, get_gpu, get_model, kv_pool_bytes, load_csv_workload,
                         load_kernel_timings, memory_tables, poisson_workload, tabulate_footprint)
from sim.serving.quality import join_quality, load_quality


def write(tmp_path, text, name="w.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_csv_replay_sorts_and_reads(tmp_path):
    p = write(tmp_path, "arrival_s,prompt_tokens,output_tokens,extra\n2.5,100,10,x\n0.5,20,3,y\n")
    w = load_csv_workload(p)
    assert w.arrival.tolist() == [0.5, 2.5] and w.prompt.tolist() == [20, 100] and w.output.tolist() == [3, 10]
    assert w.max_context == 109


@pytest.mark.parametrize("body, needle", [
    ("arrival_s,prompt_tokens\n0,1\n", "missing column"),
    ("arrival_s,prompt_tokens,output_tokens\n0,10,5\nabc,10,5\n", ":3: arrival_s 'abc' is not a number"),
    ("arrival_s,prompt_tokens,output_tokens\n-1,10,5\n", ":2: arrival_s '-1' must be finite and >= 0"),
    ("arrival_s,prompt_tokens,output_tokens\n0,10.5,5\n", ":2: prompt_tokens '10.5' is not an integer"),
    ("arrival_s,prompt_tokens,output_tokens\n0,10,0\n", ":2: output_tokens must be >= 1"),
    ("arrival_s,prompt_tokens,output_tokens\n0,10\n", ":2: output_tokens None is not an integer"),
    ("arrival_s,prompt_tokens,output_tokens\n", "no requests"),
])
def test_csv_replay_bad_rows_name_the_problem(tmp_path, body, needle):
    with pytest.raises(WorkloadError) as e:
        load_csv_workload(write(tmp_path, body))
    assert needle in str(e.value) and "w.csv" in str(e.value)


def test_csv_missing_file(tmp_path):
    with pytest.raises(WorkloadError, match="no such workload file"):
        load_csv_workload(tmp_path / "nope.csv")


def test_generated_workloads_have_requested_statistics():
    w = poisson_workload(20_000, rate=5.0, prompt_mean=300, prompt_cv=0.5, output_mean=80, seed=1)
    gaps = np.diff(w.arrival)
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert w.prompt.mean() == pytest.approx(300, rel=0.03) and np.all(w.output == 80)
    b = bursty_workload(20_000, rate=5.0, burstiness=4.0, seed=1)
    bg = np.diff(b.arrival)
    assert bg.mean() == pytest.approx(0.2, rel=0.05)
    assert bg.var() / bg.mean() ** 2 == pytest.approx(4.0, rel=0.15)
    with pytest.raises(WorkloadError):
        poisson_workload(10, rate=0.0)


def synthetic_records(c0=2e-5, bw=2.5e12, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    recs = []
    for length in (256, 1024, 4096, 16384):
        for batch in (1, 8, 32):
            b = length * batch * 8 * 128 * 2 * 2
            t = (c0 + b / bw) * (1 + noise * rng.standard_normal())
            recs.append({"device": "H100", "length": length, "batch": batch, "bytes": b, "time_s": t})
    return recs


def test_fit_recovers_synthetic_parameters(tmp_path):
    recs = synthetic_records()
    recs.append({"device": "A100", "length": 1, "batch": 1, "bytes": 1e9, "time_s": 1.0})  # filtered out
    p = write(tmp_path, json.dumps(recs), "kernels.json")
    fit = fit_kernel_timings(load_kernel_timings(p), device="H100")
    assert fit.n_records == 12 and fit.r2 > 0.99
    assert fit.bandwidth == pytest.approx(2.5e12, rel=0.03)
    exact = fit_kernel_timings(synthetic_records(noise=0.0))
    assert exact.intercept_s == pytest.approx(2e-5, rel=1e-6) and exact.bandwidth == pytest.approx(2.5e12, rel=1e-9)


def test_fit_reads_the_kernel_benchmark_format(tmp_path):
    # benchmarks/kernels.py output: device at the top, attention rows with per-variant times and byte counts.
    rows = [dict(budget=b, batch=bs, bytes_no_scores=b * bs * 1024, bytes_scores=b * bs * 1200,
                 t_ours_scores_s=3e-6 + b * bs * 1024 / 2e12, t_ours_no_scores_s=2e-6 + b * bs * 1024 / 2.5e12,
                 t_sdpa_s=5e-6 + b * bs * 1024 / 2.2e12) for b in (256, 2048, 16384) for bs in (1, 16)]
    p = write(tmp_path, json.dumps({"benchmark": "kernels", "device": "NVIDIA H100 80GB HBM3", "attention": rows}),
              "kernels.json")
    fit = fit_kernel_timings(load_kernel_timings(p), device="NVIDIA H100 80GB HBM3")
    assert fit.bandwidth == pytest.approx(2e12) and fit.intercept_s == pytest.approx(3e-6)
    assert fit_kernel_timings(load_kernel_timings(p, "sdpa")).bandwidth == pytest.approx(2.2e12)
    with pytest.raises(KernelTimingError, match="unknown kernel variant"):
        load_kernel_timings(p, "cuda")
    rows[2].pop("t_ours_scores_s")
    with pytest.raises(KernelTimingError, match="attention row 2 has no field 't_ours_scores_s'"):
        load_kernel_timings(write(tmp_path, json.dumps({"device": "x", "attention": rows}), "k3.json"))


def test_fit_rejects_degenerate_and_bad_input(tmp_path):
    with pytest.raises(KernelTimingError, match="2 distinct"):
        fit_kernel_timings([{"bytes": 10, "time_s": 1.0}, {"bytes": 10, "time_s": 2.0}])
    with pytest.raises(KernelTimingError, match="does not grow"):
        fit_kernel_timings([{"bytes": 10, "time_s": 2.0}, {"bytes": 20, "time_s": 1.0}])
    with pytest.raises(KernelTimingError, match="devices present"):
        fit_kernel_timings(synthetic_records(), device="TPU")
    with pytest.raises(KernelTimingError, match="record 1 field 'time_s'"):
        load_kernel_timings(write(tmp_path, json.dumps([{"bytes": 1, "time_s": 1}, {"bytes": 2}]), "k.json"))
    with pytest.raises(KernelTimingError, match="not valid JSON"):
        load_kernel_timings(write(tmp_path, "{oops", "k2.json"))


def test_kernel_fit_replaces_attention_terms():
    m, g = get_model("llama-3-8b"), get_gpu("h100-sxm")
    base = CostModel.from_profile(m, g)
    fit = fit_kernel_timings(synthetic_records(noise=0.0))
    fitted = base.with_kernel_fit(fit, calls_per_step=m.n_layers)
    b = 1e9
    expected = m.n_layers * 2e-5 + b / 2.5e12 - b * base.kv_seconds_per_byte
    assert fitted.decode_time(b) - base.decode_time(b) == pytest.approx(expected)


def test_default_profile_numbers():
    m, g = get_model("llama-2-7b"), get_gpu("h100-sxm")
    assert m.bytes_per_slot == 32 * 32 * 128 * 2 * 2          # 0.5 MiB per token
    assert get_model("llama-3-8b").bytes_per_slot == 32 * 8 * 128 * 2 * 2
    c = CostModel.from_profile(m, g)
    bw = 3.35e12 * 0.8
    assert c.decode_time(0) == pytest.approx(1e-3 + 6.74e9 * 2 / bw)
    assert c.decode_time(bw) - c.decode_time(0) == pytest.approx(1.0)
    # prefill: linear in tokens plus the causal-attention quadratic term
    t1, t2 = c.prefill_time([1000]) - c.prefill_overhead_s, c.prefill_time([2000]) - c.prefill_overhead_s
    assert 2 * t1 < t2 < 4 * t1
    assert kv_pool_bytes(m, g, 0.9) == int(80e9 * 0.9 - 6.74e9 * 2)
    with pytest.raises(ServingConfigError, match="leave no KV memory"):
        kv_pool_bytes(m, g, 0.1)


def test_footprint_validation():
    with pytest.raises(ServingConfigError, match=r"footprint\(3\) = 4"):
        tabulate_footprint(lambda n: n + 1 if n == 3 else n, 10)
    with pytest.raises(ServingConfigError, match="integer"):
        tabulate_footprint(lambda n: n / 2, 10)
    with pytest.raises(ServingConfigError, match="accounting"):
        memory_tables(lambda n: n, get_model("llama-2-7b"), 10, accounting="pages")


def test_policy_registry_footprints():
    pytest.importorskip("policies.core.registry")
    from sim.serving.footprint import policy_footprint

    from policies.core.registry import get_policy

    fp, label, budget = policy_footprint(get_policy("full"), 128)
    assert budget is None and fp(1000) == 1000
    fp, label, budget = policy_footprint(get_policy("streaming_llm"), 128)
    assert budget == 128 and fp(1000) == 128 and fp(10) == 10 and label == "streaming_llm@128"


def test_quality_join_on_policy_and_budget(tmp_path):
    q = pd.DataFrame({"policy": ["h2o", "h2o", "h2o", "full", "full"], "budget": [128, 128, 512, 128, 512],
                      "err_mean": [0.2, 0.4, 0.1, 0.0, 0.0], "mass_mean": [0.7, 0.9, 0.95, 1.0, 1.0]})
    p = tmp_path / "q.parquet"
    q.to_parquet(p)
    s = pd.DataFrame({"policy": ["h2o", "h2o", "full", "tova"], "policy_label": ["h2o", "h2o", "full", "tova"],
                      "budget": [128, 512, np.nan, 128], "throughput_rps": [1.0, 2.0, 3.0, 4.0]})
    j = join_quality(s, load_quality(p))
    assert j["err_mean"].tolist()[:3] == pytest.approx([0.3, 0.1, 0.0])
    assert j["quality_rows"].tolist()[:3] == [2, 1, 2] and np.isnan(j["err_mean"].iloc[3])
    assert j["throughput_rps"].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_quality_join_reads_a_sweep_store_by_label_with_oracle_gap(tmp_path):
    from sim.experiments.store import ResultStore

    rows = [dict(key=f"k{i}", trace_id="t", policy=p, label=lab, budget=64, err_mean=e, mass_mean=m)
            for i, (p, lab, e, m) in enumerate([("h2o", "h2o", 0.3, 0.8), ("h2o", "h2o(recent_ratio=0.2)", 0.5, 0.7),
                                                ("oracle", "oracle", 0.1, 0.95)])]
    ResultStore(tmp_path / "store").add(rows)
    quality = load_quality(tmp_path / "store")
    s = pd.DataFrame({"policy": ["h2o", "h2o"], "policy_label": ["h2o", "h2o(recent_ratio=0.2)"],
                      "budget": [64, 64]})
    j = join_quality(s, quality)
    assert j["err_mean"].tolist() == pytest.approx([0.3, 0.5])
    assert j["err_gap"].tolist() == pytest.approx([0.2, 0.4]) and j["mass_gap"].tolist() == pytest.approx([0.15, 0.25])


def test_quality_bad_inputs(tmp_path):
    pd.DataFrame({"policy": ["x"], "budget": [1]}).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ServingConfigError, match="none of the quality columns"):
        load_quality(tmp_path / "bad.parquet")
    with pytest.raises(ServingConfigError, match="cannot read as Parquet"):
        load_quality(write(tmp_path, "not parquet", "x.parquet"))
    with pytest.raises(ServingConfigError, match="no such quality results"):
        load_quality(tmp_path / "missing.parquet")
