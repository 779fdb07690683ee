"""Arguments shared by several subcommands."""
from __future__ import annotations

import argparse

from sim.specs import open_trace
from traces.format import Trace


def add_trace_args(p: argparse.ArgumentParser, *, many: bool = False) -> None:
    """TRACE positional(s) plus the sizes used when a trace is ``synthetic:KIND``."""
    p.add_argument("traces" if many else "trace", nargs="+" if many else None, metavar="TRACE",
                   help="trace directory, or synthetic:KIND (mixed, sinks, zipf, local, recall, topic_shift, "
                        "adversarial, passkey, random) generated in memory")
    g = p.add_argument_group("synthetic traces")
    g.add_argument("--tokens", type=int, default=1024, help="tokens of a synthetic trace (default 1024)")
    g.add_argument("--prompt", type=int, default=128, help="prompt tokens of a synthetic trace (default 128)")
    g.add_argument("--layers", type=int, default=2, help="layers of a synthetic trace (default 2)")
    g.add_argument("--seed", type=int, default=0, help="seed of a synthetic trace (default 0)")
    p.add_argument("--no-verify", action="store_true", help="skip checksum/NaN verification of trace files")


def trace_refs(args: argparse.Namespace) -> list:
    """The TRACE arguments as references every worker process can reopen."""
    from sim.executors import TraceRef

    return [TraceRef(spec, args.tokens, args.prompt, args.layers, args.seed) for spec in args.traces]


def load(args: argparse.Namespace, spec: str) -> Trace:
    return open_trace(spec, n_tokens=args.tokens, n_prompt=args.prompt, n_layers=args.layers, seed=args.seed,
                      verify=not args.no_verify)


def int_list(text: str) -> list[int]:
    """``32,64,128`` -> [32, 64, 128]."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_model_option(p: argparse.ArgumentParser, *, default: str | None = "smollm2-135m") -> None:
    """``--model NAME|DIR|FILE.gguf``, resolved by traces.models (the one place that knows models)."""
    p.add_argument("--model", default=default, required=default is None, metavar="NAME|DIR|FILE.gguf",
                   help="a registered model (`kvsim models`: smollm2-135m, tiny), a local Hugging Face folder, or a "
                        "llama-family .gguf file" + (f" (default {default})" if default else ""))
