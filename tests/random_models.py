"""Small random-weight models built from configs, seeded, for the closed-loop and generation tests: one builder per
architecture, so that the tests that compare paths (runner, generate(), recorder) build the very same model."""
from __future__ import annotations

from typing import Sequence

import torch

#: Gemma-3's layer pattern at test size: sliding layers around one global layer
GEMMA3_LAYERS = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")


def random_llama(*, n_kv: int = 2, max_positions: int = 256):
    """A 2-layer Llama (4 query heads, ``n_kv`` KV heads, head_dim 16, vocabulary 101), seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=n_kv, max_position_embeddings=max_positions)
    return LlamaForCausalLM(cfg).eval()


def random_gemma3(layer_types: Sequence[str] = GEMMA3_LAYERS, *, window: int = 8):
    """A Gemma-3 text model with ``layer_types`` (4 query heads, 1 KV head, head_dim 32, sliding ``window``), seed 0."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=len(layer_types),
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
                           sliding_window=window, max_position_embeddings=256, layer_types=list(layer_types))
    return Gemma3ForCausalLM(cfg).eval()
