"""KVzip's context-reconstruction pass, as a trace stores it: the plan (which repeat tokens reread which chunk of
the prompt) and the arrays the pass leaves per layer.

KVzip (Kim et al., 2025, arXiv 2505.23416) scores a cached prompt token by how much the model attends to it while
it *rereads* the prompt: after the prompt, the model is fed "repeat the previous context" followed by the context
again, a chunk at a time, each chunk over the prompt's cache alone (the repeat tokens of one chunk are dropped
before the next; kvpress ``KVzipPress``). A trace recorded with ``kvsim record --kvzip`` stores, per layer, the
post-RoPE queries ``recon_q`` [R, Hq, d] and keys ``recon_k`` [R, Hkv, d] of those R repeat tokens (all chunks,
in order), and this plan in its manifest; ``policies.kvzip`` computes its scores from them in replay, and the closed
loop runs the same pass in the model (``traces.hf.reconstruction_pass``).

Repeat tokens of chunk c (kvpress ``KVzipPress.prepare``): the instruction (``FIRST_INSTRUCTION`` for the first
chunk; ``NEXT_INSTRUCTION`` plus the last ``PREV_POSTFIX`` tokens of the previous chunk for the others), the
suffix (``"\\n"``: kvsim's prompts are plain text, not chat turns, which is kvpress's choice for a tokenizer without
a chat template), then the chunk's own tokens. All chunks' repeat tokens sit at positions P, P+1, ... (the cache
holds the prompt alone when each chunk starts). Without a tokenizer (a random-weight model built from a config)
the instruction and suffix are empty: the pass rereads each chunk bare (``ReconstructionPlan.instruction`` says
so). A synthetic trace has no model to reread it: ``synthetic_reconstruction`` takes each chunk's own prompt
queries and keys as its repeat tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

FIRST_INSTRUCTION = "\n\nRepeat the previous context exactly."
NEXT_INSTRUCTION = "\n\nRepeat the part of the previous context exactly, starting with"
SUFFIX = "\n"
#: tokens of the previous chunk repeated after ``NEXT_INSTRUCTION`` (kvpress ``prev_postfix_size``)
PREV_POSTFIX = 8
#: context tokens reread per pass (kvpress ``chunk_size``)
DEFAULT_CHUNK = 2048
#: the per-layer array names of the pass in a trace
ARRAYS = ("recon_q", "recon_k")


class ReconstructionError(ValueError):
    """A reconstruction plan or its arrays are inconsistent (the message names the field)."""


@dataclass(frozen=True)
class ReconstructionChunk:
    """One rereading pass: prompt positions [start, end) reread by the repeat tokens ``ids`` (instruction, suffix,
    then the chunk's ``end - start`` tokens)."""

    start: int
    end: int
    ids: tuple[int, ...]

    @property
    def n_tokens(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class ReconstructionPlan:
    """The chunks of a reconstruction pass over a P-token prompt, and how its instruction was written."""

    chunks: tuple[ReconstructionChunk, ...]
    n_prompt: int
    chunk_size: int = DEFAULT_CHUNK
    instruction: str = "kvpress"      # "kvpress" (FIRST/NEXT_INSTRUCTION + SUFFIX), "none" or "synthetic"

    def __post_init__(self) -> None:
        at = 0
        for i, c in enumerate(self.chunks):
            if c.start != at or c.end <= c.start or c.n_tokens < c.end - c.start:
                raise ReconstructionError(f"reconstruction.chunks[{i}]: [{c.start}, {c.end}) with {c.n_tokens} "
                                          f"repeat tokens does not continue the chunks before it at {at}")
            at = c.end
        if at != self.n_prompt:
            raise ReconstructionError(f"reconstruction.chunks cover {at} prompt tokens, not the trace's "
                                      f"{self.n_prompt}")

    @property
    def n_tokens(self) -> int:
        """R: the repeat tokens of all chunks (the rows of ``recon_q`` / ``recon_k``)."""
        return sum(c.n_tokens for c in self.chunks)

    def layout(self) -> np.ndarray:
        """int64 [n_chunks, 4]: start, end, first repeat row, repeat rows of each chunk (what the kernels read)."""
        rows, out = 0, []
        for c in self.chunks:
            out.append((c.start, c.end, rows, c.n_tokens))
            rows += c.n_tokens
        return np.array(out, np.int64).reshape(-1, 4)

    def to_json(self) -> dict[str, Any]:
        return {"n_prompt": self.n_prompt, "chunk_size": self.chunk_size, "instruction": self.instruction,
                "chunks": [{"start": c.start, "end": c.end, "ids": list(c.ids)} for c in self.chunks]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "ReconstructionPlan":
        try:
            chunks = tuple(ReconstructionChunk(int(c["start"]), int(c["end"]), tuple(int(x) for x in c["ids"]))
                           for c in d["chunks"])
            return ReconstructionPlan(chunks, int(d["n_prompt"]), int(d.get("chunk_size", DEFAULT_CHUNK)),
                                      str(d.get("instruction", "kvpress")))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ReconstructionError):
                raise
            raise ReconstructionError(f"reconstruction: malformed plan ({e!r})") from None


def make_plan(prompt_ids: Sequence[int], chunk_size: int = DEFAULT_CHUNK,
              encode: Callable[[str], list[int]] | None = None) -> ReconstructionPlan:
    """kvpress's chunks over ``prompt_ids`` (module docstring), the instruction and suffix tokenised by ``encode``
    (no special tokens); without ``encode`` each chunk is reread bare."""
    chunk_size = int(chunk_size)
    if chunk_size < 1:
        raise ReconstructionError(f"reconstruction chunk size must be >= 1, got {chunk_size}")
    ids = [int(x) for x in prompt_ids]
    first = encode(FIRST_INSTRUCTION) if encode else []
    nxt = encode(NEXT_INSTRUCTION) if encode else []
    suffix = encode(SUFFIX) if encode else []
    chunks = []
    for start in range(0, len(ids), chunk_size):
        end = min(len(ids), start + chunk_size)
        head = first if start == 0 else nxt + ids[max(0, start - PREV_POSTFIX):start]
        chunks.append(ReconstructionChunk(start, end, tuple(head + suffix + ids[start:end])))
    return ReconstructionPlan(tuple(chunks), len(ids), chunk_size, "kvpress" if encode else "none")


def synthetic_reconstruction(q: np.ndarray, k: np.ndarray, n_prompt: int,
                             chunk_size: int = DEFAULT_CHUNK) -> tuple[ReconstructionPlan, np.ndarray, np.ndarray]:
    """A reconstruction pass for a trace without a model (synthetic generators): each chunk's repeat tokens are its
    own prompt queries and keys, reread verbatim. Returns (plan, recon_q, recon_k)."""
    plan_chunks, rows = [], []
    for start in range(0, n_prompt, chunk_size):
        end = min(n_prompt, start + chunk_size)
        plan_chunks.append(ReconstructionChunk(start, end, tuple(range(start, end))))
        rows.append(np.arange(start, end))
    idx = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    plan = ReconstructionPlan(tuple(plan_chunks), n_prompt, chunk_size, "synthetic")
    return plan, np.asarray(q)[idx], np.asarray(k)[idx]
