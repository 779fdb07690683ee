"""ChunkKV (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context
LLM Inference").

Tokens are kept in whole chunks of ``chunk_length`` contiguous positions (chunk c holds positions
[c * chunk_length, (c + 1) * chunk_length), the last one possibly partial): a chunk's score is the sum of its
tokens' scores, and every token carries its chunk's score, so the lowest chunks go first (ties evict the
older token, so at most one chunk -- the last one reached -- is cut, as kvpress truncates the last selected
chunk). The token score is SnapKV's observation-window attention (the last ``window_size`` prompt queries,
GQA-reduced by mean, summed over the window), the scorer ChunkKV builds on. Defaults: chunk_length 20 and
window 64 (kvpress ``ChunkKVPress`` over ``SnapKVPress``; the paper reports chunk size 10 as also good).
Ambiguities: at decode each step's query attention is added to the tokens' scores (accumulated, as H2O),
since the window's old queries are not stored; layer-wise index reuse (paper Sec. 3.2) is not modelled.

kvpress's ``ChunkKVPress`` (submitted to kvpress as the paper's implementation, NVIDIA/kvpress PR #51 "add
ChunkKV") over ``SnapKVPress`` differs from these defaults in four ways, each a parameter here:

- ``scope``: kvpress sums the inner press's token scores over the layer's KV heads before forming chunk scores,
  so every KV head of a layer keeps the same chunks (``scope=layer``: a chunk's score is the sum over the
  layer's KV heads of that head's chunk score; at decode each head's chunk score is over its own cached slots).
  We found no statement in the paper on how the heads of a layer are combined, so kvpress's code is the only
  reference for it; the default stays ``head`` (each KV head ranks its own chunks by its own attention, as
  SnapKV selects per head), kvsim's reading before this option existed, so that existing results and the
  pinned kept sets (tests/data/kept_golden.json) keep their meaning.
- ``chunk_reduce``: kvpress ranks chunks by the mean of their tokens' (head-summed) scores, the paper by the
  sum; the two differ only for a partial chunk (the remainder at the end of the prompt, or at decode a chunk
  with evicted tokens). ``mean`` averages over the chunk's cached slots (per head, then summed over heads
  under ``scope=layer``, which at prefill is kvpress's mean of the head sum).
- ``kernel_size`` / ``pooling``: SnapKVPress pools the window scores over ``kernel_size`` neighbouring
  positions (average, zero padding counted, as ``avg_pool1d``) before chunking; the default 1 is no pooling.
  Pooling runs over the candidates (with ``window_pad``, the positions before the window), and at decode over
  cached slots within ``kernel_size // 2`` positions (uncached positions count as zero, like padding).
- ``window_pad``: SnapKVPress gives the observation window (the last ``window_size`` positions) the score
  ``max + 1`` (its maximum over the layer, on its scale of the window *mean*), so the chunks covering the
  window are kept. Here the window's tokens score as the layer's best candidate plus ``window_size`` (the same
  rule on kvsim's scale of the window *sum*), before chunking; at decode the padded window is the last
  ``window_size`` positions.

kvpress's ChunkKV(SnapKV) is therefore ``chunkkv:n_sink=0,n_recent=0,scope=layer,chunk_reduce=mean,
kernel_size=5,pooling=avg,window_pad=true`` (benchmarks/kvpress_parity.py); kvpress selects
``int(n_chunks * (1 - ratio))`` whole chunks, the budget kvsim is then given.
"""
import numpy as np
from numba import njit

from policies.core.base import Param, PolicyError, kernel, param_indices
from policies.core.shared_kernels import group_rows_scores, group_score
from policies.core.registry import register
from policies.core.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, ScorerPolicy, protection
from policies.core.kvpress_press import KvpressPress, protected_extra, require

SCOPES = ("head", "layer")
CHUNK_REDUCE = ("sum", "mean")
POOLING = ("max", "avg")          # pool_scores' order: 0 max, 1 avg

SCHEMA = protection(n_sink=0, n_recent=1) + (
    Param("chunk_length", 20, "int", 1, 1024, doc="contiguous positions per chunk"),
    Param("window_size", 64, "int", 1, 1024, doc="prompt queries scoring the tokens (SnapKV observation window)"),
    Param("scope", "head", "choice", choices=SCOPES, searchable=False,
          doc="head: each KV head ranks its own chunks; layer: chunk scores summed over the layer's KV heads, one "
              "chunk selection per layer (kvpress ChunkKVPress)"),
    Param("chunk_reduce", "sum", "choice", choices=CHUNK_REDUCE, searchable=False,
          doc="chunk score: sum (paper) or mean (kvpress) of its cached tokens' scores; differ for partial chunks"),
    Param("kernel_size", 1, "int", 1, 63,
          doc="pooling of token scores over neighbouring positions before chunking, odd (1: none; kvpress's "
              "SnapKVPress: 5)"),
    Param("pooling", "avg", "choice", choices=POOLING, searchable=False,
          doc="pooling when kernel_size > 1: avg (kvpress's SnapKVPress, zero padding counted) or max"),
    Param("window_pad", False, "bool", searchable=False,
          doc="the last window_size positions score as the layer's best other token + window_size (kvpress "
              "SnapKVPress's max + 1 window padding), so chunks covering the window are kept"),
)
P = param_indices(SCHEMA)


@njit(cache=True)
def chunk_sums(base, positions, n, chunk, out, mean=False):
    """out[i] = sum (``mean``: mean) of base[j] over cached slots j in the chunk of slot i (slots in position
    order)."""
    i0 = 0
    while i0 < n:
        c = positions[i0] // chunk
        i1 = i0
        acc = 0.0
        while i1 < n and positions[i1] // chunk == c:
            acc += base[i1]
            i1 += 1
        if mean:
            acc /= i1 - i0
        for i in range(i0, i1):
            out[i] = acc
        i0 = i1


@njit(cache=True)
def add_chunk_stats(base, positions, n, chunk, mean, acc):
    """acc[c] += sum (``mean``: mean) of base[j] over the cached slots j of chunk c (slots in position order)."""
    i0 = 0
    while i0 < n:
        c = positions[i0] // chunk
        i1 = i0
        s = 0.0
        while i1 < n and positions[i1] // chunk == c:
            s += base[i1]
            i1 += 1
        acc[c] += s / (i1 - i0) if mean else s
        i0 = i1


@njit(cache=True)
def pool_cached(raw, positions, n, lim, kernel_size, pooling, out):
    """out[i] for the slots with positions < lim: raw pooled over the slots j with positions < lim and
    |pos_j - pos_i| <= kernel_size // 2 (pooling 0: max, 1: sum / kernel_size, absent positions counting as 0,
    as ``avg_pool1d``'s zero padding); slots at lim or later copy raw. Slots in position order."""
    r = kernel_size // 2
    for i in range(n):
        if positions[i] >= lim:
            out[i] = raw[i]
            continue
        acc = raw[i]
        j = i - 1
        while j >= 0 and positions[i] - positions[j] <= r:
            acc = max(acc, raw[j]) if pooling == 0 else acc + raw[j]
            j -= 1
        j = i + 1
        while j < n and positions[j] < lim and positions[j] - positions[i] <= r:
            acc = max(acc, raw[j]) if pooling == 0 else acc + raw[j]
            j += 1
        out[i] = acc if pooling == 0 else acc / kernel_size


@njit(cache=True)
def chunk_scores(params, raw, positions, lengths, newest, w_obs, scores):
    """Chunk scores [Hkv, n] from the token scores raw [Hkv, n] of slots at ``positions`` (position order):
    pooling, window padding (the positions > newest - w_obs), then per head or per layer chunk statistics."""
    hkv = lengths.shape[0]
    chunk = int(params[P.chunk_length])
    mean = int(params[P.chunk_reduce]) == 1
    k_size = int(params[P.kernel_size])
    pad = params[P.window_pad] != 0.0
    lim = newest + 1 - w_obs if pad else newest + 1
    tok = raw
    if k_size > 1:
        tok = np.empty_like(raw)
        for h in range(hkv):
            pool_cached(raw[h], positions[h], lengths[h], lim, k_size, int(params[P.pooling]), tok[h])
    if pad:
        if k_size <= 1:
            tok = raw.copy()
        best = 0.0
        found = False
        for h in range(hkv):
            for i in range(lengths[h]):
                if positions[h, i] < lim and (not found or tok[h, i] > best):
                    best = tok[h, i]
                    found = True
        for h in range(hkv):
            for i in range(lengths[h]):
                if positions[h, i] >= lim:
                    tok[h, i] = best + w_obs
    if int(params[P.scope]) == 0:
        for h in range(hkv):
            chunk_sums(tok[h], positions[h], lengths[h], chunk, scores[h], mean)
        return
    acc = np.zeros(newest // chunk + 1)
    for h in range(hkv):
        add_chunk_stats(tok[h], positions[h], lengths[h], chunk, mean, acc)
    for h in range(hkv):
        for i in range(lengths[h]):
            scores[h, i] = acc[positions[h, i] // chunk]


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    n = k.shape[0]
    hkv = k.shape[1]
    w = min(int(params[P.window_size]), n)
    ring = np.zeros((1, 1))
    raw = np.zeros((hkv, n))
    pos = np.empty((hkv, n), np.int64)
    for h in range(hkv):
        group_rows_scores(q, k, scale, h, n - w, n, 0, raw[h], ring, 0)
        for i in range(n):
            slot_state[h, i, 0] = raw[h, i]
            pos[h, i] = i
    chunk_scores(params, raw, pos, np.full(hkv, n, np.int64), n - 1, w, scores)


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    hkv = lengths.shape[0]
    raw = np.zeros((hkv, positions.shape[1]))
    for h in range(hkv):
        for i in range(lengths[h]):
            slot_state[h, i, 0] += group_score(probs, h, i, 0)
            raw[h, i] = slot_state[h, i, 0]
    chunk_scores(params, raw, positions, lengths, t, min(int(params[P.window_size]), t + 1), scores)


@register
class ChunkKV(ScorerPolicy):
    """Whole chunks of contiguous tokens selected by their summed observation-window attention (per KV head, or
    per layer with ``scope=layer``; see the module docstring for kvpress's reading)."""

    name = "chunkkv"
    reads_keys = False
    reads_values = False
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"chunk_length": (20, 10, 40)}
    summary = "whole chunks by summed attention score"
    schema = SCHEMA
    P = P
    slot_fields = 1
    score_prompt = score_prompt
    score_step = score_step

    def validate(self) -> None:
        super().validate()
        if self.params["kernel_size"] % 2 == 0:
            raise PolicyError(f"{self.name}.kernel_size: {self.params['kernel_size']} must be odd "
                              f"(centred pooling with padding kernel_size // 2)")

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``ChunkKVPress`` over ``SnapKVPress``: kvpress's reading of ChunkKV (chunks chosen per layer by their mean avg-pooled SnapKV score, the window padded); kvpress keeps whole chunks, so a budget that is not a whole number of chunks differs by its part-chunk; kvsim's protected tokens (n_sink, n_recent) may differ from it."""
        require(self, "ChunkKVPress", scope="layer", chunk_reduce="mean", pooling="avg", window_pad=True)
        p = self.params
        return KvpressPress({"cls": "ChunkKVPress", "chunk_length": p["chunk_length"],
                             "press": {"cls": "SnapKVPress", "window_size": p["window_size"], "kernel_size": p["kernel_size"]}}, differs_by=protected_extra(self), unit=p["chunk_length"])
