"""The kvsim command line: help, replay, sweep (resumable), synth/inspect, demo, and clear errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from sim.cli import build_parser, main

SMALL = ["--tokens", "64", "--prompt", "8", "--layers", "1"]


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("demo", "policies", "replay", "sweep", "synth", "inspect"):
        assert cmd in out
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        assert parser.description, f"kvsim {name} has no description"


def _modules_after(code: str) -> set[str]:
    """The heavy modules a fresh interpreter has imported after running ``code``."""
    probe = code + "\nimport sys; print(' '.join(m for m in ('numba', 'torch', 'pandas', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_help_imports_no_numba_torch_or_pandas():
    """`kvsim --help` and `kvsim COMMAND --help` answer at once: building every parser imports none of them."""
    assert _modules_after("from sim.cli import build_parser; build_parser()") == set()


def test_listing_policies_compiles_no_kernel_and_imports_no_torch():
    """`kvsim policies` reads every policy's schema (combinators included) and compiles nothing."""
    code = ("import contextlib, io\nfrom sim.cli import main\nwith contextlib.redirect_stdout(io.StringIO()): "
            "main(['policies'])\nfrom policies import list_policies, policy_class\nfrom policies.core.base import Kernel\n"
            "ks = [f for n in list_policies() for f in (policy_class(n).step_fn, policy_class(n).prefill_fn) "
            "if isinstance(f, Kernel)]\nassert ks and all(k._dispatcher is None for k in ks), 'compiled at listing'")
    assert "torch" not in _modules_after(code)


def test_replay_json(capsys):
    assert main(["replay", "synthetic:zipf", *SMALL, "--policy", "h2o:recent_ratio=0.25", "--budget", "16",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["label"] == "h2o(recent_ratio=0.25)" and 0 < summary["mass_mean"] <= 1 + 1e-6


def test_sweep_resumes_without_recomputing(tmp_path, capsys):
    args = ["sweep", "synthetic:mixed", *SMALL, "--policies", "h2o;window;oracle", "--budgets", "8,16",
            "--out", str(tmp_path / "res"), "--quiet", "--plot", str(tmp_path / "p.png")]
    assert main(args) == 0
    first = pd.read_parquet(tmp_path / "res")
    assert len(first) == 6 and first.key.is_unique
    n_parts = len(list((tmp_path / "res").glob("part-*.parquet")))
    assert main(args) == 0
    assert len(list((tmp_path / "res").glob("part-*.parquet"))) == n_parts      # nothing recomputed
    assert (tmp_path / "p.png").stat().st_size > 10_000
    assert "h2o" in capsys.readouterr().out


def test_synth_then_inspect(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["synth", "passkey", "--out", str(out), "--tokens", "64", "--prompt", "32", "--head-dim", "16"]) == 0
    assert main(["inspect", str(out)]) == 0
    assert "verified" in capsys.readouterr().out
    assert main(["replay", str(out), "--policy", "streaming_llm", "--budget", "12", "--json"]) == 0


def test_demo_synthetic(tmp_path, capsys):
    assert main(["demo", "--synthetic", "mixed", "--tokens", "96", "--prompt", "16", "--budgets", "8,16",
                 "--out", str(tmp_path)]) == 0
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    page = (tmp_path / "demo.html").read_text()
    assert page.count("<tr>") > 3 and page.count('<img src="data:image/png;base64,') == 3
    assert 'data-fact="model"' in page and "kvsim demo --synthetic mixed" in page
    out = capsys.readouterr().out
    assert "oracle" in out and f"page: {tmp_path / 'demo.html'}" in out


def test_demo_on_a_recorded_model_replays_every_policy(tmp_path, capsys):
    """The demo on a model's recorded trace (the shipped tiny one here, SmolLM2 by default): every policy runs,
    KVzip included, whose rereading pass the demo records into its trace."""
    from traces.format import load_trace

    assert main(["demo", "--model", "tiny", "--tokens", "96", "--prompt", "48", "--budgets", "16,32",
                 "--out", str(tmp_path)]) == 0
    trace = load_trace(next(tmp_path.glob("demo-trace-*")))
    assert trace.meta.reconstruction is not None
    assert "kvzip" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["replay", "synthetic:zipf", *SMALL, "--policy", "nope", "--budget", "8"], "unknown policy 'nope'"),
    (["replay", "synthetic:zipf", *SMALL, "--policy", "h2o:foo=1", "--budget", "8"], "unknown parameter"),
    (["replay", "synthetic:zipf", *SMALL, "--policy", "h2o", "--budget", "65"], "larger than the trace"),
    (["replay", "synthetic:nope", *SMALL, "--policy", "h2o", "--budget", "8"], "unknown synthetic kind"),
    (["replay", "/nonexistent/trace", "--policy", "h2o", "--budget", "8"], "not a trace directory"),
])
def test_bad_input_exits_2_with_a_named_error(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
