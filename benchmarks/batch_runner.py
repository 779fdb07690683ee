"""Closed-loop batching speed-up on SmolLM2-135M (CPU, torch backend): N (policy, budget) configurations run
one at a time vs as one batch (`gpu_validate.closedloop.runner.run_batch`), and the batched results checked against the
solo ones. Writes benchmarks/results/batch_runner.json.

    python -m benchmarks.batch_runner [--model smollm2-135m] [--prompt 128] [--decode 32]

``--streamed``: one batch of STREAMED configurations (policies without a prefill selector, whose prompt goes token by
token through the policy: the closed loop's costliest batches) on 512 + 128 tokens of the shipped text, one thread,
timed, with the CPU time of its policy steps (the host's work around the model) per token; with ``--before DIR``
the same batch is first timed on another checkout of the code (e.g. ``git worktree add /tmp/head HEAD``) in a
subprocess and the results compared. Adds the ``streamed`` object to batch_runner.json,
keeping its other keys.

    python -m benchmarks.batch_runner --streamed [--before /tmp/head | --before-json FILE | --before-seconds S]
                                                 [--pairs N]

``--pairs N`` times the old code and this one N times, alternated, each batch in its own process, and reports the
medians (this VM's speed drifts by 20-35% from one day to the next, and within a session with its neighbours). The
issue's baseline, the runner that stepped each layer inside its attention, is ``git worktree add /tmp/base 3f55fb9``
(the worker's imports fall back to that checkout's module layout).

(``--before-json``: what ``PYTHONPATH=/tmp/head python benchmarks/batch_runner.py --streamed-worker`` printed, the old
code timed earlier in the same session.)
"""
from __future__ import annotations

import argparse
import os
import sys
import time


POLICIES = ("streaming_llm", "h2o", "tova", "snapkv", "pyramidkv", "cascading", "bumblebee", "ada_snapkv")
#: streamed configurations (no prefill selector; BUZZ has one, so it is not among them), budget STREAMED_BUDGET
STREAMED = ("h2o:recent_ratio=0.1", "h2o:recent_ratio=0.3", "h2o:recent_ratio=0.5", "h2o:recent_ratio=0.7",
            "streaming_llm:n_sinks=1", "streaming_llm:n_sinks=4", "streaming_llm:n_sinks=8",
            "d2o:recent_ratio=0.1", "d2o:recent_ratio=0.25", "d2o:recent_ratio=0.5",
            "cascading:n_cascades=2", "cascading:n_cascades=4", "cascading:n_cascades=8",
            "tova", "window", "decoding(h2o)", "critical(h2o)")
STREAMED_BUDGET = 64


def _streamed_batch(model_name: str, n_prompt: int, n_decode: int) -> dict:
    """Time one run_batch of the STREAMED jobs with the code importable here (this checkout, or the one put first on
    PYTHONPATH by --before): seconds, the load around it, and every row's NLL and top-1 for the comparison."""
    import numpy as np
    import torch

    # --before's checkout may predate today's modules: the tree by feature (gpu_validate.closedloop, sim.replay,
    # sim.experiments) and gpu_validate.closedloop.jobs (BatchJob was in the runner module)
    BatchJob = _first_of("gpu_validate.closedloop.jobs", "gpu_validate.closedloop.runner", "gpu_validate.jobs",
                         "gpu_validate.runner", name="BatchJob")
    run_batch = _first_of("gpu_validate.closedloop.runner", "gpu_validate.runner", name="run_batch")
    parse_policy = _first_of("sim.experiments.specs", "sim.specs", name="parse_policy")
    limit_threads = _first_of("sim.replay.threads", "sim.threads", name="limit_threads")
    from traces.model import default_text
    from traces.models import load_model

    limit_threads(1)
    torch.set_grad_enabled(False)
    model, tok = load_model(model_name, device="cpu")
    ids = tok(default_text())["input_ids"][:n_prompt + n_decode]
    jobs = [BatchJob(parse_policy(s), STREAMED_BUDGET, ids[:n_prompt], continuation=ids[n_prompt:]) for s in STREAMED]
    if len({j.batch_key for j in jobs}) != 1:
        raise SystemExit("the streamed configurations do not form one batch")
    host = _time_host_steps()
    run_batch(model, [BatchJob(j.policy, j.budget, ids[:12], continuation=ids[12:16]) for j in jobs])   # compile
    host.update(cpu=0.0, wall=0.0)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    res = run_batch(model, jobs)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "load": [load0, os.getloadavg()[0]], "rows": len(res),
            "host_cpu_seconds": host["cpu"], "host_wall_seconds": host["wall"], "host_steps": host["what"],
            "nll": np.stack([r.nll for r in res]).tolist(), "top1": np.stack([r.top1 for r in res]).tolist()}


def _time_host_steps() -> dict:
    """Accumulate the CPU and wall time of the closed loop's policy steps (the host's work around the model: the
    steps, their contract checks and the compaction) in the returned dict: `DecodeSteps.step` (every layer after
    the forward), or, in a checkout from before it, `BatchRunner._policy_step` (one layer inside its attention)."""
    acc = {"cpu": 0.0, "wall": 0.0}
    try:
        owner = _first_of("gpu_validate.closedloop.decode_steps", "gpu_validate.decode_steps", name="DecodeSteps")
        name = "step"
    except ImportError:
        owner = _first_of("gpu_validate.closedloop.batch_runner", "gpu_validate.batch_runner", name="BatchRunner")
        name = "_policy_step"
    acc["what"] = f"{owner.__name__}.{name}"
    real = getattr(owner, name)

    def timed(*a, **k):
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            acc["cpu"] += time.thread_time() - c0
            acc["wall"] += time.perf_counter() - w0

    setattr(owner, name, timed)
    return acc


def _first_of(*modules: str, name: str):
    """``name`` from the first of ``modules`` that defines it (the benchmark's imports on an older checkout)."""
    import importlib

    for mod in modules:
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {modules} defines {name}")


def _worker(args, checkout: str | None) -> dict:
    """One timed streamed batch in its own process (``_streamed_batch``): this checkout's code, or ``checkout``'s
    when given (first on PYTHONPATH; this file's worker, so an older checkout needs none of its own)."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = os.path.abspath(checkout) if checkout else root
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [code, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--streamed-worker", "--model", args.model,
                          "--prompt", str(args.prompt), "--decode", str(args.decode)], env=env, cwd=code,
                         check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _commit(checkout: str | None) -> str | None:
    """The short commit of a git checkout (``--before``'s code), or None."""
    import subprocess

    if not checkout:
        return None
    out = subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    return out.stdout.strip() or None


def streamed_main(args) -> int:
    import json

    import numpy as np

    from benchmarks._util import RESULTS, machine, write_result
    from sim.reports.runinfo import kvsim_version, now

    tokens = args.prompt + args.decode
    runs: list[dict] = []          # per pair: the old code's batch (when timed here), then this checkout's
    for i in range(args.pairs):    # alternated, one process each, never side by side
        pair = {}
        if args.before_json and i == 0:
            with open(args.before_json) as f:
                pair["before"] = json.loads(f.read().strip().splitlines()[-1])
        elif args.before:
            pair["before"] = _worker(args, args.before)
        pair["after"] = _worker(args, None)
        for side, r in pair.items():
            print(f"pair {i + 1}/{args.pairs} {side}: {r['seconds']:.1f} s, host "
                  f"{1e3 * r['host_cpu_seconds'] / tokens:.2f} ms/token, load {r['load']}", flush=True)
        runs.append(pair)
    after, before = runs[0]["after"], runs[0].get("before")

    def median(side: str, key: str, per_token: bool = False):
        xs = [r[side][key] for r in runs if side in r and key in r[side]]
        return float(np.median(xs)) * (1e3 / tokens if per_token else 1.0) if xs else None

    streamed = {"n_configs": after["rows"], "n_prompt": args.prompt, "n_decode": args.decode, "threads": 1,
                "pairs": len(runs), "batch_seconds": median("after", "seconds"),
                "before_seconds": median("before", "seconds") if before else args.before_seconds,
                "load": after["load"][0],
                "host_cpu_ms_per_token": median("after", "host_cpu_seconds", True),
                "before_host_cpu_ms_per_token": median("before", "host_cpu_seconds", True)}
    if streamed["before_host_cpu_ms_per_token"]:
        streamed["host_cpu_ratio_before_vs_after"] = (streamed["before_host_cpu_ms_per_token"]
                                                      / streamed["host_cpu_ms_per_token"])
    detail = {"model": args.model, "budget": STREAMED_BUDGET, "policies": list(STREAMED),
              "load_after": after["load"][1], "before_load": before["load"] if before else None,
              "before_code": args.before or args.before_json, "before_commit": _commit(args.before),
              "machine": machine(),
              "runs": [{side: {"seconds": r["seconds"], "load": r["load"],
                               "host_cpu_ms_per_token": 1e3 * r["host_cpu_seconds"] / tokens,
                               "host_wall_ms_per_token": 1e3 * r["host_wall_seconds"] / tokens}
                        for side, r in pair.items()} for pair in runs],
              "host_steps": {"after": after["host_steps"], "before": before.get("host_steps") if before else None,
                             "after_wall_seconds": after["host_wall_seconds"],
                             "before_wall_seconds": before.get("host_wall_seconds") if before else None,
                             "what": "CPU time (thread_time, one thread) of the policy steps per token fed to the "
                                     "model (prompt and decode): the steps, their checks and the compaction, the "
                                     "host's work around the model's forward"},
              "note": "load: 1-minute load average of this 2-core machine (shared with other jobs) when the timed "
                      "batch started (load_after: when it ended); before: the previous code on the same batch, "
                      "same session, never side by side; with several pairs (runs), the figures are the medians"}
    if before:
        compared = [r for r in runs if "before" in r]
        detail["max_abs_nll_diff_vs_before"] = max(
            float(np.abs(np.array(r["before"]["nll"]) - np.array(r["after"]["nll"])).max()) for r in compared)
        detail["top1_identical_to_before"] = all(r["before"]["top1"] == r["after"]["top1"] for r in compared)
    path = RESULTS / "batch_runner.json"
    payload = json.loads(path.read_text()) if path.exists() else {}
    if "streamed" in payload:      # the earlier measurement stays, with the code and load it was taken on
        old = payload.get("streamed_detail", {})
        payload.setdefault("streamed_history", []).append(
            {**payload["streamed"], "code": old.get("kvsim"), "before_code": old.get("before_code"),
             "before_commit": old.get("before_commit"), "date": old.get("date")})
    detail.update(kvsim=kvsim_version(), date=now())
    payload["streamed"] = streamed
    payload["streamed_detail"] = detail
    print(json.dumps(streamed), json.dumps({k: v for k, v in detail.items() if k != "machine"}))
    print(write_result("batch_runner", payload))
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--budgets", default="32,64")
    ap.add_argument("--solo", type=int, default=3, help="configurations also timed one at a time (default 3)")
    ap.add_argument("--streamed", action="store_true",
                    help="time one batch of 17 streamed configurations instead (default 512 + 128 tokens)")
    ap.add_argument("--before", default=None, help="with --streamed: a checkout of the old code to time first")
    ap.add_argument("--before-json", default=None, help="with --streamed: the old code's --streamed-worker output")
    ap.add_argument("--before-seconds", type=float, default=None,
                    help="with --streamed: the old code's time on the same batch, measured separately")
    ap.add_argument("--pairs", type=int, default=1,
                    help="with --streamed: how many times the old code and this one are timed, alternated (the "
                         "medians are reported; the machine's speed drifts)")
    ap.add_argument("--streamed-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.streamed or args.streamed_worker:
        if "--prompt" not in argv:
            args.prompt = 512
        if "--decode" not in argv:
            args.decode = 128
        if args.streamed_worker:      # what it imports must be importable from an older checkout too
            import json

            print(json.dumps(_streamed_batch(args.model, args.prompt, args.decode)))
            return 0
        return streamed_main(args)
    import numpy as np
    import torch  # noqa: F401  (loaded first, so limit_threads caps its pool too)

    from benchmarks._util import machine, write_result
    from gpu_validate.closedloop.jobs import BatchJob
    from gpu_validate.closedloop.runner import CompressedRunner, run_batch
    from sim.experiments.specs import parse_policy
    from sim.replay.threads import limit_threads
    from traces.model import default_text
    from traces.models import load_model

    limit_threads(1)   # one thread, through the API sweep workers use
    torch.set_grad_enabled(False)
    model, tok = load_model(args.model, device="cpu")
    ids = tok(default_text())["input_ids"][:args.prompt + args.decode]
    budgets = [int(b) for b in args.budgets.split(",")]
    jobs = [BatchJob(parse_policy(p), b, ids[:args.prompt], continuation=ids[args.prompt:])
            for p in POLICIES for b in budgets]
    # warm-up: every policy's kernels loaded/compiled once, outside both timings
    run_batch(model, [BatchJob(j.policy, j.budget, ids[:12], continuation=ids[12:16]) for j in jobs])
    t0 = time.perf_counter()
    batched = run_batch(model, jobs)
    t_batch = time.perf_counter() - t0
    solo_times, max_dnll, same_top1 = [], 0.0, True
    step = max(1, len(jobs) // args.solo)
    for i in range(0, len(jobs), step)[:args.solo]:
        j = jobs[i]
        t0 = time.perf_counter()
        solo = CompressedRunner(model, j.policy, j.budget).run(j.prompt, continuation=j.continuation)
        solo_times.append(time.perf_counter() - t0)
        max_dnll = max(max_dnll, float(np.abs(solo.nll - batched[i].nll).max()))
        same_top1 &= solo.top1.tolist() == batched[i].top1.tolist()
    per_solo = float(np.mean(solo_times))
    out = {"model": os.path.basename(args.model.rstrip("/")), "n_prompt": args.prompt, "n_decode": args.decode,
           "policies": list(POLICIES), "budgets": budgets, "n_configs": len(jobs),
           "batch_seconds": t_batch, "solo_seconds_mean": per_solo, "solo_measured": len(solo_times),
           "speedup": per_solo * len(jobs) / t_batch, "max_abs_nll_diff": max_dnll, "top1_identical": same_top1,
           "threads": 1, "machine": machine(),
           "note": "2-core machine shared with other jobs; solo time is the mean of the configurations timed alone"}
    import json

    from benchmarks._util import RESULTS

    old = RESULTS / "batch_runner.json"
    if old.exists():          # keep the --streamed measurement
        prev = json.loads(old.read_text())
        out.update({k: prev[k] for k in ("streamed", "streamed_detail") if k in prev})
    path = write_result("batch_runner", out)
    print(f"{len(jobs)} configs: batch {t_batch:.1f} s, solo {per_solo:.1f} s each -> speed-up "
          f"{out['speedup']:.1f}x; max |ΔNLL| batch vs solo {max_dnll:.2e}; top-1 identical {same_top1}; {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
