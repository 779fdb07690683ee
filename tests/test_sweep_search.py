"""Sweeps, executors, search and reports: same rows everywhere, resumable, kill-safe."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from policies import PolicyError
from sim.cli import main
from sim.experiments.executors import Job, TraceRef, execute
from sim.experiments.search import run_search
from sim.experiments.store import ResultStore
from sim.experiments.sweep import expand_grid, parse_policy_grid, plan, run_sweep

REF = TraceRef("synthetic:mixed", n_tokens=96, n_prompt=16, n_layers=2, seed=1)
COLUMNS = ["key", "label", "budget", "mass_mean", "err_mean", "kl_mean", "slots_mean"]


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df[COLUMNS].sort_values("key").reset_index(drop=True)


def test_grid_expansion():
    labels = [p.label() for p in expand_grid("h2o:recent_ratio=0.1|0.5,group_reduce=mean|max")]
    assert len(labels) == 4 and "h2o(recent_ratio=0.1, group_reduce=max)" in labels
    assert len(parse_policy_grid("h2o;h2o;tova")) == 2
    with pytest.raises(PolicyError, match="expected param=value"):
        expand_grid("h2o:recent_ratio")


def test_oracle_budget_curve_is_one_job():
    jobs = plan([REF], parse_policy_grid("oracle;h2o"), [8, 16, 32])
    assert sorted(len(j.budgets) for j in jobs) == [1, 1, 1, 3]


def test_processes_equal_in_process(tmp_path):
    pols = parse_policy_grid("h2o;window;oracle")
    a = run_sweep([REF], pols, [8, 16], ResultStore(tmp_path / "a"), workers=1, progress=False)
    b = run_sweep([REF], pols, [8, 16], ResultStore(tmp_path / "b"), workers=2, progress=False)
    pd.testing.assert_frame_equal(_sorted(a), _sorted(b))


def test_ray_local_equals_local_processes(tmp_path, ray_local):
    pols = parse_policy_grid("tova;streaming_llm;oracle")
    a = run_sweep([REF], pols, [8, 16], ResultStore(tmp_path / "a"), workers=2, progress=False)
    b = run_sweep([REF], pols, [8, 16], ResultStore(tmp_path / "b"), ray_address="local", progress=False)
    pd.testing.assert_frame_equal(_sorted(a), _sorted(b))


def test_resume_skips_finished_rows(tmp_path):
    store = ResultStore(tmp_path / "s")
    run_sweep([REF], parse_policy_grid("h2o"), [8], store, progress=False)
    assert plan([REF], parse_policy_grid("h2o;window"), [8, 16], store.keys()) == \
        plan([REF], parse_policy_grid("h2o;window"), [8, 16], store.keys())
    todo = plan([REF], parse_policy_grid("h2o;window"), [8, 16], store.keys())
    assert sorted((j.policy, j.budgets) for j in todo) == [("h2o", (16,)), ("window", (8,)), ("window", (16,))]


_KILL_SCRIPT = """
import sys
from sim.experiments.executors import TraceRef
from sim.experiments.store import ResultStore
from sim.experiments.sweep import parse_policy_grid, run_sweep
ref = TraceRef("synthetic:mixed", n_tokens=160, n_prompt=16, n_layers=2, seed=2)
run_sweep([ref], parse_policy_grid("h2o:recent_ratio=0.1|0.3|0.5|0.7;window;tova;random;streaming_llm"),
          [8, 16, 32, 48], ResultStore(sys.argv[1]), workers=1, progress=False)
"""


def test_sigkill_at_random_points_then_resume_gives_exact_rows(tmp_path):
    store_dir = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    rng = np.random.default_rng(0)
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(store_dir)], env=env)
        time.sleep(float(rng.uniform(1.5, 4.0)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ResultStore(store_dir).load()                 # whatever was killed, the store still loads
    subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(store_dir)], env=env, check=True)
    df = ResultStore(store_dir).load()
    assert len(df) == 8 * 4 and df.key.is_unique
    assert not list(store_dir.glob(".part-*"))        # no partial files are ever visible as parts
    parts = pd.concat([pd.read_parquet(p) for p in ResultStore(store_dir).parts()])
    assert len(parts) == len(df)                      # nothing was written twice


def test_search_finds_and_reuses(tmp_path):
    store = ResultStore(tmp_path / "s")
    res = run_search(REF, "h2o", [8, 16], store, n_trials=6, progress=False)
    assert len(res.trials) == 6 and len(res.pareto) == 1
    assert res.pareto.loss.iloc[0] == res.trials.loss.min()
    n_rows = len(store.load())
    again = run_search(REF, "h2o", [8, 16], store, n_trials=6, progress=False)    # same seed: all cached
    assert len(store.load()) == n_rows
    pd.testing.assert_frame_equal(res.trials, again.trials)


def test_search_pareto_and_gap(tmp_path):
    res = run_search(REF, "streaming_llm", [8, 16, 32], ResultStore(tmp_path / "s"), n_trials=8,
                     multi_objective=True, objective="gap", progress=False)
    front = res.pareto
    assert len(front) >= 1 and (np.diff(front.kv_bytes_mean.to_numpy()) >= 0).all()
    assert (np.diff(front.loss.to_numpy()) <= 1e-12).all()          # more memory never costs more loss on it


def test_report_and_search_cli(tmp_path, capsys):
    res = tmp_path / "res"
    small = ["--tokens", "96", "--prompt", "16", "--layers", "1"]
    assert main(["sweep", "synthetic:zipf", *small, "--policies", "h2o;window;oracle", "--budgets", "8,16",
                 "--out", str(res), "--quiet", "--workers", "1"]) == 0
    assert main(["search", "synthetic:zipf", *small, "--policy", "h2o", "--budgets", "8,16", "--trials", "4",
                 "--pareto", "--out", str(res), "--quiet", "--workers", "1", "--plot", str(tmp_path / "s.png")]) == 0
    assert main(["report", str(res), "--out", str(tmp_path / "rep"), "--occupancy", "synthetic:zipf", *small,
                 "--budget", "8", "--policies", "h2o;window"]) == 0
    for name in ("report.html", "budget_curves.png", "pareto.png", "occupancy.png"):
        assert (tmp_path / "rep" / name).stat().st_size > 1000
    assert main(["report", str(tmp_path / "missing")]) == 2


def _trace_without_pass(tmp_path: Path) -> str:
    """A recorded (not synthetic) one-layer trace on disk without KVzip's context-reconstruction pass."""
    from traces.format import LayerArrays, LayerAttention, ModelInfo, TraceMeta, write_trace

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((24, h, 8)).astype(np.float32) for h in (2, 1, 1))
    meta = TraceMeta(ModelInfo("m", 1, 2, 1, 8, attention=(LayerAttention(rope_theta=1e4),)), 24, 16)
    return str(write_trace(tmp_path / "plain", meta, [LayerArrays(q, k, v)]))


def test_all_skips_what_a_trace_cannot_serve_and_explicit_names_fail_early(tmp_path, capsys):
    from sim.experiments.sweep import implicit_labels

    assert "kvzip" in implicit_labels("all") and "kvzip" not in implicit_labels("all;kvzip")
    assert implicit_labels("h2o;kvzip") == frozenset()
    ref = TraceRef(_trace_without_pass(tmp_path))
    policies = parse_policy_grid("kvzip;critical(kvzip);h2o")
    with pytest.raises(PolicyError, match=r"kvzip on trace .*kvsim record --kvzip"):
        run_sweep([ref], policies, [8], ResultStore(tmp_path / "explicit"), progress=False)
    assert ResultStore(tmp_path / "explicit").keys() == set()        # nothing ran
    df = run_sweep([ref], policies, [8], ResultStore(tmp_path / "all"), progress=False,
                   optional={"kvzip", "critical(kvzip)"})
    assert set(df.label) == {"h2o"}
    assert "skipping critical(kvzip)" in capsys.readouterr().err


def test_sweep_cli_all_on_a_trace_without_the_pass(tmp_path, capsys):
    path = _trace_without_pass(tmp_path)
    assert main(["sweep", path, "--policies", "all", "--budgets", "8", "--out", str(tmp_path / "r"), "--quiet"]) == 0
    out = capsys.readouterr()
    assert "skipping kvzip" in out.err and "h2o" in out.out


def test_report_occupancy_all_on_a_trace_without_the_pass(tmp_path, capsys):
    path = _trace_without_pass(tmp_path)
    store = tmp_path / "r"
    assert main(["sweep", path, "--policies", "h2o", "--budgets", "8", "--out", str(store), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["report", str(store), "--occupancy", path, "--policies", "all", "--budget", "8",
                 "--out", str(tmp_path / "rep")]) == 0
    err = capsys.readouterr().err
    assert "skipping kvzip" in err and "skipping buzz: budget 8" in err
    assert (tmp_path / "rep" / "occupancy.png").exists()
    # named: an error that says what to do, before any replay
    assert main(["report", str(store), "--occupancy", path, "--policies", "h2o;kvzip", "--budget", "8",
                 "--out", str(tmp_path / "rep2")]) != 0
    assert "kvsim record --kvzip" in capsys.readouterr().err and not (tmp_path / "rep2" / "occupancy.png").exists()


def test_opening_a_store_removes_the_temp_files_of_killed_writers_only(tmp_path):
    """A writer killed between its temporary file and the rename leaves a hidden file; opening the store removes
    those of this host's dead processes and keeps a live writer's."""
    import socket

    store = ResultStore(tmp_path / "s")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    stale = store.root / f".part-{host}-{int(dead.stdout)}-abc.tmp"
    live = store.root / f".part-{host}-{os.getpid()}-def.tmp"
    other_host = store.root / f".part-elsewhere-{int(dead.stdout)}-ghi.tmp"
    for f in (stale, live, other_host):
        f.write_bytes(b"partial")
    ResultStore(store.root)
    assert not stale.exists() and live.exists() and other_host.exists()
