"""Closed-loop batching speed-up on SmolLM2-135M (CPU, torch backend): N (policy, budget) configurations run
one at a time vs as one batch (`gpu_validate.closedloop.runner.run_batch`), and the batched results checked against the
solo ones. Writes benchmarks/results/batch_runner.json.

    python -m benchmarks.batch_runner [--model smollm2-135m] [--prompt 128] [--decode 32]

``--streamed``: one batch of STREAMED configurations (policies without a prefill selector, whose prompt goes token by
token through the policy: the closed loop's costliest batches) on 512 + 128 tokens of the shipped text, one thread,
timed, with the CPU time of its policy steps (the host's work around the model) per token; with ``--before DIR`` the same batch is first timed on another checkout of the code (e.g. ``git worktree add
/tmp/head HEAD``) in a subprocess and the results compared. Adds the ``streamed`` object to batch_runner.json,
keeping its other keys.

    python -m benchmarks.batch_runner --streamed [--before /tmp/head | --before-json FILE | --before-seconds S]

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

    try:
        from gpu_validate.closedloop.jobs import BatchJob
    except ImportError:   # --before's checkout may predate gpu_validate.closedloop.jobs (BatchJob was in gpu_validate.closedloop.runner)
        from gpu_validate.closedloop.runner import BatchJob
    from gpu_validate.closedloop.runner import run_batch
    from sim.experiments.specs import parse_policy
    from sim.replay.threads import limit_threads
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
        from gpu_validate.closedloop.decode_steps import DecodeSteps as owner
        name = "step"
    except ImportError:
        from gpu_validate.closedloop.batch_runner import BatchRunner as owner
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


def streamed_main(args) -> int:
    import json
    import subprocess

    import numpy as np

    from benchmarks._util import RESULTS, machine, write_result
    from sim.reports.runinfo import kvsim_version, now

    before = None
    if args.before_json:
        with open(args.before_json) as f:
            before = json.loads(f.read().strip().splitlines()[-1])
    elif args.before:      # the other checkout's code, in its own process, before this one's (never side by side)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.abspath(args.before),
                                                                         os.environ.get("PYTHONPATH")]))}
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--streamed-worker", "--model", args.model,
                              "--prompt", str(args.prompt), "--decode", str(args.decode)], env=env, cwd=args.before,
                             check=True, stdout=subprocess.PIPE, text=True).stdout
        before = json.loads(out.strip().splitlines()[-1])
        print(f"before ({args.before}): {before['seconds']:.1f} s, load {before['load']}", flush=True)
    if before:
        print(f"before: {before['seconds']:.1f} s, load {before['load']}", flush=True)
    after = _streamed_batch(args.model, args.prompt, args.decode)
    print(f"after: {after['seconds']:.1f} s, load {after['load']}", flush=True)
    tokens = args.prompt + args.decode
    streamed = {"n_configs": after["rows"], "n_prompt": args.prompt, "n_decode": args.decode, "threads": 1,
                "batch_seconds": after["seconds"],
                "before_seconds": before["seconds"] if before else args.before_seconds,
                "load": after["load"][0],
                "host_cpu_ms_per_token": 1e3 * after["host_cpu_seconds"] / tokens,
                "before_host_cpu_ms_per_token": (1e3 * before["host_cpu_seconds"] / tokens
                                                 if before and "host_cpu_seconds" in before else None)}
    if streamed["before_host_cpu_ms_per_token"]:
        streamed["host_cpu_ratio_before_vs_after"] = (streamed["before_host_cpu_ms_per_token"]
                                                      / streamed["host_cpu_ms_per_token"])
    detail = {"model": args.model, "budget": STREAMED_BUDGET, "policies": list(STREAMED),
              "load_after": after["load"][1], "before_load": before["load"] if before else None,
              "before_code": args.before or args.before_json, "machine": machine(),
              "host_steps": {"after": after["host_steps"], "before": before.get("host_steps") if before else None,
                             "after_wall_seconds": after["host_wall_seconds"],
                             "before_wall_seconds": before.get("host_wall_seconds") if before else None,
                             "what": "CPU time (thread_time, one thread) of the policy steps per token fed to the "
                                     "model (prompt and decode): the steps, their checks and the compaction, the "
                                     "host's work around the model's forward"},
              "note": "load: 1-minute load average of this 2-core machine (shared with other jobs) when the timed "
                      "batch started (load_after: when it ended); before: the previous code on the same batch, "
                      "same session, never side by side"}
    if before:
        detail["max_abs_nll_diff_vs_before"] = float(np.abs(np.array(before["nll"]) - np.array(after["nll"])).max())
        detail["top1_identical_to_before"] = before["top1"] == after["top1"]
    path = RESULTS / "batch_runner.json"
    payload = json.loads(path.read_text()) if path.exists() else {}
    if "streamed" in payload:      # the earlier measurement stays, with the code and load it was taken on
        old = payload.get("streamed_detail", {})
        payload.setdefault("streamed_history", []).append(
            {**payload["streamed"], "code": old.get("kvsim"), "before_code": old.get("before_code"),
             "date": old.get("date")})
    detail.update(kvsim=kvsim_version(), date=now())
    payload["streamed"] = streamed
    payload["streamed_detail"] = detail
    print(json.dumps(streamed), json.dumps({k: v for k, v in detail.items() if k != "machine"}))
    print(write_result("batch_runner", payload))
    return 0


def main(argv: list[str]) -> int:
    import numpy as np
    import torch  # noqa: F401  (loaded first, so limit_threads caps its pool too)

    from benchmarks._util import machine, write_result
    from gpu_validate.closedloop.jobs import BatchJob
    from gpu_validate.closedloop.runner import CompressedRunner, run_batch
    from sim.experiments.specs import parse_policy
    from sim.replay.threads import limit_threads
    from traces.model import default_text
    from traces.models import load_model

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
    ap.add_argument("--streamed-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.streamed or args.streamed_worker:
        if "--prompt" not in argv:
            args.prompt = 512
        if "--decode" not in argv:
            args.decode = 128
        if args.streamed_worker:
            import json

            print(json.dumps(_streamed_batch(args.model, args.prompt, args.decode)))
            return 0
        return streamed_main(args)
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
