"""``kvsim validate``: run one policy at one budget closed-loop inside a real HF model and report its losses."""
from __future__ import annotations

import argparse
import json
import sys

from sim.commands._common import (add_budget_option, add_chunk_option, add_device_options, add_model_option,
                                 add_policy_option, add_sliding_option, add_text_option, add_threads_option,
                                 apply_threads, positive_int)


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"depths must lie in [0, 1], got {text!r}")
    return values


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model/--text/--device/--backend/--prompt shared by validate and fidelity."""
    add_model_option(p)
    add_text_option(p, what="text to score")
    add_device_options(p)
    p.add_argument("--prompt", type=positive_int, default=256, help="prompt tokens")
    p.add_argument("--decode", type=int, default=128, help="teacher-forced continuation tokens scored")
    add_sliding_option(p)
    add_chunk_option(p)
    add_threads_option(p)


def load_model_and_ids(args: argparse.Namespace):
    """(model, tokenizer, token ids of the text, device, backend) from the shared arguments (their --threads cap
    applied to this process)."""
    from gpu_validate.kvcache.backends import pick_device
    from traces.models import load_model

    apply_threads(args)

    device, backend = pick_device(args.device, args.backend)
    if args.prompt < 1 or args.decode < 2:
        raise ValueError(f"--prompt must be >= 1 and --decode >= 2, got {args.prompt} and {args.decode}")
    model, tok = load_model(args.model, device=device)
    from traces.model import read_text

    text = read_text(args.text)[0]
    ids = tok(text, verbose=False)["input_ids"]
    need = args.prompt + args.decode
    if len(ids) < need:
        raise ValueError(f"the text has {len(ids)} tokens; --prompt {args.prompt} + --decode {args.decode} needs "
                         f"{need}")
    return model, tok, ids, device, backend


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="run a policy closed-loop inside a real model (GPU, or CPU for tiny models)",
                       description="Greedy/teacher-forced decoding with the policy evicting from per-head varlen "
                                   "caches (Triton kernels on GPU): perplexity delta and top-1 agreement vs the full "
                                   "cache, passkey retrieval by depth, KV memory held, decode tokens/s.")
    add_model_args(p)
    add_policy_option(p)
    add_budget_option(p)
    p.add_argument("--passkey-depths", type=_floats, default=[0.1, 0.5, 0.9],
                   help="relative depths of the pass key (empty string to skip)")
    p.add_argument("--passkey-context", type=int, default=256, help="tokens of each passkey prompt")
    p.add_argument("--passkey-keys", type=int, default=2, help="keys tried per depth")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from gpu_validate.closedloop.model_metrics import passkey_accuracy, text_metrics
    from gpu_validate.closedloop.jobs import check_run_args
    from sim.experiments.specs import parse_policy

    torch.set_grad_enabled(False)
    policy = parse_policy(args.policy)
    check_run_args(policy, args.budget, args.backend or "torch")
    model, tok, ids, device, backend = load_model_and_ids(args)
    res = {"model": args.model, "policy": policy.label(), "budget": args.budget, "device": device,
           "backend": backend, "n_prompt": args.prompt, "n_decode": args.decode, "sliding": args.sliding}
    from tqdm.auto import tqdm

    n_runs = 1 + (2 * len(args.passkey_depths) * args.passkey_keys if args.passkey_depths else 0)
    with tqdm(total=n_runs, desc="validate", unit="run", file=sys.stderr) as bar:
        m = text_metrics(model, ids[:args.prompt + args.decode], args.prompt, policy, args.budget, backend=backend,
                         sliding=args.sliding, chunk=args.chunk)
        m.pop("nll_per_token")
        res.update(m)
        bar.update(1)
        bar.write(f"{policy.label()} @ {args.budget} text: ΔPPL {m['delta_ppl']:+.3f}  top-1 "
                  f"{m['top1_agreement']:.3f}  {m['tokens_per_s']:.1f} tok/s", file=sys.stderr)
        sys.stderr.flush()

        def done(label: str, hit: bool) -> None:
            bar.update(1)
            bar.write(f"{label}: {'retrieved' if hit else 'missed'}", file=sys.stderr)
            sys.stderr.flush()

        if args.passkey_depths:
            filler = ids[args.prompt + args.decode:] or ids
            kw = dict(depths=args.passkey_depths, n_context=args.passkey_context, n_keys=args.passkey_keys,
                      backend=backend, on_result=done, sliding=args.sliding, chunk=args.chunk)
            res["passkey"] = passkey_accuracy(model, tok, filler, policy, args.budget, **kw)
            from policies.core.registry import get_policy

            res["passkey_full_cache"] = passkey_accuracy(model, tok, filler, get_policy("full"), args.budget, **kw)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{policy.label()} @ budget {args.budget} on {args.model} ({device}, {backend})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in res.items():
        if k not in ("model", "policy", "budget", "device", "backend"):
            table.add_row(k, f"{v:.5g}" if isinstance(v, float) else str(v))
    Console().print(table)
    return 0
