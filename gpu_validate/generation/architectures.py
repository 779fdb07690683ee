"""Which transformers models kvsim's generation cache runs, and the one error every other model gets.

The cache needs a decoder whose attention modules call transformers' AttentionInterface with post-RoPE keys,
take their KV cache as a `transformers.Cache` and their positions as ``position_ids``, and compute plain softmax
attention: the RoPE families kvsim converts and records (`traces.models.SUPPORTED_ARCHITECTURES`), whose
generate() path the tests hold to transformers' own. Anything else -- encoders, soft-capped or linear attention,
and absolute-position decoders such as GPT-2, which the closed-loop runner scores but generate() is not tested
on -- is refused up front, by name, instead of failing or drifting somewhere inside a forward.
"""
from __future__ import annotations

from gpu_validate.validate_error import ValidateError
from traces.hf.geometry import text_config

#: ``config.model_type`` of the decoders the generation cache supports
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
SUPPORTED_NAMES = "Llama, Mistral, Qwen2, Qwen3 and Gemma-3"


def check_architecture(model) -> None:
    """Raise `ValidateError` naming the model's architecture unless kvsim's generation cache supports it."""
    cfg = model.config
    model_type = getattr(cfg, "model_type", None)
    arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
    if model_type not in SUPPORTED_MODEL_TYPES or getattr(cfg, "is_encoder_decoder", False):
        raise ValidateError(f"kvsim cannot generate with {arch} (model_type {model_type!r}): its cache runs inside "
                            f"{SUPPORTED_NAMES} decoders only")
    text = text_config(cfg)
    if getattr(text, "attn_logit_softcapping", None):
        raise ValidateError(f"kvsim cannot generate with {arch}: it soft-caps its attention logits "
                            f"(attn_logit_softcapping={text.attn_logit_softcapping}), which kvsim's kernels do not")
