"""Classify the attention heads of a recorded trace: sinks, local, previous-token and induction heads.

Scores per (layer, query head), averaged over queries at positions >= min_pos, from the stored q/k:
  sink   = attention on position 0;            local = attention on the last `window` positions (self incl.);
  prev   = attention on position t-1; top_token = the token text most often holding a query's largest weight
  (share of queries, mean distance), which exposes delimiter sinks such as newlines;
          induction = on a trace of a token block repeated twice
  (random vocabulary ids, or a held-out text passage with --induction-block text),
  attention of a second-copy query at t on t-L+1 (the token that followed the query's previous occurrence).
    PYTHONPATH=. python -m traces.model.analyze_heads --out traces/model/heads.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from traces.format import load_trace
from traces.model import default_text, load_default_model, record_default_trace
from traces.recorder import record_trace

SINK, LOCAL, PREV, INDUCTION = 0.3, 0.5, 0.4, 0.3   # thresholds for naming a head by its dominant pattern


def attention_rows(q: np.ndarray, k: np.ndarray, scale: float, rows: np.ndarray) -> np.ndarray:
    """Causal softmax probabilities [len(rows), Hq, T] of the chosen query rows (GQA: head h uses h // g)."""
    T, hq, _ = q.shape
    g = hq // k.shape[1]
    kk = np.repeat(np.asarray(k, np.float64), g, axis=1)                     # [T, Hq, d]
    logits = np.einsum("rhd,thd->rht", np.asarray(q, np.float64)[rows], kk) * scale
    logits = np.where(np.arange(T)[None, None, :] > rows[:, None, None], -np.inf, logits)
    logits -= logits.max(axis=2, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(axis=2, keepdims=True)


def pattern_scores(trace, min_pos: int = 32, window: int = 8) -> list[dict]:
    """Sink / local / previous-token scores per (layer, head) of a trace."""
    out = []
    rows = np.arange(min_pos, trace.meta.n_tokens)
    for i, layer in enumerate(trace.meta.model.layer_ids):
        la = trace.layer(i)
        p = attention_rows(la.q, la.k, trace.meta.softmax_scale, rows)
        t = rows[:, None]
        local_mask = (np.arange(p.shape[2])[None, :] > t - window)              # [R, T]; causal part already 0
        texts = trace.tokens["text"].tolist() if trace.tokens is not None else None
        for h in range(p.shape[1]):
            ph = p[:, h]
            rec = {"layer": int(layer), "head": h, "sink": float(ph[:, 0].mean()),
                   "local": float((ph * local_mask).sum(1).mean()),
                   "prev": float(ph[np.arange(len(rows)), rows - 1].mean())}
            if texts is not None:
                top = ph.argmax(1)
                word, n = Counter(texts[j] for j in top).most_common(1)[0]
                hit = np.array([texts[j] == word for j in top])
                rec.update(top_token=word, top_token_share=float(hit.mean()),
                           top_token_distance=float((rows - top)[hit].mean()))
            out.append(rec)
    return out


def induction_scores(trace, block: int) -> dict[tuple[int, int], float]:
    """Attention of second-copy queries on the successor of their previous occurrence (random block x2)."""
    rows = np.arange(block + 1, 2 * block)
    res = {}
    for i, layer in enumerate(trace.meta.model.layer_ids):
        la = trace.layer(i)
        p = attention_rows(la.q, la.k, trace.meta.softmax_scale, rows)
        for h in range(p.shape[1]):
            res[(int(layer), h)] = float(p[np.arange(len(rows)), h, rows - block + 1].mean())
    return res


def label(s: dict) -> str:
    names = [n for n, thr in (("sink", SINK), ("local", LOCAL), ("prev-token", PREV), ("induction", INDUCTION))
             if s[n.split("-")[0]] >= thr]
    return "+".join(names) or "diffuse"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "heads.json")
    ap.add_argument("--tokens", type=int, default=1024, help="length of the natural-text trace")
    ap.add_argument("--block", type=int, default=256, help="block length for the induction test")
    ap.add_argument("--induction-block", choices=("random", "text"), default="random",
                    help="repeat random token ids, or a held-out text passage (from token 2048 on)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        nat = load_trace(record_default_trace(Path(tmp) / "text", n_prompt=args.tokens // 2,
                                              n_decode=args.tokens - args.tokens // 2))
        scores = pattern_scores(nat)
        model, tok = load_default_model()
        rng = np.random.default_rng(0)
        if args.induction_block == "random":
            blk = rng.integers(1, model.config.vocab_size, args.block).tolist()
        else:
            blk = tok(default_text(), verbose=False)["input_ids"][2048:2048 + args.block]
        rep = record_trace(model, blk + blk, Path(tmp) / "rep", n_prompt=args.block, n_decode=args.block,
                           teacher_forced=True, progress=False, model_id="kvsim-tiny-llama",
                           source={"text_id": f"{args.induction_block}-block-x2"})
        ind = induction_scores(load_trace(rep.path), args.block)
        rep_tok = load_trace(rep.path).tokens
    nll1 = float(rep_tok["nll"][1:args.block].mean())
    nll2 = float(rep_tok["nll"][args.block + 1:].mean())
    for s in scores:
        s["induction"] = ind[(s["layer"], s["head"])]
        s["label"] = label(s)
    res = {"natural_text_tokens": args.tokens, "induction_block": args.induction_block, "block": args.block,
           "thresholds":
           {"sink": SINK, "local": LOCAL, "prev": PREV, "induction": INDUCTION},
           "repeated_block_nll_first_copy": round(nll1, 3), "repeated_block_nll_second_copy": round(nll2, 3),
           "heads": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()} for s in scores]}
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print("| layer | head | sink | local | prev | induction | top token (share, distance) | label |")
    print("|---|---|---|---|---|---|---|---|")
    for s in res["heads"]:
        print(f"| {s['layer']} | {s['head']} | {s['sink']:.2f} | {s['local']:.2f} | {s['prev']:.2f} | "
              f"{s['induction']:.2f} | {s['top_token']!r} ({s['top_token_share']:.2f}, {s['top_token_distance']:.0f}) "
              f"| {s['label']} |")
    print(f"repeated {args.induction_block} block NLL: first copy {nll1:.3f}, second copy {nll2:.3f}")


if __name__ == "__main__":
    main()
