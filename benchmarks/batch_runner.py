"""Closed-loop batching speed-up on SmolLM2-135M (CPU, torch backend): N (policy, budget) configurations run
one at a time vs as one batch (`gpu_validate.runner.run_batch`), and the batched results checked against the
solo ones. Writes benchmarks/results/batch_runner.json.

    python benchmarks/batch_runner.py [--model smollm2-135m] [--prompt 128] [--decode 32]
"""
from __future__ import annotations

import argparse
import os
import sys
import time


POLICIES = ("streaming_llm", "h2o", "tova", "snapkv", "pyramidkv", "cascading", "bumblebee", "ada_snapkv")


def main(argv: list[str]) -> int:
    import numpy as np
    import torch  # noqa: F401  (loaded first, so limit_threads caps its pool too)

    from benchmarks._util import machine, write_result
    from gpu_validate.runner import BatchJob, CompressedRunner, run_batch
    from sim.specs import parse_policy
    from sim.threads import limit_threads
    from traces.model import default_text
    from traces.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--budgets", default="32,64")
    ap.add_argument("--solo", type=int, default=3, help="configurations also timed one at a time (default 3)")
    args = ap.parse_args(argv)
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
    path = write_result("batch_runner", out)
    print(f"{len(jobs)} configs: batch {t_batch:.1f} s, solo {per_solo:.1f} s each -> speed-up "
          f"{out['speedup']:.1f}x; max |ΔNLL| batch vs solo {max_dnll:.2e}; top-1 identical {same_top1}; {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
