"""Full cache: never evicts. The reference every other policy is measured against."""

from policies.core.base import STEP_SIG, Policy, kernel
from policies.core.registry import register


@kernel(STEP_SIG)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    """Keep every slot (the engine sizes the buffer for the whole trace).

    Shapes (the engine's step contract, policies/core/base.py): budget, lengths [Hkv]; probs [Hkv, G, cap] the step's
    attention over the cached slots; keys, values [Hkv, cap, d]; positions [Hkv, cap]; slot_state [Hkv, cap, 0];
    head_state [Hkv, 0]; keep, merge_to, merge_w [Hkv, cap]; params [0] (no parameters).
    """
    return


@register
class FullCache(Policy):
    """Keep every token; its budget is ignored and its memory grows with the sequence."""

    name = "full"
    reads_keys = False
    reads_values = False
    reads_attention = False
    summary = "keep everything (reference)"
    unbounded = True
    step_fn = _step
