"""Does a user's plain shell get the speed of a hand-tuned one? The check that thread budgeting cannot drift.

Runs the same kvsim commands from the CLI twice: in a plain user environment (no thread variable set, so only
kvsim's own budgeting in ``sim/replay/threads.py`` limits the pools) and with every thread variable forced to 1
(what benchmarks used to set by hand). Goal: plain / forced <= 1.1 for each command. Commands:

  - ``kvsim sweep TRACE --policies all --budgets 32,64,96,128,192,256,384,512 --workers 2``
  - ``kvsim search TRACE --policy h2o --budgets 64,128 --trials 24 --workers 2``
  - ``kvsim sweep TRACE --policies all --budgets 64,256 --ray local`` (when Ray is installed)

Each command runs ``--repeat`` times per environment, alternating, into a fresh store; the best time counts.
Writes benchmarks/results/threads.json with every time, the ratios and the environment.
Run: python -m benchmarks.threads [--trace DIR] [--repeat 2] [--skip-ray]
"""
from __future__ import annotations

import argparse
import builtins
import importlib.util
import tempfile
from functools import partial
from pathlib import Path

from benchmarks._util import cli_seconds, machine, user_env, write_result
from sim.replay.threads import thread_env

print = partial(builtins.print, flush=True)
DEFAULT_TRACE = "kvsim-out/smollm2-135m-1024-256"
SWEEP_BUDGETS = "32,64,96,128,192,256,384,512"
GOAL_RATIO = 1.1


def commands(trace: str, with_ray: bool) -> dict[str, list[str]]:
    """The measured commands (without ``--out``, which each run gets fresh)."""
    cmds = {
        "sweep": ["sweep", trace, "--policies", "all", "--budgets", SWEEP_BUDGETS, "--workers", "2", "--quiet"],
        "search": ["search", trace, "--policy", "h2o", "--budgets", "64,128", "--trials", "24", "--workers", "2",
                   "--quiet"],
    }
    if with_ray:
        cmds["sweep_ray_local"] = ["sweep", trace, "--policies", "all", "--budgets", "64,256", "--ray", "local",
                                   "--quiet"]
    return cmds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE,
                    help="a real-model trace directory (default: benchmarks/replay.py's SmolLM2 1024+256 trace, "
                         "recorded when missing)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per command and environment (best counts)")
    ap.add_argument("--skip-ray", action="store_true", help="leave out the --ray local sweep")
    args = ap.parse_args(argv)
    if not Path(args.trace).exists():
        from benchmarks.replay import DEFAULT_MODEL, ensure_trace

        ensure_trace(args.trace, DEFAULT_MODEL)
    with_ray = not args.skip_ray and importlib.util.find_spec("ray") is not None
    envs = {"plain": user_env(), "forced_1": user_env(**thread_env(1), NUMBA_NUM_THREADS="1")}
    rows = []
    result = {"trace": args.trace, "goal_ratio": GOAL_RATIO, "machine": machine(), "runs": rows}
    for name, cmd in commands(args.trace, with_ray).items():
        times: dict[str, list[float]] = {env: [] for env in envs}
        for r in range(args.repeat):
            order = list(envs) if r % 2 == 0 else list(reversed(envs))    # alternate, so drift hits both
            for env_name in order:
                with tempfile.TemporaryDirectory() as tmp:
                    secs = cli_seconds([*cmd, "--out", tmp], envs[env_name])
                times[env_name].append(secs)
                print(f"{name:16s} {env_name:9s} {secs:7.1f} s")
        best = {k: min(v) for k, v in times.items()}
        row = {"name": name, "command": "kvsim " + " ".join(cmd), "seconds": times, "best": best,
               "ratio_plain_over_forced": best["plain"] / best["forced_1"]}
        row["goal_met"] = row["ratio_plain_over_forced"] <= GOAL_RATIO
        rows.append(row)
        print(f"{name}: plain {best['plain']:.1f} s, forced {best['forced_1']:.1f} s, "
              f"ratio {row['ratio_plain_over_forced']:.2f} (goal <= {GOAL_RATIO})")
        result["goals_met"] = all(r["goal_met"] for r in rows)
        result["machine_after"] = {"load_avg_1min": machine()["load_avg_1min"]}
        write_result("threads", result)


if __name__ == "__main__":
    main()
