"""LagKV (Liang et al., 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important").

After the ``n_sink`` sinks the sequence is cut into partitions of ``lag_size`` positions; partition j is scored
against the next one (its "lag" reference): every channel of its keys is min-max normalised with the
reference's per-channel min and max, a token's key statistic is the standard deviation of its normalised
channels, softmax-ed over the partition; the same for values; the score is the sum of the two. The last
partition (no reference yet) is not scored: it is kept whole (score +inf). Defaults n_sink=4, lag_size=128
(paper and kvpress ``LagKVPress``). Ambiguity: at decode the partitions are fixed by position and hold only
the tokens still cached, so the reference of a partition is its cached successor (the paper compresses a
partition once, when its successor is complete).

Three readings are parameters. The paper's method (a top-k within each partition and head; the last
partition, which has no reference, and the remainder of the sequence join the sliding window), its authors'
code (github.com/AI-Lab-China-Merchants-Bank/LagKV, ``lag_kv.py``: a ``topk`` of ``ratio * lag_size`` tokens
in each partition, ``torch.std``, the last full partition and the remainder kept whole) and kvpress's
``LagKVPress`` defaults all take the second value of each; kvsim's defaults are its original reading, kept so
that existing results and the pinned kept sets (tests/data/kept_golden.json) keep their meaning:

- ``cross_scoring`` (default true, kvpress ``cross_scoring=True``): the scores are compared across partitions.
  False: a token's score is its rank within its partition, so every partition keeps the same number of tokens
  from its top: ``(rank - m + 1) / lag_size`` for the rank 0..m-1 (ascending score, ties: the older lower) among
  the m cached tokens of its partition. With full partitions (the prompt) this is kvpress's ``rank / lag_size``
  less a constant; at decode, where cached partitions hold fewer tokens, it keeps evicting from the fullest.
  Equal ranks of different partitions tie (the older goes first; kvpress's ``torch.topk`` leaves ties
  unspecified).
- ``partial_reference`` (default true): a partition is scored against its successor even when that one is not
  yet complete (the remainder of the prompt), so only the last, partial partition is unscored. False: only a
  complete successor (its ``lag_size`` positions all seen) is a reference, so the last complete partition and
  the remainder stay unscored and kept, and a prompt shorter than ``n_sink + 2 * lag_size`` is not scored at
  all (all its tokens tie: the oldest go first, kvpress's recency scores for that case).
- ``std_ddof`` (default 0): the standard deviation over the channels divides by ``d - std_ddof``; 1 is
  ``torch.std``'s default (Bessel's correction), which the authors' code and kvpress use. It rescales every
  token's statistic by sqrt(d / (d - 1)) before the softmax, which changes how key and value scores add up,
  so it moves near-ties in either mode (SmolLM2, d = 64: 140 of kvpress's within-partition ranks differ at
  std_ddof=0, 10 at 1; the cross-scored kept sets match kvpress's only at 1).

kvsim adds 1e-6 to the reference's min-max range; kvpress and the authors' code do not (a channel constant over
the reference would divide by zero there). kvpress's defaults are therefore
``lagkv:n_sink=4,n_recent=0,cross_scoring=false,partial_reference=false,std_ddof=1``
(benchmarks/kvpress_parity.py).
"""
import numpy as np
from numba import njit

from policies.core.base import Param, kernel, param_indices
from policies.core.registry import register
from policies.core.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, ScorerPolicy, protection
from policies.core.kvpress_press import KvpressPress, protected_extra, require

SCHEMA = protection(n_sink=4, n_recent=1) + (
    Param("lag_size", 128, "int", 2, 4096, doc="partition length; the next partition is the reference"),
    Param("cross_scoring", True, "bool", searchable=False,
          doc="compare scores across partitions (kvpress cross_scoring=True); false: rank within each partition, "
              "so each keeps the same count (paper, authors' code, kvpress's default)"),
    Param("partial_reference", True, "bool", searchable=False,
          doc="score a partition against an incomplete successor; false: only a complete one, so the last "
              "complete partition and the remainder stay unscored (paper, authors' code, kvpress)"),
    Param("std_ddof", 0, "int", 0, 1, searchable=False,
          doc="channel std divides by d - std_ddof (1: torch.std's default, the authors' code and kvpress)"),
)
P = param_indices(SCHEMA)


@njit(cache=True, fastmath={"reassoc", "contract"})   # SIMD sums over the channels (rounding-level differences)
def _norm_std_softmax(x, i0, i1, r0, r1, out, add, mn, mx, z, s, ddof=0):
    """out[i0:i1] (+)= softmax over the partition of std_c((x[i, c] - min_ref c) / (max_ref c - min_ref c)),
    the std dividing by d - ddof. mn, mx, z [d] and s [n] are the caller's scratch (this runs per partition,
    step and head)."""
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
        s[i] = np.sqrt(ssd / (d - ddof))          # np.std(z, ddof=ddof)
        top = max(top, s[i])
    tot = 0.0
    for i in range(i0, i1):
        s[i] = np.exp(s[i] - top)
        tot += s[i]
    for i in range(i0, i1):
        out[i] = out[i] + s[i] / tot if add else s[i] / tot


@njit(cache=True)
def _rank_in_partition(out, i0, i1, lag):
    """out[i0:i1] <- (rank - m + 1) / lag, rank 0..m-1 of out[i] within the partition (ascending, ties: the older
    lower), m = i1 - i0: every partition's best token scores 0, its next -1 / lag, ..."""
    m = i1 - i0
    order = np.argsort(out[i0:i1], kind="mergesort")
    for r in range(m):
        out[i0 + order[r]] = (r - m + 1) / lag


#: slot state: the slot's score when its partition was last scored, and what that score was computed from: its
#: partition's cached slot count and position sum, its reference's count and sum, and whether it was scored at all
_SCORE, _SIG, _N_SIG = 0, 1, 5
SLOT_FIELDS = _SIG + _N_SIG


@njit(cache=True)
def lag_scores_cached(keys, values, positions, n, n_sink, lag, out, cross, partial_ref, ddof, state):
    """LagKV scores of n cached slots (positions increasing); sinks and the unreferenced tail get +inf. A
    partition's reference is its successor's cached slots, only once that partition is complete unless
    ``partial_ref``; ``cross`` False ranks the scores within each partition (``_rank_in_partition``).

    Only the partitions whose inputs changed since ``state`` (the slots' slot state, `SLOT_FIELDS` wide) was written
    are rescored. A partition's scores depend on its own cached slots and its reference's (and on whether it is
    scored); between steps a partition only loses slots and gains newer positions, so an unchanged (count, position
    sum) of both means the same slots, whose stored scores are then exactly what a recomputation gives. A decode step
    thus rescores the partitions next to its eviction and its new token, not all of them."""
    d = keys.shape[1]
    mn = np.empty(d)
    mx = np.empty(d)
    z = np.empty(d)
    s = np.empty(n)
    sig = np.empty(_N_SIG)
    part = np.empty(n, np.int64)
    for i in range(n):
        part[i] = (positions[i] - n_sink) // lag if positions[i] >= n_sink else -1
    seen = positions[n - 1] + 1 if n > 0 else 0     # positions 0 .. seen - 1 have been seen (the newest is cached)
    i0 = 0
    while i0 < n:
        i1 = i0
        while i1 < n and part[i1] == part[i0]:
            i1 += 1
        r1 = i1
        while r1 < n and part[r1] == part[i1]:
            r1 += 1
        scored = i1 < n and part[i0] >= 0 and part[i1] == part[i0] + 1 and (
            partial_ref or n_sink + (part[i1] + 1) * lag <= seen)
        sig[0] = i1 - i0
        sig[1] = 0.0
        for i in range(i0, i1):
            sig[1] += positions[i]
        sig[2] = r1 - i1
        sig[3] = 0.0
        for i in range(i1, r1):
            sig[3] += positions[i]
        sig[4] = 1.0 if scored else 0.0
        same = True
        for f in range(_N_SIG):
            same = same and state[i0, _SIG + f] == sig[f]
        if same:
            for i in range(i0, i1):
                out[i] = state[i, _SCORE]
        else:
            if scored:
                _norm_std_softmax(keys, i0, i1, i1, r1, out, False, mn, mx, z, s, ddof)
                _norm_std_softmax(values, i0, i1, i1, r1, out, True, mn, mx, z, s, ddof)
                if not cross:
                    _rank_in_partition(out, i0, i1, lag)
            else:
                for i in range(i0, i1):
                    out[i] = np.inf
            for i in range(i0, i1):
                state[i, _SCORE] = out[i]
                for f in range(_N_SIG):
                    state[i, _SIG + f] = sig[f]
        i0 = i1


@njit(cache=True)
def lag_scores(keys, values, positions, n, n_sink, lag, out, cross=True, partial_ref=True, ddof=0):
    """``lag_scores_cached`` scoring every partition afresh (an empty slot state)."""
    lag_scores_cached(keys, values, positions, n, n_sink, lag, out, cross, partial_ref, ddof,
                      np.zeros((n, SLOT_FIELDS)))


@njit(cache=True)
def _modes(params):
    return params[P.cross_scoring] != 0.0, params[P.partial_reference] != 0.0, int(params[P.std_ddof])


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    pos = np.arange(k.shape[0])
    cross, partial_ref, ddof = _modes(params)
    for h in range(k.shape[1]):
        lag_scores_cached(k[:, h, :], v[:, h, :], pos, k.shape[0], int(params[P.n_sink]), int(params[P.lag_size]),
                          scores[h], cross, partial_ref, ddof, slot_state[h])


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    cross, partial_ref, ddof = _modes(params)
    for h in range(lengths.shape[0]):
        lag_scores_cached(keys[h], values[h], positions[h], lengths[h], int(params[P.n_sink]), int(params[P.lag_size]),
                          scores[h], cross, partial_ref, ddof, slot_state[h])


@register
class LagKV(ScorerPolicy):
    """Lag-relative min/max normalised key and value statistics per partition (see the module docstring)."""

    name = "lagkv"
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"lag_size": (128, 32, 64)}
    summary = "lag-relative key/value statistics per partition"
    schema = SCHEMA
    P = P
    slot_fields = SLOT_FIELDS
    score_prompt = score_prompt
    score_step = score_step

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``LagKVPress`` (its rule: the last full partition and the remainder unscored, torch.std's Bessel correction); kvsim's protected tokens (n_recent) may differ from it."""
        require(self, "LagKVPress", partial_reference=False, std_ddof=1)
        p = self.params
        return KvpressPress({"cls": "LagKVPress", "n_sink": p["n_sink"], "lag_size": p["lag_size"],
                             "cross_scoring": p["cross_scoring"]}, differs_by=protected_extra(self, n_sink=p["n_sink"]))
