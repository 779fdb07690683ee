"""StreamingLLM (Xiao et al., 2023): attention sinks plus a sliding window of recent tokens, on the scorer base.

The score of a slot is its position (the newest rank highest) and the first ``n_sinks`` positions are protected,
so the lowest-scored candidate is always the oldest non-sink token. The score is a position only, so ``ada`` and
``critical`` refuse it; ``decoding(streaming_llm)`` (compress to the window every N steps) is allowed.
"""

from policies.core.base import Guarantees, Param, kernel, param_indices
from policies.core.registry import register
from policies.core.scorer import SCORE_STEP_SIG, Protection, ScorerPolicy
from policies.core.kvpress_press import KvpressPress

SCHEMA = (Param("n_sinks", 4, "int", 0, 1024, doc="initial tokens always kept (attention sinks)"),)
P = param_indices(SCHEMA)


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    """Each slot's position: the oldest non-sink slot has the lowest score."""
    for h in range(lengths.shape[0]):
        for i in range(lengths[h]):
            scores[h, i] = positions[h, i]


@register
class StreamingLLM(ScorerPolicy):
    """Keep the first ``n_sinks`` tokens and the most recent ``budget - n_sinks`` (paper default: 4 sinks)."""

    name = "streaming_llm"
    reads_keys = False
    reads_values = False
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"n_sinks": (4, 0, 1, 16)}
    reads_attention = False
    summary = "sinks + sliding window"
    schema = SCHEMA
    P = P
    protect = Protection(sinks="n_sinks", recent=None)
    ranks_by_position = True
    score_step = score_step

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(sinks=self.params["n_sinks"], recent=self.base_size(budget) - self.params["n_sinks"])

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``StreamingLLMPress``: the first ``n_sink`` tokens and the newest."""
        return KvpressPress({"cls": "StreamingLLMPress", "n_sink": self.params["n_sinks"]})
