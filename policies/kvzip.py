"""KVzip (Kim et al., 2025, arXiv 2505.23416; kvpress ``KVzipPress``): keep the prompt tokens the model needs to
*reread* its context.

Score: after the prompt, the model rereads it ("Repeat the previous context exactly." then the context, a chunk of
``chunk_size`` tokens at a time; ``traces.reconstruction``). A prompt token's score in a layer and KV head is the
largest attention it receives from any repeat token of its chunk, over the query heads of the group
(kvpress: ``amax`` over group and queries), where each repeat query's softmax runs over the first
``min(n_sink, chunk start)`` tokens, the chunk's own tokens and the repeat tokens up to itself (kvpress's
``_compute_cross_attention``), at the layer's softmax scale (kvpress: 1/sqrt(d), the same for Llama-family models;
kvpress refuses Gemma-3, where the scale differs). The pass is recorded into the trace (``kvsim record --kvzip``)
and run in the model by the closed loop (``traces.hf.reconstruction_pass``); a trace without it is an error naming the
option. Scoring is trace-only work, in float32 GEMM blocks of ``ROWS`` repeat queries, once per prepared trace.

Budgets (``layerwise``, kvpress's name and default False): every compressed layer's and KV head's prompt scores are
ranked together and the ``budget * L * Hkv`` best are kept (the first ``n_sink`` tokens of every head always, as
kvpress's ``score = max + 1``), so each head's share follows its scores; ``layerwise=True`` ranks each layer's heads
together at ``budget * Hkv`` per layer. A head's share becomes its budget for the whole run (``allocate``); a head
whose share falls below the policy's minimum (its sinks plus one) is raised to it, taken from the largest shares
(kvpress has no floor: it never evicts after the prompt). Deviation for decoding (kvpress compresses the prompt
once and keeps every decoded token): ``decode_rule`` ``keep_new`` (default) ranks decoded tokens above every prompt
token (prompt tokens go first, lowest score first; then the oldest decoded), ``max_attention`` scores a decoded
token by the largest attention (group max) a decode query has given it.

KVzip+ (kvpress's ``kvzip_plus_normalization``) is its own policy, ``kvzip_plus`` (policies/kvzip_plus.py).

slot_state: [0] the slot's score, [1] 1 when a prompt token (scored by the pass). head_state: [0] the column
where the layer's prompt-score table [Hkv, P] starts (``prompt_head_state`` appends it).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from policies.core.base import Param, PolicyError, kernel, param_indices, prompt_memo
from policies.core.shared_kernels import group_score
from policies.core.registry import register
from policies.core.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, ScorerPolicy, protection
from policies.core.kvpress_press import KvpressPress, protected_extra

DECODE_RULES = ("keep_new", "max_attention")
SCHEMA = protection(n_sink=4, n_recent=0) + (
    Param("layerwise", False, "bool", doc="rank each layer's heads together (True) or every layer's (kvpress: False)",
          searchable=False),
    Param("chunk_size", 2048, "int", 1, 1 << 20, searchable=False,
          doc="context tokens reread per reconstruction pass (kvpress: 2048; a trace is recorded with one)"),
    Param("decode_rule", "keep_new", "choice", choices=DECODE_RULES,
          doc="decoded tokens: ranked above the prompt's (kvpress keeps them all), or scored by max attention"),
)
P = param_indices(SCHEMA)
_MAX_ATTENTION = float(DECODE_RULES.index("max_attention"))
#: a decoded token's score under ``keep_new``: above any attention probability, finite (``critical`` rescales it)
NEW_TOKEN_SCORE = 1e30
#: repeat queries per GEMM block when scoring
ROWS = 512


def reconstruction_scores(recon_q: np.ndarray, recon_k: np.ndarray, k: np.ndarray, layout: np.ndarray,
                          n_sink: int, scale: float, row_weight: np.ndarray | None = None,
                          col_weight: np.ndarray | None = None) -> np.ndarray:
    """One layer's KVzip scores [Hkv, P] of the P prompt keys ``k`` [P, Hkv, d] from the pass's queries
    ``recon_q`` [R, Hq, d] and keys ``recon_k`` [R, Hkv, d], chunk ``layout`` [C, 4] (start, end, first repeat row,
    rows; ``ReconstructionPlan.layout``): module docstring. float32 GEMMs, float64 result. KVzip+ (policies/
    kvzip_plus.py) weighs each repeat row's probabilities by ``row_weight`` [R] and each query head's column by
    ``col_weight`` [Hq, P] before the maximum."""
    n_prompt, hkv, _ = k.shape
    g_n = recon_q.shape[1] // hkv
    out = np.zeros((hkv, n_prompt))
    for start, end, r0, n in layout:
        sink = min(int(n_sink), int(start))
        for h in range(hkv):
            keys = np.concatenate([k[:sink, h], k[start:end, h], recon_k[r0:r0 + n, h]]).astype(np.float32)
            ctx = sink + end - start
            best = out[h, start:end]
            for a in range(0, n, ROWS):
                b = min(n, a + ROWS)
                later = np.arange(n)[None, :] > np.arange(a, b)[:, None]      # causal among the repeat rows
                for g in range(g_n):
                    logits = (recon_q[r0 + a:r0 + b, h * g_n + g].astype(np.float32) @ keys.T) * np.float32(scale)
                    logits[:, ctx:][later] = -np.inf
                    logits -= logits.max(axis=1, keepdims=True)
                    np.exp(logits, out=logits)
                    probs = logits[:, sink:ctx] / logits.sum(axis=1, keepdims=True)
                    if row_weight is not None:
                        probs *= row_weight[r0 + a:r0 + b, None]
                    top = probs.max(axis=0)
                    if col_weight is not None:
                        top = top * col_weight[h * g_n + g, start:end]
                    np.maximum(best, top, out=best)
    return out


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    """Each prompt token's score from the layer's table (``prompt_head_state``)."""
    n = k.shape[0]
    for h in range(k.shape[1]):
        off = np.int64(head_state[h, 0])
        if off <= 0 or off + n > head_state.shape[1]:
            raise ValueError("kvzip: no prompt-score table in the head state (prompt_head_state was not called)")
        for i in range(n):
            s = head_state[h, off + i]
            scores[h, i] = s
            slot_state[h, i, 0] = s
            slot_state[h, i, 1] = 1.0


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    """A prompt token keeps its score; a decoded one per ``decode_rule``."""
    by_attention = params[P.decode_rule] == _MAX_ATTENTION
    for h in range(lengths.shape[0]):
        for i in range(lengths[h]):
            if slot_state[h, i, 1] == 0.0:
                if by_attention:
                    slot_state[h, i, 0] = max(slot_state[h, i, 0], group_score(probs, h, i, 2))
                else:
                    slot_state[h, i, 0] = NEW_TOKEN_SCORE
            scores[h, i] = slot_state[h, i, 0]


def _share(scores: np.ndarray, keep: int, n_sink: int) -> np.ndarray:
    """How many of each head's tokens are among the ``keep`` best of ``scores`` [..., Hkv, P] ranked together (the
    first ``n_sink`` of each head first, as kvpress's ``max + 1``): int64 counts [..., Hkv]."""
    ranked = scores.copy()
    ranked[..., :n_sink] = np.inf
    flat = ranked.reshape(-1)
    top = np.argsort(-flat, kind="stable")[:keep]
    counts = np.bincount(top // scores.shape[-1], minlength=flat.size // scores.shape[-1])
    return counts.reshape(scores.shape[:-1]).astype(np.int64)


def _floor(counts: np.ndarray, floor: int) -> np.ndarray:
    """``counts`` with every entry raised to ``floor``, the slots taken from the largest entry (down to the floor at
    most), then from the largest of the rest, until the total is back."""
    out = counts.copy().reshape(-1)
    need = int(np.clip(floor - out, 0, None).sum())
    out = np.maximum(out, floor)
    while need > 0:
        i = int(np.argmax(out))
        if out[i] <= floor:
            break
        take = min(need, int(out[i] - floor))
        out[i] -= take
        need -= take
    return out.reshape(counts.shape)


@register
class KVzip(ScorerPolicy):
    """Keep the prompt tokens the model attends to most while rereading its context (KVzip, kvpress
    ``KVzipPress``); see the module docstring for the pass, the budgets and the decode rule."""

    name = "kvzip"
    reads_keys = False
    reads_values = False
    summary = "attention received while the model rereads its context (KVzip's reconstruction pass)"
    schema = SCHEMA
    P = P
    slot_fields = 2
    head_fields = 1
    allocates_heads = True      # its allocate() ranks heads and layers together: ada(kvzip) is refused
    score_prompt = score_prompt
    score_step = score_step

    def reconstruction_chunk(self) -> int | None:
        return int(self.params["chunk_size"])

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``KVzipPress``: the same reconstruction pass and scores, the budget of all layers and heads
        (or of each layer, ``layerwise``) shared by rank. kvpress words the repeat request with the tokenizer's
        chat template when it has one; kvsim's pass is the plain-text one (the template-less suffix)."""
        p = self.params
        return KvpressPress({"cls": "KVzipPress", "n_sink": p["n_sink"], "layerwise": p["layerwise"],
                             "chunk_size": p["chunk_size"]}, differs_by=protected_extra(self, n_sink=p["n_sink"]),
                            note="kvsim's pass rereads the prompt without a chat template: give KVzipPress a "
                                 "tokenizer without one (tokenizer.chat_template = None) for the same scores")

    def prompt_scores(self, prompt_layers: Any) -> np.ndarray:
        """[L, Hkv, P] float64, one [Hkv, P] per compressed layer: the scores of every prompt token, from the
        reconstruction pass the prompt view gives (``reconstruction(j)``: the trace's, or the closed loop's run in
        the model)."""
        read = getattr(prompt_layers, "reconstruction", None)
        if read is None:
            raise PolicyError(f"{self.label()}: this prompt view has no context-reconstruction pass")
        n_sink, size = int(self.params["n_sink"]), int(self.params["chunk_size"])

        def compute() -> np.ndarray:        # one array: a recorded trace's replays keep it on disk (sim.replay.trace_tables)
            out = []
            for j in range(len(prompt_layers)):
                plan, recon_q, recon_k, k, scale = read(j, size)
                if plan.chunk_size != size and plan.n_prompt > min(plan.chunk_size, size):
                    raise PolicyError(f"{self.label()}: the reconstruction pass was recorded with chunk_size="
                                      f"{plan.chunk_size}; record again with `kvsim record --kvzip --kvzip-chunk "
                                      f"{size}` or pass chunk_size={plan.chunk_size}")
                out.append(reconstruction_scores(np.asarray(recon_q), np.asarray(recon_k), np.asarray(k),
                                                 plan.layout(), n_sink, scale,
                                                 *self.reconstruction_weights(prompt_layers, j, size)))
            return np.stack(out)

        return prompt_memo(prompt_layers, (f"{self.name}.scores", n_sink, size), compute)

    def reconstruction_weights(self, prompt_layers: Any, j: int, chunk_size: int) -> tuple:
        """(row_weight, col_weight) of `reconstruction_scores` for compressed layer j: none for KVzip (KVzip+
        divides by the repeat tokens' hidden-state norms and multiplies by the values' W_O-projected norms)."""
        return None, None

    def allocate(self, budget: int, n_kv_heads: int, prompt_layers: Sequence[tuple[np.ndarray, np.ndarray]],
                 scale: float) -> np.ndarray:
        """Each head's share of the best prompt scores (module docstring), its budget for the run."""
        n_layers = len(prompt_layers)
        flat = np.full((n_layers, n_kv_heads), budget, np.int64)
        n_prompt = len(prompt_layers[0][1]) if n_layers else 0
        if budget >= n_prompt:
            return flat            # the prompt fits in every head: nothing to share
        scores = self.prompt_scores(prompt_layers)          # [L, Hkv, P]
        n_sink = min(int(self.params["n_sink"]), n_prompt)
        floor = self.min_budget()
        if self.params["layerwise"]:
            return np.stack([_floor(_share(s, budget * n_kv_heads, n_sink), floor) for s in scores])
        return _floor(_share(scores, budget * n_layers * n_kv_heads, n_sink), floor)

    def prompt_head_state(self, head_state: np.ndarray, prompt_layers: Any, j: int) -> np.ndarray:
        """The head state with compressed layer j's prompt-score table [Hkv, P] appended, its column in field 0."""
        table = self.prompt_scores(prompt_layers)[j]
        out = np.concatenate([head_state, table], axis=1)
        out[:, 0] = head_state.shape[1]
        return out
