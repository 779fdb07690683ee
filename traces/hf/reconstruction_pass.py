"""KVzip's context-reconstruction pass run in a transformers model: the one place both the recorder (``kvsim record
--kvzip``) and the closed loop (a ``kvzip`` row) run it, so the simulator and the model score from the same pass.

The prompt goes through the model with its own cache (``CachedForward``, in chunks); then each chunk of the plan
(``traces.reconstruction``) is fed after a copy of that cache, with the model's own attention routed through a
handler that keeps, per layer, the post-RoPE queries and keys of the repeat tokens; the copy is dropped, so every
chunk rereads the prompt's cache alone (kvpress truncates the cache back to the context after each chunk; a copy
also restores a sliding layer's window, which a truncation cannot). Cost: one more forward over the prompt (none
when the recorder hands over its own cache after the prompt) plus one over its R ~ P repeat tokens; the arrays kept
are R x (Hq + Hkv) x d per layer.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Sequence

import numpy as np

from traces.hf.forward import DEFAULT_CHUNK, CachedForward
from traces.hf.routing import attention_call, model_attention, routed
from traces.reconstruction import ReconstructionPlan, make_plan


def tokenizer_of(model) -> Any:
    """The tokenizer saved beside the model's weights (``config._name_or_path``, local files only), or None (a
    random-weight model built from a config has none)."""
    path = getattr(model.config, "_name_or_path", "") or ""
    return _tokenizer_at(path) if path else None


@functools.lru_cache(maxsize=4)
def _tokenizer_at(path: str) -> Any:
    """The tokenizer of a model folder, read once per process (every prompt of a closed-loop run asks), or None."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return None


def plan_for(model, prompt_ids: Sequence[int], chunk_size: int, tokenizer: Any = None) -> ReconstructionPlan:
    """kvpress's reconstruction plan of ``prompt_ids`` with the instruction written by ``tokenizer`` (else the
    model's own, ``tokenizer_of``; without one the chunks are reread bare)."""
    tok = tokenizer if tokenizer is not None else tokenizer_of(model)
    encode = None if tok is None else (lambda text: list(tok.encode(text, add_special_tokens=False)))
    return make_plan(prompt_ids, chunk_size, encode)


def run_reconstruction(model, prompt_ids: Sequence[int], plan: ReconstructionPlan, layers: Sequence[int],
                       q_heads: Sequence[int] | None = None, kv_heads: Sequence[int] | None = None,
                       dtype: Any = np.float32, prompt_cache: Any = None
                       ) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Run the pass (module docstring) and return, for each of ``layers``, (recon_q [R, Hq', d], recon_k
    [R, Hkv', d], recon_h [R] or None) of the chosen query and KV heads (all by default), post-RoPE, in ``dtype``; recon_h is
    the L2 norm of each repeat token's hidden state as the attention module receives it (after the layer's input
    norm), float32: KVzip+ divides each repeat query's attention by it (kvpress ``kvzip_plus_normalization``).
    ``prompt_cache``: the model's cache after exactly these prompt tokens, fed in ``DEFAULT_CHUNK``-token forwards
    by the model's own attention (the recorder's, which has just fed them so): the prompt's forward is then not
    run again (the cache is only copied, never changed)."""
    import torch

    wanted = set(int(x) for x in layers)
    got: dict[int, tuple[list, list]] = {l: ([], []) for l in wanted}
    norms: dict[int, list] = {l: [] for l in wanted}
    rereading = False

    def hidden_norm(layer: int):
        def hook(module, args, kwargs):
            if rereading:
                h = kwargs.get("hidden_states", args[0] if args else None)
                norms[layer].append(torch.linalg.vector_norm(h[0].float(), dim=-1).cpu().numpy().astype(np.float32))
        return hook

    def keep(module, query, key, value, attention_mask, **kwargs):
        """The model's own attention (also when a caller routes the model elsewhere), keeping the repeat tokens'
        q/k once the prompt is in the cache."""
        out = model_attention(module, query, key, value, attention_mask, **kwargs)
        layer = attention_call(module, query, kwargs).layer
        if rereading and layer in wanted:
            t = query.shape[2]
            q = query[0] if q_heads is None else query[0, list(q_heads)]
            k = key[0, :, -t:] if kv_heads is None else key[0, list(kv_heads), -t:]
            got[layer][0].append(q.transpose(0, 1).float().cpu().numpy().astype(dtype))
            got[layer][1].append(k.transpose(0, 1).float().cpu().numpy().astype(dtype))
        return out

    fwd = CachedForward(model)
    handles = [m.register_forward_pre_hook(hidden_norm(l), with_kwargs=True)
               for l in wanted if (m := _attention_module(model, l)) is not None]
    try:
        with torch.no_grad(), routed(model, keep):
            if prompt_cache is None:
                ids = torch.tensor([[int(x) for x in prompt_ids]], device=fwd.device)
                for _ in fwd.chunks(ids, DEFAULT_CHUNK):
                    pass
                prompt_cache = fwd.past
            rereading = True
            for c in plan.chunks:
                fwd.past = copy.deepcopy(prompt_cache)
                fwd(list(c.ids))
    finally:
        for h in handles:
            h.remove()
    for layer, (qs, ks) in got.items():
        n_h = sum(x.shape[0] for x in norms[layer])
        if sum(x.shape[0] for x in qs) != plan.n_tokens or n_h not in (0, plan.n_tokens):
            raise ValueError(f"layer {layer}: the reconstruction pass saw {sum(x.shape[0] for x in qs)} repeat "
                             f"tokens, the plan has {plan.n_tokens}; is it an attention layer of this model?")
    # an architecture without ``self_attn`` modules gives no norms (None: KVzip+ says so)
    return {layer: (np.concatenate(qs), np.concatenate(ks), np.concatenate(norms[layer]) if norms[layer] else None)
            for layer, (qs, ks) in got.items()}


def _attention_module(model, layer: int) -> Any:
    """The attention module of decoder layer ``layer`` (``self_attn`` of a Llama-family decoder), or None."""
    try:
        return model.get_decoder().layers[layer].self_attn
    except (AttributeError, IndexError, TypeError):
        return None
