"""Random eviction: a floor any useful policy must beat."""

from policies.core.base import STEP_SIG, Guarantees, Param, Policy, kernel, param_indices
from policies.core.shared_kernels import hash_uniform
from policies.core.registry import register

SCHEMA = (
    Param("seed", 0, "int", 0, 2**31 - 1, doc="random seed", searchable=False),
    Param("protect_recent", 1, "int", 1, 1024, doc="newest tokens never evicted"),
)
P = param_indices(SCHEMA)


@kernel(STEP_SIG)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    """Evict uniformly chosen slots older than the protected newest ones, as a pure function of
    (seed, layer, head, step, draw).

    Shapes (the engine's step contract, policies/core/base.py): budget, lengths [Hkv]; probs [Hkv, G, cap] the step's
    attention over the cached slots; keys, values [Hkv, cap, d]; positions [Hkv, cap]; slot_state [Hkv, cap, 0];
    head_state [Hkv, 0]; keep, merge_to, merge_w [Hkv, cap]; params [2] read by name through ``P``.
    """
    seed = int(params[P.seed])
    protect = int(params[P.protect_recent])
    for h in range(lengths.shape[0]):
        n = lengths[h]
        for r in range(max(0, n - budget[h])):
            cand = 0
            for i in range(n):
                if keep[h, i] != 0 and positions[h, i] <= t - protect:
                    cand += 1
            if cand == 0:
                break
            pick = int(hash_uniform(seed, layer * 65536 + h, t, r) * cand)
            for i in range(n):
                if keep[h, i] != 0 and positions[h, i] <= t - protect:
                    if pick == 0:
                        keep[h, i] = 0
                        break
                    pick -= 1


@register
class RandomEviction(Policy):
    """Evict uniformly at random among all but the ``protect_recent`` newest tokens; the choice is a pure function
    of (seed, layer, head, step), so replays are deterministic under a seed."""

    name = "random"
    reads_keys = False
    reads_values = False
    reads_attention = False
    summary = "uniform random eviction"
    schema = SCHEMA
    P = P
    step_fn = _step

    def min_budget(self) -> int:
        return self.params["protect_recent"]

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(recent=self.params["protect_recent"])
