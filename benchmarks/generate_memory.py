"""A policy inside ``model.generate()``: decode speed, peak memory and K/V bytes held, against transformers' own cache.

Each configuration runs in its own process (peak RSS from ``/usr/bin/time``): the model generates ``--new-tokens``
greedy tokens after a long prompt of real prose (the shipped texts, repeated), once with transformers' own cache
(``DynamicCache``; on Gemma-3 its hybrid cache, which holds only the 512-token window on the sliding layers) and
once per budget with kvsim's cache (`gpu_validate.generation`) running ``--policy``. Decode tokens/s is timed
between the first and the last new token (a streamer stamps each), so the prompt phase is not counted on either
side. CPU, torch backend, one process at a time. SmolLM2's prompt is 8 064 tokens: with the 64 new ones it fills
its 8 192 positions.

    python -m benchmarks.generate_memory [--model smollm2-135m] [--prompt-tokens 8064] [--budgets 256,1024,4096]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._util import machine, user_env, write_result

DEFAULTS = {"smollm2-135m": {"prompt": 8064, "sliding": ["keep"]},
            "gemma3-270m": {"prompt": 16384, "sliding": ["keep", "compress"]}}


class StampStreamer:
    """transformers' streamer protocol: the wall time of every ``put`` after the prompt's."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def tokens_per_s(self) -> float:
        n = len(self.stamps) - 1
        return n / (self.stamps[-1] - self.stamps[0]) if n > 0 else float("nan")


def one(args: argparse.Namespace) -> dict:
    """One configuration in this process; returns its JSON row."""
    import torch

    from traces.models import load_model

    torch.set_grad_enabled(False)
    model, tok = load_model(args.model, progress=False)
    ids = tok(Path(args.prompt_file).read_text(), verbose=False)["input_ids"][:args.prompt_tokens]
    streamer = StampStreamer()
    t0 = time.perf_counter()
    if args.cache == "transformers":
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new_tokens, do_sample=False,
                             min_new_tokens=args.new_tokens, streamer=streamer)
        from traces.hf.geometry import model_shape

        new = out[0, len(ids):].tolist()
        shape = model_shape(model)
        per_slot = shape.n_kv_heads * 2 * shape.head_dim * next(model.parameters()).element_size()
        seen = len(ids) + len(new) - 1
        kinds = shape.layer_types or ("full_attention",) * shape.n_layers
        window = shape.sliding_window or seen
        held = sum(min(seen, window) if k == "sliding_attention" else seen for k in kinds) * per_slot
        row = {"kv_bytes_held": int(held), "kv_bytes_full_cache": int(seen * len(kinds) * per_slot)}
    else:
        from gpu_validate.generation import generate

        res = generate(model, [ids], args.policy, args.budget, max_new_tokens=args.new_tokens, streamer=streamer,
                       sliding=args.sliding)
        new = res.rows[0].new_tokens
        row = {"kv_bytes_held": int(res.rows[0].kv_bytes_held),
               "kv_bytes_full_cache": int(res.rows[0].kv_bytes_full_cache)}
    return {"cache": args.cache, "policy": None if args.cache == "transformers" else args.policy,
            "budget": args.budget, "sliding": args.sliding, "prompt_tokens": len(ids), "new_tokens": len(new),
            "decode_tokens_per_s": streamer.tokens_per_s(), "seconds_total": time.perf_counter() - t0,
            "new_token_ids": new, **row}


def timed_one(model: str, prompt_file: str, prompt_tokens: int, new_tokens: int, cache: str, policy: str = "",
              budget: int = 0, sliding: str = "keep") -> dict:
    """`one` in a fresh process under /usr/bin/time (peak RSS of the whole process)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        cmd = ["/usr/bin/time", "-f", "%M", "-o", tf.name, sys.executable, "-m", "benchmarks.generate_memory", "--one",
               "--model", model, "--prompt-file", prompt_file, "--prompt-tokens", str(prompt_tokens),
               "--new-tokens", str(new_tokens), "--cache", cache, "--policy", policy, "--budget", str(budget),
               "--sliding", sliding]
        proc = subprocess.run(cmd, env=user_env(), capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"{cache} {policy} {budget} failed: {proc.stderr[-3000:]}")
        peak_kb = int(tf.read().split()[-1])
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**row, "peak_rss_mb": peak_kb / 1024}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(DEFAULTS))
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="256,1024,4096")
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-file", help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="kvsim", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--sliding", default="keep", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args)))
        return 0
    from benchmarks.long_context import long_text

    d = DEFAULTS[args.model]
    n = args.prompt_tokens or d["prompt"]
    text = str(long_text(n, args.model))
    rows = []
    out = {"model": args.model, "prompt_tokens": n, "new_tokens": args.new_tokens, "policy": args.policy,
           "device": "cpu", "backend": "torch", "rows": rows, "machine": machine()}
    plan = [("transformers", "", 0, "keep")] + [("kvsim", args.policy, int(b), s) for b in args.budgets.split(",")
                                                 for s in d["sliding"]]
    for cache, policy, budget, sliding in plan:
        r = timed_one(args.model, text, n, args.new_tokens, cache, policy, budget, sliding)
        rows.append(r)
        print(f"{cache:>12s} {policy or '':>8s} {budget or '':>5} {sliding:>8s}: {r['decode_tokens_per_s']:.2f} tok/s, "
              f"K/V held {r['kv_bytes_held'] / 2 ** 20:.1f} MiB of {r['kv_bytes_full_cache'] / 2 ** 20:.1f}, "
              f"peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
        write_result(f"generate_{args.model}", out)
    base = rows[0]
    for r in rows[1:]:
        r["speed_vs_transformers"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        r["kv_share_of_transformers"] = r["kv_bytes_held"] / base["kv_bytes_held"]
        r["kv_share_of_full"] = r["kv_bytes_held"] / r["kv_bytes_full_cache"]
    out["load_avg_1min_after"] = machine()["load_avg_1min"]
    print(f"wrote {write_result(f'generate_{args.model}', out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
