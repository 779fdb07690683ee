"""The speed a person feels: how fast the CLI answers, and how long a newcomer's first ``kvsim demo`` takes.

Everything runs in README command 1's install (a venv with ``pip install torch==2.13.0 -e .``, no test extra),
built once at ``--venv`` (default /tmp/kvsim-readme1) and reused, with a plain user environment (no thread
variables: the CLI's own thread budgeting is what is measured).

- ``cli``: ``kvsim --help``, ``kvsim replay --help``, ``kvsim policies`` and a warm ``kvsim replay synthetic:mixed
  --policy h2o --budget 64``: every run's wall seconds and the best of ``--repeat`` next to the goal;
- ``demo`` (``--demo``): a fresh ``git clone`` of this repository's HEAD, empty numba and model caches
  (``KVSIM_CACHE`` in a temporary folder; the clone has no ``__pycache__``), then ``kvsim demo`` twice in it: the
  first run (model fetched from the package registry, converted, recorded, every kernel compiled) and the second
  (everything reused).

Writes benchmarks/results/cli.json (the part not rerun is kept from the previous file).

    python -m benchmarks.cli_speed [--demo] [--repeat 3] [--venv DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from benchmarks._util import RESULTS, machine, user_env, write_result

#: the issue's goals, seconds (best of 3 on a quiet machine; the first demo from a fresh clone)
GOALS = {"help": 0.5, "policies": 1.5, "replay_warm": 2.5, "demo_first": 120.0}
CLI = {"help": ["--help"], "command_help": ["replay", "--help"], "policies": ["policies"],
       "replay_warm": ["replay", "synthetic:mixed", "--policy", "h2o", "--budget", "64"]}


def readme_install(venv: Path) -> Path:
    """README command 1's install at ``venv`` (made once): the path of its ``kvsim`` script."""
    kvsim = venv / "bin" / "kvsim"
    if not kvsim.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "torch==2.13.0", "-e", str(ROOT)], check=True)
    return kvsim


def timed(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> float:
    """Wall seconds of one run of ``cmd`` (which must succeed)."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return wall


def cli_timings(kvsim: Path, repeat: int) -> dict:
    env = user_env()
    timed([str(kvsim), *CLI["replay_warm"]], env)          # compiles once: "warm" is every later run
    out = {}
    for name, args in CLI.items():
        runs = [round(timed([str(kvsim), *args], env), 3) for _ in range(repeat)]
        out[name] = {"command": "kvsim " + " ".join(args), "runs_s": runs, "best_s": min(runs),
                     "goal_s": GOALS.get(name)}
    return out


def demo_timings(venv: Path) -> dict:
    """The first and second ``kvsim demo`` in a fresh clone with empty caches."""
    with tempfile.TemporaryDirectory(prefix="kvsim-cold-") as tmp:
        clone = Path(tmp) / "kvsim"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
        env = user_env(KVSIM_CACHE=str(Path(tmp) / "cache"))
        env["PYTHONPATH"] = str(clone)                      # the clone's code, not this checkout's
        env.pop("NUMBA_CACHE_DIR", None)                   # numba caches beside the clone's sources: empty
        cmd = [str(venv / "bin" / "python"), "-m", "sim.cli", "demo", "--out", str(Path(tmp) / "out")]
        load_before = os.getloadavg()[0]
        first = timed(cmd, env, cwd=clone)
        second = timed(cmd, env, cwd=clone)
    from policies import list_policies

    n_policies = len(list_policies(combinators=False))         # what the demo replays
    return {"commit": commit, "command": f"kvsim demo (SmolLM2-135M, 4 layers, 512 + 512 tokens, {n_policies} "
                                         "policies x 4 budgets)",
            "first_s": round(first, 1), "second_s": round(second, 1), "goal_first_s": GOALS["demo_first"],
            "load_avg_1min_before": load_before,
            "first_includes": "model wheel download, GGUF conversion, trace recording, numba compilation of the "
                              "engine and every policy's kernels, the sweep, plots and page"}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", action="store_true", help="also time the first and second demo in a fresh clone")
    ap.add_argument("--no-cli", action="store_true", help="skip the CLI timings (keep the previous ones)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--venv", type=Path, default=Path("/tmp/kvsim-readme1"))
    args = ap.parse_args(argv)
    kvsim = readme_install(args.venv)
    path = RESULTS / "cli.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    result.update(machine=machine(), install="README command 1: pip install torch==2.13.0 -e . (no test extra)")
    if not args.no_cli:
        result["cli"] = cli_timings(kvsim, args.repeat)
        for name, row in result["cli"].items():
            print(f"{row['command']:<55} best {row['best_s']:.2f} s  runs {row['runs_s']}  goal {row['goal_s']}")
    if args.demo:
        result["demo"] = demo_timings(args.venv)
        print(f"kvsim demo from a fresh clone: first {result['demo']['first_s']} s, second "
              f"{result['demo']['second_s']} s (goal first <= {GOALS['demo_first']} s)")
    write_result("cli", result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
