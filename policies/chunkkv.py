"""ChunkKV (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context
LLM Inference").

Tokens are kept in whole chunks of ``chunk_length`` contiguous positions: a chunk's score is the sum of its
tokens' scores, and every token carries its chunk's score, so the lowest chunks go first (ties evict the
older token, so at most one chunk -- the last one reached -- is cut, as kvpress truncates the last selected
chunk). The token score is SnapKV's observation-window attention (the last ``window_size`` prompt queries,
GQA-reduced by mean, summed over the window), the scorer ChunkKV builds on. Defaults: chunk_length 20 and
window 64 (kvpress ``ChunkKVPress`` over ``SnapKVPress``; the paper reports chunk size 10 as also good).
Ambiguities: at decode each step's query attention is added to the tokens' scores (accumulated, as H2O),
since the window's old queries are not stored; layer-wise index reuse (paper Sec. 3.2) is not modelled.
"""
import numpy as np
from numba import njit

from policies.kernels import group_rows_scores
from policies.base import Param, kernel, param_indices
from policies.kernels import group_score
from policies.registry import register
from policies.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, ScorerPolicy, protection

SCHEMA = protection(n_sink=0, n_recent=1) + (
    Param("chunk_length", 20, "int", 1, 1024, doc="contiguous positions per chunk"),
    Param("window_size", 64, "int", 1, 1024, doc="prompt queries scoring the tokens (SnapKV observation window)"),
)
P = param_indices(SCHEMA)


@njit(cache=True)
def chunk_sums(base, positions, n, chunk, out):
    """out[i] = sum of base[j] over cached slots j in the chunk of slot i (slots in position order)."""
    i0 = 0
    while i0 < n:
        c = positions[i0] // chunk
        i1 = i0
        acc = 0.0
        while i1 < n and positions[i1] // chunk == c:
            acc += base[i1]
            i1 += 1
        for i in range(i0, i1):
            out[i] = acc
        i0 = i1


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    n = k.shape[0]
    w = min(int(params[P.window_size]), n)
    ring = np.zeros((1, 1))
    pos = np.arange(n)
    for h in range(k.shape[1]):
        raw = np.zeros(n)
        group_rows_scores(q, k, scale, h, n - w, n, 0, raw, ring, 0)
        for i in range(n):
            slot_state[h, i, 0] = raw[i]
        chunk_sums(raw, pos, n, int(params[P.chunk_length]), scores[h])


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    for h in range(lengths.shape[0]):
        n = lengths[h]
        for i in range(n):
            slot_state[h, i, 0] += group_score(probs, h, i, 0)
        chunk_sums(np.ascontiguousarray(slot_state[h, :n, 0]), positions[h], n, int(params[P.chunk_length]),
                   scores[h])


@register
class ChunkKV(ScorerPolicy):
    """Whole chunks of contiguous tokens selected by their summed observation-window attention."""

    name = "chunkkv"
    summary = "whole chunks by summed attention score"
    schema = SCHEMA
    P = P
    slot_fields = 1
    score_prompt = score_prompt
    score_step = score_step
