"""`generate`: token-id prompts in, new tokens out, through transformers' own ``model.generate`` over a
`KVSimCache` (greedy or sampled, a batch of prompts of any lengths), with the memory the caches held and the
decode speed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from gpu_validate.generation.hooks import kvsim_cache
from gpu_validate.validate_error import ValidateError
from policies.core.base import Policy
from traces.hf.forward import cache_keyword


@dataclass
class Generated:
    """One prompt's continuation: its new token ids (up to and including an end-of-sequence token) and the K+V
    bytes its caches held after the last step, against an uncompressed cache over the same tokens."""

    new_tokens: list[int]
    kv_bytes_held: int
    kv_bytes_full_cache: int


@dataclass
class GenerateResult:
    """Every prompt's `Generated`, in prompt order, and the decode steps' wall time (all rows together)."""

    rows: list[Generated]
    decode_seconds: float
    n_decode_steps: int

    @property
    def tokens_per_s(self) -> float:
        """Tokens decoded per second over all rows (the prompt phase not counted)."""
        n = self.n_decode_steps * len(self.rows)
        return n / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def generate(model, prompts: Sequence[Sequence[int]], policy: Policy | str, budget: int | None = None, *,
             max_new_tokens: int = 32, temperature: float = 0.0, streamer: Any = None, seed: int | None = None,
             **options) -> GenerateResult:
    """``model.generate`` of each prompt (token ids) with ``policy`` at ``budget`` slots per KV head and layer
    (None for an unbounded policy: ``full`` is the uncompressed reference). ``temperature`` 0: greedy, else
    sampling at that temperature (``seed`` seeds torch). ``streamer``: transformers' streamer protocol
    (``put(ids)``, ``end()``). Options: `KVSimCache`'s (backend, sliding, prefill_chunk, ...)."""
    prompts = [[int(x) for x in p] for p in prompts]
    if not prompts or min(map(len, prompts)) < 1:
        raise ValidateError("need at least one prompt of at least one token")
    if temperature < 0:
        raise ValidateError(f"temperature must be >= 0, got {temperature}")
    cfg = model.generation_config
    eos = cfg.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else min(eos_ids, default=0)
    T = max(map(len, prompts))
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=device)
    sampling = {"do_sample": True, "temperature": float(temperature)} if temperature > 0 else {"do_sample": False}
    if seed is not None:
        torch.manual_seed(seed)
    with kvsim_cache(model, policy, budget, max_new_tokens=max_new_tokens, **options) as cache:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                             streamer=streamer, **sampling, **{cache_keyword(model): cache})
    held, full = cache.kv_bytes_held(), cache.kv_bytes_full_cache()
    rows = [Generated(_until_eos(out[b, T:].tolist(), eos_ids), held[b], full[b]) for b in range(len(prompts))]
    return GenerateResult(rows, cache.decode_seconds, cache.steps)


def _until_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """``tokens`` up to and including the first end-of-sequence token (generate pads a finished row after it)."""
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[:i + 1]
    return tokens
