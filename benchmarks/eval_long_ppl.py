"""Closed-loop perplexity at long context: Cascading KV cache vs StreamingLLM at equal memory (the Cascading paper's
claim) and BUZZ vs H2O at equal peak budget (BUZZ's Table 3), inside the real model.

The text (``--text``, the shipped ``default+idle`` by default) is cut to ``--prompt`` + ``--decode`` tokens; the
prompt streams through each policy's cache (Cascading, StreamingLLM and H2O token by token: Cascading refuses
chunked prefill, and the other two stream as their papers do; BUZZ samples it once, Remark 2), then the
``--decode`` tokens are teacher forced and scored. PPL / ΔPPL are against the unmodified model on the same tokens
(`gpu_validate.closedloop.model_metrics.metrics_of_run`). The rows go through the model batched (`gpu_validate.closedloop.runner.run_batch`:
one batch per kind, streamed or prefill selector, and budget tier, the prompt's forward shared by all; one batch of
budgets 256-2048 padded every row to 2048 slots: 1.7 s a streamed token on SmolLM2-135M here). Writes
benchmarks/results/eval_long_ppl_<model>_<context>k.json.

    python -m benchmarks.eval_long_ppl --model smollm2-135m --prompt 7936 --decode 256 \\
        --budgets 256,512,1024,2048

``--policies`` picks the rows (default cascading, streaming_llm, h2o, buzz); a short run (``--prompt 512
--decode 32``) measures the cost first.
"""
from __future__ import annotations

import argparse
import sys
import time


POLICIES = ("cascading", "streaming_llm", "h2o", "buzz")


def main(argv: list[str]) -> int:
    import torch  # noqa: F401  (loaded first, so limit_threads caps its pool too)

    from benchmarks._util import length_result_name, machine, write_result
    from gpu_validate.closedloop.model_metrics import metrics_of_run
    from gpu_validate.closedloop.chunked_forward import full_model_logits
    from gpu_validate.closedloop.jobs import BatchJob
    from gpu_validate.closedloop.runner import run_batch
    from sim.experiments.specs import parse_policy
    from sim.replay.threads import limit_threads
    from traces.model import read_text
    from traces.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default="default+idle", help="a shipped text (names joined by '+') or a file")
    ap.add_argument("--prompt", type=int, default=7936)
    ap.add_argument("--decode", type=int, default=256, help="teacher-forced tokens (the first is not scored)")
    ap.add_argument("--budgets", default="256,512,1024,2048", help="slots per KV head and layer, comma-separated")
    ap.add_argument("--policies", default=",".join(POLICIES), help="policy specs, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="result name (default eval_long_ppl_<model>_<context>k)")
    args = ap.parse_args(argv)
    limit_threads(args.threads)
    torch.set_grad_enabled(False)
    t_start = time.perf_counter()
    model, tok = load_model(args.model, device="cpu")
    ids = tok(read_text(args.text)[0], add_special_tokens=False, verbose=False)["input_ids"]
    n = args.prompt + args.decode
    if len(ids) < n:
        raise SystemExit(f"--text has {len(ids)} tokens; --prompt + --decode needs {n}")
    ids = ids[:n]
    budgets = [int(b) for b in args.budgets.split(",")]
    specs = [p for p in args.policies.split(",") if p]
    jobs = [BatchJob(parse_policy(p), b, ids[:args.prompt], continuation=ids[args.prompt:]) for p in specs
            for b in budgets]
    t0 = time.perf_counter()
    full = full_model_logits(model, ids, start=args.prompt)
    full_seconds = time.perf_counter() - t0
    print(f"full-cache reference: {full_seconds:.0f} s", flush=True)
    rows: list[dict] = []

    def done(i: int, res) -> None:
        j = jobs[i]
        m = metrics_of_run(res, model, ids, args.prompt, full)
        m.pop("nll_per_token")
        rows.append({"policy": j.policy.label(), "spec": specs[i // len(budgets)], "budget": j.budget,
                     "streams": j.streams, **m, "batch_rows": res.extra["batch_rows"],
                     "seconds_since_start": round(time.perf_counter() - t_start, 1)})
        print(f"{j.policy.label():>16} @ {j.budget:>5}: PPL {m['ppl']:.3f} (full {m['ppl_full']:.3f}, "
              f"ΔPPL {m['delta_ppl']:+.3f}), top-1 {m['top1_agreement']:.3f}, "
              f"{time.perf_counter() - t_start:.0f} s", flush=True)

    run_batch(model, jobs, max_rows=len(jobs), on_result=done)
    model_id = args.model.rstrip("/").split("/")[-1]
    name = args.out or length_result_name("eval_long_ppl", model_id, n)
    path = write_result(name, {
        "model": model_id, "context_tokens": n, "n_prompt": args.prompt, "n_decode": args.decode,
        "text": args.text, "layers": "all", "policies": specs, "budgets": budgets, "threads": args.threads,
        "full_reference_seconds": round(full_seconds, 1), "seconds": round(time.perf_counter() - t_start, 1),
        "machine": machine(), "rows": rows})
    print(f"wrote {path} in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
