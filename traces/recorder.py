"""Record attention traces (post-RoPE q, k, v per layer) from HF decoder models into the kvsim format.

Prefill of the prompt, then token-by-token decode through the model's KV cache (greedy, or
teacher-forced on the given text). Every stored layer is checked for faithfulness (attention recomputed
from the stored q/k/v against the model's own attention output, windowed on a sliding layer) before the trace
is written atomically. The manifest records each layer's attention as the model ran it (global or sliding with
its window, RoPE base, softmax scale), so hybrid models (Gemma-3: 15 sliding + 3 global layers) record at any
length the model supports.

tokens.parquet row t describes position t: ``token_id`` fed at t, ``nll`` = -log p(token_t | tokens_<t)
and ``top1_id`` = argmax p(. | tokens_<t) under the full cache (NaN / -1 at t = 0, which has no context).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from traces.capture import Capture, CaptureError, capturing, layer_attention, model_shape
from traces.faithful import LayerFaithfulness, assert_faithful, default_tolerance, layer_faithfulness
from traces.format import LayerArrays, ModelInfo, TraceMeta, TraceWriter


class RecordError(ValueError):
    """Bad recording arguments (message names the argument and the allowed range)."""


@dataclass(frozen=True)
class RecordResult:
    path: Path
    faithfulness: list[LayerFaithfulness]
    mean_nll_decode: float


def _check_subset(name: str, values: Sequence[int] | None, n: int) -> tuple[int, ...]:
    if values is None:
        return tuple(range(n))
    vals = tuple(int(v) for v in values)
    if not vals:
        raise RecordError(f"{name} must not be empty")
    if len(set(vals)) != len(vals):
        raise RecordError(f"{name} has duplicates: {list(vals)}")
    bad = [v for v in vals if not 0 <= v < n]
    if bad:
        raise RecordError(f"{name} {bad} out of range: the model has {n} (valid 0..{n - 1})")
    return vals


def _max_positions(config: Any) -> int | None:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def record_trace(model, token_ids: Sequence[int], out_dir: str | Path, *, n_prompt: int, n_decode: int,
                 tokenizer: Any = None, layers: Sequence[int] | None = None, kv_heads: Sequence[int] | None = None,
                 dtype: str = "float32", teacher_forced: bool = False, model_id: str | None = None,
                 source: dict | None = None, progress: bool = True, overwrite: bool = False,
                 tol: float | None = None, single_pass: bool = False) -> RecordResult:
    """Run prefill + decode, capture q/k/v of the chosen layers and KV heads, check and write a trace.

    token_ids: the text; the first n_prompt are the prompt; with teacher_forced the next n_decode are fed
    as the decoded tokens, otherwise decode is greedy. kv_heads selects KV heads; each keeps its whole
    query-head group (GQA: query head h uses KV head h // (Hq/Hkv)). single_pass (teacher-forced only) feeds
    all tokens in one causal forward instead of token by token: the same attention, several times faster.
    """
    import pandas as pd
    import torch
    from tqdm.auto import tqdm

    shape = model_shape(model.config)
    if dtype not in ("float16", "float32"):
        raise RecordError(f"dtype must be 'float16' or 'float32', got {dtype!r}")
    if int(n_prompt) < 1:
        raise RecordError(f"n_prompt must be >= 1, got {n_prompt}")
    if int(n_decode) < 0:
        raise RecordError(f"n_decode must be >= 0, got {n_decode}")
    ids = [int(t) for t in token_ids]
    need = n_prompt + (n_decode if teacher_forced else 0)
    if len(ids) < need:
        raise RecordError(f"text has {len(ids)} tokens; n_prompt={n_prompt}"
                          + (f" + n_decode={n_decode} (teacher-forced)" if teacher_forced else "")
                          + f" needs {need}")
    total = n_prompt + n_decode
    if single_pass and not teacher_forced:
        raise RecordError("single_pass needs teacher_forced (greedy decode must run token by token)")
    max_pos = _max_positions(model.config)
    if max_pos and total > max_pos:
        raise RecordError(f"n_prompt + n_decode = {total} exceeds the model's context of {max_pos} positions")
    layer_ids = _check_subset("layers", layers, shape.n_layers)
    kv = _check_subset("kv_heads", kv_heads, shape.n_kv_heads)
    group = shape.n_q_heads // shape.n_kv_heads
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (use overwrite to replace it)")

    cap = Capture(layer_ids, kv, group, np.dtype(dtype))
    device = next(model.parameters()).device
    fed, nll, top1 = [], [], []
    model.eval()
    cache_kw = cache_keyword(model)
    with torch.no_grad(), capturing(model, cap), tqdm(total=total, desc="record", unit="tok",
                                                      disable=not progress) as bar:
        first = total if single_pass else n_prompt
        out = model(input_ids=torch.tensor([ids[:first]], device=device), use_cache=True)
        logp = torch.log_softmax(out.logits[0].float(), dim=-1)
        fed.extend(ids[:first])
        nll.append(math.nan)
        top1.append(-1)
        tgt = torch.tensor(ids[1:first], device=device)
        nll.extend((-logp[:-1].gather(1, tgt[:, None])[:, 0]).tolist())
        top1.extend(logp[:-1].argmax(-1).tolist())
        last, past = logp[-1], returned_cache(out)
        bar.update(first)
        for step in range(total - first):
            tok = ids[n_prompt + step] if teacher_forced else int(last.argmax())
            nll.append(float(-last[tok]))
            top1.append(int(last.argmax()))
            fed.append(tok)
            out = model(input_ids=torch.tensor([[tok]], device=device), use_cache=True, **{cache_kw: past})
            last, past = torch.log_softmax(out.logits[0, -1].float(), dim=-1), returned_cache(out)
            bar.update(1)

    scales = {round(cap.scaling[layer], 12) for layer in layer_ids if layer in cap.scaling}
    if len(scales) > 1:
        raise CaptureError(f"layers use different softmax scales {sorted(scales)}; record them separately")
    scale = cap.scaling[layer_ids[0]] if layer_ids[0] in cap.scaling else shape.head_dim ** -0.5

    cols = np.concatenate([np.arange(h * shape.head_dim, (h + 1) * shape.head_dim) for h in cap.q_heads])
    layers_out, faith = [], []
    attention = tuple(layer_attention(model.config, layer, cap.scaling.get(layer, scale), cap.window.get(layer))
                      for layer in layer_ids)
    for layer, attn in zip(layer_ids, attention):
        q, k, v, model_o = cap.arrays(layer)
        res, lse, o = layer_faithfulness(layer, q, k, v, model_o, attn.scale, window=attn.window)
        faith.append(res)
        wo = output_projection(model, layer)
        layers_out.append(LayerArrays(q, k, v, lse, o, None if wo is None else wo[:, cols]))
    compute = str(next(model.parameters()).dtype)
    assert_faithful(faith, default_tolerance(dtype, compute) if tol is None else tol)

    decode_nll = [x for x in nll[n_prompt:] if not math.isnan(x)]
    mean_nll = float(np.mean(decode_nll)) if decode_nll else math.nan
    name = model_id or getattr(model.config, "_name_or_path", "") or type(model).__name__
    hidden = layers_out[0].wo.shape[0] if layers_out[0].wo is not None else 0
    info = ModelInfo(model_id=str(name), n_layers=shape.n_layers, n_q_heads=len(kv) * group, n_kv_heads=len(kv),
                     head_dim=shape.head_dim, rope=shape.rope, layer_ids=layer_ids, hidden_size=hidden,
                     attention=attention)
    src = {
        **(source or {}),
        "recorder": "traces.recorder",
        "model_type": shape.model_type,
        "decode": "teacher_forced" if teacher_forced else "greedy",
        "single_pass": bool(single_pass),
        "kv_heads": list(kv),
        "q_heads": cap.q_heads,
        "model_n_q_heads": shape.n_q_heads,
        "model_n_kv_heads": shape.n_kv_heads,
        "device": str(device),
        "model_dtype": str(next(model.parameters()).dtype),
        "faithfulness_rel_err": {str(r.layer): r.rel_err for r in faith},
        "mean_nll_prompt": float(np.nanmean(nll[:n_prompt])) if n_prompt > 1 else math.nan,
        "mean_nll_decode": mean_nll,
    }
    src = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in src.items()}
    meta = TraceMeta(model=info, n_tokens=total, n_prompt=n_prompt, dtype=dtype, softmax_scale=float(scale),
                     kind="qkv", source=src)
    text = [tokenizer.decode([t]) if tokenizer is not None else "" for t in fed]
    tokens = pd.DataFrame({
        "position": np.arange(total, dtype=np.int64), "token_id": np.asarray(fed, np.int64), "text": text,
        "is_prompt": np.arange(total) < n_prompt, "top1_id": np.asarray(top1, np.int64),
        "nll": np.asarray(nll, np.float32),
    })
    with TraceWriter(out_dir, meta, compute_reference=False, overwrite=overwrite) as w:
        for la in tqdm(layers_out, desc="write", unit="layer", disable=not progress):
            w.add_layer(la)
        w.set_tokens(tokens)
    return RecordResult(out_dir, faith, mean_nll)


def cache_keyword(model) -> str:
    """The keyword a model's forward takes its KV cache by: ``cache`` (transformers >= 5.2x, where
    ``past_key_values`` is deprecated) or ``past_key_values`` (earlier releases)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(out: Any) -> Any:
    """The KV cache a forward returned, under either release's name."""
    return out["cache"] if "cache" in out else out.past_key_values


def output_projection(model, layer: int) -> np.ndarray | None:
    """The attention output projection W_O [hidden, Hq*d] of decoder layer ``layer`` in torch's Linear layout
    (``o = W_O @ concat(heads)``), float32; None for an architecture without ``self_attn.o_proj``."""
    try:
        lin = model.get_decoder().layers[layer].self_attn.o_proj
    except (AttributeError, IndexError, TypeError):
        return None
    return lin.weight.detach().float().cpu().numpy()
