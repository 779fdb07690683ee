"""`kvsim record`: record an attention trace from any model the registry resolves (name, HF folder, .gguf)."""
from __future__ import annotations

import argparse
from pathlib import Path

from sim.commands._common import add_model_option, add_text_option, positive_int


def _index_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip() != "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 0,2, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one index")
    return vals


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "record", help="record post-RoPE q/k/v traces from a HF decoder model",
        description="Prefill N prompt tokens and decode M tokens (greedy or teacher-forced) with a model "
                    "(registered name, local HF folder or .gguf), capture q/k/v of every (or the chosen) layer, "
                    "check faithfulness, write a trace.")
    add_model_option(p)
    add_text_option(p, what="text to record")
    p.add_argument("--prompt-tokens", type=positive_int, default=512, help="prompt (prefill) length N")
    p.add_argument("--decode-tokens", type=positive_int, default=256, help="decoded tokens M")
    p.add_argument("--out", type=Path, required=True, help="trace directory to create")
    p.add_argument("--keep-layers", dest="layers", type=_index_list, default=None,
                   help="indices of the model layers to keep, e.g. 0,2 (default all)")
    p.add_argument("--keep-kv-heads", dest="kv_heads", type=_index_list, default=None,
                   help="indices of the KV heads to keep with their query groups, e.g. 0 (default all)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="storage dtype of q/k/v")
    p.add_argument("--model-dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="dtype to run the model in (default: as saved)")
    p.add_argument("--teacher-forced", action="store_true", help="feed the text's tokens instead of greedy decode")
    p.add_argument("--single-pass", action="store_true",
                   help="with --teacher-forced: one causal forward over all tokens instead of token-by-token decode")
    p.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="N",
                   help="tokens per model forward while prefilling (default 512): each chunk attends over the "
                        "model's cache plus itself, so memory stays bounded at long context")
    p.add_argument("--kvzip", action="store_true",
                   help="also record KVzip's context-reconstruction pass (the model rereads the prompt; the "
                        "kvzip policy needs it): one more forward over the prompt and its repeat, about the "
                        "prompt's q/k again in bytes")
    p.add_argument("--kvzip-chunk", type=positive_int, default=2048, metavar="N",
                   help="with --kvzip: prompt tokens reread per pass (kvpress's chunk_size, default 2048)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from traces.models import load_model, model_id
    from traces.recorder import RecordError, record_trace

    if not (args.device == "cpu" or args.device.startswith("cuda")):
        raise RecordError(f"--device must be cpu or cuda[:i], got {args.device!r}")
    from traces.model import read_text

    text, text_id = read_text(args.text)
    source = {"text_id": text_id}
    model, tok = load_model(args.model, device=args.device, torch_dtype=args.model_dtype)
    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
    res = record_trace(model, ids, args.out, n_prompt=args.prompt_tokens, n_decode=args.decode_tokens,
                       tokenizer=tok, layers=args.layers, kv_heads=args.kv_heads, dtype=args.dtype,
                       teacher_forced=args.teacher_forced, model_id=model_id(args.model), source=source,
                       progress=not args.no_progress,
                       overwrite=args.overwrite, single_pass=args.single_pass, chunk=args.prefill_chunk,
                       reconstruction_chunk=args.kvzip_chunk if args.kvzip else None)
    worst = max(r.rel_err for r in res.faithfulness)
    print(f"wrote {res.path}: {args.prompt_tokens}+{args.decode_tokens} tokens, {len(res.faithfulness)} layers, "
          f"faithful (max rel err {worst:.1e}), mean decode NLL {res.mean_nll_decode:.3f}")
    return 0
