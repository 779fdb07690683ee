"""`DecodeGraph`: a runner's decode forward (one token per row) replayed as a CUDA graph.

A decode step of a small batch is bound by launches, not by the GPU: every layer's projections, RoPE, append, split-K
attention and MLP are a few dozen kernels, each launched from Python. Nothing in that forward depends on the host any
more -- the policies step after it (`gpu_validate.closedloop.decode_steps`), capacities are checked on the host's
mirror, the caches are allocated at capacity and every kernel's grid depends on capacities only -- so it is captured
once and replayed: the token ids and positions go into static tensors, the graph runs, the logits come out of a static
tensor (cloned, since the next replay overwrites it). What the host does inside the forward per layer (append a slot to
the mirror, mark the layer's step due) runs in `BatchRunner.graph_bookkeeping` before each replay, since a replay runs
no Python.

The first ``WARMUP`` decode steps run eagerly (Triton compiles its kernels, cuBLAS creates its handles: neither may
happen during a capture); the next is captured and replayed at once. Where a graph cannot serve -- not CUDA, an open
loop (its dense reference copy grows every step), a row whose logit scale changes every step (BUZZ's log n), the
steps taken per layer, or a capture that fails -- the runner runs eagerly and `reason` says why (the run info names
it).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

WARMUP = 2


class DecodeGraph:
    """The decode forward of a runner's ``B`` rows as a CUDA graph; ``eager(ids, positions)`` is the forward it
    stands for ([B, 1] int64 token ids and positions on the device, returns float32 logits [B, V])."""

    def __init__(self, eager: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], reason: str | None) -> None:
        self.eager = eager
        self.reason = reason
        self.graph: Any = None
        self.steps = 0

    @property
    def used(self) -> bool:
        return self.graph is not None

    def info(self) -> dict[str, Any]:
        """What the run info says of it: used, or the reason it was not."""
        return {"cuda_graph": self.used, "cuda_graph_fallback": None if self.used else self.reason}

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, bookkeeping: Callable[[], None]) -> torch.Tensor:
        """The logits after this decode step's tokens: eager while warming up or where no graph serves, else a
        replay (``bookkeeping`` first: what the forward's Python would have done)."""
        if self.reason is not None or self.steps < WARMUP:
            self.steps += 1
            return self.eager(ids, positions)
        if self.graph is None:
            return self._capture(ids, positions, bookkeeping)
        bookkeeping()
        self._ids.copy_(ids)
        self._pos.copy_(positions)
        self.graph.replay()
        return self._out.clone()

    def _capture(self, ids: torch.Tensor, positions: torch.Tensor, bookkeeping: Callable[[], None]) -> torch.Tensor:
        """Capture the forward on static inputs (its Python runs once, doing this step's bookkeeping) and replay it
        for this step. A failed capture raises `GraphCaptureFailed` with the reason kept: the runner then restores
        the host state the captured Python touched and runs the step eagerly, as every later one."""
        self._ids, self._pos = ids.clone(), positions.clone()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(graph):
                self._out = self.eager(self._ids, self._pos)
        except Exception as exc:  # noqa: BLE001 - any capture failure: run eagerly, and say why
            self.reason = f"capture failed: {type(exc).__name__}: {exc}"[:300]
            raise GraphCaptureFailed(self.reason) from exc
        self.graph = graph
        graph.replay()
        return self._out.clone()

    @property
    def capturing_next(self) -> bool:
        """Whether the next call captures (the runner snapshots the host state the capture's Python touches)."""
        return self.reason is None and self.graph is None and self.steps >= WARMUP


class GraphCaptureFailed(RuntimeError):
    """A decode graph's capture failed after the forward's Python may have run: the runner restores its host state
    for the step and runs it eagerly."""
