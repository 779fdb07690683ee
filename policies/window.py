"""Sliding window: keep the most recent ``budget`` tokens."""

from policies.core.base import STEP_SIG, Guarantees, Policy, kernel
from policies.core.registry import register
from policies.core.kvpress_press import KvpressPress


@kernel(STEP_SIG)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    """Evict the oldest slots of each head beyond its budget (slots are in position order).

    Shapes (the engine's step contract, policies/core/base.py): budget, lengths [Hkv]; probs [Hkv, G, cap] the step's
    attention over the cached slots; keys, values [Hkv, cap, d]; positions [Hkv, cap]; slot_state [Hkv, cap, 0];
    head_state [Hkv, 0]; keep, merge_to, merge_w [Hkv, cap]; params [0] (no parameters).
    """
    for h in range(lengths.shape[0]):
        # slots are in position order, so the oldest are the first ones
        for i in range(max(0, lengths[h] - budget[h])):
            keep[h, i] = 0


@register
class SlidingWindow(Policy):
    """Keep the last ``budget`` tokens (including the newest)."""

    name = "window"
    reads_keys = False
    reads_values = False
    reads_attention = False
    summary = "most recent tokens only"
    step_fn = _step

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(sinks=0, recent=budget)

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``StreamingLLMPress`` without sinks: the newest tokens."""
        return KvpressPress({"cls": "StreamingLLMPress", "n_sink": 0})
