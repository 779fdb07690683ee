"""Running a transformers model forward: over its own KV cache a chunk at a time, or at given positions.

One forward over a long prompt builds T x T masks and scores in every layer, and T x V logits (Gemma-3's 262 k
vocabulary makes 32 k tokens' logits 34 GB). `CachedForward` feeds a model piece by piece with its own KV cache
carried between forwards, and runs the LM head only on the positions asked for, so memory stays bounded;
`forward_in_chunks` is its loop over a whole sequence, ``chunk`` tokens per forward. The recorder (prompt in
chunks, then decode steps on the same cache), the faithfulness check, the closed loop's prompt forward, the
full-cache reference logits and the benchmarks' plain-model timings all go this way. `forward_at` is the other
kind of forward kvsim makes: tokens at given positions without the model's cache, for the routed decode steps whose
attention holds the cache itself (`traces.hf.routing`).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

#: tokens per forward when a prompt (or a teacher-forced text) is fed through the model: each chunk attends over the
#: model's cache plus itself, so no layer builds a T x T mask and the logits of one chunk are all that is held
DEFAULT_CHUNK = 512


def cache_keyword(model) -> str:
    """The keyword a model's forward takes its KV cache by: ``cache`` (transformers >= 5.2x, where
    ``past_key_values`` is deprecated) or ``past_key_values`` (earlier releases)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(out: Any) -> Any:
    """The KV cache a forward returned, under either release's name."""
    return out["cache"] if "cache" in out else out.past_key_values


class CachedForward:
    """A model run forward piece by piece over its own KV cache (``past``, carried from one call to the next)."""

    def __init__(self, model) -> None:
        self.model, self.keyword = model, cache_keyword(model)
        self.device = next(model.parameters()).device
        self.past: Any = None

    def __call__(self, ids, keep: int = 1):
        """Logits [B, keep, V] of the last ``keep`` of ``ids`` ([B, t] tensor, or one row of token ids), fed after
        everything fed before; the LM head runs on those positions alone."""
        import torch

        if not isinstance(ids, torch.Tensor):
            ids = torch.tensor([[int(x) for x in ids]], device=self.device)
        kw = {self.keyword: self.past} if self.past is not None else {}
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=int(keep), **kw)
        self.past = returned_cache(out)
        return out.logits

    def chunks(self, ids, chunk: int, keep: Callable[[int, int], int] = lambda c0, c1: 1
               ) -> Iterator[tuple[int, int, Any]]:
        """Feed ``ids`` [B, T] ``chunk`` tokens per forward and yield (c0, c1, the logits of the chunk's last
        ``keep(c0, c1)`` positions) for each chunk [c0, c1)."""
        chunk = max(1, int(chunk))
        for c0 in range(0, ids.shape[1], chunk):
            c1 = min(ids.shape[1], c0 + chunk)
            yield c0, c1, self(ids[:, c0:c1], keep(c0, c1))


def forward_in_chunks(model, ids, chunk: int = DEFAULT_CHUNK, keep: Callable[[int, int], int] = lambda c0, c1: 1
                      ) -> Iterator[tuple[int, int, Any]]:
    """Feed ``ids`` [B, T] through ``model`` ``chunk`` tokens per forward with the model's own KV cache between
    forwards (no layer builds a T x T mask or score matrix: bounded memory at long context), and yield (c0, c1,
    the logits of the chunk's last ``keep(c0, c1)`` positions) for each chunk [c0, c1)."""
    return CachedForward(model).chunks(ids, chunk, keep)


def forward_at(model, ids, positions, *, logits: bool = True):
    """Tokens ``ids`` [B, t] at ``positions`` [B, t] without the model's KV cache (a routed attention holds it): the
    logits after the last token [B, V] (float32), or None with ``logits=False``, which runs the decoder stack alone
    (the LM head -- a fifth of SmolLM2's decode FLOPs -- is skipped when no prediction is read)."""
    if not logits:
        model.get_decoder()(input_ids=ids, position_ids=positions, use_cache=False)
        return None
    out = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1)
    return out.logits[:, -1].float()


#: the rows (tokens x batch) of a linear layer's input for which `skinny_linears` computes ``(W x^T)^T``
SKINNY_ROWS = range(2, 5)


@contextlib.contextmanager
def skinny_linears(model) -> Iterator[None]:
    """For the block, the model's float32 linear layers on the CPU compute an input of 2-4 rows as ``(W @ x^T)^T``
    instead of ``x @ W^T``: the same products, summed in another order (results agree to float32 rounding).

    Why: a decode step of a small batch is a matrix product with 2-4 rows per weight, and the CPU's BLAS takes a
    slow path for that shape. Measured on this project's 2-core machine (torch 2.13, weights read from memory as a
    decode step reads them): SmolLM2-135M's 211 weight products of a step took 109 ms at 3 rows as ``x @ W^T``
    and 39 ms as ``W @ x^T``; Gemma-3-270M's LM head 224 ms against 55 ms. A closed-loop batch of 3 rows streaming
    a 512-token prompt (critical(TOVA) at budget 48: ~590 model steps) went from 76 s to 46 s. One row, and five or
    more, keep ``x @ W^T`` (no gain, or a loss, there). Other devices and dtypes are left alone."""
    import torch

    def skinny(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if rows not in SKINNY_ROWS:
            return torch.nn.functional.linear(x, module.weight, module.bias)
        y = torch.mm(module.weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
        if module.bias is not None:
            y += module.bias
        return y.reshape(*x.shape[:-1], module.weight.shape[0])

    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"
              and m.weight.dtype == torch.float32 and "forward" not in vars(m)]
    for m in layers:
        m.forward = skinny.__get__(m)
    try:
        yield
    finally:
        for m in layers:
            del m.forward
