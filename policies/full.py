"""Full cache: never evicts. The reference every other policy is measured against."""
from numba import njit

from policies.base import STEP_SIG, Policy
from policies.registry import register


@njit(STEP_SIG, cache=True)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    return


@register
class FullCache(Policy):
    """Keep every token; its budget is ignored and its memory grows with the sequence."""

    name = "full"
    summary = "keep everything (reference)"
    unbounded = True
    step_fn = _step
