"""Synthetic traces whose attention has a known structure, built from additive logit components.

Each key is laid out in feature blocks so that ``softmax_scale * q_t . k_i`` is a sum of designed terms:

* sink:      a constant bonus for the first ``n_sinks`` tokens (attention sinks);
* salience:  ``zipf_strength * log w_i`` with Zipf weights ``w_i`` on a random permutation (heavy hitters);
* locality:  ``local * c_t . c_i`` for an AR(1) random walk ``c`` with correlation length ``local_length``,
             about ``local * exp(-|t - i| / local_length)`` (local windows, no periodic aliasing);
* content:   random per-token vectors; queries recall a chosen old token (periodic recall, passkey) or
             the current topic's shared vector (topic shifts).

Query heads sharing a KV head (GQA) see the same keys with jittered strengths. ``kind`` picks a recipe;
"mixed" gives heads of different types per layer (concentrated and diffuse heads side by side).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from traces.format import InMemoryTrace, LayerArrays, LayerAttention, ModelInfo, TraceMeta
from traces.reference import full_attention_reference

KINDS = ("mixed", "sinks", "zipf", "local", "recall", "topic_shift", "adversarial", "passkey", "random")
_N_FREQ = 4
_MIN_HEAD_DIM = 2 + 2 * _N_FREQ + 4


@dataclass(frozen=True)
class HeadRecipe:
    """Strengths of the logit components of one KV head (its query heads jitter them)."""

    sink: float = 0.0
    zipf: float = 0.0
    local: float = 0.0
    recall: float = 0.0
    topic: float = 0.0
    noise: float = 1.0
    flip_zipf_at: float = 2.0     # fraction of T after which the salience term changes sign (adversarial)


_RECIPES: dict[str, HeadRecipe] = {
    "sinks": HeadRecipe(sink=6.0, local=1.0),
    "zipf": HeadRecipe(zipf=1.5, sink=2.0),
    "local": HeadRecipe(local=6.0, sink=1.0),
    "recall": HeadRecipe(recall=9.0, local=1.0, sink=2.0),
    "topic_shift": HeadRecipe(topic=4.0, sink=2.0, local=0.5),
    "adversarial": HeadRecipe(zipf=2.0, recall=8.0, flip_zipf_at=0.5),
    "passkey": HeadRecipe(sink=3.0, local=2.0, recall=14.0),
    "random": HeadRecipe(noise=2.0),
}
_MIXED_CYCLE = ("sinks", "zipf", "local", "recall", "topic_shift")


def _recipe_for(kind: str, layer: int, head: int) -> HeadRecipe:
    if kind != "mixed":
        return _RECIPES[kind]
    return _RECIPES[_MIXED_CYCLE[(layer * 2 + head) % len(_MIXED_CYCLE)]]


def _ar1_walk(rng: np.random.Generator, T: int, dims: int, rho: float) -> np.ndarray:
    """Unit-scale AR(1) random walk [T, dims]: E[c_t . c_i] = rho ** |t - i|."""
    noise = rng.standard_normal((T, dims)) / np.sqrt(dims)
    walk = np.empty((T, dims))
    walk[0] = noise[0]
    for t in range(1, T):
        walk[t] = rho * walk[t - 1] + np.sqrt(1.0 - rho * rho) * noise[t]
    return walk


def _recall_targets(kind: str, T: int, rng: np.random.Generator, recall_every: int, window: int,
                    passkey_pos: int, n_needle_queries: int) -> np.ndarray:
    """Per step, the old position the query looks up, or -1."""
    tgt = np.full(T, -1, np.int64)
    if kind == "passkey":
        tgt[T - n_needle_queries:] = passkey_pos
        return tgt
    for t in range(window + 1, T, recall_every):
        tgt[t] = rng.integers(0, t - window)
    return tgt


def _checked_windows(kind: str, n_layers: int, n_q_heads: int, n_kv_heads: int, head_dim: int, n_tokens: int,
                     n_prompt: int, windows: Sequence[int | None] | None) -> list[int | None]:
    """``make_synthetic_trace``'s arguments checked (a ValueError naming the bad one); returns the per-layer windows
    (None: global)."""
    if kind not in KINDS:
        raise ValueError(f"unknown synthetic kind {kind!r}; choose from {KINDS}")
    if head_dim < _MIN_HEAD_DIM:
        raise ValueError(f"head_dim must be >= {_MIN_HEAD_DIM} for synthetic traces, got {head_dim}")
    if n_q_heads % n_kv_heads:
        raise ValueError(f"n_q_heads ({n_q_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    if not 0 <= n_prompt < n_tokens:
        raise ValueError(f"n_prompt must be in [0, n_tokens={n_tokens}), got {n_prompt}")
    windows = [None] * n_layers if windows is None else list(windows)
    if len(windows) != n_layers:
        raise ValueError(f"windows has {len(windows)} entries for {n_layers} layers")
    return windows


def make_synthetic_trace(kind: str = "mixed", *, n_layers: int = 2, n_q_heads: int = 4, n_kv_heads: int = 2,
                         head_dim: int = 32, n_tokens: int = 512, n_prompt: int = 64, seed: int = 0,
                         n_sinks: int = 4, zipf_alpha: float = 1.1, recall_every: int = 16, recall_window: int = 32,
                         segment: int = 128, passkey_pos: int | None = None, n_needle_queries: int = 16,
                         local_length: float = 4.0, dtype: str = "float32",
                         windows: Sequence[int | None] | None = None, reference_from: int = 0) -> InMemoryTrace:
    """Generate a synthetic trace with a known attention structure (see module docstring). ``windows`` makes a
    hybrid model: per layer None (global) or a sliding window, whose windowed attention is the reference.
    ``reference_from``: the full-attention reference (lse, o) only from that row on, zeros before (what a replay
    reads is the measured rows': a long trace's cost measurement skips the quadratic rest)."""
    windows = _checked_windows(kind, n_layers, n_q_heads, n_kv_heads, head_dim, n_tokens, n_prompt, windows)
    T, d, G = n_tokens, head_dim, n_q_heads // n_kv_heads
    scale = d ** -0.5
    rng = np.random.default_rng(seed)
    dc = d - 2 - 2 * _N_FREQ
    pos = np.arange(T)
    rho = float(np.exp(-1.0 / local_length))
    passkey_pos = n_prompt // 4 if passkey_pos is None else passkey_pos
    if kind == "passkey" and not 0 <= passkey_pos < T - n_needle_queries:
        raise ValueError(f"passkey_pos {passkey_pos} must lie before the last {n_needle_queries} queries")
    layers = []
    for layer in range(n_layers):
        q = np.zeros((T, n_q_heads, d), np.float64)
        k = np.zeros((T, n_kv_heads, d), np.float64)
        v = rng.standard_normal((T, n_kv_heads, d))
        for h in range(n_kv_heads):
            rec = _recipe_for(kind, layer, h)
            ranks = rng.permutation(T) + 1
            walk = _ar1_walk(rng, T, 2 * _N_FREQ, rho)
            content = rng.standard_normal((T, dc)) / np.sqrt(dc)
            if kind == "passkey":   # make the needle unique: no other token shares its content direction
                u = content[passkey_pos] / np.linalg.norm(content[passkey_pos])
                others = np.arange(T) != passkey_pos
                content[others] -= np.outer(content[others] @ u, u)
            topics = rng.standard_normal((T // max(1, segment) + 1, dc)) / np.sqrt(dc)
            seg = pos // max(1, segment)
            content_k = content + (topics[seg] if rec.topic else 0.0)
            k[:, h, 0] = (pos < n_sinks).astype(np.float64)
            k[:, h, 1] = -zipf_alpha * np.log(ranks)
            k[:, h, 2:2 + 2 * _N_FREQ] = walk
            k[:, h, 2 + 2 * _N_FREQ:] = content_k
            targets = _recall_targets(kind if kind == "passkey" else "recall", T, rng, recall_every, recall_window,
                                      passkey_pos, n_needle_queries)
            for g in range(G):
                jit_ = rng.uniform(0.7, 1.3, size=6)
                zsign = np.where(pos < rec.flip_zipf_at * T, 1.0, -1.0)
                qh = q[:, h * G + g]
                qh[:, 0] = rec.sink * jit_[0] / scale
                qh[:, 1] = rec.zipf * jit_[1] * zsign / scale
                qh[:, 2:2 + 2 * _N_FREQ] = rec.local * jit_[2] * walk / scale
                qc = rec.noise * rng.standard_normal((T, dc)) / np.sqrt(dc)
                if rec.topic:
                    qc += rec.topic * jit_[3] * topics[seg] / scale
                if rec.recall:
                    has = targets >= 0
                    tgt_vec = content[targets[has]]
                    qc[has] += rec.recall * jit_[4] * tgt_vec / (scale * (tgt_vec ** 2).sum(1, keepdims=True))
                qh[:, 2 + 2 * _N_FREQ:] = qc
        q32, k32, v32 = (a.astype(dtype) for a in (q, k, v))
        lse, o = full_attention_reference(q32, k32, v32, scale, window=windows[layer], start=reference_from)
        wo = random_output_projection(n_q_heads, head_dim, seed * 1000 + layer)
        layers.append(LayerArrays(q32, k32, v32, lse, o, wo))
    attention = tuple(LayerAttention("sliding" if w else "global", w or None, 0.0, scale) for w in windows)
    model = ModelInfo(f"synthetic-{kind}", n_layers, n_q_heads, n_kv_heads, head_dim, rope="none",
                      layer_ids=tuple(range(n_layers)), hidden_size=n_q_heads * head_dim, attention=attention)
    source: dict[str, Any] = dict(generator="traces.synthetic", kind=kind, seed=seed, n_sinks=n_sinks,
                                  local_length=local_length,
                                  zipf_alpha=zipf_alpha, recall_every=recall_every, recall_window=recall_window,
                                  segment=segment, passkey_pos=passkey_pos, n_needle_queries=n_needle_queries)
    meta = TraceMeta(model, T, n_prompt, dtype=dtype, softmax_scale=scale, kind="synthetic", source=source)
    return InMemoryTrace(meta, layers)


def random_output_projection(n_q_heads: int, head_dim: int, seed: int) -> np.ndarray:
    """A random W_O [Hq*d, Hq*d] (hidden = Hq*d) whose query heads have different gains (log-normal, as trained
    models' heads do), so that W_O-aware policies and metrics see heads that matter unequally. Drawn from its
    own generator: the trace's q/k/v do not change with it."""
    rng = np.random.default_rng([seed, 0x57])
    width = n_q_heads * head_dim
    gains = np.repeat(rng.lognormal(0.0, 0.7, n_q_heads), head_dim)
    return (rng.standard_normal((width, width)) * gains[None, :] / np.sqrt(width)).astype(np.float32)
