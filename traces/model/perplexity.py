"""Measure the shipped model's perplexity on held-out text (and on training text, to show the gap).

Non-overlapping windows of the given context length, first token of each window unscored; writes JSON.
    PYTHONPATH=. python -m traces.model.perplexity --out traces/model/eval.json
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from traces.model import default_text, load_default_model
from traces.model.corpus import load_documents, split_documents


def window_nll(model, ids: np.ndarray, ctx: int, max_windows: int | None = None) -> tuple[float, int]:
    """Mean next-token NLL over non-overlapping windows of ctx tokens; returns (nll, tokens scored)."""
    import torch

    n = (len(ids) - 1) // ctx
    if n < 1:
        raise ValueError(f"text of {len(ids)} tokens is shorter than one window of {ctx}+1")
    n = min(n, max_windows) if max_windows else n
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(n):
            x = torch.from_numpy(ids[i * ctx:(i + 1) * ctx + 1].astype(np.int64))[None]
            logits = model(input_ids=x[:, :-1]).logits[0].float()
            total += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
            count += ctx
    return total / count, count


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "eval.json")
    ap.add_argument("--contexts", default="256,1024,2048")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    model, tok = load_default_model()
    eos = tok.eos_token_id
    held = np.asarray(tok(default_text(), verbose=False)["input_ids"], np.int64)
    train_docs, _ = split_documents(load_documents())
    train = np.asarray([t for _, text in train_docs for t in tok(text, verbose=False)["input_ids"] + [eos]], np.int64)
    res = {"heldout_tokens": int(len(held)), "vocab_size": int(model.config.vocab_size), "results": []}
    for ctx in (int(c) for c in args.contexts.split(",")):
        h, hn = window_nll(model, held, ctx)
        t, tn = window_nll(model, train, ctx, max_windows=max(1, hn // ctx))
        res["results"].append({"context": ctx, "heldout_nll": round(h, 4), "heldout_ppl": round(math.exp(h), 2),
                               "heldout_tokens_scored": hn, "train_sample_nll": round(t, 4),
                               "train_sample_ppl": round(math.exp(t), 2)})
        print(json.dumps(res["results"][-1]), flush=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
