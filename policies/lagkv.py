"""LagKV (Liang et al., 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important").

After the ``n_sink`` sinks the sequence is cut into partitions of ``lag_size`` positions; partition j is scored
against the next one (its "lag" reference): every channel of its keys is min-max normalised with the
reference's per-channel min and max, a token's key statistic is the standard deviation of its normalised
channels, softmax-ed over the partition; the same for values; the score is the sum of the two. The last
partition (no reference yet) is not scored: it is kept whole (score +inf). Defaults n_sink=4, lag_size=128
(paper and kvpress ``LagKVPress``). Ambiguity: at decode the partitions are fixed by position and hold only
the tokens still cached, so the reference of a partition is its cached successor (the paper compresses a
partition once, when its successor is complete).
"""
import numpy as np
from numba import njit

from policies.base import Param, kernel, param_indices
from policies.registry import register
from policies.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, ScorerPolicy, protection

SCHEMA = protection(n_sink=4, n_recent=1) + (
    Param("lag_size", 128, "int", 2, 4096, doc="partition length; the next partition is the reference"),)
P = param_indices(SCHEMA)


@njit(cache=True, fastmath={"reassoc", "contract"})   # SIMD sums over the channels (rounding-level differences)
def _norm_std_softmax(x, i0, i1, r0, r1, out, add, mn, mx, z, s):
    """out[i0:i1] (+)= softmax over the partition of std_c((x[i, c] - min_ref c) / (max_ref c - min_ref c)).
    mn, mx, z [d] and s [n] are the caller's scratch (this runs per partition, step and head)."""
    d = x.shape[1]
    for c in range(d):
        mn[c] = np.inf
        mx[c] = -np.inf
    for r in range(r0, r1):
        for c in range(d):
            mn[c] = min(mn[c], x[r, c])
            mx[c] = max(mx[c], x[r, c])
    for c in range(d):
        mx[c] = 1.0 / (mx[c] - mn[c] + 1e-6)       # the reference's inverse range: one division per channel
    top = -np.inf
    for i in range(i0, i1):
        tot = 0.0
        for c in range(d):
            z[c] = (x[i, c] - mn[c]) * mx[c]
            tot += z[c]
        mean = tot / d
        ssd = 0.0
        for c in range(d):
            ssd += (z[c] - mean) ** 2
        s[i] = np.sqrt(ssd / d)          # np.std(z)
        top = max(top, s[i])
    tot = 0.0
    for i in range(i0, i1):
        s[i] = np.exp(s[i] - top)
        tot += s[i]
    for i in range(i0, i1):
        out[i] = out[i] + s[i] / tot if add else s[i] / tot


@njit(cache=True)
def lag_scores(keys, values, positions, n, n_sink, lag, out):
    """LagKV scores of n cached slots (positions increasing); sinks and the unreferenced tail get +inf."""
    d = keys.shape[1]
    mn = np.empty(d)
    mx = np.empty(d)
    z = np.empty(d)
    s = np.empty(n)
    part = np.empty(n, np.int64)
    for i in range(n):
        part[i] = (positions[i] - n_sink) // lag if positions[i] >= n_sink else -1
        out[i] = np.inf
    i0 = 0
    while i0 < n:
        i1 = i0
        while i1 < n and part[i1] == part[i0]:
            i1 += 1
        if i1 == n:
            break
        r1 = i1
        while r1 < n and part[r1] == part[i1]:
            r1 += 1
        if part[i0] >= 0 and part[i1] == part[i0] + 1:
            _norm_std_softmax(keys, i0, i1, i1, r1, out, False, mn, mx, z, s)
            _norm_std_softmax(values, i0, i1, i1, r1, out, True, mn, mx, z, s)
        i0 = i1


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    pos = np.arange(k.shape[0])
    for h in range(k.shape[1]):
        lag_scores(k[:, h, :], v[:, h, :], pos, k.shape[0], int(params[P.n_sink]), int(params[P.lag_size]),
                   scores[h])


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    for h in range(lengths.shape[0]):
        lag_scores(keys[h], values[h], positions[h], lengths[h], int(params[P.n_sink]), int(params[P.lag_size]),
                   scores[h])


@register
class LagKV(ScorerPolicy):
    """Lag-relative min/max normalised key and value statistics per partition (see the module docstring)."""

    name = "lagkv"
    summary = "lag-relative key/value statistics per partition"
    schema = SCHEMA
    P = P
    score_prompt = score_prompt
    score_step = score_step
