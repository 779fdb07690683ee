"""Expected Attention (kvpress ``ExpectedAttentionPress``, Devoto et al., 2025).

Each key is scored by the attention that *future* queries are expected to give it. The prompt's queries
(after the ``n_sink`` first, which carry outliers) are taken before RoPE; their mean ``mu`` and covariance
``S`` are rotated by the RoPE matrix averaged over the next ``n_future_positions`` positions (``R``), and
for a Gaussian query ``E[exp(q.k / sqrt d)] = exp(k.R mu / sqrt d + k^T R S R^T k / (2 d))``. Per query head
these logits are softmax-ed over the (non-sink) keys, averaged over the query heads sharing the KV head, and
multiplied by ``||v||`` (``use_vnorm``; ``epsilon`` added first). Defaults follow kvpress: n_sink 4,
n_future_positions 512, covariance and value norm on, epsilon 0.

Trace-specific choices (documented ambiguities):
- traces hold post-RoPE queries, so each query is un-rotated at its position with the rotate-half RoPE of
  HF Llama-style models. ``rope_theta`` must match the model: by default (-1) each layer uses its own base,
  read from the trace's manifest or, closed loop, from the model's config (SmolLM2: 1e5; Gemma-3: 1e6 on
  global and 1e4 on sliding layers); a value overrides it for every layer (0: no RoPE, nothing is rotated).
  With a wrong base the score degrades badly (SmolLM2, 1e4 instead of 1e5: attention error 0.336 against
  0.131 at budget 256);
- the decode step never sees queries, so the statistics are the prompt's, frozen; each new key gets its
  logits once, when appended, and the softmax runs over the keys still cached at every step.
- with QK-norm (Qwen3, Gemma-3) the stored queries are normalised before RoPE, so the statistics are those of
  the normalised queries, as the keys they meet are;
- the logits use 1 / sqrt(d) as kvpress does (Gemma-3's query_pre_attn_scalar 256 gives the same at d 256).
State: per KV head and query head ``g`` the rotated mean and covariance, in a block [G * (d + d * d)] sized for the
layer (``prompt_head_state`` appends it once the prompt's geometry is known; head field ``STATS_AT`` holds where it
starts), per slot a "logits set" flag, its G logits (G <= 8 query heads per KV head) and its value norm (a value never
changes in the cache: computed once, as the logits are).
"""
from typing import Any

import numpy as np
from numba import njit

from policies.core.base import FROM_MODEL, Param, PolicyError, kernel, param_indices
from policies.core.shared_kernels import l2_norm
from policies.core.registry import register
from policies.core.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, ScorerPolicy, protection
from policies.core.kvpress_press import KvpressPress, protected_extra, require

MAX_G = 8
#: head fields: the column where the statistics block starts (0: none appended yet), and 1 when the block already
#: holds the prompt's statistics (a replay's ``replay_head_state``, computed once per trace and parameters):
#: ``score_prompt`` then reads them instead of computing them
STATS_AT, STATS_GIVEN = 0, 1
#: slot field of the slot's value norm (after the "logits set" flag and the G logits), computed with its logits
VNORM = 1 + MAX_G
_VECTOR_MATH = {"reassoc", "contract"}   # SIMD sums in the per-slot kernels (rounding-level differences)
SCHEMA = protection(n_sink=4, n_recent=1) + (
    Param("n_future_positions", 512, "int", 1, 1 << 16, doc="future positions the RoPE rotation is averaged over"),
    Param("use_covariance", True, "bool", doc="add the query covariance term (else the mean only)"),
    Param("use_vnorm", True, "bool", doc="multiply scores by ||v||"),
    Param("epsilon", 0.0, "float", 0.0, 1.0, doc="added to scores before the value-norm rescaling"),
    Param("rope_theta", FROM_MODEL, "float", FROM_MODEL, 1e9, searchable=False, from_layer="rope_theta",
          doc="RoPE base; -1: each layer's own (from the trace or the model); 0: no RoPE"),
)
P = param_indices(SCHEMA)


@njit(cache=True)
def rope_tables(n0, n1, d, theta):
    """cos, sin [n1 - n0, d / 2] of the inverse RoPE angles -pos * theta^(-2j/d) at positions n0..n1-1 (rotate-half
    layout), once per layer for all its query heads."""
    half = d // 2
    cos_t = np.empty((n1 - n0, half))
    sin_t = np.empty((n1 - n0, half))
    for r in range(n0, n1):
        for j in range(half):
            a = -1.0 * r * theta ** (-2.0 * j / d)
            cos_t[r - n0, j] = np.cos(a)
            sin_t[r - n0, j] = np.sin(a)
    return cos_t, sin_t


@njit(cache=True)
def mean_rotation(p0, nf, d, theta):
    """R averaged over the future positions p0..p0+nf-1: cos I + sin J per frequency [d, d]."""
    rbar = np.zeros((d, d))
    half = d // 2
    for j in range(half):
        w = theta ** (-2.0 * j / d)
        c = 0.0
        s = 0.0
        for p in range(p0, p0 + nf):
            c += np.cos(p * w)
            s += np.sin(p * w)
        c /= nf
        s /= nf
        rbar[j, j] = c
        rbar[j + half, j + half] = c
        rbar[j, j + half] = -s
        rbar[j + half, j] = s
    return rbar


@njit(cache=True)
def query_stats(params, q, hq, n0, d, cos_t, sin_t, rbar):
    """Rotated mean [d] and covariance [d, d] of query head ``hq``'s pre-RoPE queries at rows n0..P-1; the
    queries are un-rotated with the layer's ``rope_tables`` and the statistics rotated by its ``mean_rotation``
    (both unused when ``rope_theta`` is 0)."""
    P_ = q.shape[0]
    theta = params[P.rope_theta]
    half = d // 2
    rows = np.empty((P_ - n0, d))
    for r in range(n0, P_):
        if theta > 0.0:
            for j in range(half):
                c = cos_t[r - n0, j]
                s = sin_t[r - n0, j]
                x0 = np.float64(q[r, hq, j])
                x1 = np.float64(q[r, hq, j + half])
                rows[r - n0, j] = c * x0 - s * x1
                rows[r - n0, j + half] = s * x0 + c * x1
        else:
            for x in range(d):
                rows[r - n0, x] = q[r, hq, x]
    mu = np.zeros(d)
    for r in range(rows.shape[0]):
        mu += rows[r]
    mu /= max(rows.shape[0], 1)
    cov = np.zeros((d, d))
    if params[P.use_covariance] != 0.0:
        cen = rows - mu
        cov = cen.T @ cen / max(rows.shape[0], 1)
    if theta <= 0.0:
        return mu, cov
    return rbar @ mu, rbar @ cov @ rbar.T


@njit(cache=True, fastmath=_VECTOR_MATH)
def logit(key, mu, cov, d, use_cov):
    """k.mu / sqrt(d) + k^T cov k / (2 d), in float64 without temporaries (one call per new key and step)."""
    lin = 0.0
    for x in range(d):
        lin += np.float64(key[x]) * mu[x]
    out = lin / np.sqrt(d)
    if use_cov:
        quad = 0.0
        for x in range(d):
            row = 0.0
            for y in range(d):
                row += cov[x, y] * np.float64(key[y])
            quad += np.float64(key[x]) * row
        out += quad / d / 2.0
    return out


@njit(cache=True, fastmath=_VECTOR_MATH)
def value_norm(value):
    """||value|| as the scores have always taken it (``l2_norm`` under the per-slot kernels' SIMD sums)."""
    return l2_norm(value)


@njit(cache=True)
def prompt_logits(keys, mu, cov, d, use_cov, out):
    """``logit`` of every row of keys [n, d] into out[n]: two BLAS products for the whole prompt."""
    k64 = keys.astype(np.float64)
    lin = np.dot(k64, mu) / np.sqrt(d)
    if use_cov:
        lin += (np.dot(k64, cov) * k64).sum(axis=1) / d / 2.0
    out[:] = lin


@njit(cache=True, fastmath=_VECTOR_MATH)
def combine(params, logits, vnorms, positions, n, g_n, out):
    """Per query head softmax of the logits over the non-sink slots, mean over the group, times ||v|| (``vnorms``,
    each slot's value norm, ``l2_norm``)."""
    n_sink = int(params[P.n_sink])
    acc = np.zeros(n)
    ex = np.empty(n)
    for g in range(g_n):
        mx = -np.inf
        for i in range(n):
            if positions[i] >= n_sink:
                mx = max(mx, logits[i, g])
        tot = 0.0
        for i in range(n):
            ex[i] = np.exp(logits[i, g] - mx) if positions[i] >= n_sink else 0.0
            tot += ex[i]
        for i in range(n):
            if positions[i] >= n_sink:
                acc[i] += ex[i] / tot / g_n
    for i in range(n):
        s = acc[i]
        if params[P.use_vnorm] != 0.0:
            s = (s + params[P.epsilon]) * vnorms[i]
        out[i] = s


@njit(cache=True)
def _stats_at(head_state, h, g, d):
    """Views of query head g's rotated mean [d] and covariance [d, d] in KV head h's statistics block."""
    base = int(head_state[h, STATS_AT]) + g * (d + d * d)
    mu = head_state[h, base:base + d]
    cov = head_state[h, base + d:base + d + d * d].reshape((d, d))
    return mu, cov


def stats_block(n_kv_heads: int, g: int, d: int) -> np.ndarray:
    """The zero statistics block of a layer with ``g`` query heads per KV head and head_dim ``d``."""
    return np.zeros((n_kv_heads, g * (d + d * d)))


@njit(cache=True, nogil=True)
def prompt_stats(params, q, hkv, mus, covs):
    """Every query head's rotated statistics of the prompt queries q [P, Hq, d] (``query_stats``) into mus
    [Hkv, G, d] and covs [Hkv, G, d, d]: what ``score_prompt`` computes before scoring, a function of the trace
    and the parameters only."""
    n, hq_n, d = q.shape
    g_n = hq_n // hkv
    n0 = min(int(params[P.n_sink]), n - 1)
    theta = params[P.rope_theta]
    cos_t, sin_t = rope_tables(n0, n, d, theta) if theta > 0.0 else (np.empty((0, 0)), np.empty((0, 0)))
    rbar = mean_rotation(n, int(params[P.n_future_positions]), d, theta) if theta > 0.0 else np.empty((0, 0))
    for h in range(hkv):
        for g in range(g_n):
            mu, cov = query_stats(params, q, h * g_n + g, n0, d, cos_t, sin_t, rbar)
            mus[h, g] = mu
            covs[h, g] = cov


@kernel(SCORE_PROMPT_SIG)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    """The prompt's statistics (``prompt_stats``; a replay's head state may hold them already, ``STATS_GIVEN``),
    every prompt key's logits under them, and the keys' scores (``combine``)."""
    n, hkv, d = k.shape
    g_n = q.shape[1] // hkv
    if g_n > MAX_G:
        raise ValueError("expected_attention: at most 8 query heads per KV head")
    use_cov = params[P.use_covariance] != 0.0
    pos = np.arange(n)
    block = head_state[0, STATS_AT] > 0.0          # no block: a bare head state (the prefill alone, no decode)
    given = block and head_state[0, STATS_GIVEN] != 0.0
    mus = np.empty((hkv, g_n, d))
    covs = np.empty((hkv, g_n, d, d))
    if not given:
        prompt_stats(params, q, hkv, mus, covs)
    for h in range(hkv):
        logits = np.empty((n, g_n))
        for g in range(g_n):
            if given:
                smu, scov = _stats_at(head_state, h, g, d)
                mus[h, g] = smu
                covs[h, g] = scov
            elif block:
                smu, scov = _stats_at(head_state, h, g, d)
                smu[:] = mus[h, g]
                scov[:, :] = covs[h, g]
            prompt_logits(k[:, h, :], mus[h, g].copy(), covs[h, g].copy(), d, use_cov, logits[:, g])
            for i in range(n):
                slot_state[h, i, 1 + g] = logits[i, g]
        for i in range(n):
            slot_state[h, i, 0] = 1.0
            slot_state[h, i, VNORM] = value_norm(v[i, h])
        combine(params, logits, slot_state[h, :, VNORM], pos, n, g_n, scores[h])


@kernel(SCORE_STEP_SIG)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    d = keys.shape[2]
    g_n = probs.shape[1]
    use_cov = params[P.use_covariance] != 0.0
    block = head_state[0, STATS_AT] > 0.0          # none: no prompt statistics, every logit 0
    for h in range(lengths.shape[0]):
        n = lengths[h]
        for i in range(n):
            if slot_state[h, i, 0] == 0.0:       # a key appended since: its logits under the prompt's statistics
                for g in range(g_n):
                    if block:
                        mu, cov = _stats_at(head_state, h, g, d)
                        slot_state[h, i, 1 + g] = logit(keys[h, i], mu, cov, d, use_cov)
                    else:
                        slot_state[h, i, 1 + g] = 0.0
                slot_state[h, i, VNORM] = value_norm(values[h, i])
                slot_state[h, i, 0] = 1.0
        combine(params, np.ascontiguousarray(slot_state[h, :n, 1:1 + g_n]), slot_state[h, :n, VNORM], positions[h],
                n, g_n, scores[h])


@register
class ExpectedAttention(ScorerPolicy):
    """Keys scored by the attention future queries are expected to give them (see the module docstring)."""

    name = "expected_attention"
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"use_covariance": (True, False), "use_vnorm": (True, False)}
    summary = "expected future attention from query mean/covariance"
    schema = SCHEMA
    P = P
    slot_fields = 2 + MAX_G
    head_fields = 2
    score_prompt = score_prompt
    score_step = score_step

    def replay_head_state(self, n_kv_heads: int, head_dim: int, layer: Any, memo: dict | None = None,
                          n_prompt: int = 0) -> np.ndarray:
        """The head state with the statistics block appended holding the prompt queries' statistics
        (``prompt_stats``: the rotations' ~50 k sines and cosines and a d x d covariance per query head, most of the
        prefill), computed once per trace and parameters and kept in ``memo`` for every budget and sibling
        configuration; the prefill reads them (the same bits) instead of computing them. The closed loop's block
        (``prompt_head_state``) starts empty: its prefill computes them."""
        head = super().replay_head_state(n_kv_heads, head_dim, layer, memo, n_prompt)
        if n_prompt < 1 or memo is None:
            return head
        params = self.param_vector(layer.attention)
        key = ("expected_attention.stats", n_prompt, *(float(params[i]) for i in (
            P.n_sink, P.n_future_positions, P.use_covariance, P.rope_theta)))
        d = head_dim
        stats = memo.get(key)                     # [Hkv, G, d + d * d]: each query head's mean, then covariance
        if stats is None:
            g = layer.q.shape[1] // n_kv_heads
            mus, covs = np.empty((n_kv_heads, g, d)), np.empty((n_kv_heads, g, d, d))
            prompt_stats(params, np.ascontiguousarray(layer.q[:n_prompt]), n_kv_heads, mus, covs)
            stats = memo[key] = np.concatenate([mus, covs.reshape(n_kv_heads, g, d * d)], axis=2)
        out = np.concatenate([head, stats.reshape(n_kv_heads, -1)], axis=1)
        out[:, STATS_AT] = head.shape[1]
        out[:, STATS_GIVEN] = 1.0
        return out

    def prompt_head_state(self, head_state: np.ndarray, prompt_layers: Any, j: int) -> np.ndarray:
        """The head state with an empty statistics block appended for compressed layer j's geometry (G query heads
        per KV head, head_dim d: G * (d + d * d) columns per KV head), unless the replay's already holds one."""
        if head_state[0, STATS_AT] > 0.0:
            return head_state
        q, k = prompt_layers[j]
        hkv = head_state.shape[0]
        out = np.concatenate([head_state, stats_block(hkv, q.shape[1] // hkv, k.shape[2])], axis=1)
        out[:, STATS_AT] = head_state.shape[1]
        return out

    def validate(self) -> None:
        super().validate()
        theta = self.params["rope_theta"]
        if theta != FROM_MODEL and theta < 0:
            raise PolicyError(f"{self.name}.rope_theta: {theta} is neither -1 (the layer's own) nor a base >= 0")

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``ExpectedAttentionPress`` (it reads the model's RoPE base, as ``rope_theta=-1`` does); kvsim's protected tokens (n_recent) may differ from it."""
        require(self, "ExpectedAttentionPress", rope_theta=-1.0)
        p = self.params
        return KvpressPress({"cls": "ExpectedAttentionPress", "n_future_positions": p["n_future_positions"], "n_sink": p["n_sink"],
                             "use_covariance": p["use_covariance"], "use_vnorm": p["use_vnorm"], "epsilon": p["epsilon"]}, differs_by=protected_extra(self, n_sink=p["n_sink"]))
