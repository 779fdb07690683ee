"""A model's own forward over a long sequence, a chunk of tokens at a time.

One forward over a long prompt builds T x T masks and scores in every layer, and T x V logits (Gemma-3's 262 k
vocabulary makes 32 k tokens' logits 34 GB); fed ``chunk`` tokens per forward with the model's KV cache between
forwards, and the LM head run only on the positions asked for, memory stays bounded. The closed loop's prompt
forward (`gpu_validate.prompt_store`) and the full-cache reference logits (`full_model_logits`) both go this way.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch

from gpu_validate.jobs import ValidateError

#: prompt tokens per model forward when a batch's prompts go through the model with its own attention
PROMPT_CHUNK = 512


def forward_in_chunks(model, ids: torch.Tensor, chunk: int, keep) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Feed ``ids`` [B, T] through ``model`` ``chunk`` tokens per forward with the model's own KV cache between
    forwards (no layer builds a T x T mask or score matrix: bounded memory at long context), and yield (c0, c1,
    the logits of the chunk's last ``keep(c0, c1)`` positions) for each chunk [c0, c1); the LM head runs on those
    positions alone."""
    from traces.recorder import cache_keyword, returned_cache

    kw_name, past = cache_keyword(model), None
    for c0 in range(0, ids.shape[1], chunk):
        c1 = min(ids.shape[1], c0 + chunk)
        kw = {kw_name: past} if past is not None else {}
        out = model(input_ids=ids[:, c0:c1], use_cache=True, logits_to_keep=keep(c0, c1), **kw)
        past = returned_cache(out)
        yield c0, c1, out.logits


def full_model_logits(model, ids: Sequence[int], *, start: int = 0, chunk: int = PROMPT_CHUNK) -> np.ndarray:
    """Logits [T - start, V] of the unmodified model over ``ids`` at positions start .. T-1 (the full-cache
    reference), ``chunk`` tokens per forward (`forward_in_chunks`): one forward over 32 k tokens would need tens
    of GB (Gemma-3's 262 k-token vocabulary alone makes T x V logits 34 GB)."""
    ids = [int(x) for x in ids]
    if not 0 <= start < len(ids):
        raise ValidateError(f"start must be in [0, {len(ids)}) for {len(ids)} tokens, got {start}")

    x = torch.tensor([ids], device=next(model.parameters()).device)
    parts = []
    model.eval()
    with torch.no_grad():   # keep: the chunk's positions at or after start (at least one: the head needs a row)
        for c0, c1, logits in forward_in_chunks(model, x, chunk, lambda c0, c1: max(1, c1 - max(start, c0))):
            if c1 > start:
                parts.append(logits[0, -(c1 - max(start, c0)):].float().cpu().numpy())
    return np.concatenate(parts)
