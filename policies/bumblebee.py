"""BumbleBee (Kumari et al., 2024): submodular mixture of key diversity and accumulated-attention importance.

Objective (eq. 4): g(A) = lam * f_FL(A) + (1 - lam) * c(A) over a ground set V of keys of one KV head, with
  f_FL(A) = sum_{v in V} max_{a in A} sim(v, a) / sum_{v in V} sim(v, v)      (eq. 2, normalised: f_FL(V) = 1)
  c(A)    = phi(sum_{a in A} m(a)) / phi(sum_{v in V} m(v))                   (eq. 3, |U| = 1, c(V) = 1)
where sim is ReLU-truncated cosine similarity of keys (Appx. D; 1 + cos and |cos| also exposed), m is the
attention a key accumulated and phi is log(1 + x) or the inverse of g(y) = alpha * y**(1/alpha) + beta * y.

Prompt (Alg. 1, ``prefill_fn``): V = the prompt keys, m = causal attention accumulated over all prompt queries,
greedy maximisation of g under |S| <= budget (lazy/Minoux greedy by default: the same picks as the naive greedy;
the paper's stochastic greedy with eps = 1e-5 samples nearly all of V per pick, so it is not offered). Up to
FULL_MATRIX_MAX = 2048 prompt tokens it builds the P x P similarity matrix (8 P^2 bytes per head, <= 32 MiB);
beyond, it keeps only the normalised keys and recomputes a similarity column (O(P d)) when a gain needs one
(``greedy_select_keys``): the same picks from bitwise the same gains (where BLAS sums each cosine as one FMA
chain, as OpenBLAS does up to d = 448), in O(P d) memory plus a 256 MiB column cache
(a 32 k-token replay at d = 256 peaks at 0.9 GB instead of 13 GB: benchmarks/bumblebee_long.py). Time O(P^2 d)
for the first round of gains (SGEMM in blocks of 64 columns, bitwise the FMA chain: ``cosine_rows``) plus O(P d)
per later evaluation that misses the cache (lazy: 1-1.5 P of them at 32 k tokens; naive: O(budget P^2 d) in all);
single-threaded (the replay runs layers in parallel).
Decode (Alg. 2, ``step``): V = S' = cache plus the new key; when over budget, drop argmin_k g(k | S' \\ k).
With V = S' the facility-location gain of k is (sim(k, k) - max_{j != k} sim(k, j)) / |V| sim(k, k), so each slot
carries its nearest-neighbour similarity (and that neighbour's position) in slot_state: a step costs O(budget * d)
plus O(budget * d) for each slot whose nearest neighbour was the one evicted (0.01-0.2 per step measured in
benchmarks/bumblebee_step.py; O(budget^2 d) in the worst case) instead of the O(budget^2) similarity matrix of
the paper's Appx. E.

Choices the paper leaves open: GQA (the paper's LLaMA has none) reduces a group's probabilities with
``group_reduce``; the importance of the incoming key at the eviction decision is its attention over S' and,
when it stays, is renormalised over S_t (line 14); ties evict the older token / pick the earlier one.
``recent_ratio``: the paper "further combine[s] the global submodular summary with the most recent local context"
(Sec. 1, Fig. 1) and compares against "+ Local" baselines, but gives no split and Alg. 2 alone has no window.
Default 0.5 (the even split of its H2+Local baseline); 0 is Alg. 2 alone, which on a local-attention model
(the shipped tiny Llama) evicts each new token at once and retains less attention than random eviction.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from policies._bumblebee_greedy import FULL_MATRIX_MAX, concave, concave_from, greedy_select, greedy_select_keys
from policies._bumblebee_similarity import (COL_ROWS, _cos_from, _dots_to, kernel_sim, self_sim, sim_columns,
                                            similarity_into, similarity_matrix, unit_keys_t)
from policies.core.base import PREFILL_SIG, STEP_SIG, Guarantees, Param, Policy, kernel, param_indices
from policies.core.shared_kernels import GROUP_REDUCE, group_score, prompt_attention, prompt_attention_table
from policies.core.scorer import recent_slots
from policies.core.registry import register

CONCAVE = ("power", "log")
SIMILARITY = ("relu_cos", "one_plus_cos", "abs_cos")
GREEDY = ("lazy", "naive")

SCHEMA = (
    Param("lam", 0.3, "float", 0.0, 1.0, doc="mixture weight of facility-location diversity (eq. 4)"),
    Param("concave", "power", "choice", choices=CONCAVE,
          doc="phi of the importance term: inverse of alpha y^(1/alpha) + beta y (power) or log(1 + x)"),
    Param("alpha", 0.04, "float", 0.005, 1.0, log=True, doc="curvature of the power concave function"),
    Param("beta", 1.0, "float", 0.0, 10.0, doc="linear part of the power concave function"),
    Param("similarity", "relu_cos", "choice", choices=SIMILARITY, doc="facility-location kernel on keys"),
    Param("recent_ratio", 0.5, "float", 0.0, 1.0, doc="share of the budget kept as local window (Fig. 1)"),
    Param("group_reduce", "mean", "choice", choices=GROUP_REDUCE, doc="GQA aggregation of query heads"),
    Param("greedy", "lazy", "choice", choices=GREEDY, searchable=False,
          doc="prompt greedy: lazy (Minoux) or naive (every gain every pick: O(budget P^2 d) beyond 2048 prompt "
              "tokens); identical selections"),
)
P = param_indices(SCHEMA)
# slot_state fields
F_ACC, F_NN, F_NNPOS, F_NORM = range(4)


@njit(cache=True)
def nearest_selected(uT, inset, mode):
    """For each selected i (inset[i] != 0): (largest sim(i, j), j) over the selected j != i, ties to the smaller
    j; (0, -1) when alone. The similarities are ``similarity_matrix``'s (``sim_columns``). O(s^2 d) time for s
    selected, O(s d + COL_ROWS s) memory."""
    d, n = uT.shape
    idx = np.flatnonzero(inset)
    s = idx.shape[0]
    uTs = np.empty((d, s), np.float32)
    for x in range(d):
        for a in range(s):
            uTs[x, a] = uT[x, idx[a]]
    nn = np.zeros(n, np.float64)
    nn_pos = np.full(n, -1, np.int64)
    R = COL_ROWS
    C = np.empty((R, s), np.float64)
    rows = np.empty(R, np.int64)
    for a0 in range(0, s, R):
        nr = min(R, s - a0)
        for r in range(nr):
            rows[r] = a0 + r
        sim_columns(uTs, rows, nr, mode, C)
        for r in range(nr):
            a = a0 + r
            best, best_s = -1, 0.0
            for b in range(s):
                if b != a and (best < 0 or C[r, b] > best_s):
                    best, best_s = b, C[r, b]
            nn[idx[a]] = best_s
            nn_pos[idx[a]] = idx[best] if best >= 0 else -1
    return nn, nn_pos


@kernel(PREFILL_SIG)
def _prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    lam = params[P.lam]
    kind = int(params[P.concave])
    alpha, beta = params[P.alpha], params[P.beta]
    mode = int(params[P.similarity])
    lazy = params[P.greedy] == 0.0
    n_prompt = k.shape[0]
    full = n_prompt <= FULL_MATRIX_MAX
    S = np.empty((n_prompt if full else 0, n_prompt if full else 0), np.float64)
    if n_prompt > 0 and head_state.shape[1] == n_prompt:     # a replay's importance table (replay_head_state)
        importance = head_state.copy()
    else:
        importance = prompt_attention(q, k, scale, int(params[P.group_reduce]))
    for h in range(k.shape[1]):
        m = importance[h]
        recent = recent_slots(budget[h], params[P.recent_ratio])
        forced = np.zeros(n_prompt, np.uint8)
        forced[max(0, n_prompt - recent):] = 1
        inset = np.zeros(n_prompt, np.uint8)
        if full:
            similarity_into(k[:, h, :], mode, S)
            sel, _ = greedy_select(S, m, budget[h], forced, lam, kind, alpha, beta, lazy)
            for e in sel:
                inset[e] = 1
            nn = np.zeros(n_prompt, np.float64)
            nn_pos = np.full(n_prompt, -1, np.int64)
            for i in range(n_prompt):
                if inset[i] == 0:
                    continue
                best, best_s = -1, 0.0
                for j in range(n_prompt):
                    if j != i and inset[j] != 0 and (best < 0 or S[i, j] > best_s):
                        best, best_s = j, S[i, j]
                nn[i], nn_pos[i] = best_s, best
        else:
            uT = unit_keys_t(k[:, h, :])
            if budget[h] >= n_prompt:
                inset[:] = 1            # the greedy would pick every key
            else:
                sel, _, _ = greedy_select_keys(uT, m, budget[h], forced, lam, kind, alpha, beta, lazy, mode)
                for e in sel:
                    inset[e] = 1
            nn, nn_pos = nearest_selected(uT, inset, mode)
        for i in range(n_prompt):
            keep[h, i] = inset[i]
            if inset[i] == 0:
                continue
            slot_state[h, i, F_ACC] = m[i]
            nrm = 0.0
            for x in range(k.shape[2]):
                nrm += np.float64(k[i, h, x]) ** 2
            slot_state[h, i, F_NORM] = np.sqrt(nrm)
            slot_state[h, i, F_NN] = nn[i]
            slot_state[h, i, F_NNPOS] = nn_pos[i]


@njit(cache=True)
def _nearest(keys, slot_state, positions, keep, h, i, n, mode):
    """Nearest neighbour (similarity, position) of slot i among the kept slots j != i (0, -1 when alone)."""
    best, best_pos = 0.0, -1
    ni = slot_state[h, i, F_NORM]
    dots = np.empty(n, np.float32)
    _dots_to(keys, h, i, n, dots)
    for j in range(n):
        if j == i or keep[h, j] == 0:
            continue
        s = kernel_sim(_cos_from(dots[j], ni, slot_state[h, j, F_NORM]), mode)
        if best_pos < 0 or s > best:
            best, best_pos = s, positions[h, j]
    return best, best_pos


@njit(cache=True)
def _admit(h, t, new, probs, keys, positions, slot_state, gmode, mode, dots):
    """The new token's arrival in head h's slots (the new one at slot ``new``): Alg. 2 line 5, this query's
    attention (over S_{t-1} + k_t) added to every slot's accumulated importance; the new key's norm; and nearest
    neighbours, the new key against every cached key (O(n d)): it becomes the nearest of the slots it is closer
    to, and gets its own."""
    n = new + 1
    for i in range(n):
        slot_state[h, i, F_ACC] += group_score(probs, h, i, gmode)
    nrm = 0.0
    for x in range(keys.shape[2]):
        nrm += np.float64(keys[h, new, x]) ** 2
    slot_state[h, new, F_NORM] = np.sqrt(nrm)
    nn, nn_pos = 0.0, -1
    _dots_to(keys, h, new, new, dots)
    for i in range(new):
        s = kernel_sim(_cos_from(dots[i], slot_state[h, i, F_NORM], slot_state[h, new, F_NORM]), mode)
        if slot_state[h, i, F_NNPOS] < 0 or s > slot_state[h, i, F_NN]:
            slot_state[h, i, F_NN] = s
            slot_state[h, i, F_NNPOS] = t
        if nn_pos < 0 or s > nn:
            nn, nn_pos = s, positions[h, i]
    slot_state[h, new, F_NN] = nn
    slot_state[h, new, F_NNPOS] = nn_pos


@njit(cache=True)
def _least_gain(h, n, live, hi_pos, keep, positions, slot_state, lam, kind, alpha, beta, ss):
    """Alg. 2 line 10: the kept candidate (position below ``hi_pos``) of least conditional gain g(k | S' \\ k) with
    V = S' (``live`` slots kept), or -1 when only protected slots are left."""
    m_tot = 0.0
    for i in range(n):
        if keep[h, i] != 0:
            m_tot += slot_state[h, i, F_ACC]
    phi_tot = concave(m_tot, kind, alpha, beta)
    worst, worst_g = -1, 0.0
    for i in range(n):
        if keep[h, i] == 0 or positions[h, i] >= hi_pos:
            continue
        imp = 0.0
        if phi_tot > 0.0:
            rest = concave_from(m_tot - slot_state[h, i, F_ACC], kind, alpha, beta, phi_tot)
            imp = (phi_tot - rest) / phi_tot
        fl = (ss - slot_state[h, i, F_NN]) / (live * ss) if slot_state[h, i, F_NNPOS] >= 0 else 1.0 / live
        gain = lam * fl + (1.0 - lam) * imp
        if worst < 0 or gain < worst_g:
            worst, worst_g = i, gain
    return worst


@kernel(STEP_SIG)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    lam = params[P.lam]
    kind = int(params[P.concave])
    alpha, beta = params[P.alpha], params[P.beta]
    mode = int(params[P.similarity])
    gmode = int(params[P.group_reduce])
    g_n = probs.shape[1]
    ss = self_sim(mode)
    gone = np.zeros(g_n, np.float64)
    dots = np.empty(keys.shape[1], np.float32)
    for h in range(lengths.shape[0]):
        n = lengths[h]
        new = n - 1
        _admit(h, t, new, probs, keys, positions, slot_state, gmode, mode, dots)
        excess = n - budget[h]
        if excess <= 0:
            continue
        hi_pos = t - recent_slots(budget[h], params[P.recent_ratio]) + 1
        for g in range(g_n):
            gone[g] = 0.0
        live = n
        while excess > 0:
            worst = _least_gain(h, n, live, hi_pos, keep, positions, slot_state, lam, kind, alpha, beta, ss)
            if worst < 0:    # only protected slots left (cannot happen while recent <= budget)
                break
            keep[h, worst] = 0
            live -= 1
            excess -= 1
            gone_pos = positions[h, worst]
            for g in range(g_n):
                gone[g] += probs[h, g, worst]
            # line 14: the kept new key's attention renormalised over S_t
            if keep[h, new] != 0:
                acc = 0.0
                for g in range(g_n):
                    p = probs[h, g, new] / (1.0 - gone[g]) if gone[g] < 1.0 else 0.0
                    if gmode == 2:
                        acc = p if g == 0 or p > acc else acc
                    else:
                        acc += p
                slot_state[h, new, F_ACC] = acc / g_n if gmode == 0 else acc
            # slots whose nearest neighbour just left look for a new one
            for i in range(n):
                if keep[h, i] != 0 and slot_state[h, i, F_NNPOS] == gone_pos:
                    s, p = _nearest(keys, slot_state, positions, keep, h, i, n, mode)
                    slot_state[h, i, F_NN] = s
                    slot_state[h, i, F_NNPOS] = p


def objective(keys: np.ndarray, importance: np.ndarray, subset, ground=None, *, lam: float = 0.3,
              concave_kind: str = "power", alpha: float = 0.04, beta: float = 1.0,
              similarity: str = "relu_cos") -> float:
    """g_lam(subset) of eq. 4 over the ground set ``ground`` (default all rows of keys [n, d]); for tests/eval."""
    n = keys.shape[0]
    ground = np.arange(n) if ground is None else np.asarray(list(ground), dtype=np.int64)
    subset = np.asarray(list(subset), dtype=np.int64)
    mode = SIMILARITY.index(similarity)
    kind = CONCAVE.index(concave_kind)
    S = similarity_matrix(np.ascontiguousarray(keys, dtype=np.float64), mode)
    fl = S[np.ix_(ground, subset)].max(axis=1).sum() / np.diag(S)[ground].sum() if len(subset) else 0.0
    phi_tot = concave(float(importance[ground].sum()), kind, alpha, beta)
    imp = concave(float(importance[subset].sum()), kind, alpha, beta) / phi_tot if phi_tot > 0 else 0.0
    return float(lam * fl + (1.0 - lam) * imp)


@register
class BumbleBee(Policy):
    """Keep a diverse and important summary: greedy submodular selection on the prompt (Alg. 1), then per
    decode step drop the key with the smallest conditional gain of the diversity/importance mixture (Alg. 2).
    Defaults follow the paper's LongBench setting (lam = 0.3, power concave alpha = 0.04, beta = 1, ReLU cosine).
    """

    name = "bumblebee"
    reads_values = False
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"lam": (0.3, 0.0, 0.6)}
    summary = "submodular diversity + importance"
    schema = SCHEMA
    P = P
    slot_fields = 4
    step_fn = _step
    prefill_fn = _prefill

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(recent=int(recent_slots(budget, self.params["recent_ratio"])))

    def replay_head_state(self, n_kv_heads: int, head_dim: int, layer: Any, memo: dict | None = None,
                          n_prompt: int = 0) -> np.ndarray:
        """Every prompt key's importance [Hkv, n_prompt] (``prompt_attention``, O(P^2 G d), most of a replay's
        time): it depends on the trace and ``group_reduce`` only, so it is the trace table
        ``policies.core.shared_kernels.prompt_attention_table`` (computed once per trace, shared with BUZZ); the prefill reads it
        (the same bits) instead of recomputing. The closed loop's head state has no columns, and its prefill
        computes the importance itself."""
        if n_prompt < 1:
            return super().replay_head_state(n_kv_heads, head_dim, layer, memo, n_prompt)
        mode = int(self.param_vector(layer.attention)[P.group_reduce])
        return prompt_attention_table(layer, memo, n_prompt, mode)
