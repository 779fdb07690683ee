"""The full-cache reference: the unmodified model's logits over a long sequence, a chunk of tokens at a time.

The forward itself is the model adapter's (`traces.hf.forward.forward_in_chunks`: the model's own KV cache between
chunks, the LM head run only on the positions asked for), so memory stays bounded at any length: one forward
over 32 k tokens would build T x T masks in every layer and T x V logits (Gemma-3's 262 k vocabulary: 34 GB).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from gpu_validate.validate_error import ValidateError
from traces.hf.forward import DEFAULT_CHUNK, forward_in_chunks


def full_model_logits(model, ids: Sequence[int], *, start: int = 0, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """Logits [T - start, V] of the unmodified model over ``ids`` at positions start .. T-1 (the full-cache
    reference), ``chunk`` tokens per forward."""
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
