"""What kvsim reads of a transformers model: its attention geometry, each layer's attention, and W_O.

`model_shape` is the one reader of a model's shape (layers, query / KV heads, head_dim, positional scheme,
sliding window and per-layer kinds, context length) for the recorder and the closed-loop runner alike; it refuses
up front the attention kvsim's recorder, replay engine and kernels do not compute (soft-capped logits, GPT-2's
per-layer inverse scaling or upcast reordering, query heads that are not a whole multiple of the KV heads).
`layer_attention` describes one layer's attention as its call ran it (scale and window from the call, RoPE base and
scaling from the config: `rope_theta`), and `output_projection` reads a layer's W_O. Every function takes a model or
its config; a multimodal config is read through its text config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from traces.format import LayerAttention

#: ``model_type`` of the supported decoders with absolute (learned) positions instead of RoPE
NO_ROPE_MODEL_TYPES = ("gpt2", "gpt_neo", "opt")


class UnsupportedModelError(ValueError):
    """kvsim cannot read or route this model (the message names what it lacks or does differently)."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder's attention geometry, read from its config (`model_shape`)."""

    model_type: str
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    rope: str                          # "rope", or "none" for absolute positions (GPT-2)
    sliding_window: int | None         # the config's window (None: no sliding layer)
    layer_types: tuple[str, ...] | None = None   # ``full_attention`` / ``sliding_attention`` per layer, if given
    max_positions: int | None = None   # the model's context length, if the config says

    @property
    def group(self) -> int:
        """Query heads per KV head (1 for MHA)."""
        return self.n_q_heads // self.n_kv_heads


def text_config(model_or_config: Any) -> Any:
    """The decoder's config of a model or a config (a multimodal config's text config)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def model_shape(model_or_config: Any) -> ModelShape:
    """Layers / heads / head_dim / positions / windows of a Llama, Qwen2/3, Mistral, Gemma-3 or GPT-2-style
    decoder; `UnsupportedModelError` for a model whose attention kvsim does not compute (module docstring)."""
    cfg = text_config(model_or_config)
    n_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    n_q = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if not n_layers or not n_q:
        raise UnsupportedModelError(f"config of model_type={cfg.model_type!r} has no layer/head counts")
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_q
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")
    head_dim = getattr(cfg, "head_dim", None) or hidden // n_q
    if n_q % n_kv:
        raise UnsupportedModelError(f"num_attention_heads={n_q} is not a multiple of num_key_value_heads={n_kv}")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise UnsupportedModelError(
            f"model_type={cfg.model_type!r} soft-caps its attention logits (attn_logit_softcapping="
            f"{cfg.attn_logit_softcapping}); kvsim's recorder, replay engine and kernels compute plain softmax "
            "attention and would not reproduce it")
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or getattr(cfg, "reorder_and_upcast_attn", False):
        raise UnsupportedModelError("GPT-2 variants with scale_attn_by_inverse_layer_idx/reorder_and_upcast_attn are "
                                    "not supported")
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    types_ = getattr(cfg, "layer_types", None)
    max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return ModelShape(cfg.model_type, int(n_layers), int(n_q), int(n_kv), int(head_dim),
                      "none" if cfg.model_type in NO_ROPE_MODEL_TYPES else "rope", int(window) if window else None,
                      tuple(str(t) for t in types_) if types_ else None, int(max_pos) if max_pos else None)


def layer_type(model_or_config: Any, layer: int) -> str | None:
    """``config.layer_types[layer]`` (``full_attention`` / ``sliding_attention``) where the config has them."""
    types_ = getattr(text_config(model_or_config), "layer_types", None)
    return str(types_[layer]) if types_ and layer < len(types_) else None


def rope_theta(model_or_config: Any, layer: int) -> float | None:
    """The RoPE base of one layer: its layer type's entry of ``rope_parameters`` (Gemma-3: 1e6 global, 1e4
    sliding), else the model's one base (``rope_theta`` with ``rope_scaling``, in releases before
    ``rope_parameters``); 0.0 for a model without RoPE. None when the rotation is not plain RoPE at one base
    (llama3/yarn/linear scaling), so nothing downstream un-rotates with a wrong base."""
    cfg = text_config(model_or_config)
    if cfg.model_type in NO_ROPE_MODEL_TYPES:
        return 0.0
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict):
        kind = layer_type(cfg, layer)
        if kind in params and isinstance(params[kind], dict):
            params = params[kind]
        theta = params.get("rope_theta")
        scaling = params.get("rope_type", "default")
    else:
        theta = getattr(cfg, "rope_theta", None)
        rs = getattr(cfg, "rope_scaling", None) or {}
        scaling = rs.get("rope_type", rs.get("type", "default"))
    if scaling != "default" or not theta:
        return None
    return float(theta)


def layer_attention(model_or_config: Any, layer: int, scale: float, window: int | None) -> LayerAttention:
    """One layer's attention as the model computes it: the ``scale`` and ``window`` its attention call used
    (`traces.hf.routing.attention_call`), and its RoPE base from the config."""
    return LayerAttention(kind="sliding" if window else "global", window=int(window) if window else None,
                          rope_theta=rope_theta(model_or_config, layer), scale=float(scale))


def output_projection(model, layer: int) -> np.ndarray | None:
    """The attention output projection W_O [hidden, Hq*d] of decoder layer ``layer`` in torch's Linear layout
    (``o = W_O @ concat(heads)``), float32; None for an architecture without ``self_attn.o_proj``."""
    try:
        lin = model.get_decoder().layers[layer].self_attn.o_proj
    except (AttributeError, IndexError, TypeError):
        return None
    return lin.weight.detach().float().cpu().numpy()
