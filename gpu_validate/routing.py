"""Routing a transformers model's attention to the closed-loop runner, and the model's geometry.

transformers' AttentionInterface takes a named attention function; `routed` registers ours under ``IMPL_NAME``
(with the SDPA mask builder, so the model prepares its masks as for SDPA) and switches the model to it for a
block, sending every attention module's call to the innermost active runner's ``attention`` (as the recorder,
`traces.capture`, does for its captures). `model_geometry` reads the layer / head counts the runner's caches are
shaped by from the model's config.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from gpu_validate.jobs import ValidateError

IMPL_NAME = "kvsim_validate"
#: the runners inside `routed` blocks, innermost last: the one every routed attention call goes to
_ACTIVE: list[Any] = []


def layer_idx(module) -> int:
    """The layer index of an attention module (what the runner keys its caches by)."""
    idx = getattr(module, "layer_idx", None)
    if idx is None:
        raise ValidateError(f"{type(module).__name__} has no layer_idx; cannot route its attention")
    return int(idx)


def _routed_attention(module, query, key, value, attention_mask, **kwargs):
    return _ACTIVE[-1].attention(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPL_NAME, _routed_attention)
    AttentionMaskInterface.register(IMPL_NAME, sdpa_mask)


@contextlib.contextmanager
def routed(model, runner) -> Iterator[None]:
    """Send the model's attention to ``runner`` (its ``attention(module, query, key, value, attention_mask,
    **kwargs)`` returns what an attention function does) for the duration of the block, then restore it."""
    _register()
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(IMPL_NAME)
    except Exception as exc:  # transformers raises several types here
        raise ValidateError(f"{type(model).__name__} does not support a pluggable attention function: {exc}") from exc
    _ACTIVE.append(runner)
    try:
        yield
    finally:
        _ACTIVE.remove(runner)
        model.set_attn_implementation(previous)


def model_geometry(model) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head_dim) of a Llama/Qwen2/Mistral/GPT-2-style HF config."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    n_q = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if not n_layers or not n_q:
        raise ValidateError(f"config of model_type={cfg.model_type!r} has no layer/head counts")
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_q
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")
    head_dim = getattr(cfg, "head_dim", None) or hidden // n_q
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or getattr(cfg, "reorder_and_upcast_attn", False):
        raise ValidateError("GPT-2 variants with scale_attn_by_inverse_layer_idx/reorder_and_upcast_attn are not "
                            "supported")
    return int(n_layers), int(n_q), int(n_kv), int(head_dim)
