"""The simulator's cost model (`benchmarks/sim_cost.py`): the model side read from the last GPU check, the
comparison's arithmetic and its page section. The shortcut its long synthetic traces take (the reference of the
measured rows only, ``full_attention_reference(start=...)``) is the library's: test_full_attention_reference.py."""
from __future__ import annotations

import pytest

from benchmarks import docs_tables, sim_cost


def test_closed_loop_of_an_8b_geometry_comes_from_the_gpu_check():
    out = sim_cost.closed_loop_8b("llama3-8b", 4096)
    assert "gpu_check.json" in out["source"] and "32 layers" in out["source"]
    # the roofline is a floor: the measured closed loop cannot be faster
    assert 0 < out["floor_seconds"] < out["measured_seconds"]
    # qwen3-8b has more layers and parameters: more model time per cell
    assert sim_cost.closed_loop_8b("qwen3-8b", 4096)["floor_seconds"] > out["floor_seconds"]


def test_cells_per_run_in_time_and_in_cost():
    ctx = {"per_cell": {"h2o": {"replay_seconds": 2.0, "trace_only_seconds": 0.0}},
           "closed_loop": {"measured_seconds": 100.0, "floor_seconds": 1.0}}
    got = sim_cost.compare(ctx)["h2o"]
    assert got["cells_per_run_time_measured"] == pytest.approx(50.0)
    assert got["cells_per_run_time_floor"] == pytest.approx(0.5)
    gpu, cpu = sim_cost.PRICES["h100_gpu_hour"]["usd"], sim_cost.PRICES["cpu_core_hour"]["usd"]
    assert got["cells_per_run_cost_floor"] == pytest.approx(0.5 * gpu / cpu)


def test_speed_page_section(monkeypatch):
    model = {"n_prompt": 512, "n_decode": 128, "cells": 203, "simulate_seconds": 40.0, "record_seconds": 3.0,
             "sim_per_cell": 40.0 / 203, "simulate_seconds_all_losses": 80.0, "closed_per_cell": 4.0,
             "ratio": 4.0 / (40.0 / 203), "load": 1.0, "families": {"h2o": {"cells": 28, "seconds": 9.0}},
             "recommend_seconds": 700.0, "recommend_command": "kvsim recommend --threads 1", "recommend_model_runs": 45,
             "recommend_load": 2.0, "recommend_default_threads": {"seconds": 460.0, "command": "kvsim recommend",
                                                                  "model_runs": 45, "load": 1.9, "cores": 2,
                                                                  "stage_seconds": {"simulate": 300.0, "search": 120.0,
                                                                                    "certify": 20.0}},
             "recommend_first_run": {"seconds": 461.0, "stage_seconds": {"simulate": 256.0}, "peak_rss_gb": 5.7,
                                     "load": 1.0, "command": "kvsim recommend",
                                     "then_cached": {"seconds": 285.0, "stage_seconds": {"simulate": 101.0},
                                                     "peak_rss_gb": 5.0}}}
    ctx = {"budget": 512, "per_cell": {"h2o": {"replay_seconds": 60.0, "trace_only_seconds": 1.0}},
           "closed_loop": {"measured_seconds": 100.0, "floor_seconds": 1.5, "source": "the check"}}
    ctx["comparison"] = sim_cost.compare(ctx)
    data = {"models": {"smollm2-135m": model}, "prices": sim_cost.PRICES,
            "scale": {"llama3-8b": {"decode": 256, "contexts": {"4096": ctx}}}, "machine": {"load_avg_1min": 1.0}}
    monkeypatch.setattr(docs_tables, "load", lambda name: data if name == "sim_cost" else None)
    text = docs_tables.sim_cost_section()
    assert "| smollm2-135m | 512 + 128 | 203 |" in text
    assert "Where simulating first does not pay" in text and "h2o at 4096 + 256" in text
    assert "$2.99 per GPU-hour" in text
    assert "`kvsim recommend --threads 1`: 700 s end to end" in text
    assert "default threads (all 2 cores): `kvsim recommend`: 460 s" in text
    assert "from an empty numba cache" in text and "`kvsim recommend` 461 s end to end (simulating 256 s)" in text
    assert "kernels cached: 285 s (simulating 101 s), 5 GB" in text
    assert "of which simulating 300 s, the search (its closed-loop runs, refinement included) 120 s, certifying 20 s" \
        in text
