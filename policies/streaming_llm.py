"""StreamingLLM (Xiao et al., 2023): attention sinks plus a sliding window of recent tokens."""
from numba import njit

from policies.base import STEP_SIG, Guarantees, Param, Policy, param_indices
from policies.registry import register

SCHEMA = (Param("n_sinks", 4, "int", 0, 1024, doc="initial tokens always kept (attention sinks)"),)
P = param_indices(SCHEMA)


@njit(STEP_SIG, cache=True)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    """Evict the oldest non-sink slots of each head until it holds its budget.

    Shapes (the engine's step contract, policies/base.py): budget, lengths [Hkv]; probs [Hkv, G, cap] the step's
    attention over the cached slots; keys, values [Hkv, cap, d]; positions [Hkv, cap]; slot_state [Hkv, cap, 0];
    head_state [Hkv, 0]; keep, merge_to, merge_w [Hkv, cap]; params [1] read by name through ``P``.
    """
    n_sinks = int(params[P.n_sinks])
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
    reads_attention = False
    summary = "sinks + sliding window"
    schema = SCHEMA
    P = P
    step_fn = _step

    def min_budget(self) -> int:
        return self.params["n_sinks"] + 1

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(sinks=self.params["n_sinks"], recent=budget - self.params["n_sinks"])
