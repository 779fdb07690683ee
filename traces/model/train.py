"""Train kvsim's shipped tiny Llama-style model (GQA + RoPE) on offline text, on one CPU thread.

Reproducible: fixed seed, fixed corpus (see corpus.py), token-budget curriculum over sequence length.
Schedule progress (LR cosine, curriculum phase) is the larger of the token-budget fraction and the
wall-clock-cap fraction, so a slow shared machine still ends with a decayed LR and the long phase.
At every checkpoint the held-out NLL is measured and the fp16 export is rewritten atomically only when
it improved, so stopping (SIGTERM, cap, crash) never leaves a half-written or overfit model. Run:
    PYTHONPATH=. nice -n 10 python -m traces.model.train --minutes 60
A second stage continues from an exported model (--init-from) with its own curriculum, e.g. long contexts
at a low learning rate; it reuses that model's tokenizer.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import numpy as np

from traces.format import atomic_write_bytes
from traces.model.corpus import corpus_digest, load_documents, split_documents

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "kvsim-tiny-llama"
#: training logs and state go beside the benchmark results in the checkout, not into the package
LOGS = HERE.parents[1] / "benchmarks" / "results" / "tiny_model_training"
EOS = "<|endoftext|>"
# (fraction of the token budget at which the phase starts, sequence length, sequences per step)
CURRICULUM = ((0.0, 256, 32), (0.35, 512, 16), (0.65, 1024, 8), (0.85, 2048, 4))


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE trained on the training documents only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """Concatenate documents, each followed by EOS, into one int32 token stream."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def build_config(vocab_size: int, args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.max_positions, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attention_bias=False, mlp_bias=False, initializer_range=0.02,
    )


def parse_curriculum(text: str) -> tuple[tuple[float, int, int], ...]:
    """'0:1024:8,0.5:2048:4' -> ((0.0, 1024, 8), (0.5, 2048, 4)): start fraction, sequence length, batch."""
    try:
        phases = tuple((float(a), int(b), int(c)) for a, b, c in (p.split(":") for p in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"curriculum must look like 0:1024:8,0.5:2048:4, got {text!r}") from None
    if not phases or phases[0][0] != 0.0 or any(x[0] >= y[0] for x, y in zip(phases, phases[1:])):
        raise argparse.ArgumentTypeError(f"curriculum must start at 0 and increase, got {text!r}")
    return phases


def phase_for(progress: float, curriculum=CURRICULUM) -> tuple[int, int]:
    seq, bs = curriculum[0][1:]
    for start, s, b in curriculum:
        if progress >= start:
            seq, bs = s, b
    return seq, bs


def lr_at(progress: float, step: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of peak over the schedule's progress in [0, 1]."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(progress, 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def export(model, out: Path) -> None:
    """Write fp16 safetensors + config.json via a temp dir; each file lands with os.replace."""
    half = copy.deepcopy(model).to(dtype=__import__("torch").float16)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".export-") as tmp:
        half.save_pretrained(tmp, safe_serialization=True)
        for name in ("config.json", "generation_config.json", "model.safetensors"):
            src = Path(tmp) / name
            if src.exists():
                os.replace(src, out / name)


def eval_loss(model, stream: np.ndarray, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token NLL over non-overlapping windows of the held-out stream."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        n = min((len(stream) - 1) // seq_len, max_windows)
        for i in range(n):
            x = torch.from_numpy(stream[i * seq_len:(i + 1) * seq_len + 1].astype(np.int64))[None]
            logits = model(input_ids=x[:, :-1]).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum")
            total += float(nll)
            count += seq_len
    model.train()
    return total / max(count, 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--minutes", type=float, default=60.0, help="wall-clock cap for the training loop")
    ap.add_argument("--total-tokens", type=int, default=6_000_000, help="token budget of the schedule")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--checkpoint-seconds", type=float, default=180.0)
    ap.add_argument("--log", type=Path, default=LOGS / "train_log.jsonl")
    ap.add_argument("--state", type=Path, default=LOGS / "train_state.json")
    ap.add_argument("--init-from", type=Path, default=None, help="continue from an exported model folder")
    ap.add_argument("--curriculum", type=parse_curriculum, default=CURRICULUM,
                    help="start:seq_len:batch,... over schedule progress (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.init_from is not None and args.init_from.resolve() == args.out.resolve():
        ap.error("--init-from must differ from --out (the export is rewritten during training)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))

    docs = load_documents()
    train_docs, held_docs = split_documents(docs)
    tok = _tokenizer(args, train_docs)
    train_ids = encode_stream(tok, [t for _, t in train_docs])
    val_ids = encode_stream(tok, [t for _, t in held_docs])
    _save_tokenizer(tok, args)
    heldout_text = "".join(t for _, t in held_docs)
    atomic_write_bytes(HERE / "data" / "heldout.txt", heldout_text.encode("utf-8"))

    model, opt = _model_and_optimizer(tok, args)
    n_params = sum(p.numel() for p in model.parameters())
    state = {
        "corpus": {"train_docs": [d for d, _ in train_docs], "heldout_docs": [d for d, _ in held_docs],
                   "sha256": corpus_digest(docs), "train_tokens": int(len(train_ids)),
                   "heldout_tokens": int(len(val_ids)), "train_chars": sum(len(t) for _, t in train_docs),
                   "heldout_chars": len(heldout_text)},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "curriculum": args.curriculum, "n_params": n_params, "step": 0, "tokens_seen": 0, "finished": False,
    }
    print(json.dumps({k: state[k] for k in ("n_params",)} | {"train_tokens": len(train_ids),
                                                             "val_tokens": len(val_ids)}), flush=True)
    _train(args, model, opt, train_ids, val_ids, state, rng, stop)


def _tokenizer(args: argparse.Namespace, train_docs: list[tuple[str, str]]):
    """The model's tokenizer: the one of ``--init-from``'s model, else a BPE trained on the training documents."""
    if args.init_from is not None:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
    return train_tokenizer([t for _, t in train_docs], args.vocab)


def _save_tokenizer(tok, args: argparse.Namespace) -> None:
    """Write the tokenizer's files into ``--out`` (each lands with os.replace)."""
    from transformers import PreTrainedTokenizerFast

    args.out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=None,
                                   pad_token=EOS, model_max_length=args.max_positions)
    with tempfile.TemporaryDirectory(dir=args.out.parent, prefix=".tok-") as tmp:
        fast.save_pretrained(tmp)
        for name in os.listdir(tmp):
            os.replace(Path(tmp) / name, args.out / name)


def _model_and_optimizer(tok, args: argparse.Namespace):
    """The model (``--init-from``'s, else freshly initialised from the seeded torch RNG) in training mode, and its
    AdamW with weight decay on the matrices only."""
    import torch
    from transformers import LlamaForCausalLM

    if args.init_from is not None:
        model = LlamaForCausalLM.from_pretrained(args.init_from, local_files_only=True, dtype=torch.float32)
    else:
        model = LlamaForCausalLM(build_config(tok.get_vocab_size(), args))
    model.config._attn_implementation = "sdpa"
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    return model, opt


def _train(args: argparse.Namespace, model, opt, train_ids: np.ndarray, val_ids: np.ndarray, state: dict,
           rng: np.random.Generator, stop: dict) -> None:
    """The training loop: curriculum batches until the token budget, the wall-clock cap or SIGTERM; a log line
    every 10 steps, a checkpoint (held-out NLL, export when it improved, the state file) every
    ``--checkpoint-seconds`` and at the end."""
    import torch

    args.log.unlink(missing_ok=True)
    for path in (args.log, args.state):
        path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    last_ckpt = t0
    step = tokens = 0
    stop_reason = "token budget reached"

    def checkpoint(final: bool) -> None:
        val = eval_loss(model, val_ids, 1024)
        rec = {"step": step, "tokens": tokens, "val_nll_1024": round(val, 4), "val_ppl_1024": round(math.exp(val), 3),
               "elapsed_s": round(time.time() - t0, 1)}
        state.setdefault("val_history", []).append(rec)
        if val < state.get("best_val_nll_1024", float("inf")):
            export(model, args.out)
            state.update(best_val_nll_1024=round(val, 4), best_val_ppl_1024=round(math.exp(val), 3),
                         exported_step=step, exported_tokens_seen=tokens)
        state.update(step=step, tokens_seen=tokens, elapsed_s=round(time.time() - t0, 1), finished=final,
                     stop_reason=stop_reason if final else None)
        atomic_write_bytes(args.state, json.dumps(state, indent=1).encode())
        print(json.dumps(rec), flush=True)

    cap_s = args.minutes * 60
    if args.init_from is not None:
        state["init_val_nll_1024"] = round(eval_loss(model, val_ids, 1024), 4)
    while tokens < args.total_tokens:
        if stop["flag"]:
            stop_reason = "SIGTERM"
            break
        if time.time() - t0 > cap_s:
            stop_reason = f"wall-clock cap {args.minutes} min"
            break
        progress = max(tokens / args.total_tokens, (time.time() - t0) / cap_s)
        seq, bs = phase_for(progress, args.curriculum)
        starts = rng.integers(0, len(train_ids) - seq - 1, size=bs)
        batch = torch.from_numpy(np.stack([train_ids[s:s + seq + 1] for s in starts]).astype(np.int64))
        lr = lr_at(progress, step, args.lr, args.warmup)
        loss = _train_step(model, opt, batch, lr)
        step += 1
        tokens += bs * seq
        if step % 10 == 0:
            rec = {"step": step, "tokens": tokens, "seq_len": seq, "loss": round(float(loss), 4),
                   "lr": round(lr, 6), "elapsed_s": round(time.time() - t0, 1)}
            with open(args.log, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), flush=True)
        if time.time() - last_ckpt > args.checkpoint_seconds:
            checkpoint(False)
            last_ckpt = time.time()
    checkpoint(True)
    print(json.dumps({"done": stop_reason, "step": step, "tokens": tokens}), flush=True)


def _train_step(model, opt, batch, lr: float):
    """One optimiser step on ``batch`` [B, seq + 1] (next-token cross-entropy, gradients clipped at 1) at learning
    rate ``lr``; returns the loss."""
    import torch

    for g in opt.param_groups:
        g["lr"] = lr
    logits = model(input_ids=batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


if __name__ == "__main__":
    main()
