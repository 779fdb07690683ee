"""``kvsim generate``: a model generates from a prompt with a policy compressing its KV cache (transformers'
``generate()`` over `gpu_validate.generation.KVSimCache`), the text streamed to the terminal as it comes."""
from __future__ import annotations

import argparse
import json
import sys

from sim.commands._common import (add_chunk_option, add_device_options, add_model_option, add_policy_option,
                                 add_sliding_option, add_threads_option, apply_threads, positive_int)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text inside a real model with a policy compressing its KV cache",
                       description="transformers' generate() with the model's KV cache replaced by kvsim's per-head "
                                   "varlen caches, run by the policy (the memory evicted is freed); the text streams "
                                   "as it is generated. `--policy full` is the uncompressed reference.")
    add_model_option(p)
    add_policy_option(p, extra="; 'full' keeps every token (no --budget needed)")
    p.add_argument("--budget", type=positive_int, default=None,
                   help="slots per KV head and layer (required unless the policy keeps everything)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt")
    src.add_argument("--prompt-file", metavar="FILE", help="a UTF-8 file holding the prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampling at this temperature")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    add_device_options(p)
    add_sliding_option(p)
    add_chunk_option(p)
    add_threads_option(p)
    p.add_argument("--json", action="store_true", help="end with one line of JSON: the text, token ids, memory, speed")
    p.set_defaults(func=run)


class _TextStream:
    """transformers' streamer protocol: writes the text of the new tokens as they come (the prompt, the first
    ``put``, is skipped; a token that ends inside a multi-byte character waits for the next)."""

    def __init__(self, tokenizer, out) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.shown = 0
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids.extend(int(x) for x in value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.out.write(text[self.shown:])
            self.out.flush()
            self.shown = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.out.write(text[self.shown:] + "\n")
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    import torch

    from gpu_validate.kvcache.backends import pick_device
    from gpu_validate.generation import generate
    from gpu_validate.closedloop.jobs import check_run_args
    from sim.experiments.specs import parse_policy
    from traces.models import load_model

    apply_threads(args)
    torch.set_grad_enabled(False)
    policy = parse_policy(args.policy)
    if args.budget is None and not policy.unbounded:
        raise ValueError(f"--budget is required for policy {policy.label()}")
    check_run_args(policy, args.budget or 1, args.backend or "torch")   # before the model loads
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = args.prompt
    device, backend = pick_device(args.device, args.backend)
    model, tok = load_model(args.model, device=device)
    ids = tok(text, verbose=False)["input_ids"]
    if not ids:
        raise ValueError("the prompt has no tokens")
    res = generate(model, [ids], policy, args.budget, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, seed=args.seed, streamer=_TextStream(tok, sys.stdout),
                   backend=backend, sliding=args.sliding, prefill_chunk=args.chunk)
    row = res.rows[0]
    out = {"text": tok.decode(row.new_tokens, skip_special_tokens=True), "new_tokens": row.new_tokens,
           "kv_bytes_held": row.kv_bytes_held, "kv_bytes_full_cache": row.kv_bytes_full_cache,
           "tokens_per_s": res.tokens_per_s, "policy": policy.label(), "budget": args.budget, "model": args.model,
           "prompt_tokens": len(ids), "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
           "device": device, "backend": backend,
           "sliding": args.sliding, "prefill_chunk": args.chunk, "decode_seconds": res.decode_seconds}
    if args.json:
        print(json.dumps(out))
    else:
        at = "" if args.budget is None else f" @ {args.budget}"
        print(f"{policy.label()}{at}: KV held {row.kv_bytes_held / 2**20:.2f} MiB of "
              f"{row.kv_bytes_full_cache / 2**20:.2f} MiB (full cache), {res.tokens_per_s:.1f} tokens/s",
              file=sys.stderr)
    return 0
