"""Observed attention (kvpress ``ObservedAttentionPress``; H2O's accumulated attention, normalised).

A prompt token's score is the attention it receives from the prompt's own queries, *averaged over the queries
that can see it*: with causal attention token i is seen by the P - i queries i..P-1, so the column sum of the
prompt's attention matrix is divided by P - i. Per query head, then the mean over the query heads that share the
KV head (kvpress: ``attentions.sum(2) / arange(n, 0, -1)``, then ``.view(..., G, n).mean(2)``). The average,
unlike H2O's sum, does not favour old tokens for having been seen more often; it favours the last prompt tokens
instead (token P-1 is scored by one query only).

The prompt's attention is computed in blocks of query rows (``policies.core.shared_kernels.causal_attention_scores``: SGEMM
tiles, O(G * 128 * P) memory, never the P x P matrix), at the trace's softmax scale.

Decode (kvpress compresses the prompt only; here the budget holds at every step): ``decode_rule``
  - ``average`` (default): the same rule continued, each step's query adds its attention (the group mean over the
    cached slots, what a decode kernel sees) to the slot's sum and one to its count, score = sum / count;
  - ``accumulated``: the sum alone (H2O's score, its prompt part the prompt's column sums);
  - ``frozen``: a prompt token keeps its prompt score; a new token is scored once, by the attention of its own
    query (the average over the one query that has seen it), and keeps it.
The prompt is always selected by kvpress's average. Protection: kvpress protects nothing; here ``n_sink`` first
tokens (default 0) and the ``n_recent`` newest (default 1: the new token is kept until a query has seen it).

slot_state: [0] the attention summed over the queries that saw the slot, [1] how many did.
"""
import numpy as np

from policies.core.base import Param, kernel, param_indices
from policies.core.shared_kernels import causal_attention_scores, group_score
from policies.core.registry import register
from policies.core.scorer import PROMPT_TABLE, SCORE_PROMPT_SIG, SCORE_STEP_SIG, ScorerPolicy, protection
from policies.core.kvpress_press import KvpressPress, protected_extra

DECODE_RULES = ("average", "accumulated", "frozen")
SCHEMA = protection(n_sink=0, n_recent=1) + (
    Param("decode_rule", "average", "choice", choices=DECODE_RULES,
          doc="decode score: average over the queries that saw the token (kvpress's rule continued), "
              "accumulated sum (H2O), or frozen once scored"),
)
P = param_indices(SCHEMA)
_ACCUMULATED = float(DECODE_RULES.index("accumulated"))
_FROZEN = float(DECODE_RULES.index("frozen"))


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    """Column sums of the prompt's causal attention (group mean per query row), over the number of queries that
    see each token."""
    n = k.shape[0]
    hkv = k.shape[1]
    g_n = q.shape[1] // hkv
    ring = np.zeros((1, 1), np.float64)
    at = int(head_state[0, PROMPT_TABLE])        # a replay's table of these sums (ScorerPolicy.with_prompt_table)
    for h in range(hkv):
        sums = np.zeros(n, np.float64)
        if at > 0:
            sums[:] = head_state[h, at:at + n]
        else:
            causal_attention_scores(q, k, scale, h * g_n, g_n, h, 0, n, 0, sums, ring, 0)
        for i in range(n):
            seen = np.float64(n - i)
            slot_state[h, i, 0] = sums[i]
            slot_state[h, i, 1] = seen
            scores[h, i] = sums[i] / seen


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    """Add the step's attention (group mean) to each slot's sum and count, per ``decode_rule``."""
    rule = params[P.decode_rule]
    for h in range(lengths.shape[0]):
        for i in range(lengths[h]):
            s = group_score(probs, h, i, 0)
            if rule == _FROZEN:
                if slot_state[h, i, 1] == 0.0:       # a new token: scored once, by its own query
                    slot_state[h, i, 0] = s
                    slot_state[h, i, 1] = 1.0
            else:
                slot_state[h, i, 0] += s
                slot_state[h, i, 1] += 1.0
            if rule == _ACCUMULATED:
                scores[h, i] = slot_state[h, i, 0]
            else:
                scores[h, i] = slot_state[h, i, 0] / slot_state[h, i, 1]


@register
class ObservedAttention(ScorerPolicy):
    """Keep the tokens with the highest attention received, averaged over the queries that saw them (kvpress
    ``ObservedAttentionPress``, which needs eager attention; here the prompt's attention is recomputed in blocks).
    See the module docstring for the decode rule and the protection."""

    name = "observed_attention"
    reads_keys = False
    reads_values = False
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"decode_rule": ("average", "accumulated")}
    summary = "prompt attention received, averaged over the queries that saw the token"
    schema = SCHEMA
    P = P
    slot_fields = 2
    head_fields = 1               # PROMPT_TABLE
    score_prompt = score_prompt
    score_step = score_step

    def prompt_attention_mode(self) -> int | None:
        """``score_prompt``'s sums are ``prompt_attention`` with the group's mean per query row (mode 0)."""
        return 0

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``ObservedAttentionPress`` (attention received, averaged over the queries that saw the token; eager attention); kvsim's protected tokens (n_sink, n_recent) may differ from it."""
        return KvpressPress({"cls": "ObservedAttentionPress"}, differs_by=protected_extra(self), attn="eager")
