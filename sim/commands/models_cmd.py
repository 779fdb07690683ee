"""``kvsim models``: the registered models (size, source, licence, cached or not); ``--fetch`` caches one."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the registered models and whether each is cached",
                       description="List kvsim's named models with their licences. Any command's --model also "
                                   "takes a local Hugging Face folder or a .gguf file (Llama, Qwen2, Qwen3, Mistral, "
                                   "Gemma-3).")
    p.add_argument("--fetch", metavar="NAME", default=None,
                   help="fetch and convert this model into the cache now (e.g. on a connected machine)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from traces.models import DEFAULT_MODEL, MODELS, ModelError, cache_dir, entry, is_cached, model_folder, \
        resolve_model

    if args.fetch:
        if entry(args.fetch) is None:
            raise ModelError(f"--fetch {args.fetch!r}: not a registered model; choose from {', '.join(MODELS)}")
        print(f"{args.fetch}: ready in {resolve_model(args.fetch)}")
    table = Table(title=f"kvsim models (cache: {cache_dir()}, set KVSIM_CACHE to move it)")
    for col in ("name", "model", "parameters", "size", "source", "licence", "cached"):
        table.add_column(col, overflow="fold")
    for e in MODELS.values():
        cached = ("shipped" if e.shipped
                  else f"yes: {model_folder(e)}" if is_cached(e) else "no (fetched on first use)")
        table.add_row(e.name + (" (default)" if e.name == DEFAULT_MODEL else ""), e.title, e.params, e.size,
                      e.source, e.licence, cached)
    Console(width=160).print(table)
    return 0
