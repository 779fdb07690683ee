"""Record attention traces (post-RoPE q, k, v per layer) from HF decoder models into the kvsim format.

Prefill of the prompt, then token-by-token decode through the model's KV cache (greedy, or
teacher-forced on the given text). Every stored layer is checked for faithfulness (attention recomputed
from the stored q/k/v against the model's own attention output, windowed on a sliding layer) before the trace
is written atomically. The manifest records each layer's attention as the model ran it (global or sliding with
its window, RoPE base, softmax scale), so hybrid models (Gemma-3: 15 sliding + 3 global layers) record at any
length the model supports.

tokens.parquet row t describes position t: ``token_id`` fed at t, ``nll`` = -log p(token_t | tokens_<t)
and ``top1_id`` = argmax p(. | tokens_<t) under the full cache (NaN / -1 at t = 0, which has no context).

Where things live: everything done to the transformers model is `traces.hf` (`geometry`: its shape, each layer's
attention and W_O; `routing`: its attention routed to the capture; `forward`: the chunked forward over its own
cache); `traces.capture` holds the captured q/k/v, `traces.faithful` the faithfulness check and `traces.format`
the writer. This module runs the model and scores the fed tokens.
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from traces.capture import Capture, CaptureError, capturing
from traces.faithful import LayerFaithfulness, assert_faithful, default_tolerance, layer_faithfulness
from traces.format import LayerArrays, ModelInfo, TraceMeta, TraceWriter
from traces.hf.forward import DEFAULT_CHUNK, CachedForward
from traces.hf.geometry import layer_attention, model_shape, output_projection
from traces.hf.reconstruction_pass import plan_for, run_reconstruction


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


def record_trace(model, token_ids: Sequence[int], out_dir: str | Path, *, n_prompt: int, n_decode: int,
                 tokenizer: Any = None, layers: Sequence[int] | None = None, kv_heads: Sequence[int] | None = None,
                 dtype: str = "float32", teacher_forced: bool = False, model_id: str | None = None,
                 source: dict | None = None, progress: bool = True, overwrite: bool = False,
                 tol: float | None = None, single_pass: bool = False, chunk: int | None = None,
                 prompt_scores: bool = True, reconstruction_chunk: int | None = None) -> RecordResult:
    """Run prefill + decode, capture q/k/v of the chosen layers and KV heads, check and write a trace.

    token_ids: the text; the first n_prompt are the prompt; with teacher_forced the next n_decode are fed
    as the decoded tokens, otherwise decode is greedy. kv_heads selects KV heads; each keeps its whole
    query-head group (GQA: query head h uses KV head h // (Hq/Hkv)). single_pass (teacher-forced only) feeds
    all tokens causally in chunks instead of the decoded ones token by token: the same attention, several times
    faster. The prompt always goes through in chunks of ``chunk`` tokens (``DEFAULT_CHUNK``) with the model's own
    cache, and every captured array lives in memory-mapped buffers until its layer is checked and written, so
    memory stays bounded at any length the model supports. ``prompt_scores=False`` leaves the prompt positions'
    next-token NLL and top-1 out of the tokens table (NaN and -1, as position 0's): the LM head then runs only on
    the positions that predict decoded tokens (Gemma-3's 262 k-token head is most of its forward's FLOPs).
    ``reconstruction_chunk`` (``kvsim record --kvzip``) also runs KVzip's context-reconstruction pass over the
    prompt in chunks of that many tokens and stores its queries and keys (``traces.reconstruction``; it costs a
    forward over its ~P repeat tokens, and one more over the prompt unless the prompt went through in the default
    chunks, whose cache it then starts from; and (Hq + Hkv) * d values per repeat token and layer, about as much
    as the prompt's q and k).
    """
    import torch

    shape = model_shape(model)
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
    if shape.max_positions and total > shape.max_positions:
        raise RecordError(f"n_prompt + n_decode = {total} exceeds the model's context of {shape.max_positions} "
                          "positions")
    layer_ids = _check_subset("layers", layers, shape.n_layers)
    kv = _check_subset("kv_heads", kv_heads, shape.n_kv_heads)
    group = shape.group
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (use overwrite to replace it)")

    model.eval()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.capture-") as spill:
        cap = Capture(layer_ids, kv, group, np.dtype(dtype), total, Path(spill))
        try:
            with torch.no_grad(), capturing(model, cap):
                fed, nll, top1, used_chunk, prompt_cache = _run_model(
                    model, ids, n_prompt=n_prompt, total=total, teacher_forced=teacher_forced,
                    single_pass=single_pass, chunk=chunk, progress=progress, prompt_scores=prompt_scores,
                    keep_prompt_cache=bool(reconstruction_chunk))
            meta, tokens = _describe(model, cap, shape, layer_ids, kv, group, fed, nll, top1, n_prompt=n_prompt,
                                     dtype=dtype, model_id=model_id, source=source, teacher_forced=teacher_forced,
                                     single_pass=single_pass, chunk=used_chunk, tokenizer=tokenizer)
            recon = None
            if reconstruction_chunk:
                plan = plan_for(model, ids[:n_prompt], int(reconstruction_chunk), tokenizer)
                recon = run_reconstruction(model, ids[:n_prompt], plan, layer_ids, q_heads=cap.q_heads, kv_heads=kv,
                                           dtype=np.dtype(dtype), prompt_cache=prompt_cache)
                del prompt_cache
                meta = replace(meta, reconstruction=plan)
            tolerance = default_tolerance(dtype, str(next(model.parameters()).dtype)) if tol is None else tol
            faith = _check_and_write(model, cap, meta, tokens, out_dir, tolerance=tolerance, overwrite=overwrite,
                                     progress=progress, recon=recon)
        finally:
            cap.close()
    mean_nll = meta.source["mean_nll_decode"]
    return RecordResult(out_dir, faith, math.nan if mean_nll is None else mean_nll)


def _run_model(model, ids: list[int], *, n_prompt: int, total: int, teacher_forced: bool, single_pass: bool,
               chunk: int | None, progress: bool, prompt_scores: bool = True, keep_prompt_cache: bool = False
               ) -> tuple[list[int], list[float], list[int], int, Any]:
    """Feed the prompt (with ``single_pass`` the whole teacher-forced text) in chunks, then decode token by
    token on the same cache (`traces.hf.forward.CachedForward`); returns the fed tokens, each position's NLL and
    top-1 (NaN / -1 at position 0, and at every prompt position without ``prompt_scores``), the chunk used, and
    with ``keep_prompt_cache`` a copy of the model's cache after the prompt when it is the one KVzip's reconstruction
    pass would build (`traces.hf.reconstruction_pass.run_reconstruction`: the prompt in ``DEFAULT_CHUNK``-token
    forwards, so a chunk must end at the prompt's end; else None, and the pass feeds the prompt again).
    The LM head runs only on the rows whose predictions are read (and each chunk's last, for the next token)."""
    import copy

    import torch

    fwd = CachedForward(model)
    chunk = max(1, int(chunk or DEFAULT_CHUNK))
    first = total if single_pass else n_prompt
    fed: list[int] = list(ids[:first])
    nll, top1 = [math.nan], [-1]          # position 0 has no context; position p >= 1 is predicted by p - 1
    prompt_cache = None
    snapshot = keep_prompt_cache and chunk == DEFAULT_CHUNK       # the pass's own chunks, where one ends at n_prompt

    def read(c0: int, c1: int) -> tuple[int, int]:
        """The rows [lo, hi) of chunk [c0, c1) whose predictions are scored: those of a fed token (hi), less the
        ones predicting prompt tokens without ``prompt_scores``."""
        hi = min(c1, first - 1) - c0
        return (0 if prompt_scores else min(max(0, min(c1, n_prompt - 1) - c0), hi)), hi

    def keep(c0: int, c1: int) -> int:
        lo, hi = read(c0, c1)
        return c1 - c0 - (lo if hi > lo else c1 - c0 - 1)

    with tqdm(total=total, desc="record", unit="tok", disable=not progress) as bar:
        x = torch.tensor([ids[:first]], device=fwd.device)
        for c0, c1, logits in fwd.chunks(x, chunk, keep):
            lo, hi = read(c0, c1)
            got_nll, got_top1 = _next_token_scores(logits[0], c1 - c0 - logits.shape[1], lo, ids[c0 + 1:c0 + 1 + hi])
            nll.extend(got_nll)
            top1.extend(got_top1)
            last = torch.log_softmax(logits[0, -1].float(), dim=-1)
            if snapshot and c1 == n_prompt:
                prompt_cache = copy.deepcopy(fwd.past)
            bar.update(c1 - c0)
        for step in range(total - first):
            tok = ids[n_prompt + step] if teacher_forced else int(last.argmax())
            nll.append(float(-last[tok]))
            top1.append(int(last.argmax()))
            fed.append(tok)
            last = torch.log_softmax(fwd([tok])[0, -1].float(), dim=-1)
            bar.update(1)
    return fed, nll, top1, chunk, prompt_cache


#: logits rows turned into float32 log-probabilities at a time (a 262 k-token vocabulary never makes a whole chunk's)
SCORE_ROWS = 64


def _next_token_scores(logits, row0: int, skip: int, targets: Sequence[int]) -> tuple[list[float], list[int]]:
    """The NLL of ``targets[i]`` and the argmax of the prediction of chunk row i, for every i < len(targets);
    ``logits`` holds rows ``row0`` on, and the first ``skip`` rows get none (NaN, -1)."""
    import torch

    nll: list[float] = [math.nan] * skip
    top1: list[int] = [-1] * skip
    for r0 in range(skip, len(targets), SCORE_ROWS):
        r1 = min(len(targets), r0 + SCORE_ROWS)
        lp = torch.log_softmax(logits[r0 - row0:r1 - row0].float(), dim=-1)
        tgt = torch.tensor(list(targets[r0:r1]), device=lp.device)
        nll.extend((-lp.gather(1, tgt[:, None])[:, 0]).tolist())
        top1.extend(lp.argmax(-1).tolist())
    return nll, top1


def _describe(model, cap: Capture, shape, layer_ids: tuple[int, ...], kv: tuple[int, ...], group: int,
              fed: list[int], nll: list[float], top1: list[int], *, n_prompt: int, dtype: str, model_id: str | None,
              source: dict | None, teacher_forced: bool, single_pass: bool, chunk: int, tokenizer: Any):
    """The trace's metadata (each layer's attention as its calls ran it) and its tokens table."""
    total = len(fed)
    scales = {round(cap.scaling[layer], 12) for layer in layer_ids if layer in cap.scaling}
    if len(scales) > 1:
        raise CaptureError(f"layers use different softmax scales {sorted(scales)}; record them separately")
    scale = cap.scaling[layer_ids[0]] if layer_ids[0] in cap.scaling else shape.head_dim ** -0.5
    attention = tuple(layer_attention(model.config, layer, cap.scaling.get(layer, scale), cap.window.get(layer))
                      for layer in layer_ids)
    decode_nll = [x for x in nll[n_prompt:] if not math.isnan(x)]
    wo = output_projection(model, layer_ids[0])
    info = ModelInfo(model_id=str(model_id or getattr(model.config, "_name_or_path", "") or type(model).__name__),
                     n_layers=shape.n_layers, n_q_heads=len(kv) * group, n_kv_heads=len(kv), head_dim=shape.head_dim,
                     rope=shape.rope, layer_ids=layer_ids, hidden_size=0 if wo is None else wo.shape[0],
                     attention=attention)
    src = {
        **(source or {}),
        "recorder": "traces.recorder",
        "model_type": shape.model_type,
        "decode": "teacher_forced" if teacher_forced else "greedy",
        "single_pass": bool(single_pass),
        "prefill_chunk": chunk,
        "kv_heads": list(kv),
        "q_heads": cap.q_heads,
        "model_n_q_heads": shape.n_q_heads,
        "model_n_kv_heads": shape.n_kv_heads,
        "device": str(next(model.parameters()).device),
        "model_dtype": str(next(model.parameters()).dtype),
        "mean_nll_prompt": (float(np.nanmean(nll[:n_prompt])) if np.isfinite(nll[:n_prompt]).any()
                            else math.nan),    # none: one prompt token, or prompt_scores off
        "mean_nll_decode": float(np.mean(decode_nll)) if decode_nll else math.nan,
    }
    src = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in src.items()}
    meta = TraceMeta(model=info, n_tokens=total, n_prompt=n_prompt, dtype=dtype, softmax_scale=float(scale),
                     kind="qkv", source=src)
    tokens = pd.DataFrame({
        "position": np.arange(total, dtype=np.int64), "token_id": np.asarray(fed, np.int64),
        "text": [tokenizer.decode([t]) if tokenizer is not None else "" for t in fed],
        "is_prompt": np.arange(total) < n_prompt, "top1_id": np.asarray(top1, np.int64),
        "nll": np.asarray(nll, np.float32),
    })
    return meta, tokens


def _check_and_write(model, cap: Capture, meta: TraceMeta, tokens: Any, out_dir: Path, *, tolerance: float,
                     overwrite: bool, progress: bool, recon: dict | None = None) -> list[LayerFaithfulness]:
    """One layer at a time: its reference (windowed on a sliding layer), its faithfulness (a failure discards the
    whole trace), then its files (with the layer's reconstruction-pass arrays from ``recon``); nothing but the
    current layer's captured arrays is held in memory."""
    d = meta.model.head_dim
    cols = np.concatenate([np.arange(h * d, (h + 1) * d) for h in cap.q_heads])
    faith: list[LayerFaithfulness] = []
    with TraceWriter(out_dir, meta, compute_reference=False, overwrite=overwrite) as w:
        for i, layer in enumerate(tqdm(meta.model.layer_ids, desc="check+write", unit="layer", disable=not progress)):
            attn = meta.attention(i)
            q, k, v, model_o = cap.arrays(layer)
            res, lse, o = layer_faithfulness(layer, q, k, v, model_o, attn.scale, window=attn.window)
            assert_faithful([res], tolerance)
            faith.append(res)
            wo = output_projection(model, layer)
            w.add_layer(LayerArrays(q, k, v, lse, o, None if wo is None else wo[:, cols],
                                    *(recon[layer] if recon is not None else (None, None))))
        rel_err = {str(r.layer): r.rel_err for r in faith}
        w.meta = replace(meta, source={**meta.source, "faithfulness_rel_err": rel_err})
        w.set_tokens(tokens)
    return faith

