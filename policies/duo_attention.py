"""DuoAttention (Xiao et al., 2024, arXiv 2410.10819), as kvpress's ``DuoAttentionPress`` in its on-the-fly mode.

Heads are of two kinds: *retrieval* heads keep the whole context, *streaming* heads only ``sink_size`` attention
sinks and the ``recent_size`` most recent tokens. The ``head_compression_ratio`` share of all the model's KV
heads (``round(ratio * L * Hkv)``, every compressed layer ranked together) with the lowest head scores stream.

Head scores (kvpress's ``duo_attention_on_the_fly``; the trained patterns the paper and kvpress's default mode
download cannot be reached): per layer, the mean pre-RoPE query of each query head and the mean pre-RoPE key of
each KV head over a text are repeated at positions 0..n-1 (``pattern_len``, kvpress's ``q_len = 500``) and
RoPE-rotated; the last position's softmax attention over the n keys (scale 1 / sqrt(d), as kvpress) is summed
cumulatively and the mean of that curve, the "area under the cumulated attention curve", is the query head's
score, averaged over the query heads of the KV head. Deviations: the text is the replayed prompt (kvpress averages
50 BookSum samples), and the traces hold post-RoPE queries and keys, so each row is un-rotated at its position
with the layer's RoPE base (``rope_theta``: -1 reads it from the trace or, closed loop, from the model's config;
0 means no RoPE: every head then scores alike and the split follows the head order). The ranking is a stable sort
(ties: the lower layer, then the lower head, streams first; kvpress's ``np.argsort`` does not say).

Defaults and sources: ``sink_size=128``, ``recent_size=256`` and ``pattern_len=500`` are kvpress's on-the-fly
values (the paper's released patterns use 64 sinks and 256 recent tokens); ``head_compression_ratio=0.5`` is the
paper's setting for GQA models (MHA: 0.75). kvpress's default ratio is 0.0, which turns every head into a
retrieval head (its evaluation always sets it).

Budget (kvsim budgets are per KV head; ``allocate`` gives every head its own, the mechanism PyramidKV's layer
budgets use): a retrieval head keeps up to the budget B, a streaming head up to ``min(sink_size + recent_size,
B)``, so the memory held, ``(1 - r) B + r min(S, B)`` slots per head on average (reported as held memory, like
every policy's), is at most the budget and depends on the split. kvpress's own compression ratio,
``r (1 - S / n)`` for n tokens, is what this holds at a budget of at least the sequence length. kvpress never
evicts from a retrieval head; with a budget below the sequence a retrieval head here keeps its first
``min(sink_size, b - 1)`` tokens and the most recent ones, the streaming rule with a wider window. A streaming
head's window slides during decoding (the paper's constant-memory streaming heads; kvpress masks the prompt's
middle once and then lets decoded tokens accumulate). At budgets up to ``sink_size + recent_size`` the split
changes nothing: every head is then StreamingLLM with ``min(sink_size, b - 1)`` sinks; pick smaller
``sink_size`` / ``recent_size`` for small budgets.

Not a scorer: the rule is a per-head size, not a ranking, so ``ada``/``critical``/``decoding``/``threshold``
do not apply.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from numba import njit

from policies.core.base import (FROM_MODEL, PREFILL_SIG, STEP_SIG, Guarantees, Param, Policy, PolicyError, kernel,
                           param_indices, prompt_memo)
from policies.expected_attention import rope_tables
from policies.core.registry import register
from policies.core.kvpress_press import KvpressPress, require

SCHEMA = (
    Param("head_compression_ratio", 0.5, "float", 0.0, 1.0,
          doc="share of the KV heads made streaming heads (paper, GQA: 0.5; kvpress default 0.0: none)"),
    Param("sink_size", 128, "int", 0, 1 << 16, searchable=False,
          doc="attention sinks a head keeps (kvpress on-the-fly: 128; paper patterns: 64)"),
    Param("recent_size", 256, "int", 1, 1 << 20, searchable=False,
          doc="recent tokens a streaming head keeps (kvpress on-the-fly and paper: 256)"),
    Param("pattern_len", 500, "int", 2, 1 << 16, searchable=False,
          doc="positions of the synthetic mean-query/mean-key pattern that scores heads (kvpress: 500)"),
    Param("rope_theta", FROM_MODEL, "float", FROM_MODEL, 1e9, searchable=False,
          doc="RoPE base to un-rotate the trace's q/k; -1: each layer's own (trace or model), 0: no RoPE"),
)
P = param_indices(SCHEMA)


@kernel(STEP_SIG)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    """Each head over its budget drops its oldest tokens after its first ``min(sink_size, budget - 1)``."""
    sink = np.int64(params[P.sink_size])
    for h in range(lengths.shape[0]):
        excess = lengths[h] - budget[h]
        s = min(sink, budget[h] - 1)
        i = 0
        while excess > 0 and i < lengths[h]:
            if positions[h, i] >= s:
                keep[h, i] = 0
                excess -= 1
            i += 1


@kernel(PREFILL_SIG)
def _prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    """Each head keeps the first ``min(sink_size, budget - 1)`` prompt tokens and the most recent ones."""
    n = k.shape[0]
    sink = np.int64(params[P.sink_size])
    for h in range(k.shape[1]):
        b = budget[h]
        if n <= b:
            continue
        s = min(sink, b - 1)
        for i in range(s, n - (b - s)):
            keep[h, i] = 0


@njit(cache=True)
def _rotate(x, cos_t, sin_t, r, inverse):
    """x [d] rotated (rotate-half RoPE) by position r's angles of the ``rope_tables`` (which hold the inverse)."""
    half = x.shape[0] // 2
    out = np.empty(x.shape[0])
    sgn = 1.0 if inverse else -1.0
    for j in range(half):
        c = cos_t[r, j]
        s = sgn * sin_t[r, j]
        out[j] = c * x[j] - s * x[j + half]
        out[j + half] = s * x[j] + c * x[j + half]
    return out


@njit(cache=True)
def head_scores(q, k, theta, n_pos):
    """kvpress's on-the-fly DuoAttention score of each KV head of one layer from its prompt q [P, Hq, d] and
    k [P, Hkv, d] (post-RoPE; un-rotated with base ``theta``, 0: no RoPE): float64 [Hkv]."""
    P_, hq_n, d = q.shape
    hkv = k.shape[1]
    g_n = hq_n // hkv
    rope = theta > 0.0
    m = max(P_, n_pos)
    cos_t, sin_t = rope_tables(0, m, d, theta) if rope else (np.zeros((1, 1)), np.zeros((1, 1)))
    qm = np.zeros((hq_n, d))
    km = np.zeros((hkv, d))
    for r in range(P_):
        for j in range(hq_n):
            row = q[r, j].astype(np.float64)
            qm[j] += _rotate(row, cos_t, sin_t, r, True) if rope else row
        for h in range(hkv):
            row = k[r, h].astype(np.float64)
            km[h] += _rotate(row, cos_t, sin_t, r, True) if rope else row
    qm /= max(P_, 1)
    km /= max(P_, 1)
    out = np.zeros(hkv)
    logits = np.empty(n_pos)
    for j in range(hq_n):
        h = j // g_n
        qr = _rotate(qm[j], cos_t, sin_t, n_pos - 1, False) if rope else qm[j]
        mx = -np.inf
        for p in range(n_pos):
            kr = _rotate(km[h], cos_t, sin_t, p, False) if rope else km[h]
            logits[p] = np.dot(qr, kr) / np.sqrt(d)
            mx = max(mx, logits[p])
        tot = 0.0
        for p in range(n_pos):
            logits[p] = np.exp(logits[p] - mx)
            tot += logits[p]
        cum = 0.0
        area = 0.0
        for p in range(n_pos):
            cum += logits[p] / tot
            area += cum
        out[h] += area / n_pos / g_n
    return out


def _layer_bases(prompt_layers: Any) -> list[float | None] | None:
    """Each compressed layer's RoPE base, as the prompt view records it (the simulator's and the closed-loop
    runner's views both answer ``rope_theta(j)``), or None when the view says nothing about them (a plain list)."""
    read = getattr(prompt_layers, "rope_theta", None)
    return None if read is None else [read(j) for j in range(len(prompt_layers))]


@register
class DuoAttention(Policy):
    """Retrieval heads keep up to the budget, streaming heads sinks + a recent window (DuoAttention, kvpress's
    on-the-fly head scores); see the module docstring for the head scores, the budget and the defaults."""

    name = "duo_attention"
    reads_keys = False
    reads_values = False
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"head_compression_ratio": (0.5, 0.25, 0.75)}
    summary = "retrieval heads keep the budget, streaming heads sinks + recent (on-the-fly head split)"
    schema = SCHEMA
    P = P
    reads_attention = False
    step_fn = _step
    prefill_fn = _prefill

    def streaming_size(self, budget: int) -> int:
        """Slots a streaming head keeps at this budget."""
        return min(self.params["sink_size"] + self.params["recent_size"], budget)

    def guarantees(self, budget: int) -> Guarantees:
        b = self.streaming_size(budget) if self.params["head_compression_ratio"] > 0 else budget
        s = min(self.params["sink_size"], b - 1)
        return Guarantees(sinks=s, recent=b - s)

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``DuoAttentionPress`` with on-the-fly head scores: the same split of heads (the lowest-scored
        share streams, keeping its first 128 and last 256 tokens). kvpress averages its scores over 50 BookSum
        samples from the Hugging Face hub; kvsim computes them on the prompt, so the same sets need kvsim's scores
        handed to it. The press decides its own sizes: compare at a budget of the whole prompt."""
        require(self, "DuoAttentionPress", sink_size=128, recent_size=256, rope_theta=-1.0)
        return KvpressPress({"cls": "DuoAttentionPress", "head_compression_ratio": self.params["head_compression_ratio"],
                             "on_the_fly_scoring": True}, sets_ratio=False, budgets="prompt", needs=("head_scores",),
                            note="kvpress's on-the-fly head scores average BookSum samples from the Hugging Face hub; "
                                 "kvsim scores the heads on the prompt (policies/duo_attention.py): hand kvsim's to "
                                 "duo_attention_on_the_fly for the same split")

    def head_scores(self, prompt_layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """[L, Hkv] kvpress's on-the-fly scores of the compressed layers' KV heads (higher: retrieval)."""
        theta = self.params["rope_theta"]
        if theta == FROM_MODEL:
            bases = _layer_bases(prompt_layers)
            if bases is None or any(b is None for b in bases):
                raise PolicyError(f"{self.label()}: rope_theta=-1 means each layer's own RoPE base, which this "
                                  f"trace or model does not record (a scaled RoPE, or no record of it); pass "
                                  f"rope_theta=VALUE explicitly")
        else:
            bases = [theta] * len(prompt_layers)
        n_pos = self.params["pattern_len"]

        def compute() -> np.ndarray:
            out = []
            for (q, k), base in zip(prompt_layers, bases):
                out.append(head_scores(np.ascontiguousarray(q, np.float32), np.ascontiguousarray(k, np.float32),
                                       float(base), n_pos))
            return np.array(out, np.float64).reshape(len(prompt_layers), -1)

        return prompt_memo(prompt_layers, ("duo_attention.head_scores", n_pos, tuple(bases)), compute)

    def streaming_heads(self, n_kv_heads: int, prompt_layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """[L, Hkv] bool: the heads made streaming (the lowest scores, ``round(ratio * L * Hkv)`` of them)."""
        n_layers = len(prompt_layers)
        mask = np.zeros((n_layers, n_kv_heads), bool)
        n_stream = round(n_layers * n_kv_heads * self.params["head_compression_ratio"])
        if n_stream > 0:
            scores = self.head_scores(prompt_layers)
            mask.flat[np.argsort(scores, axis=None, kind="stable")[:n_stream]] = True
        return mask

    def allocate(self, budget: int, n_kv_heads: int, prompt_layers: Sequence[tuple[np.ndarray, np.ndarray]],
                 scale: float) -> np.ndarray:
        out = np.full((len(prompt_layers), n_kv_heads), budget, np.int64)
        small = self.streaming_size(budget)
        if small < budget:           # else the split changes nothing: no head scores needed
            out[self.streaming_heads(n_kv_heads, prompt_layers)] = small
        return out
