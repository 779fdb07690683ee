"""Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression").

Keys with a low L2 norm draw high attention, so the cache keeps the lowest-norm keys. A scorer on the
base in policies/core/scorer.py: the score is ``-||k||``, prompt and decode alike. A key never changes in the
cache, so its score is computed once, when the key is first scored, and kept in its slot state
([0] 1 once scored, [1] the score): the same bits as scoring it at every step, without a pass over d per slot
and step.
"""

from policies.core.base import kernel, param_indices
from policies.core.shared_kernels import l2_norm
from policies.core.registry import register
from policies.core.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, ScorerPolicy, protection
from policies.core.kvpress_press import KvpressPress, protected_extra

SCHEMA = protection(n_sink=0, n_recent=1)
P = param_indices(SCHEMA)


#: slot state: set once the slot's key is scored, and its score
_SCORED, _SCORE = 0, 1


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    for i in range(k.shape[0]):
        for h in range(k.shape[1]):
            scores[h, i] = -l2_norm(k[i, h])
            slot_state[h, i, _SCORED] = 1.0
            slot_state[h, i, _SCORE] = scores[h, i]


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    for h in range(lengths.shape[0]):
        for i in range(lengths[h]):
            if slot_state[h, i, _SCORED] == 0.0:
                slot_state[h, i, _SCORED] = 1.0
                slot_state[h, i, _SCORE] = -l2_norm(keys[h, i])
            scores[h, i] = slot_state[h, i, _SCORE]


@register
class Knorm(ScorerPolicy):
    """Keep the keys of lowest L2 norm (kvpress ``KnormPress``: score ``-||k||``). The paper and kvpress
    compress only the prompt and protect nothing; at decode the same rule evicts per step, and the newest
    token is kept (``n_recent=1``) so a high-norm new key is not dropped before any query sees it."""

    name = "knorm"
    reads_values = False
    summary = "lowest key L2 norm kept"
    schema = SCHEMA
    P = P
    slot_fields = 2
    score_prompt = score_prompt
    score_step = score_step

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``KnormPress`` (score ``-||k||``, nothing protected); kvsim's protected tokens (n_sink, n_recent) may differ from it."""
        return KvpressPress({"cls": "KnormPress"}, differs_by=protected_extra(self))
