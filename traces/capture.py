"""Capture post-RoPE q/k/v and the model's own attention output from HF decoder models.

Method: the model's attention is routed to kvsim (`traces.hf.routing`): every attention module of
Llama/Qwen2/Qwen3/Mistral/Gemma-3/GPT-2-style models hands its query/key/value exactly as the model attends (q after
QK-norm and RoPE, k/v after RoPE and after the KV-cache update; a sliding layer's cache hands over only its window).
The capture's handler runs the model's own SDPA attention unchanged (`traces.hf.routing.model_attention`), so
recording never alters outputs, and keeps the new positions' q/k/v and the attention output of the selected layers
and KV heads, plus what each layer's call says about its attention (softmax scale, sliding window). The model's
geometry and each layer's attention description are read by `traces.hf.geometry`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from traces.hf.routing import attention_call, model_attention, routed


class CaptureError(ValueError):
    """The requested capture does not fit what the model's attention calls hand over (message names the problem)."""


@dataclass
class Capture:
    """Per-layer buffers of every position's q [T, Hq', d], k/v [T, Hkv', d] (``store_dtype``) and the model's
    attention output o [T, Hq', d] (float32), filled as the model's attention calls arrive.

    The buffers are raw files in ``spill`` (one per layer and array), appended to as positions arrive and read
    back memory-mapped one layer at a time (``arrays``): recording a long context holds no layer in the process's
    memory (written pages stay in the OS page cache, not in the recorder's resident set)."""
    layer_ids: tuple[int, ...]
    kv_heads: tuple[int, ...]
    group: int
    store_dtype: np.dtype
    n_tokens: int
    spill: Path
    files: dict[int, dict[str, Any]] = field(default_factory=dict)
    dims: dict[int, int] = field(default_factory=dict)
    scaling: dict[int, float] = field(default_factory=dict)
    window: dict[int, int | None] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)

    @property
    def q_heads(self) -> list[int]:
        return [h * self.group + j for h in self.kv_heads for j in range(self.group)]

    def _dtype(self, name: str) -> np.dtype:
        return np.dtype(np.float32) if name == "o" else self.store_dtype

    def _path(self, layer: int, name: str) -> Path:
        return self.spill / f"{layer:03d}-{name}.bin"

    def add(self, layer: int, query, key, value, out, scaling: float, window: int | None = None) -> None:
        """Store one attention call: query [1,Hq,t,d], key/value [1,Hkv,S,d] (the cache as the layer attends
        over it: everything seen, or on a sliding layer its last window - 1 tokens, then the t new ones),
        out [1,t,Hq,d]."""
        if layer not in self.layer_ids:
            return
        if query.shape[0] != 1:
            raise CaptureError(f"recording supports batch size 1, got {query.shape[0]}")
        t, s = query.shape[2], key.shape[2]
        seen = self.seen.get(layer, 0)
        held = seen if not window else min(seen, max(window - 1, 0))
        if s not in (seen + t, held + t):
            raise CaptureError(f"layer {layer}: key length {s} != cached {seen} + new {t}; the model must run "
                               "with a growing KV cache (a sliding layer may hand over only its window)")
        if seen + t > self.n_tokens:
            raise CaptureError(f"layer {layer}: {seen + t} positions exceed the {self.n_tokens} being recorded")
        self.seen[layer] = seen + t
        self.window[layer] = int(window) if window else None
        qh, kh = self.q_heads, list(self.kv_heads)
        if layer not in self.files:
            self.dims[layer] = int(query.shape[-1])
            self.files[layer] = {name: open(self._path(layer, name), "wb") for name in ("q", "k", "v", "o")}
        new = {"q": query[0, qh].transpose(0, 1), "k": key[0, kh, s - t:].transpose(0, 1),
               "v": value[0, kh, s - t:].transpose(0, 1), "o": out[0][:, qh]}
        for name, x in new.items():
            self.files[layer][name].write(x.detach().float().cpu().numpy().astype(self._dtype(name)).tobytes())
        self.scaling[layer] = float(scaling)

    def arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(q, k, v, model_o) of one layer over all recorded positions (memory-mapped, read-only)."""
        if layer not in self.files:
            raise CaptureError(f"layer {layer} was never called; is it an attention layer of this model?")
        if self.seen[layer] != self.n_tokens:
            raise CaptureError(f"layer {layer}: {self.seen[layer]} of {self.n_tokens} positions were recorded")
        for f in self.files[layer].values():
            f.flush()
        T, d = self.n_tokens, self.dims[layer]
        heads = {"q": len(self.q_heads), "k": len(self.kv_heads), "v": len(self.kv_heads), "o": len(self.q_heads)}
        return tuple(np.memmap(self._path(layer, name), dtype=self._dtype(name), mode="r", shape=(T, heads[name], d))
                     for name in ("q", "k", "v", "o"))

    def close(self) -> None:
        """Close every buffer file (the recorder's spill directory is removed after)."""
        for files in self.files.values():
            for f in files.values():
                f.close()


@contextlib.contextmanager
def capturing(model, capture: Capture) -> Iterator[Capture]:
    """Route the model's attention through the recorder for the duration of the block, then restore it."""

    def record(module, query, key, value, attention_mask, **kwargs):
        out, weights = model_attention(module, query, key, value, attention_mask, **kwargs)
        call = attention_call(module, query, kwargs)
        capture.add(call.layer, query, key, value, out, call.scale, call.window)
        return out, weights

    with routed(model, record):
        yield capture
