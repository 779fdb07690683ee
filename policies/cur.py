"""CUR leverage scores (kvpress ``CURPress``, after CurDKV: Sengupta et al., 2025, arXiv 2509.15038).

CurDKV keeps the tokens with the largest leverage in a CUR decomposition of the key and value matrices. kvpress
approximates a row's leverage by its squared norm (the length-squared sampling probability of CUR), and so does
this module, as kvpress computes it:

1. ``k2 = ||k||^2`` and ``v2 = ||v||^2`` per token, or, with ``use_random_leverage``, the squared norms of ``k G``
   and ``v G`` for one Gaussian matrix ``G`` [d, r] with entries N(0, 1 / r) (kvpress: ``r = 20``, a fresh
   ``torch.randn`` at every call; here ``sketch_dim`` and a counter-based draw from ``seed`` and the layer, so a
   replay is reproducible: ``projection(seed, layer, d, r)``);
2. ``use_local_approximation``: within windows of ``local_window_size`` positions (0..w-1, w..2w-1, ...; the last
   one partial), each of k2 and v2 is divided by its window sum;
3. ``leverage_type``: ``key`` (k2), ``value`` (v2), ``kv_avg`` ((k2 + v2) / 2) or ``kv_product`` (k2 * v2);
4. divided by the sum over the head's tokens (it changes no ranking within a head, only across heads, which
   ``ada(cur)`` compares); the first ``num_sinks`` tokens score 1.0 and are protected.

Defaults are kvpress 0.5.x's: ``num_sinks=4``, ``leverage_type=kv_product``, ``use_random_leverage=False``,
``use_local_approximation=True``, ``local_window_size=16``; the sketch size 20 is kvpress's hard-coded ``r``.
kvpress protects no recent token; here the newest is kept (``n_recent=1``), as for the other key/value scorers.
A window whose squared norms sum to 0 (all-zero keys) gives its tokens 0 where kvpress divides 0 by 0.

Decode (kvpress scores the prompt only): a token's score is the prompt rule applied to the whole sequence so far.
Its squared norms are computed once, when it arrives; windows are by position and each is normalised by the sum
over *all* the tokens of the window, evicted ones included, so a token's normalised values are final once its
window is complete; the window still filling is normalised by its running sum. Step 4's sum runs over the cached
tokens (a decode kernel sees no others).

Related kvpress presses: ``LeverageScorePress`` and ``CompactorPress`` (Chari & Van Durme, 2025) score keys by
their true statistical leverage (a Gaussian sketch of the centred pre-RoPE keys and a Cholesky solve), the same
family with the exact leverage instead of the squared-norm approximation; not implemented here.

State: slot_state [0] k2, [1] v2, [2] 0 new / 1 in the open window / 2 window complete, [3] [4] the final
normalised k2 and v2; head_state [0] 1 once a window is open, [1] its index, [2] [3] its running sums.
"""
import numpy as np
from numba import njit

from policies.core.base import Param, kernel, param_indices
from policies.core.shared_kernels import hash_uniform
from policies.core.registry import register
from policies.core.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, Protection, ScorerPolicy
from policies.core.kvpress_press import KvpressPress, protected_extra, require

LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")
SCHEMA = (
    Param("num_sinks", 4, "int", 0, 1024, searchable=False,
          doc="first tokens always kept (kvpress: their score is set to 1)"),
    Param("n_recent", 1, "int", 0, 1024, searchable=False, doc="newest positions never evicted (kvsim)"),
    Param("leverage_type", "kv_product", "choice", choices=LEVERAGE_TYPES,
          doc="score from the key leverage, the value leverage, their mean or their product"),
    Param("use_random_leverage", False, "bool", doc="squared norms after a Gaussian random projection"),
    Param("sketch_dim", 20, "int", 1, 256, searchable=False, doc="columns of the random projection (kvpress: 20)"),
    Param("seed", 0, "int", 0, 2**31 - 1, searchable=False, doc="seed of the random projection"),
    Param("use_local_approximation", True, "bool", doc="normalise the squared norms within local windows"),
    Param("local_window_size", 16, "int", 1, 4096, doc="positions per local window"),
)
P = param_indices(SCHEMA)


@njit(cache=True)
def projection(seed, layer, d, r):
    """The random projection G [d, r] of one layer: N(0, 1 / r) entries by Box-Muller from ``hash_uniform``."""
    g = np.empty((d, r), np.float64)
    for x in range(d):
        for j in range(r):
            u1 = hash_uniform(seed, layer, x * r + j, 0)
            u2 = hash_uniform(seed, layer, x * r + j, 1)
            g[x, j] = np.sqrt(-2.0 * np.log(1.0 - u1)) * np.cos(2.0 * np.pi * u2) / np.sqrt(r)
    return g


@njit(cache=True)
def sq_norm(row, g, use_g):
    """||row||^2, or ||row G||^2 when ``use_g``, in float64."""
    acc = 0.0
    if not use_g:
        for x in range(row.shape[0]):
            v = np.float64(row[x])
            acc += v * v
        return acc
    for j in range(g.shape[1]):
        s = 0.0
        for x in range(row.shape[0]):
            s += np.float64(row[x]) * g[x, j]
        acc += s * s
    return acc


@njit(cache=True)
def _ratio(a, b):
    return a / b if b > 0.0 else 0.0


@njit(cache=True)
def combine(kind, nk, nv, positions, n, num_sinks, out):
    """The leverage type's score of the n tokens, divided by their sum, sinks set to 1."""
    tot = 0.0
    for i in range(n):
        if kind == 0:
            s = nk[i]
        elif kind == 1:
            s = nv[i]
        elif kind == 2:
            s = 0.5 * (nk[i] + nv[i])
        else:
            s = nk[i] * nv[i]
        out[i] = s
        tot += s
    for i in range(n):
        out[i] = _ratio(out[i], tot)
        if positions[i] < num_sinks:
            out[i] = 1.0


@njit(cache=True)
def _setup(params, layer, d):
    use_g = params[P.use_random_leverage] != 0.0
    g = projection(np.int64(params[P.seed]), layer, d, np.int64(params[P.sketch_dim])) if use_g \
        else np.zeros((1, 1), np.float64)
    return use_g, g


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    """kvpress's score of the prompt; the window holding the last prompt token stays open for decode."""
    n, hkv, d = k.shape
    use_g, g = _setup(params, layer, d)
    local = params[P.use_local_approximation] != 0.0
    w = int(params[P.local_window_size])
    kind = int(params[P.leverage_type])
    pos = np.arange(n)
    nk = np.empty(n)
    nv = np.empty(n)
    for h in range(hkv):
        for i in range(n):
            slot_state[h, i, 0] = sq_norm(k[i, h], g, use_g)
            slot_state[h, i, 1] = sq_norm(v[i, h], g, use_g)
            slot_state[h, i, 2] = 1.0
            nk[i] = slot_state[h, i, 0]
            nv[i] = slot_state[h, i, 1]
        if local:
            for w0 in range(0, n, w):
                w1 = min(n, w0 + w)
                sk = 0.0
                sv = 0.0
                for i in range(w0, w1):
                    sk += slot_state[h, i, 0]
                    sv += slot_state[h, i, 1]
                last = w1 == n
                for i in range(w0, w1):
                    nk[i] = _ratio(slot_state[h, i, 0], sk)
                    nv[i] = _ratio(slot_state[h, i, 1], sv)
                    if not last:
                        slot_state[h, i, 2] = 2.0
                        slot_state[h, i, 3] = nk[i]
                        slot_state[h, i, 4] = nv[i]
                if last:
                    head_state[h, 0] = 1.0
                    head_state[h, 1] = w0 // w
                    head_state[h, 2] = sk
                    head_state[h, 3] = sv
        combine(kind, nk, nv, pos, n, int(params[P.num_sinks]), scores[h])


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    """Squared norms of the new tokens (and the open window's sums), then kvpress's score of the cached tokens."""
    d = keys.shape[2]
    use_g, g = _setup(params, layer, d)
    local = params[P.use_local_approximation] != 0.0
    w = int(params[P.local_window_size])
    kind = int(params[P.leverage_type])
    for h in range(lengths.shape[0]):
        n = lengths[h]
        for i in range(n):
            if slot_state[h, i, 2] != 0.0:
                continue
            k2 = sq_norm(keys[h, i], g, use_g)
            v2 = sq_norm(values[h, i], g, use_g)
            slot_state[h, i, 0] = k2
            slot_state[h, i, 1] = v2
            if local:
                wi = positions[h, i] // w
                if head_state[h, 0] == 0.0 or wi != head_state[h, 1]:
                    if head_state[h, 0] != 0.0:          # the open window is complete: its values are final
                        for j in range(n):
                            if slot_state[h, j, 2] == 1.0:
                                slot_state[h, j, 2] = 2.0
                                slot_state[h, j, 3] = _ratio(slot_state[h, j, 0], head_state[h, 2])
                                slot_state[h, j, 4] = _ratio(slot_state[h, j, 1], head_state[h, 3])
                    head_state[h, 0] = 1.0
                    head_state[h, 1] = wi
                    head_state[h, 2] = 0.0
                    head_state[h, 3] = 0.0
                head_state[h, 2] += k2
                head_state[h, 3] += v2
            slot_state[h, i, 2] = 1.0
        nk = np.empty(n)
        nv = np.empty(n)
        for i in range(n):
            if not local:
                nk[i] = slot_state[h, i, 0]
                nv[i] = slot_state[h, i, 1]
            elif slot_state[h, i, 2] == 2.0:
                nk[i] = slot_state[h, i, 3]
                nv[i] = slot_state[h, i, 4]
            else:
                nk[i] = _ratio(slot_state[h, i, 0], head_state[h, 2])
                nv[i] = _ratio(slot_state[h, i, 1], head_state[h, 3])
        combine(kind, nk, nv, positions[h], n, int(params[P.num_sinks]), scores[h])


@register
class CUR(ScorerPolicy):
    """Keep the tokens of largest approximate CUR leverage of keys and values (kvpress ``CURPress``); see the
    module docstring for the score, its decode rule and the related leverage presses."""

    name = "cur"
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"leverage_type": ("kv_product", "key", "value")}
    summary = "approximate CUR leverage (squared norms) of keys and values"
    schema = SCHEMA
    P = P
    slot_fields = 5
    head_fields = 4
    protect = Protection(sinks="num_sinks", recent="n_recent")
    score_prompt = score_prompt
    score_step = score_step

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``CURPress`` (leverage of keys and values; the random-leverage sketch is not reproducible across the two, so ``use_random_leverage`` must be off); kvsim's protected tokens (n_recent) may differ from it."""
        require(self, "CURPress", use_random_leverage=False)
        p = self.params
        return KvpressPress({"cls": "CURPress", "num_sinks": p["num_sinks"], "leverage_type": p["leverage_type"],
                             "use_local_approximation": p["use_local_approximation"], "local_window_size": p["local_window_size"]}, differs_by=protected_extra(self, sink_param=None))

