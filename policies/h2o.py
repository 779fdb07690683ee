"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention plus a recent window, on the scorer base.

The score of a slot is the attention it accumulated over every query that saw it (``slot_state[..., 0]``); the
recent window is ``recent_ratio`` of the head's budget (``recent_slots``). The plain policy streams the prompt
through the step, so the prompt's scores accumulate over the cached tokens only; its prompt score (the column
sums of the whole prompt's attention) is what ``ada(h2o)`` (``ada_h2o``) allocates with at prefill.
"""
import numpy as np

from policies.core.base import Param, kernel, param_indices
from policies.core.shared_kernels import GROUP_REDUCE, group_rows_scores, group_score
from policies.core.registry import register
from policies.core.scorer import PROMPT_TABLE, SCORE_PROMPT_SIG, SCORE_STEP_SIG, Protection, ScorerPolicy

SCHEMA = (
    Param("recent_ratio", 0.5, "float", 0.0, 1.0, doc="share of the budget kept as recent window"),
    Param("group_reduce", "mean", "choice", choices=GROUP_REDUCE, doc="GQA aggregation of query heads"),
)
P = param_indices(SCHEMA)


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    """Each prompt token's attention accumulated over all prompt queries (GQA-reduced per query); it stays the
    slot's accumulated score for decode. A replay hands the sums over in the head state (``PROMPT_TABLE``)."""
    P_ = q.shape[0]
    ring = np.zeros((1, 1), np.float64)
    at = int(head_state[0, PROMPT_TABLE])
    for h in range(k.shape[1]):
        if at > 0:
            scores[h, :P_] = head_state[h, at:at + P_]
        else:
            group_rows_scores(q, k, scale, h, 0, P_, int(params[P.group_reduce]), scores[h], ring, 0)
        for i in range(P_):
            slot_state[h, i, 0] = scores[h, i]


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    """Add each slot's attention to its accumulated score (slot_state[..., 0]); that is its score."""
    mode = int(params[P.group_reduce])
    for h in range(lengths.shape[0]):
        for i in range(lengths[h]):
            slot_state[h, i, 0] += group_score(probs, h, i, mode)
            scores[h, i] = slot_state[h, i, 0]


@register
class H2O(ScorerPolicy):
    """Keep the ``recent_ratio`` share of the budget as a recent window and fill the rest with the tokens of
    highest accumulated attention (sum over all past queries). The paper uses an even split of heavy hitters
    and recent tokens. GQA: the query heads sharing a KV head are reduced by ``group_reduce`` (the paper
    predates GQA; mean keeps scores on the MHA scale). Ties evict the older token.
    """

    name = "h2o"
    reads_keys = False
    reads_values = False
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"recent_ratio": (0.5, 0.1, 0.25, 0.75)}
    summary = "accumulated attention + recent window"
    schema = SCHEMA
    P = P
    slot_fields = 1
    head_fields = 1               # PROMPT_TABLE
    protect = Protection(sinks=None, recent="recent_ratio", rule="share")
    stream_prompt = True
    score_prompt = score_prompt
    score_step = score_step

    def prompt_attention_mode(self) -> int | None:
        """``score_prompt``'s column sums are ``prompt_attention`` in the ``group_reduce`` mode."""
        return GROUP_REDUCE.index(self.params["group_reduce"])
