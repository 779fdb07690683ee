"""Routing a transformers model's attention through kvsim: one attention function, pluggable handlers.

transformers' AttentionInterface takes a named attention function; `routed` registers kvsim's under ``IMPL_NAME``
(with the SDPA mask builder, so the model prepares its masks as for SDPA), switches the model to it for a block
and sends every attention module's call to the innermost active handler: ``handler(module, query, key, value,
attention_mask, **kwargs)`` returns what an attention function does, ``(out [B, t, Hq, d], weights)``. Query, key
and value arrive exactly as the model attends: q after QK-norm and RoPE, k/v after RoPE and after the model's own
KV-cache update (a sliding layer's cache hands over only its window).

The recorder's handler (`traces.capture.capturing`) and the closed-loop runner's prompt phase run the model's own
attention (`model_attention`) and keep what they need of q/k/v; the runner's decode steps and the generation
cache (`gpu_validate.closedloop.batch_runner`, `gpu_validate.generation`) replace it with attention over kvsim's compressed
caches. `attention_call` reads what a call says about its layer (index, softmax scale, sliding window).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from traces.hf.geometry import UnsupportedModelError

IMPL_NAME = "kvsim"
#: the handlers of the `routed` blocks, innermost last: the one every routed attention call goes to
_HANDLERS: list[Callable[..., Any]] = []


@dataclass(frozen=True)
class AttentionCall:
    """What one attention call says about its layer: index, softmax scale, sliding window (None: global)."""

    layer: int
    scale: float
    window: int | None


def attention_call(module, query, kwargs: dict) -> AttentionCall:
    """The layer index of an attention module, and the scale and window its call passes (the scale: ``scaling``,
    else the module's, else head_dim ** -0.5)."""
    idx = getattr(module, "layer_idx", None)
    if idx is None:
        raise UnsupportedModelError(f"{type(module).__name__} has no layer_idx; cannot route its attention")
    scale = kwargs.get("scaling")
    if scale is None:
        scale = getattr(module, "scaling", None)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or None
    return AttentionCall(int(idx), float(scale), int(window) if window else None)


def model_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's own attention of one call (transformers' SDPA function, as the model passed its arguments,
    without dropout): ``(out [B, t, Hq, d], weights)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.setdefault("dropout", 0.0)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _routed_attention(module, query, key, value, attention_mask, **kwargs):
    if not _HANDLERS:
        raise RuntimeError(f"the model's attention is set to {IMPL_NAME!r} outside a `routed` block")
    return _HANDLERS[-1](module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPL_NAME, _routed_attention)
    AttentionMaskInterface.register(IMPL_NAME, sdpa_mask)


@contextlib.contextmanager
def routed(model, handler: Callable[..., Any]) -> Iterator[None]:
    """Send the model's attention calls to ``handler`` (module docstring) for the duration of the block, then
    restore the model's own attention implementation. Blocks nest: the innermost handler gets the calls."""
    _register()
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(IMPL_NAME)
    except Exception as exc:  # transformers raises several types here
        raise UnsupportedModelError(f"{type(model).__name__} does not support a pluggable attention function: "
                                    f"{exc}") from exc
    if model.config._attn_implementation != IMPL_NAME:
        model.set_attn_implementation(previous)
        raise UnsupportedModelError(f"{type(model).__name__} does not dispatch attention through AttentionInterface")
    _HANDLERS.append(handler)
    try:
        yield
    finally:
        for i in range(len(_HANDLERS) - 1, -1, -1):     # this block's entry (a handler may be routed twice)
            if _HANDLERS[i] is handler:
                del _HANDLERS[i]
                break
        model.set_attn_implementation(previous)
