"""TOVA (Oren et al., 2024): evict the token with the lowest attention from the current query."""
from numba import njit

from policies.base import STEP_SIG, Param, Policy, param_indices
from policies.kernels import GROUP_REDUCE, group_score
from policies.registry import register

SCOPES = ("layer", "head")
SCHEMA = (
    Param("scope", "layer", "choice", choices=SCOPES, doc="one decision per layer (paper) or per head"),
    Param("group_reduce", "mean", "choice", choices=GROUP_REDUCE, doc="GQA aggregation when scope='head'"),
)
P = param_indices(SCHEMA)
_LAYER_SCOPE = float(SCOPES.index("layer"))     # how the kernel sees scope='layer' (choices encode by index)


@njit(STEP_SIG, cache=True)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    """Evict the slots the current query attends to least (summed over the layer, or per head).

    Shapes (the engine's step contract, policies/base.py): budget, lengths [Hkv]; probs [Hkv, G, cap] the step's
    attention over the cached slots; keys, values [Hkv, cap, d]; positions [Hkv, cap]; slot_state [Hkv, cap, 0];
    head_state [Hkv, 0]; keep, merge_to, merge_w [Hkv, cap]; params [2] read by name through ``P``.
    """
    per_layer = params[P.scope] == _LAYER_SCOPE
    mode = int(params[P.group_reduce])
    hkv = lengths.shape[0]
    if per_layer:
        # one decision for the whole layer: heads hold the same positions (same appends, same evictions)
        n = lengths[0]
        for _ in range(max(0, n - budget[0])):
            best = -1
            best_s = 0.0
            for i in range(n):
                if keep[0, i] == 0:
                    continue
                s = 0.0
                for h in range(hkv):
                    s += group_score(probs, h, i, 0)
                if best < 0 or s < best_s:
                    best, best_s = i, s
            for h in range(hkv):
                keep[h, best] = 0
        return
    for h in range(hkv):
        n = lengths[h]
        for _ in range(max(0, n - budget[h])):
            best = -1
            best_s = 0.0
            for i in range(n):
                if keep[h, i] == 0:
                    continue
                s = group_score(probs, h, i, mode)
                if best < 0 or s < best_s:
                    best, best_s = i, s
            keep[h, best] = 0


@register
class TOVA(Policy):
    """When over budget, drop the token the current query attends to least. The paper averages attention over
    all heads of a layer and evicts the same token from every head (``scope='layer'``); ``scope='head'``
    decides per KV head with ``group_reduce`` over its query heads. Ties evict the older token.
    """

    name = "tova"
    summary = "lowest current attention"
    schema = SCHEMA
    P = P
    step_fn = _step
