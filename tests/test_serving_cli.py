"""`kvsim serve-sim` end to end on a small workload: outputs, quality join, kernel fit, CSV replay, errors."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("policies.core.registry")

from policies import PolicyError  # noqa: E402
from sim.commands import serve_sim_cmd as serve_sim  # noqa: E402
from sim.serving import ServingConfigError, WorkloadError  # noqa: E402


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvsim")
    serve_sim.register(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["serve-sim", *argv])
    return args.func(args)


def test_serve_sim_writes_results_plots_and_joins_quality(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    pd.DataFrame({"policy": ["streaming_llm", "streaming_llm"], "budget": [64, 256],
                  "err_mean": [0.3, 0.1], "mass_mean": [0.6, 0.9]}).to_parquet("q.parquet")
    kernels = [{"device": "H100", "length": n, "batch": 1, "bytes": n * 4096, "time_s": 1e-5 + n * 4096 / 2e12}
               for n in (128, 1024, 8192)]
    (tmp_path / "k.json").write_text(json.dumps(kernels))
    rc = cli("--policies", "full;streaming_llm", "--budgets", "64,256",
             "--requests", "150", "--rate", "20", "--prompt-mean", "300", "--output-mean", "40",
             "--quality", "q.parquet", "--kernel-timings", "k.json", "--out", "out", "--quiet")
    assert rc == 0
    df = pd.read_csv(tmp_path / "out" / "serving.csv")
    assert df["label"].tolist() == ["full", "streaming_llm@64", "streaming_llm@256"]
    assert df["completed"].tolist() == [150] * 3
    assert df["err_mean"].iloc[1:].tolist() == pytest.approx([0.3, 0.1]) and np.isnan(df["err_mean"].iloc[0])
    # a smaller cache reads fewer bytes per decode step: tokens come out no slower
    assert df["tpot_mean_s"].iloc[1] <= df["tpot_mean_s"].iloc[2] <= df["tpot_mean_s"].iloc[0]
    meta = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert meta["kernel_fit"]["bandwidth_Bps"] == pytest.approx(2e12) and "fit" in meta["cost_model"]
    for png in ("latency_cdf.png", "throughput_vs_budget.png"):
        assert (tmp_path / "out" / png).read_bytes()[:4] == b"\x89PNG"
    assert "streaming_llm@64" in capsys.readouterr().out


def test_serve_sim_csv_replay_and_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,100,5\n0.1,200,3\n")
    assert cli("--arrivals", "csv", "--trace-csv", "t.csv", "--policies", "full", "--out", "o", "--quiet") == 0
    assert pd.read_csv(tmp_path / "o" / "serving.csv")["completed"].tolist() == [2]
    (tmp_path / "bad.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,100,5\nsoon,200,3\n")
    with pytest.raises(WorkloadError, match="bad.csv:3: arrival_s 'soon'"):
        cli("--arrivals", "csv", "--trace-csv", "bad.csv", "--out", "o", "--quiet")
    with pytest.raises(ServingConfigError, match="--trace-csv"):
        cli("--arrivals", "csv", "--out", "o", "--quiet")
    with pytest.raises(PolicyError, match="param=value"):
        cli("--policies", "streaming_llm:sinks", "--out", "o", "--quiet")
    with pytest.raises(PolicyError, match="budget 1 is below"):
        cli("--policies", "streaming_llm", "--budgets", "1", "--out", "o", "--quiet")


def test_serve_sim_is_discovered_by_the_kvsim_cli(tmp_path, monkeypatch, capsys):
    from sim.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["serve-sim", "--policies", "streaming_llm", "--budgets", "128", "--requests", "40",
                 "--out", "o", "--quiet"]) == 0
    assert main(["serve-sim", "--model", "llama-2-7b", "--pool-gb", "0.001", "--requests", "5", "--policies", "full",
                 "--out", "o", "--quiet"]) == 0   # every request rejected: reported, not a crash
    assert pd.read_csv(tmp_path / "o" / "serving.csv")["rejected"].tolist() == [5]
    assert main(["serve-sim", "--gpu", "a100-80gb", "--memory-utilization", "0.1", "--out", "o", "--quiet"]) == 2
    assert "leave no KV memory" in capsys.readouterr().err
    # kernel timings are read only when named: a file where a checkout keeps them changes nothing without
    # --kernel-timings (the --gpu preset's costs, wherever kvsim runs); a named file that is unusable or missing
    # is an error that names it
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "kernels.json").write_text("[]")
    assert main(["serve-sim", "--policies", "full", "--requests", "5", "--out", "o", "--quiet"]) == 0
    assert "kernels.json" not in capsys.readouterr().err
    meta = json.loads((tmp_path / "o" / "serving.json").read_text())
    assert meta["kernel_fit"] is None and "fit" not in meta["cost_model"]
    assert main(["serve-sim", "--policies", "full", "--requests", "5", "--out", "o", "--quiet",
                 "--kernel-timings", "benchmarks/results/kernels.json"]) == 2
    assert "benchmarks/results/kernels.json" in capsys.readouterr().err
    assert main(["serve-sim", "--policies", "full", "--requests", "5", "--out", "o", "--quiet",
                 "--kernel-timings", "nowhere.json"]) == 2
    assert "nowhere.json: no such kernel timing file" in capsys.readouterr().err
