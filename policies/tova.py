"""TOVA (Oren et al., 2024): evict the token with the lowest attention from the current query, on the scorer base.

The score of a slot is the current query's attention to it: summed over all heads of the layer (``scope='layer'``,
the paper: every head then ranks alike and evicts the same token, so heads hold the same positions), or per KV
head reduced over its query group (``scope='head'``). Nothing is protected, the newest token included. The plain
policy streams the prompt; its prompt score (the last prompt query's attention, the paper's rule applied once
to the whole prompt, as kvpress's TOVAPress does) serves ``ada(tova)``. Under ``ada`` heads hold different
positions, so the layer score of a token sums the heads that still hold it.
"""
import numpy as np

from policies.core.base import Param, kernel, param_indices
from policies.core.shared_kernels import GROUP_REDUCE, causal_attention_scores, group_score
from policies.core.registry import register
from policies.core.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, Protection, ScorerPolicy
from policies.core.kvpress_press import KvpressPress, NoKvpressPress, require

SCOPES = ("layer", "head")
SCHEMA = (
    Param("scope", "layer", "choice", choices=SCOPES, doc="one decision per layer (paper) or per head"),
    Param("group_reduce", "mean", "choice", choices=GROUP_REDUCE, doc="GQA aggregation when scope='head'"),
)
P = param_indices(SCHEMA)
_LAYER_SCOPE = float(SCOPES.index("layer"))     # how the kernel sees scope='layer' (choices encode by index)


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    """The last prompt query's attention over the prompt (layer scope: the group means summed over the heads)."""
    n = k.shape[0]
    hkv = k.shape[1]
    g_n = q.shape[1] // hkv
    per_layer = params[P.scope] == _LAYER_SCOPE
    mode = 0 if per_layer else int(params[P.group_reduce])
    ring = np.zeros((1, 1), np.float64)
    row = np.zeros((hkv, n), np.float64)
    for h in range(hkv):
        causal_attention_scores(q, k, scale, h * g_n, g_n, h, n - 1, n, mode, row[h], ring, 0)
    for h in range(hkv):
        for i in range(n):
            if per_layer:
                s = 0.0
                for u in range(hkv):
                    s += row[u, i]
                scores[h, i] = s
            else:
                scores[h, i] = row[h, i]


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    """The current query's attention to each cached slot (layer scope: summed over the heads holding it)."""
    hkv = lengths.shape[0]
    if params[P.scope] != _LAYER_SCOPE:
        mode = int(params[P.group_reduce])
        for h in range(hkv):
            for i in range(lengths[h]):
                scores[h, i] = group_score(probs, h, i, mode)
        return
    n = lengths[0]
    same = True                                # the plain policy: every head holds the same positions
    for h in range(1, hkv):
        if lengths[h] != n:
            same = False
            break
        for i in range(n):
            if positions[h, i] != positions[0, i]:
                same = False
                break
    if same:
        for i in range(n):
            s = 0.0
            for h in range(hkv):
                s += group_score(probs, h, i, 0)
            scores[0, i] = s
        for h in range(1, hkv):
            scores[h, :n] = scores[0, :n]
        return
    acc = np.zeros(t + 1, np.float64)          # by position: heads hold different tokens (under ada)
    for h in range(hkv):
        for i in range(lengths[h]):
            acc[positions[h, i]] += group_score(probs, h, i, 0)
    for h in range(hkv):
        for i in range(lengths[h]):
            scores[h, i] = acc[positions[h, i]]


@register
class TOVA(ScorerPolicy):
    """When over budget, drop the token the current query attends to least. The paper averages attention over
    all heads of a layer and evicts the same token from every head (``scope='layer'``); ``scope='head'``
    decides per KV head with ``group_reduce`` over its query heads. Ties evict the older token.
    """

    name = "tova"
    reads_keys = False
    reads_values = False
    summary = "lowest current attention"
    schema = SCHEMA
    P = P
    protect = Protection(sinks=None, recent=None)
    stream_prompt = True
    score_prompt = score_prompt
    score_step = score_step

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``TOVAPress`` scores the prompt by its last query's attention averaged over the layer's heads:
        this policy's prompt score, which it uses only when the prompt is selected at once
        (``ada(tova, floor_alpha=1)``); streamed, the prompt's chunk step sees H2O's column sums instead."""
        if not prompt_at_once:
            raise NoKvpressPress("tova streams its prompt, so a prompt compressed once is scored by the attention "
                                 "summed over all its queries (H2O's column sums), not by the last query's as "
                                 "kvpress's TOVAPress does; ada(tova, floor_alpha=1) selects the prompt at once by "
                                 "that score and keeps TOVAPress's sets")
        require(self, "TOVAPress", scope="layer", group_reduce="mean")
        return KvpressPress({"cls": "TOVAPress"})
