"""Sliding window: keep the most recent ``budget`` tokens."""
from numba import njit

from policies.base import STEP_SIG, Guarantees, Policy
from policies.registry import register


@njit(STEP_SIG, cache=True)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    for h in range(lengths.shape[0]):
        # slots are in position order, so the oldest are the first ones
        for i in range(max(0, lengths[h] - budget[h])):
            keep[h, i] = 0


@register
class SlidingWindow(Policy):
    """Keep the last ``budget`` tokens (including the newest)."""

    name = "window"
    summary = "most recent tokens only"
    step_fn = _step

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(sinks=0, recent=budget)
