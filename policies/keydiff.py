"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference").

Distinctive keys matter: each key is scored by its cosine similarity to the anchor, the mean of the
head's normalised keys, and the least similar are kept (score ``-cos(k, anchor)``, as kvpress's
``KeyDiffPress``). Ambiguity: at decode the anchor is the mean over the keys *currently cached* (the paper's
block-wise streaming uses the keys of the cache plus the incoming block; evicted keys are gone here).
"""
import numpy as np
from numba import njit

from policies.core.base import kernel, param_indices
from policies.core.shared_kernels import l2_norm
from policies.core.registry import register
from policies.core.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, ScorerPolicy, protection
from policies.core.kvpress_press import KvpressPress, protected_extra

SCHEMA = protection(n_sink=0, n_recent=1)
P = param_indices(SCHEMA)
#: slot state: set once the slot's key norm is in place, and that norm
_SCORED, _NORM = 0, 1


@njit(cache=True, fastmath={"reassoc", "contract"})   # SIMD sums (rounding-level differences)
def anti_cosine(keys, norms, n, out):
    """out[i] = -cos(keys[i], mean_j keys[j] / ||keys[j]||) for i < n (zero keys count as zero vectors), given each
    key's norm ``norms[i]`` (``l2_norm``: a key's norm is computed once, when it is first scored)."""
    d = keys.shape[1]
    anchor = np.zeros(d)
    for i in range(n):
        if norms[i] > 0.0:
            for x in range(d):
                anchor[x] += np.float64(keys[i, x]) / norms[i]
    anchor /= max(n, 1)
    a = l2_norm(anchor)
    for i in range(n):
        denom = norms[i] * a
        dot = 0.0
        for x in range(d):
            dot += np.float64(keys[i, x]) * anchor[x]
        out[i] = -(dot / denom) if denom > 0.0 else 0.0


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    """The prompt keys' scores; each key's norm goes into its slot state (``_NORM``) for the decode steps."""
    for h in range(k.shape[1]):
        for i in range(k.shape[0]):
            slot_state[h, i, _SCORED] = 1.0
            slot_state[h, i, _NORM] = l2_norm(k[i, h])
        anti_cosine(k[:, h, :], slot_state[h, :, _NORM], k.shape[0], scores[h])


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    """The cached keys' scores against the anchor of the keys cached now; a slot's norm is computed when it is new."""
    for h in range(lengths.shape[0]):
        for i in range(lengths[h]):
            if slot_state[h, i, _SCORED] == 0.0:
                slot_state[h, i, _SCORED] = 1.0
                slot_state[h, i, _NORM] = l2_norm(keys[h, i])
        anti_cosine(keys[h], slot_state[h, :, _NORM], lengths[h], scores[h])


@register
class KeyDiff(ScorerPolicy):
    """Keep the keys least cosine-similar to the head's mean normalised key (kvpress ``KeyDiffPress``); no
    protected tokens in the paper, the newest is kept at decode (``n_recent=1``)."""

    name = "keydiff"
    reads_values = False
    summary = "keys least similar to the mean key kept"
    schema = SCHEMA
    P = P
    slot_fields = 2
    score_prompt = score_prompt
    score_step = score_step

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``KeyDiffPress`` (score ``-cos(k, mean key)``, nothing protected); kvsim's protected tokens (n_sink, n_recent) may differ from it."""
        return KvpressPress({"cls": "KeyDiffPress"}, differs_by=protected_extra(self))
