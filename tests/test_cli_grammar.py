"""One spec grammar and shared options across the kvsim CLI, and the two silent wrong-result bugs it ended:
a real trace directory named ``synthetic*`` was replaced by a generated trace, and ``--no-verify`` never
reached the workers of sweep/search."""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from policies import PolicyError
from sim.cli import build_parser, main
from sim.commands._common import DefaultsHelpFormatter
from sim.experiments.executors import Job, TraceRef, execute
from sim.experiments.specs import open_trace, parse_policy_list, split_policy_list
from traces.format import TraceError
from traces.synthetic import make_synthetic_trace

SMALL = ["--tokens", "64", "--prompt", "8", "--layers", "1"]


@pytest.fixture(scope="module")
def zipf_dir(tmp_path_factory):
    """A real zipf trace on disk, saved under a name that starts with "synthetic"."""
    root = tmp_path_factory.mktemp("traces")
    path = make_synthetic_trace("zipf", n_tokens=96, n_prompt=16, n_layers=1, seed=3).save(root / "synthetic_zipf_run")
    return path


@pytest.fixture
def corrupt_dir(zipf_dir, tmp_path):
    """A copy of the trace with one byte of k changed: its checksum no longer matches."""
    path = shutil.copytree(zipf_dir, tmp_path / "corrupt")
    k = next(path.glob("layers/*/k.npy"))
    raw = bytearray(k.read_bytes())
    raw[-3] ^= 0x55
    k.write_bytes(bytes(raw))
    return path


# --- trace specs ----------------------------------------------------------------------------------------------

def test_an_existing_path_named_synthetic_wins(zipf_dir, tmp_path, capsys, monkeypatch):
    """The bug: `kvsim replay synthetic_zipf_run` replayed a generated `mixed` trace instead of the files."""
    other = shutil.copytree(zipf_dir, tmp_path / "plain_name")
    monkeypatch.chdir(zipf_dir.parent)                     # the spec is the bare relative name a user types
    rows = []
    for spec in ("synthetic_zipf_run", str(other)):
        assert main(["replay", spec, "--policy", "h2o", "--budget", "16", "--json"]) == 0
        rows.append(json.loads(capsys.readouterr().out))
    assert rows[0]["trace"] == "synthetic_zipf_run"
    assert rows[0]["err_mean"] == rows[1]["err_mean"] and rows[0]["mass_mean"] == rows[1]["mass_mean"]
    assert open_trace("synthetic_zipf_run").meta.n_tokens == 96          # not the 1024-token generated default


def test_a_directory_literally_named_like_a_synthetic_spec_still_wins(zipf_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(zipf_dir, tmp_path / "synthetic:mixed")
    assert open_trace("synthetic:mixed", n_tokens=64).meta.n_tokens == 96


@pytest.mark.parametrize("spec", ["synthetic", "synthetic_zipf", "synthetic-mixed", "Synthetic:zipf"])
def test_a_missing_name_that_only_looks_synthetic_is_an_ambiguity_error(spec, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="ambiguous trace .*synthetic:KIND"):
        open_trace(spec)
    assert main(["replay", spec, "--policy", "h2o", "--budget", "8"]) == 2
    assert "ambiguous trace" in capsys.readouterr().err


def test_the_exact_prefix_generates():
    tr = open_trace("synthetic:zipf", n_tokens=48, n_prompt=8, n_layers=1)
    assert tr.meta.n_tokens == 48 and str(tr.path) == "<memory>"
    with pytest.raises(ValueError, match="unknown synthetic kind ''"):
        open_trace("synthetic:")


# --- --no-verify ----------------------------------------------------------------------------------------------

def test_no_verify_travels_with_the_trace_ref(corrupt_dir):
    with pytest.raises(TraceError, match="checksum mismatch"):
        TraceRef(str(corrupt_dir)).open()
    trace, inputs = TraceRef(str(corrupt_dir), verify=False).open()
    assert trace.meta.n_tokens == 96 and len(inputs) == 1


@pytest.mark.parametrize("workers", [1, 2])
def test_sweep_no_verify_reaches_every_executor(corrupt_dir, tmp_path, workers, capsys):
    """Before: workers reopened the trace with verify=True, so sweep --no-verify failed on the checksum."""
    args = ["sweep", str(corrupt_dir), "--policies", "h2o;oracle", "--budgets", "16", "--quiet",
            "--workers", str(workers)]
    assert main([*args, "--out", str(tmp_path / "a")]) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "b"), "--no-verify"]) == 0
    assert len(pd.read_parquet(tmp_path / "b")) == 2


def test_search_no_verify(corrupt_dir, tmp_path, capsys):
    args = ["search", str(corrupt_dir), "--policy", "h2o", "--budgets", "16", "--trials", "2", "--quiet",
            "--workers", "1", "--out", str(tmp_path / "s")]
    assert main(args) == 2
    assert main([*args, "--no-verify"]) == 0


def test_ray_jobs_carry_verify(corrupt_dir, ray_local):
    """Ray runs the same pickled Job through run_job: the flag is part of the job itself."""
    ref = TraceRef(str(corrupt_dir), verify=False)
    job = Job(ref, "h2o", (("group_reduce", "mean"), ("recent_ratio", 0.5)), (16,), ("k",))
    rows = [r for rows in execute([job], ray_address="local") for r in rows]
    assert rows[0]["budget"] == 16


# --- policy lists ---------------------------------------------------------------------------------------------

def test_split_policy_list_is_parenthesis_aware():
    assert split_policy_list("h2o:recent_ratio=0.3,group_reduce=max; tova ;;") == \
        ["h2o:recent_ratio=0.3,group_reduce=max", "tova"]
    assert split_policy_list("decoding(snapkv:window_size=64; x, every=64);tova") == \
        ["decoding(snapkv:window_size=64; x, every=64)", "tova"]
    for bad in ("ada(h2o", "h2o);tova"):
        with pytest.raises(PolicyError, match="policy list"):
            split_policy_list(bad)


def test_parse_policy_list_full_specs_all_and_duplicates():
    pols = parse_policy_list("h2o:recent_ratio=0.3,group_reduce=max;tova;h2o:group_reduce=max,recent_ratio=0.3")
    assert [p.label() for p in pols] == ["h2o(recent_ratio=0.3, group_reduce=max)", "tova"]
    names = {p.name for p in parse_policy_list("all", exclude=("oracle",))}
    assert "oracle" not in names and {"h2o", "tova", "full"} <= names
    with pytest.raises(PolicyError, match="no policy"):
        parse_policy_list(" ; ")


# --- shared options: same name, type and default everywhere ---------------------------------------------------

POLICY_COMMANDS = {"replay": "--policy", "search": "--policy", "validate": "--policy", "sweep": "--policies",
                   "fuzz": "--policies", "fidelity": "--policies", "report": "--policies", "serve-sim": "--policies"}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return dict(sub.choices)


def test_every_policy_command_uses_the_shared_option():
    cmds = _subparsers()
    for name, flag in POLICY_COMMANDS.items():
        action = next((a for a in cmds[name]._actions if flag in a.option_strings), None)
        assert action is not None, f"kvsim {name} has no {flag}"
        assert action.metavar == ("SPEC" if flag == "--policy" else "LIST"), name
        assert "WRAPPER(SPEC" in action.help or "';'-separated" in action.help, name


def test_shared_options_have_one_type_everywhere():
    types: dict[str, set] = {}
    for name, p in _subparsers().items():
        for a in p._actions:
            if name == "generate" and "--prompt" in a.option_strings:
                # the one command that takes a prompt *text* (as every generation CLI does); everywhere else
                # --prompt is a number of prompt tokens
                assert a.type is None and a.metavar == "TEXT"
                continue
            for flag in a.option_strings:
                if flag in ("--budget", "--budgets", "--tokens", "--prompt", "--layers", "--seed", "--workers",
                            "--out", "--no-verify", "--policy", "--policies", "--device", "--backend"):
                    types.setdefault(flag, set()).add((getattr(a.type, "__name__", a.type), type(a).__name__))
    for flag, kinds in types.items():
        assert len(kinds) == 1, f"{flag} has different types across commands: {kinds}"
    # --layers means a count everywhere; record's layer indices are --keep-layers
    record = _subparsers()["record"]
    assert any("--keep-layers" in a.option_strings for a in record._actions)
    assert not any("--layers" in a.option_strings for a in record._actions)


def test_help_shows_the_real_defaults():
    """Fidelity's --prompt help said 256 while the command used 128."""
    for name, p in _subparsers().items():
        assert p.formatter_class is DefaultsHelpFormatter, name
        text = " ".join(p.format_help().split())
        for a in p._actions:
            if a.option_strings and a.default is not None and a.default is not False and a.help \
                    and a.default != argparse.SUPPRESS:
                shown = ",".join(map(str, a.default)) if isinstance(a.default, list) else str(a.default)
                assert f"(default: {shown})" in text, f"kvsim {name} {a.option_strings[0]}"
                # no hand-written default beside the real one: it is the text that went stale before
                assert not re.search(r"\(default \w", a.help), f"kvsim {name} {a.option_strings[0]}: {a.help}"
    fid = " ".join(_subparsers()["fidelity"].format_help().split())
    assert "prompt tokens (default: 128)" in fid and "256" not in fid


def test_outputs_default_to_the_working_directory():
    """No command reads or writes a repository path by default (``benchmarks/results`` means nothing after
    ``pip install``): every path default is relative, so it lands under the directory kvsim runs in."""
    from gpu_validate.model_commands.fidelity_cmd import default_out

    for name, p in _subparsers().items():
        for a in p._actions:
            for value in (a.default if isinstance(a.default, (list, tuple)) else [a.default]):
                if isinstance(value, (str, Path)) and ("/" in str(value) or isinstance(value, Path)):
                    assert not Path(value).is_absolute() and "benchmarks" not in str(value), \
                        f"kvsim {name} {a.option_strings}: {value}"
    assert _subparsers()["needle"].get_default("out") == Path("kvsim-out/needle.json")
    assert default_out("cuda:1") == Path("kvsim-out/fidelity_cuda.json")
    assert default_out("cpu") == Path("kvsim-out/fidelity_cpu.json")
    assert _subparsers()["serve-sim"].get_default("kernel_timings") is None     # measured timings only when named


# --- a CLI run per command with full specs and the shared options ---------------------------------------------

FULL_SPEC = "h2o:recent_ratio=0.25,group_reduce=max"


def test_replay_cli(capsys):
    assert main(["replay", "synthetic:zipf", *SMALL, "--seed", "2", "--policy", FULL_SPEC, "--budget", "16",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["label"] == "h2o(recent_ratio=0.25, group_reduce=max)"


def test_sweep_cli_full_specs_and_grids(tmp_path, capsys):
    assert main(["sweep", "synthetic:zipf", *SMALL, "--policies", f"{FULL_SPEC};h2o:recent_ratio=0.1|0.5;oracle",
                 "--budgets", "8,16", "--out", str(tmp_path / "r"), "--workers", "1", "--quiet"]) == 0
    df = pd.read_parquet(tmp_path / "r")
    assert set(df.label) == {"h2o(recent_ratio=0.25, group_reduce=max)", "h2o(recent_ratio=0.1)", "h2o", "oracle"}
    assert len(df) == 8


def test_search_cli_takes_a_full_spec_and_holds_its_params(tmp_path, capsys):
    assert main(["search", "synthetic:zipf", *SMALL, "--policy", "h2o:group_reduce=max", "--budgets", "16",
                 "--trials", "3", "--workers", "1", "--quiet", "--out", str(tmp_path / "s")]) == 0
    df = pd.read_parquet(tmp_path / "s")
    assert len(df) >= 1 and all(json.loads(p)["group_reduce"] == "max" if isinstance(p, str) else
                                p["group_reduce"] == "max" for p in df.params)
    assert main(["search", "synthetic:zipf", *SMALL, "--policy", "h2o:nope=1", "--budgets", "16",
                 "--trials", "1", "--quiet", "--out", str(tmp_path / "s")]) == 2


def test_search_cli_takes_a_wrapper_spec(tmp_path, capsys):
    from sim.experiments.search import split_search_spec

    assert split_search_spec("ada(knorm:n_sink=2, floor_alpha=0.3)") == ("ada(knorm)", {"n_sink": 2, "floor_alpha": 0.3})
    assert main(["search", "synthetic:zipf", *SMALL, "--policy", "ada(knorm, floor_alpha=0.3)", "--budgets", "16",
                 "--trials", "2", "--workers", "1", "--quiet", "--out", str(tmp_path / "s")]) == 0
    df = pd.read_parquet(tmp_path / "s")
    assert set(df.policy) == {"ada(knorm)"}
    assert all((json.loads(p) if isinstance(p, str) else p)["floor_alpha"] == 0.3 for p in df.params)


def test_fuzz_cli_policies_option_and_positionals(tmp_path, capsys):
    out = tmp_path / "f"
    assert main(["fuzz", "--policies", f"{FULL_SPEC};window", "--examples", "3", "--save-failures", str(out)]) == 0
    text = capsys.readouterr().out
    assert "h2o" in text and "window" in text
    assert main(["fuzz", "streaming_llm:n_sinks=2", "--examples", "2", "--save-failures", str(out)]) == 0


def test_report_cli_occupancy_with_full_specs_and_the_oracle(tmp_path, capsys):
    store = tmp_path / "r"
    assert main(["sweep", "synthetic:zipf", *SMALL, "--policies", "h2o", "--budgets", "8", "--out", str(store),
                 "--workers", "1", "--quiet"]) == 0
    assert main(["report", str(store), "--occupancy", "synthetic:zipf", *SMALL, "--budget", "8",
                 "--policies", f"{FULL_SPEC};oracle;full"]) == 0
    assert (tmp_path / "report" / "occupancy.png").stat().st_size > 5_000


def test_report_cli_when_every_policy_is_skipped_says_so(tmp_path, capsys):
    """Before: NameError on `res` when every given policy was skipped."""
    store = tmp_path / "r"
    assert main(["sweep", "synthetic:zipf", *SMALL, "--policies", "window", "--budgets", "8", "--out", str(store),
                 "--workers", "1", "--quiet"]) == 0
    assert main(["report", str(store), "--occupancy", "synthetic:zipf", *SMALL, "--policies", "full"]) == 2
    assert "no policy to draw" in capsys.readouterr().err


def test_serve_sim_cli_full_specs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["serve-sim", "--policies", f"{FULL_SPEC};streaming_llm:n_sinks=8", "--budgets", "64",
                 "--requests", "30", "--rate", "5", "--quiet", "--out", str(tmp_path / "o")]) == 0
    df = pd.read_csv(tmp_path / "o" / "serving.csv")
    assert {"h2o(recent_ratio=0.25, group_reduce=max)@64", "streaming_llm(n_sinks=8)@64"} <= set(df.label)


@pytest.mark.parametrize("cmd", ["validate", "fidelity"])
def test_model_commands_parse_the_same_specs(cmd, monkeypatch):
    """validate/fidelity need a model to run; here: their options parse full specs and lists like the others."""
    import sim.experiments.specs

    argv = ([cmd, "--policy", FULL_SPEC, "--budget", "16"] if cmd == "validate"
            else [cmd, "--policies", f"{FULL_SPEC};tova;oracle", "--budgets", "8,16"])
    args = build_parser().parse_args(argv)
    if cmd == "validate":
        assert sim.experiments.specs.parse_policy(args.policy).params["group_reduce"] == "max"
    else:
        assert args.prompt == 128 and args.budgets == [8, 16]
        labels = [p.label() for p in parse_policy_list(args.policies, exclude=("oracle",))]
        assert labels == ["h2o(recent_ratio=0.25, group_reduce=max)", "tova", "oracle"]


def test_kvsim_start_does_not_import_the_serving_simulator():
    code = ("import sys; from sim.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith(('sim.serving', 'hypothesis', 'pytest', 'ray'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(eval(out))
    assert loaded <= {"sim.serving", "sim.serving.fit", "sim.serving.footprint", "sim.serving.hardware"}, loaded


def test_policies_cli_shows_booleans_and_every_choice(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "(None..None)" not in out and "…" not in out
    assert "inclusive_bounds=true (true | false)" in out
    assert "similarity=relu_cos (relu_cos | one_plus_cos | abs_cos)" in out



def test_every_kvsim_command_in_the_readme_parses():
    """The README's CLI tour and examples match the parser (names, types, list syntax)."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    lines = re.findall(r"`(kvsim [^`]+)`", readme)
    lines += [ln.split("  #")[0] for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
              for ln in block.replace("\\\n", " ").splitlines() if ln.startswith("kvsim ")]
    commands = {name for name in _subparsers()}
    checked, bad = 0, []
    for line in lines:
        argv = shlex.split(line)[1:]
        if len(argv) < 2 or argv[0] not in commands or "..." in argv or any(a.startswith("[") for a in argv):
            continue                       # a bare command name in prose, or an elided example
        argv = [re.sub(r"^(PATH\|default|M)$", "default", a) for a in argv]
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            bad.append(line)
        checked += 1
    assert not bad, bad
    assert checked >= 15, checked
