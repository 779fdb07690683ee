"""StreamingLLM (Xiao et al., 2023): attention sinks plus a sliding window of recent tokens."""
from numba import njit

from policies.base import STEP_SIG, Guarantees, Param, Policy
from policies.registry import register


@njit(STEP_SIG, cache=True)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    n_sinks = int(params[0])
    for h in range(lengths.shape[0]):
        excess = lengths[h] - budget[h]
        i = 0
        while excess > 0 and i < lengths[h]:
            if positions[h, i] >= n_sinks:   # oldest non-sink first
                keep[h, i] = 0
                excess -= 1
            i += 1


@register
class StreamingLLM(Policy):
    """Keep the first ``n_sinks`` tokens and the most recent ``budget - n_sinks`` (paper default: 4 sinks)."""

    name = "streaming_llm"
    summary = "sinks + sliding window"
    schema = (Param("n_sinks", 4, "int", 0, 1024, doc="initial tokens always kept (attention sinks)"),)
    step_fn = _step

    def min_budget(self) -> int:
        return self.params["n_sinks"] + 1

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(sinks=self.params["n_sinks"], recent=budget - self.params["n_sinks"])
