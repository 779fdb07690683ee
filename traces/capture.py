"""Capture post-RoPE q/k/v and the model's own attention output from HF decoder models.

Method: a custom function registered in transformers' AttentionInterface (plus the matching sdpa mask
in AttentionMaskInterface). Every attention module of Llama/Qwen2/Qwen3/Mistral/Gemma-3/GPT-2-style models
calls it with query/key/value exactly as the model attends: q after QK-norm and RoPE, k/v after RoPE and
after the KV-cache update (a sliding layer's cache hands over only its window). The wrapper forwards to the
model's sdpa kernel unchanged, so recording never alters outputs, and keeps the new positions' q/k/v and the
attention output of the selected layers and KV heads, plus what each layer's call says about its attention
(softmax scale, sliding window).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from traces.format import LayerAttention

IMPL_NAME = "kvsim_record"
_ACTIVE: list["Capture"] = []


class CaptureError(ValueError):
    """The model or the requested capture is not supported (message names the problem)."""


@dataclass
class ModelShape:
    """Attention geometry read from a HF config."""
    model_type: str
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    rope: str
    sliding_window: int | None


def model_shape(config: Any) -> ModelShape:
    """Read layers/heads/head_dim/positional scheme from a HF decoder config (Llama, Qwen2/3, Mistral, Gemma-3,
    GPT-2...)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    n_q = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if not n_layers or not n_q:
        raise CaptureError(f"config of model_type={cfg.model_type!r} has no layer/head counts")
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_q
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")
    head_dim = getattr(cfg, "head_dim", None) or hidden // n_q
    if n_q % n_kv:
        raise CaptureError(f"num_attention_heads={n_q} is not a multiple of num_key_value_heads={n_kv}")
    rope = "none" if cfg.model_type in ("gpt2", "gpt_neo", "opt") else "rope"
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    if getattr(cfg, "attn_logit_softcapping", None):
        raise CaptureError(f"model_type={cfg.model_type!r} soft-caps its attention logits "
                           f"(attn_logit_softcapping={cfg.attn_logit_softcapping}); kvsim's recorder and replay "
                           "engine compute plain softmax attention and would not reproduce it")
    return ModelShape(cfg.model_type, int(n_layers), int(n_q), int(n_kv), int(head_dim), rope,
                      int(window) if window else None)


def layer_type(config: Any, layer: int) -> str | None:
    """``config.layer_types[layer]`` (``full_attention`` / ``sliding_attention``) where the config has them."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    types_ = getattr(cfg, "layer_types", None)
    return str(types_[layer]) if types_ and layer < len(types_) else None


def rope_theta(config: Any, layer: int) -> float | None:
    """The RoPE base of one layer: its layer type's entry of ``rope_parameters`` (Gemma-3: 1e6 global, 1e4
    sliding), else the model's one base; 0.0 for a model without RoPE. None when the rotation is not plain RoPE
    at one base (llama3/yarn/linear scaling), so nothing downstream un-rotates with a wrong base."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if cfg.model_type in ("gpt2", "gpt_neo", "opt"):
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


def layer_attention(config: Any, layer: int, scale: float, window: int | None) -> LayerAttention:
    """The manifest entry of one recorded layer: the ``scale`` and ``window`` its attention call used, and its
    RoPE base from the config."""
    return LayerAttention(kind="sliding" if window else "global", window=int(window) if window else None,
                          rope_theta=rope_theta(config, layer), scale=float(scale))


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


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window")
    for cap in _ACTIVE:
        cap.add(int(module.layer_idx), query, key, value, out, scaling, window)
    return out, weights


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPL_NAME, _recording_attention)
    AttentionMaskInterface.register(IMPL_NAME, sdpa_mask)


@contextlib.contextmanager
def capturing(model, capture: Capture) -> Iterator[Capture]:
    """Route the model's attention through the recorder for the duration of the block, then restore it."""
    _register()
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(IMPL_NAME)
    except Exception as exc:  # transformers raises several types here
        raise CaptureError(f"{type(model).__name__} does not support a pluggable attention function: {exc}") from exc
    if model.config._attn_implementation != IMPL_NAME:
        raise CaptureError(f"{type(model).__name__} does not dispatch attention through AttentionInterface")
    _ACTIVE.append(capture)
    try:
        yield capture
    finally:
        _ACTIVE.remove(capture)
        model.set_attn_implementation(previous)
