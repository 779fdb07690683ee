"""Q-Filters (Godey et al., 2025, arXiv 2503.02812; kvpress ``QFilterPress``).

Queries and keys of a head share one favoured direction: with ``u`` the principal right singular vector of the
head's (post-RoPE) queries, signed so that most queries project positively on it, the attention a key gets from an
average query grows with ``<k, u>``. A head's Q-Filter is ``f = -eps * v1`` (``v1`` the top right singular vector,
``eps = +1`` when more than half of the queries' projections on ``v1`` are positive, else -1), averaged over the
query heads that share the KV head, and a key's score is ``-<k, f>`` (kvpress), i.e. ``eps * <k, v1>``: the keys
projecting least on the queries' direction are evicted. Sign rule, group mean and score are those of the authors'
calibration code (``make_filters.py``) and of kvpress.

Deviation (kvsim cannot download the filters kvpress loads from the Hugging Face hub): the filters are calibrated
on the fly from *the prompt's own queries* in ``score_prompt`` (all its rows, every query head), not offline on a
calibration set (the authors: 3000 query vectors sampled from 20 sequences of 2048 tokens). v1 is the top
eigenvector of ``Q^T Q`` (float64), which is the top right singular vector of Q. The filter of each KV head stays
in the head state and scores every key at decode (the step never sees queries, so it is not re-calibrated). With
no prompt there is no filter: every key scores 0 and the oldest candidates go first.

A key's score never changes once the filter is set (the step does not re-calibrate it), so it is computed once,
when the key is first scored, and kept in its slot state ([0] 1 once scored, [1] the score): the same bits as scoring
it at every step.

Protection: kvpress protects nothing; the authors' cache keeps a recent window (64 tokens with a 128-token cache
in their example); here ``n_sink`` (default 0) and ``n_recent`` (default 1, the new token kept until a query has
seen it). head_state: [0] 1 once calibrated, [1 : 1 + d] the filter (head_dim <= 256).
"""
import numpy as np
from numba import njit

from policies.core.base import kernel, param_indices
from policies.core.registry import register
from policies.core.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, ScorerPolicy, protection
from policies.core.kvpress_press import KvpressPress, protected_extra

MAX_D = 256
SCHEMA = protection(n_sink=0, n_recent=1)
P = param_indices(SCHEMA)


@njit(cache=True)
def head_filter(q, hq):
    """The Q-Filter of query head ``hq`` from the rows of q [n, Hq, d]: ``-eps * v1`` (see the module docstring)."""
    n, _, d = q.shape
    rows = np.empty((n, d), np.float64)
    for r in range(n):
        for x in range(d):
            rows[r, x] = q[r, hq, x]
    _, vecs = np.linalg.eigh(rows.T @ rows)
    v1 = np.ascontiguousarray(vecs[:, d - 1])
    proj = rows @ v1
    positive = 0
    for r in range(n):
        if proj[r] > 0.0:
            positive += 1
    eps = 1.0 if positive > 0.5 * n else -1.0
    return -eps * v1


#: slot state: set once the slot's key is scored, and its score
_SCORED, _SCORE = 0, 1


@njit(cache=True)
def key_score(key, f):
    """-<key, f> in float64."""
    acc = 0.0
    for x in range(f.shape[0]):
        acc += np.float64(key[x]) * f[x]
    return -acc


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    """Calibrate each KV head's filter on the prompt's queries (mean over its query group) and score the keys."""
    n, hkv, d = k.shape
    if d > MAX_D:
        raise ValueError("qfilter: head_dim above 256")
    g_n = q.shape[1] // hkv
    for h in range(hkv):
        f = np.zeros(d)
        for g in range(g_n):
            f += head_filter(q, h * g_n + g)
        f /= g_n
        head_state[h, 0] = 1.0
        head_state[h, 1:1 + d] = f
        for i in range(n):
            scores[h, i] = key_score(k[i, h], f)
            slot_state[h, i, _SCORED] = 1.0
            slot_state[h, i, _SCORE] = scores[h, i]


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    """Every cached key's score under the head's filter (all 0 before one is calibrated), a new key's computed once."""
    d = keys.shape[2]
    for h in range(lengths.shape[0]):
        f = head_state[h, 1:1 + d]
        for i in range(lengths[h]):
            if slot_state[h, i, _SCORED] == 0.0:
                slot_state[h, i, _SCORED] = 1.0
                slot_state[h, i, _SCORE] = key_score(keys[h, i], f)
            scores[h, i] = slot_state[h, i, _SCORE]


@register
class QFilter(ScorerPolicy):
    """Keep the keys projecting most on the queries' principal direction (Q-Filters, kvpress ``QFilterPress``),
    with the filters calibrated on the prompt's queries instead of downloaded (see the module docstring)."""

    name = "qfilter"
    reads_values = False
    summary = "key projection on the queries' principal direction (filters from the prompt)"
    schema = SCHEMA
    P = P
    head_fields = 1 + MAX_D
    slot_fields = 2
    score_prompt = score_prompt
    score_step = score_step

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``QFilterPress`` with kvsim's filters: kvpress downloads each model's filters from the hub (none for SmolLM2 or Gemma-3), kvsim calibrates them on the prompt's queries, so the same sets need kvsim's filters handed to ``QFilterPress.load_q_filters``; kvsim's protected tokens (n_sink, n_recent) may differ from it."""
        return KvpressPress({"cls": "QFilterPress"}, differs_by=protected_extra(self), needs=("q_filters",),
                            note="QFilterPress loads its filters from the Hugging Face hub; hand it kvsim's (policies/qfilter.py) for the same sets")
