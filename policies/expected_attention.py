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
  HF Llama-style models; ``rope_theta`` must match the model (SmolLM2: 1e5; default 1e4 as Llama/HF;
  0 means the trace has no RoPE and nothing is rotated);
- the decode step never sees queries, so the statistics are the prompt's, frozen; each new key gets its
  logits once, when appended, and the softmax runs over the keys still cached at every step.
State: per KV head and query head ``g`` the rotated mean and covariance (head state, sized for G <= 8 query
heads per KV head and head_dim <= 128), per slot a "logits set" flag and its G logits.
"""
import numpy as np
from numba import njit

from policies.base import Param, param_indices
from policies.registry import register
from policies.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, ScorerPolicy, protection

MAX_G, MAX_D = 8, 128
SCHEMA = protection(n_sink=4, n_recent=1) + (
    Param("n_future_positions", 512, "int", 1, 1 << 16, doc="future positions the RoPE rotation is averaged over"),
    Param("use_covariance", True, "bool", doc="add the query covariance term (else the mean only)"),
    Param("use_vnorm", True, "bool", doc="multiply scores by ||v||"),
    Param("epsilon", 0.0, "float", 0.0, 1.0, doc="added to scores before the value-norm rescaling"),
    Param("rope_theta", 10000.0, "float", 0.0, 1e9, doc="RoPE base of the model (0: no RoPE in the trace)"),
)
P = param_indices(SCHEMA)


@njit(cache=True)
def _rotate(x, pos, theta, sign, out):
    """out = RoPE(pos) x (sign +1) or its inverse (sign -1), rotate-half layout."""
    d = x.shape[0]
    half = d // 2
    for j in range(half):
        a = sign * pos * theta ** (-2.0 * j / d)
        c, s = np.cos(a), np.sin(a)
        out[j] = c * x[j] - s * x[j + half]
        out[j + half] = s * x[j] + c * x[j + half]


@njit(cache=True)
def query_stats(params, q, hq, n0, d):
    """Rotated mean [d] and covariance [d, d] of query head ``hq``'s pre-RoPE queries at rows n0..P-1."""
    P_ = q.shape[0]
    theta = params[P.rope_theta]
    rows = np.empty((P_ - n0, d))
    for r in range(n0, P_):
        x = q[r, hq].astype(np.float64)
        if theta > 0.0:
            _rotate(x, float(r), theta, -1.0, rows[r - n0])
        else:
            rows[r - n0] = x
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
    rbar = np.zeros((d, d))          # R averaged over the future positions: cos I + sin J per frequency
    half = d // 2
    nf = int(params[P.n_future_positions])
    for j in range(half):
        w = theta ** (-2.0 * j / d)
        c = 0.0
        s = 0.0
        for p in range(P_, P_ + nf):
            c += np.cos(p * w)
            s += np.sin(p * w)
        c /= nf
        s /= nf
        rbar[j, j] = c
        rbar[j + half, j + half] = c
        rbar[j, j + half] = -s
        rbar[j + half, j] = s
    return rbar @ mu, rbar @ cov @ rbar.T


@njit(cache=True)
def logit(key, mu, cov, d, use_cov):
    """k.mu / sqrt(d) + k^T cov k / (2 d)."""
    k = key.astype(np.float64)
    out = np.dot(k, mu) / np.sqrt(d)
    if use_cov:
        out += np.dot(k, cov @ k) / d / 2.0
    return out


@njit(cache=True)
def combine(params, logits, values, positions, n, g_n, out):
    """Per query head softmax of the logits over the non-sink slots, mean over the group, times ||v||."""
    n_sink = int(params[P.n_sink])
    acc = np.zeros(n)
    for g in range(g_n):
        mx = -np.inf
        for i in range(n):
            if positions[i] >= n_sink:
                mx = max(mx, logits[i, g])
        tot = 0.0
        for i in range(n):
            if positions[i] >= n_sink:
                tot += np.exp(logits[i, g] - mx)
        for i in range(n):
            if positions[i] >= n_sink:
                acc[i] += np.exp(logits[i, g] - mx) / tot / g_n
    for i in range(n):
        s = acc[i]
        if params[P.use_vnorm] != 0.0:
            s = (s + params[P.epsilon]) * np.sqrt(np.sum(values[i].astype(np.float64) ** 2))
        out[i] = s


@njit(cache=True)
def _stats_at(head_state, h, g, d):
    base = g * (MAX_D + MAX_D * MAX_D)
    mu = head_state[h, base:base + d]
    cov = head_state[h, base + MAX_D:base + MAX_D + d * d].reshape((d, d))
    return mu, cov


@njit(SCORE_PROMPT_SIG, cache=True)
def score_prompt(params, layer, q, k, v, scale, scores, slot_state, head_state):
    n, hkv, d = k.shape
    g_n = q.shape[1] // hkv
    if g_n > MAX_G or d > MAX_D:
        raise ValueError("expected_attention: at most 8 query heads per KV head and head_dim 128")
    n0 = min(int(params[P.n_sink]), n - 1)
    use_cov = params[P.use_covariance] != 0.0
    pos = np.arange(n)
    for h in range(hkv):
        logits = np.empty((n, g_n))
        for g in range(g_n):
            mu, cov = query_stats(params, q, h * g_n + g, n0, d)
            smu, scov = _stats_at(head_state, h, g, d)
            smu[:] = mu
            scov[:, :] = cov
            for i in range(n):
                logits[i, g] = logit(k[i, h], mu, cov, d, use_cov)
                slot_state[h, i, 1 + g] = logits[i, g]
        for i in range(n):
            slot_state[h, i, 0] = 1.0
        combine(params, logits, v[:, h, :], pos, n, g_n, scores[h])


@njit(SCORE_STEP_SIG, cache=True)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, scores):
    d = keys.shape[2]
    g_n = probs.shape[1]
    use_cov = params[P.use_covariance] != 0.0
    for h in range(lengths.shape[0]):
        n = lengths[h]
        for i in range(n):
            if slot_state[h, i, 0] == 0.0:       # a key appended since: its logits under the prompt's statistics
                for g in range(g_n):
                    mu, cov = _stats_at(head_state, h, g, d)
                    slot_state[h, i, 1 + g] = logit(keys[h, i], mu, cov, d, use_cov)
                slot_state[h, i, 0] = 1.0
        combine(params, np.ascontiguousarray(slot_state[h, :n, 1:1 + g_n]), values[h], positions[h], n, g_n,
                scores[h])


@register
class ExpectedAttention(ScorerPolicy):
    """Keys scored by the attention future queries are expected to give them (see the module docstring)."""

    name = "expected_attention"
    summary = "expected future attention from query mean/covariance"
    schema = SCHEMA
    P = P
    slot_fields = 1 + MAX_G
    head_fields = MAX_G * (MAX_D + MAX_D * MAX_D)
    score_prompt = score_prompt
    score_step = score_step
