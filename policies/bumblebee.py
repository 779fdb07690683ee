"""BumbleBee (Kumari et al., 2024): submodular mixture of key diversity and accumulated-attention importance.

Objective (eq. 4): g(A) = lam * f_FL(A) + (1 - lam) * c(A) over a ground set V of keys of one KV head, with
  f_FL(A) = sum_{v in V} max_{a in A} sim(v, a) / sum_{v in V} sim(v, v)      (eq. 2, normalised: f_FL(V) = 1)
  c(A)    = phi(sum_{a in A} m(a)) / phi(sum_{v in V} m(v))                   (eq. 3, |U| = 1, c(V) = 1)
where sim is ReLU-truncated cosine similarity of keys (Appx. D; 1 + cos and |cos| also exposed), m is the
attention a key accumulated and phi is log(1 + x) or the inverse of g(y) = alpha * y**(1/alpha) + beta * y.

Prompt (Alg. 1, ``prefill_fn``): V = the prompt keys, m = causal attention accumulated over all prompt queries,
greedy maximisation of g under |S| <= budget (lazy/Minoux greedy by default: the same picks as the naive greedy;
the paper's stochastic greedy with eps = 1e-5 samples nearly all of V per pick, so it is not offered). It builds
the P x P similarity matrix: O(P^2 d) time and 8 P^2 bytes per head at a time.
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

import numpy as np
from numba import njit

from policies.base import PREFILL_SIG, STEP_SIG, Guarantees, Param, Policy, kernel, param_indices
from policies.kernels import GROUP_REDUCE, causal_attention_scores, group_score
from policies.scorer import recent_slots
from policies.registry import register

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
          doc="prompt greedy: lazy (Minoux) or naive; identical selections"),
)
P = param_indices(SCHEMA)
# slot_state fields
F_ACC, F_NN, F_NNPOS, F_NORM = range(4)


@njit(cache=True, inline="always")
def _ipow(y, n):
    """y**n for a small non-negative integer n by repeated squaring."""
    r = 1.0
    b = y
    while n > 0:
        if n & 1:
            r *= b
        b *= b
        n >>= 1
    return r


@njit(cache=True)
def concave_from(x, kind, alpha, beta, y_hi):
    """phi(x); for the power form, Newton from ``y_hi`` (any point with g(y_hi) >= x, or -1 for a safe start)."""
    if x <= 0.0:
        return 0.0
    if kind == 1:
        return np.log1p(x)
    p = 1.0 / alpha
    e = p - 1.0
    n_int = int(round(e))
    exact = abs(e - n_int) < 1e-9 and n_int < 64    # alpha = 0.04: y**24 by squaring, not pow (10x faster)
    y = y_hi
    if y < 0.0:
        y = (x / alpha) ** alpha
        if beta > 0.0 and x / beta < y:
            y = x / beta
    # g is increasing and convex on y >= 0: Newton from the right decreases monotonically onto the root
    for _ in range(200):
        yp1 = _ipow(y, n_int) if exact else y ** e
        f = alpha * yp1 * y + beta * y - x
        if f <= 0.0:
            break
        step = f / (yp1 + beta)
        y -= step
        if step <= 1e-14 * y:
            break
    return y


@njit(cache=True)
def concave(x, kind, alpha, beta):
    """phi(x) of eq. 3: kind 0 the inverse of alpha * y**(1/alpha) + beta * y (paper's power form), 1 log(1 + x)."""
    return concave_from(x, kind, alpha, beta, -1.0)


@njit(cache=True, inline="always")
def kernel_sim(cos, mode):
    """Similarity from cosine (clamped to [-1, 1] against rounding): 0 ReLU(cos) (paper), 1 1 + cos, 2 |cos|."""
    cos = min(1.0, max(-1.0, cos))
    if mode == 0:
        return cos if cos > 0.0 else 0.0
    if mode == 1:
        return 1.0 + cos
    return abs(cos)


@njit(cache=True, inline="always")
def self_sim(mode):
    return 2.0 if mode == 1 else 1.0


_VECTOR_MATH = {"reassoc", "contract"}   # lets LLVM vectorise the float32 dot products (as the engine does)


@njit(cache=True, fastmath=_VECTOR_MATH)
def _dots_to(keys, h, j, n, out):
    """out[i] = keys[h, i] . keys[h, j] for i < n, float32 SIMD: the O(n d) part of a step."""
    d = keys.shape[2]
    for i in range(n):
        acc = np.float32(0.0)
        for x in range(d):
            acc += keys[h, i, x] * keys[h, j, x]
        out[i] = acc


@njit(cache=True, inline="always")
def _cos_from(dot, ni, nj):
    if ni == 0.0 or nj == 0.0:
        return 0.0
    return np.float64(dot) / (ni * nj)


@njit(cache=True)
def similarity_matrix(k, mode):
    """sim of all pairs of rows of k [n, d] (float64 [n, n]; a zero key has cosine 0 with every other key)."""
    S = np.empty((k.shape[0], k.shape[0]), np.float64)
    similarity_into(k, mode, S)
    return S


@njit(cache=True)
def similarity_into(k, mode, S):
    """``similarity_matrix`` into S[:n, :n] (a buffer the prefill reuses for every head: no fresh 8 MB per head).

    The cosines are one GEMM of the normalised keys (BLAS) in the keys' own precision (float32 keys, as traces
    and caches hold them: SGEMM, ~3x a float64 one at d = 64; cosines to ~1e-7), symmetrised from the lower
    triangle in tiles.
    """
    n, d = k.shape
    u = np.zeros((n, d), k.dtype)
    for i in range(n):
        s = 0.0
        for x in range(d):
            s += np.float64(k[i, x]) ** 2
        if s > 0.0:
            inv = 1.0 / np.sqrt(s)
            for x in range(d):
                u[i, x] = np.float64(k[i, x]) * inv
    C = np.dot(u, u.T)
    B = 16       # tile by tile, so that the mirrored writes S[j, i] stay within a few pages
    for b0 in range(0, n, B):
        for c0 in range(0, b0 + 1, B):
            for i in range(b0, min(n, b0 + B)):
                for j in range(c0, min(i, c0 + B)):
                    s = kernel_sim(np.float64(C[i, j]), mode)
                    S[i, j] = s
                    S[j, i] = s
    for i in range(n):
        S[i, i] = self_sim(mode)


@njit(cache=True, fastmath=_VECTOR_MATH)
def _coverage_gain(S, e, cover):
    """sum_v max(0, S[e, v] - cover[v]): the facility-location gain of e before normalisation (SIMD)."""
    fl = 0.0
    for v in range(S.shape[0]):
        fl += max(S[e, v] - cover[v], 0.0)
    return fl


@njit(cache=True)
def _gain(S, e, cover, m_e, m_sel, phi_sel, lam, fl_norm, phi_tot, kind, alpha, beta):
    fl = _coverage_gain(S, e, cover)
    imp = 0.0
    if phi_tot > 0.0:
        imp = (concave(m_sel + m_e, kind, alpha, beta) - phi_sel) / phi_tot
    return lam * fl / fl_norm + (1.0 - lam) * imp


@njit(cache=True, inline="always")
def _before(a, b, bound):
    """Heap order of the lazy greedy: larger bound first, ties to the lower index (the naive scan's order)."""
    return bound[a] > bound[b] or (bound[a] == bound[b] and a < b)


@njit(cache=True)
def _sift_down(heap, n, i, bound):
    """Restore the max-heap ``heap[:n]`` below position i (after its item's bound changed or it was replaced)."""
    while True:
        top = i
        left = 2 * i + 1
        if left < n and _before(heap[left], heap[top], bound):
            top = left
        if left + 1 < n and _before(heap[left + 1], heap[top], bound):
            top = left + 1
        if top == i:
            return
        heap[i], heap[top] = heap[top], heap[i]
        i = top


@njit(cache=True)
def greedy_select(S, m, budget, forced, lam, kind, alpha, beta, lazy):
    """Alg. 1: greedy maximisation of g over V = rows of S with |selection| <= budget, ``forced`` items first.

    S [n, n] similarities, m [n] accumulated attention, forced [n] uint8 (kept unconditionally, e.g. a local
    window). ``lazy`` re-evaluates only the candidate with the highest stale upper bound (Minoux; a heap): same
    picks as the naive greedy (ties to the smaller index), far fewer gain evaluations. Returns (selected
    indices in pick order, number of gain evaluations).
    """
    n = S.shape[0]
    fl_norm = 0.0
    m_tot = 0.0
    for v in range(n):
        fl_norm += S[v, v]
        m_tot += m[v]
    phi_tot = concave(m_tot, kind, alpha, beta)
    cover = np.zeros(n, np.float64)
    chosen = np.zeros(n, np.uint8)
    order = np.empty(min(budget, n), np.int64)
    n_sel = 0
    m_sel = 0.0
    for e in range(n):
        if forced[e] != 0 and n_sel < order.shape[0]:
            chosen[e] = 1
            order[n_sel] = e
            n_sel += 1
            m_sel += m[e]
            for v in range(n):
                if S[e, v] > cover[v]:
                    cover[v] = S[e, v]
    phi_sel = concave(m_sel, kind, alpha, beta)
    bound = np.full(n, np.inf)
    stamp = np.full(n, -1, np.int64)
    # max-heap of the unchosen items by (stale bound, then lower index): its top is the scan's argmax
    heap = np.empty(n, np.int64)
    n_heap = 0
    for e in range(n):
        if chosen[e] == 0:
            heap[n_heap] = e
            n_heap += 1
    evals = 0
    it = 0
    while n_sel < order.shape[0]:
        best = -1
        if lazy:
            while True:
                best = heap[0]
                if stamp[best] == it:
                    n_heap -= 1
                    heap[0] = heap[n_heap]
                    _sift_down(heap, n_heap, 0, bound)
                    break
                bound[best] = _gain(S, best, cover, m[best], m_sel, phi_sel, lam, fl_norm, phi_tot, kind, alpha, beta)
                stamp[best] = it
                evals += 1
                _sift_down(heap, n_heap, 0, bound)     # a bound only changes at the top
        else:
            best_g = 0.0
            for e in range(n):
                if chosen[e] != 0:
                    continue
                g = _gain(S, e, cover, m[e], m_sel, phi_sel, lam, fl_norm, phi_tot, kind, alpha, beta)
                evals += 1
                if best < 0 or g > best_g:
                    best, best_g = e, g
        chosen[best] = 1
        order[n_sel] = best
        n_sel += 1
        m_sel += m[best]
        phi_sel = concave(m_sel, kind, alpha, beta)
        for v in range(n):
            if S[best, v] > cover[v]:
                cover[v] = S[best, v]
        it += 1
    return order[:n_sel], evals


@njit(cache=True)
def prompt_importance(q, k, scale, h, mode):
    """Attention each prompt key of KV head h accumulates over all prompt queries (Alg. 1 line 3): float64 [n_prompt].

    Per query row the G query heads' causal probabilities are reduced like ``group_score`` (mean/sum/max).
    Blocked GEMM tiles (``causal_attention_scores``), O(n_prompt^2 G d) time.
    """
    n_prompt, hq_n, _ = q.shape
    g_n = hq_n // k.shape[1]
    acc = np.zeros(n_prompt, np.float64)
    causal_attention_scores(q, k, scale, h * g_n, g_n, h, 0, n_prompt, mode, acc, np.zeros((1, 1)), 0)
    return acc


@kernel(PREFILL_SIG)
def _prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    lam = params[P.lam]
    kind = int(params[P.concave])
    alpha, beta = params[P.alpha], params[P.beta]
    mode = int(params[P.similarity])
    n_prompt = k.shape[0]
    S = np.empty((n_prompt, n_prompt), np.float64)
    for h in range(k.shape[1]):
        m = prompt_importance(q, k, scale, h, int(params[P.group_reduce]))
        similarity_into(k[:, h, :], mode, S)
        recent = recent_slots(budget[h], params[P.recent_ratio])
        forced = np.zeros(n_prompt, np.uint8)
        forced[max(0, n_prompt - recent):] = 1
        sel, _ = greedy_select(S, m, budget[h], forced, lam, kind, alpha, beta, params[P.greedy] == 0.0)
        inset = np.zeros(n_prompt, np.uint8)
        for e in sel:
            inset[e] = 1
        for i in range(n_prompt):
            keep[h, i] = inset[i]
            if inset[i] == 0:
                continue
            slot_state[h, i, F_ACC] = m[i]
            nrm = 0.0
            for x in range(k.shape[2]):
                nrm += np.float64(k[i, h, x]) ** 2
            slot_state[h, i, F_NORM] = np.sqrt(nrm)
            best, best_s = -1, 0.0
            for j in range(n_prompt):
                if j != i and inset[j] != 0 and (best < 0 or S[i, j] > best_s):
                    best, best_s = j, S[i, j]
            slot_state[h, i, F_NN] = best_s
            slot_state[h, i, F_NNPOS] = best


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
        # Alg. 2 line 5: accumulate this query's attention (over S_{t-1} + k_t) into every slot
        for i in range(n):
            slot_state[h, i, F_ACC] += group_score(probs, h, i, gmode)
        nrm = 0.0
        for x in range(keys.shape[2]):
            nrm += np.float64(keys[h, new, x]) ** 2
        slot_state[h, new, F_NORM] = np.sqrt(nrm)
        # nearest neighbours: the new key against every cached key, O(n d)
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
        excess = n - budget[h]
        if excess <= 0:
            continue
        recent = recent_slots(budget[h], params[P.recent_ratio])
        hi_pos = t - recent + 1
        for g in range(g_n):
            gone[g] = 0.0
        live = n
        while excess > 0:
            # Alg. 2 line 10: argmin_k g(k | S' \ k) with V = S'
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
    summary = "submodular diversity + importance"
    schema = SCHEMA
    P = P
    slot_fields = 4
    step_fn = _step
    prefill_fn = _prefill

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(recent=int(recent_slots(budget, self.params["recent_ratio"])))
