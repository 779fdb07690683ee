"""D2O (Wan et al., 2024): layer budgets by prompt-attention variance, sinks + heavy hitters + recent window,
and EMA-thresholded weighted merging of evicted tokens into their most similar kept token.

Layer level (eq. 4-5): F_v^l = Var over columns of the prompt attention's column sums; S_l = softmax(-F_v)_l
* L * budget (budget = rho * S). Token level (eq. 6-8): accumulated attention; keep T = ``n_sinks`` sinks,
the M = ``recent_ratio`` share of the rest as recent window (N:M = 3:1 -> 0.25) and the top N by score.
Merging (eq. 9-12): each evicted key's nearest kept key by cosine similarity u*; EMA threshold
tau_t = beta * u*_t + (1 - beta) tau_{t-1} (the first eviction initialises tau to the mean u*); an evicted
token with u* < tau is dropped, otherwise folded into its nearest kept slot j with softmax-over-similarity
weights w_c = e / (e + sum_i exp(u_ij)), w_e,i = exp(u_ij) / (e + sum_i exp(u_ij)) for keys and values.

Ambiguities, chosen and documented (parameterised where reasonable people differ):
  - eq. 12 writes w_e with the whole sum in the numerator; we give each evicted token its own exp(u_ij)
    (weights sum to 1, GAT-style, e = exp(1) being the conserved token's self-similarity). With one
    evicted token per step (the streaming case) both readings coincide. ``merge_weights="average"`` is the
    Table 8 ablation (equal weights 1 / (1 + count)).
  - tau is per KV head (head_state); it is updated with the current step's u* before the comparison (for
    beta < 1 this equals comparing u* with tau_{t-1}); several evicted tokens in one step use their mean u*.
    ``ema_threshold=False`` merges every evicted token (Table 6 "w.o. EMA-Threshold").
  - the prompt is streamed through ``step`` (the engine's prefill hook cannot merge), so the prompt scores
    are the causal accumulated attention and tau starts at the first eviction rather than on the prompt.
  - F_v is the mean over the layer's query heads of each head's variance (population variance); the
    prompt attention is causal. ``var_scale`` multiplies F_v inside the softmax (1 = paper; F_v of long
    prompts is large, so the literal softmax can give almost all memory to one layer). Budgets are clamped
    at ``min_budget`` (mass re-spread over the other layers) and rounded by largest remainder so that the
    total is exactly budget * L * Hkv. No re-allocation when budget >= prompt length (rho >= 1).
    ``cap_at_prompt`` (default on, not in the paper) caps S_l at the prompt length S (alpha_l <= 1) and gives
    the excess to the other layers: the literal eq. 5 can hand one layer more slots than the sequence has
    (measured on the shipped model: 1891 slots for a 1536-token trace at rho = 0.8), which is wasted memory.
  - n_sinks: the paper keeps "T" sink tokens without a value; 4 follows StreamingLLM.
  - a merged slot keeps its own accumulated score (the paper does not say how scores merge).
Keys are the cache's post-RoPE keys, as the authors' implementation sees them.

slot_state: [0] accumulated attention. head_state: [0] tau, [1] 1 once tau is initialised.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from numba import njit

from policies.base import STEP_SIG, Guarantees, Param, Policy
from policies.kernels import GROUP_REDUCE, causal_column_sums, evict_lowest, group_score
from policies.registry import register

MERGE_WEIGHTS = ("weighted", "average")
_SINKS, _RECENT, _BETA, _MERGE, _EMA, _WEIGHTS, _LAYER, _VSCALE, _CAP, _REDUCE = range(10)


def split_budget(budget: int, n_sinks: int, recent_ratio: float) -> tuple[int, int, int]:
    """(T, N, M) for a per-head budget: sinks, heavy hitters, recent window (M >= 1, T + N + M = budget)."""
    t = min(n_sinks, budget - 1)
    avail = budget - t
    m = min(avail, max(1, int(round(avail * recent_ratio))))
    return t, avail - m, m


def merge_weights(sims: np.ndarray, weighted: bool = True) -> tuple[float, np.ndarray]:
    """(w_c, w_e[i]) for a conserved token receiving evicted tokens with cosine similarities ``sims`` (eq. 12)."""
    sims = np.asarray(sims, np.float64)
    if not weighted:
        w = 1.0 / (1 + len(sims))
        return w, np.full(len(sims), w)
    ex = np.exp(sims)
    den = ex.sum() + math.e
    return math.e / den, ex / den


def layer_variances(prompt_layers: Sequence[tuple[np.ndarray, np.ndarray]], scale: float) -> np.ndarray:
    """F_v^l (eq. 4): per layer, the mean over query heads of the variance of the prompt attention column sums."""
    out = np.zeros(len(prompt_layers))
    for layer, (q, k) in enumerate(prompt_layers):
        q = np.ascontiguousarray(q, np.float32)
        k = np.ascontiguousarray(k, np.float32)
        p, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
        g = hq // hkv
        out[layer] = np.mean([causal_column_sums(q, k, scale, j, j // g, 0, p).var() for j in range(hq)])
    return out


def allocate_layers(budget: int, variances: np.ndarray, min_budget: int, var_scale: float = 1.0,
                    max_budget: int | None = None) -> np.ndarray:
    """Per-layer budgets S_l = softmax(-var_scale F_v) * L * budget (eq. 5), clamped to [min_budget, max_budget]
    with the excess or shortfall re-spread proportionally over the free layers; rounded so sum = budget * L."""
    n = len(variances)
    total = budget * n
    hi = np.inf if max_budget is None else max(max_budget, budget)   # a cap below the mean cannot hold the total
    z = -var_scale * np.asarray(variances, np.float64)
    alpha = np.exp(z - z.max())
    alpha /= alpha.sum()
    ideal = alpha * total
    fixed = np.zeros(n, bool)
    while True:
        out_lo = ~fixed & (ideal < min_budget)
        out_hi = ~fixed & (ideal > hi)
        if not (out_lo.any() or out_hi.any()):
            break
        # clamp the worse side first so that clamping one side never pushes the other past its bound
        clamp = out_lo if (min_budget - ideal[out_lo]).sum() >= (ideal[out_hi] - hi).sum() else out_hi
        ideal[clamp] = min_budget if clamp is out_lo else hi
        fixed |= clamp
        free = total - ideal[fixed].sum()
        w = alpha[~fixed]
        if (~fixed).any():
            ideal[~fixed] = w / w.sum() * free if w.sum() > 0 else free / (~fixed).sum()
    floor = np.floor(ideal + 1e-9)
    out = floor.astype(np.int64)
    short = total - int(out.sum())
    order = np.argsort(-(ideal - floor), kind="stable")
    for layer in order[:max(0, short)]:
        out[layer] += 1
    return out


@njit(cache=True)
def _cosine(keys, h, a, b):
    d = keys.shape[2]
    dot = 0.0
    na = 0.0
    nb = 0.0
    for x in range(d):
        ka = np.float64(keys[h, a, x])
        kb = np.float64(keys[h, b, x])
        dot += ka * kb
        na += ka * ka
        nb += kb * kb
    if na == 0.0 or nb == 0.0:
        return 0.0
    return dot / math.sqrt(na * nb)


@njit(cache=True)
def _merge_head(params, h, n, keys, head_state, keep, merge_to, merge_w, evicted, near, sim):
    """Match each evicted slot of head h to its nearest kept slot, apply the EMA threshold, set merges."""
    beta = params[_BETA]
    use_ema = params[_EMA] != 0.0
    weighted = int(params[_WEIGHTS]) == 0
    ne = 0
    for i in range(n):
        if keep[h, i] == 0:
            evicted[ne] = i
            ne += 1
    if ne == 0:
        return
    mean_u = 0.0
    for e in range(ne):
        best = -1
        bu = -2.0
        for j in range(n):
            if keep[h, j] == 0:
                continue
            u = _cosine(keys, h, evicted[e], j)
            if u > bu:
                bu = u
                best = j
        near[e] = best
        sim[e] = bu
        mean_u += bu
    mean_u /= ne
    if head_state[h, 1] == 0.0:
        head_state[h, 0] = mean_u
        head_state[h, 1] = 1.0
    else:
        head_state[h, 0] = beta * mean_u + (1.0 - beta) * head_state[h, 0]
    tau = head_state[h, 0]
    # denominators per receiving slot: merge_w[h, j] temporarily accumulates sum exp(u) (or the count)
    for e in range(ne):
        if near[e] < 0 or (use_ema and sim[e] < tau):
            near[e] = -1
            continue
        j = near[e]
        if merge_to[h, j] != -2:
            merge_to[h, j] = -2          # marks j as a receiver while the sums are built
            merge_w[h, j] = 0.0
        merge_w[h, j] += math.exp(sim[e]) if weighted else 1.0
    for e in range(ne):
        j = near[e]
        if j < 0:
            continue
        den = merge_w[h, j] + (math.e if weighted else 1.0)
        merge_to[h, evicted[e]] = j
        merge_w[h, evicted[e]] = (math.exp(sim[e]) if weighted else 1.0) / den
    for e in range(ne):
        j = near[e]
        if j >= 0 and merge_to[h, j] == -2:
            den = merge_w[h, j] + (math.e if weighted else 1.0)
            merge_w[h, j] = (math.e if weighted else 1.0) / den
            merge_to[h, j] = -1


@njit(STEP_SIG, cache=True)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    n_sinks = int(params[_SINKS])
    ratio = params[_RECENT]
    mode = int(params[_REDUCE])
    cap = keys.shape[1]
    evicted = np.empty(cap, np.int64)
    near = np.empty(cap, np.int64)
    sim = np.empty(cap, np.float64)
    for h in range(lengths.shape[0]):
        n = lengths[h]
        for i in range(n):
            slot_state[h, i, 0] += group_score(probs, h, i, mode)
        b = budget[h]
        if n <= b:
            continue
        sinks = min(n_sinks, b - 1)
        avail = b - sinks
        recent = min(avail, max(1, int(round(avail * ratio))))
        evict_lowest(slot_state[h, :, 0], positions[h], n, n - b, sinks, t - recent + 1, keep[h])
        if params[_MERGE] != 0.0:
            _merge_head(params, h, n, keys, head_state, keep, merge_to, merge_w, evicted, near, sim)


@register
class D2O(Policy):
    """D2O: variance-based layer budgets, sinks + accumulated-attention heavy hitters + recent window (N:M = 3:1),
    and EMA-thresholded similarity-weighted merging of evicted tokens (see the module docstring)."""

    name = "d2o"
    summary = "layer budgets by attention variance + H2O-style eviction + EMA-threshold merging"
    schema = (
        Param("n_sinks", 4, "int", 0, 64, doc="T: initial attention-sink tokens always kept"),
        Param("recent_ratio", 0.25, "float", 0.0, 1.0, doc="M / (N + M); N:M = 3:1 in the paper"),
        Param("beta", 0.7, "float", 0.0, 1.0, doc="EMA smoothing of the similarity threshold (paper: 0.5-0.9)"),
        Param("merge", True, "bool", doc="merge evicted tokens (False: eviction only)"),
        Param("ema_threshold", True, "bool", doc="drop evicted tokens below the EMA threshold (False: merge all)"),
        Param("merge_weights", "weighted", "choice", choices=MERGE_WEIGHTS, doc="eq. 12 weights or plain average"),
        Param("layer_alloc", True, "bool", doc="variance-based layer budgets (False: uniform)"),
        Param("var_scale", 1.0, "float", 0.0, 1e6, searchable=False,
              doc="multiplier of F_v in the layer softmax (1 = paper)"),
        Param("cap_at_prompt", True, "bool", searchable=False,
              doc="no layer gets more than the prompt length (alpha_l <= 1); the excess goes to the other layers"),
        Param("group_reduce", "mean", "choice", choices=GROUP_REDUCE, doc="GQA aggregation of query heads"),
    )
    slot_fields = 1
    head_fields = 2
    step_fn = _step

    def min_budget(self) -> int:
        return self.params["n_sinks"] + 1

    def guarantees(self, budget: int) -> Guarantees:
        # with layer allocation a layer may get only min_budget slots: then one recent slot is all that is promised
        b = self.min_budget() if self.params["layer_alloc"] else budget
        return Guarantees(sinks=self.params["n_sinks"], recent=split_budget(b, self.params["n_sinks"],
                                                                            self.params["recent_ratio"])[2])

    def allocate(self, budget: int, n_kv_heads: int, prompt_layers: Sequence[tuple[np.ndarray, np.ndarray]],
                 scale: float) -> np.ndarray:
        n_layers = len(prompt_layers)
        n_prompt = prompt_layers[0][0].shape[0] if prompt_layers else 0
        if not self.params["layer_alloc"] or n_layers <= 1 or n_prompt < 2 or budget >= n_prompt:
            return np.full((n_layers, n_kv_heads), budget, np.int64)
        var = layer_variances(prompt_layers, scale)
        cap = n_prompt if self.params["cap_at_prompt"] else None
        per_layer = allocate_layers(budget, var, self.min_budget(), self.params["var_scale"], cap)
        return np.repeat(per_layer[:, None], n_kv_heads, axis=1)
