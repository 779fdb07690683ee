"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention plus a recent window."""
from numba import njit

from policies.base import STEP_SIG, Guarantees, Param, Policy, param_indices
from policies.kernels import GROUP_REDUCE, evict_lowest, group_score
from policies.registry import register


SCHEMA = (
    Param("recent_ratio", 0.5, "float", 0.0, 1.0, doc="share of the budget kept as recent window"),
    Param("group_reduce", "mean", "choice", choices=GROUP_REDUCE, doc="GQA aggregation of query heads"),
)
P = param_indices(SCHEMA)


@njit(cache=True)
def recent_slots(budget: int, recent_ratio: float) -> int:
    """Recent-window size for a budget: ``round(budget * recent_ratio)`` within [0, budget].

    The one definition of a recent window (H2O, Ada-H2O and Bumblebee use it): ``recent_ratio = 0`` is no
    window at all, the heavy-hitter-only ablation of the H2O paper and Bumblebee's Alg. 2 alone. Rounding is
    Python's (half to even), so budget 1 at the default 0.5 has no window.
    """
    return min(budget, max(0, int(round(budget * recent_ratio))))


@njit(STEP_SIG, cache=True)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    """Add each slot's attention to its accumulated score (slot_state[..., 0]), then evict the lowest-scored
    slots outside the recent window.

    Shapes (the engine's step contract, policies/base.py): budget, lengths [Hkv]; probs [Hkv, G, cap] the step's
    attention over the cached slots; keys, values [Hkv, cap, d]; positions [Hkv, cap]; slot_state [Hkv, cap, 1];
    head_state [Hkv, 0]; keep, merge_to, merge_w [Hkv, cap]; params [2] read by name through ``P``.
    """
    ratio = params[P.recent_ratio]
    mode = int(params[P.group_reduce])
    for h in range(lengths.shape[0]):
        n = lengths[h]
        for i in range(n):
            slot_state[h, i, 0] += group_score(probs, h, i, mode)
        if n > budget[h]:
            recent = recent_slots(budget[h], ratio)
            evict_lowest(slot_state[h, :, 0], positions[h], n, n - budget[h], 0, t - recent + 1, keep[h])


@register
class H2O(Policy):
    """Keep the ``recent_ratio`` share of the budget as a recent window and fill the rest with the tokens of
    highest accumulated attention (sum over all past queries). The paper uses an even split of heavy hitters
    and recent tokens. GQA: the query heads sharing a KV head are reduced by ``group_reduce`` (the paper
    predates GQA; mean keeps scores on the MHA scale). Ties evict the older token.
    """

    name = "h2o"
    summary = "accumulated attention + recent window"
    schema = SCHEMA
    P = P
    slot_fields = 1
    step_fn = _step

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(recent=int(recent_slots(budget, self.params["recent_ratio"])))
