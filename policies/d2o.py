"""D2O (Wan et al., 2024): layer budgets by prompt-attention variance, sinks + heavy hitters + recent window,
and EMA-thresholded weighted merging of evicted tokens into their most similar kept token.

Layer level (eq. 4-5): F_l from the variance over keys of the prompt attention's column sums; S_l =
softmax(-F)_l * L * budget (budget = rho * S). Token level (eq. 6-8): accumulated attention; keep T = ``n_sinks``
sinks, the M = ``recent_ratio`` share of the rest as recent window (N:M = 3:1 -> 0.25) and the top N by score.
Merging (eq. 9-12): each evicted key's nearest kept key by cosine similarity u*; EMA threshold
tau_t = beta * u*_t + (1 - beta) tau_{t-1} (the first eviction initialises tau to the mean u*); an evicted
token with u* < tau is dropped, otherwise folded into its nearest kept slot j with softmax-over-similarity
weights w_c = e / (e + sum_i exp(u_ij)), w_e,i = exp(u_ij) / (e + sum_i exp(u_ij)) for keys and values.

Layer allocation, the default and why (``alloc``):
  - ``normalized`` (default, the authors' released code, AIoT-MLSys-Lab/D2O): per query head the variance
    (unbiased, as torch's ``var``) over keys of the prompt attention's column sums; min-max normalised across
    the layer's query heads (``(v - min) / (max - min + 1e-6)``); their mean is F_l in [0, 1). Then
    softmax(-F)_l * L * budget, kept in [max(min_budget, 0.01 * S), S] (S = prompt length). The softmax of
    values in [0, 1) can move at most a factor e between layers, so no layer is starved.
  - ``literal``: eq. 4 as printed, F_l = mean over query heads of the raw (population) variance, times
    ``var_scale``. On a pretrained model a sink column holds about half of every row, so F_l is in the hundreds
    and the softmax hands nearly the whole budget to one layer (SmolLM2-135M, budget 128: error 0.92 vs 0.27
    with uniform budgets). Kept as a value for the ablation.
  In both, clamped budgets re-spread the excess or shortfall over the free layers and are rounded by largest
  remainder so that the total stays exactly budget * L * Hkv (kvsim's equal-memory comparison; the released
  code clamps the ratio to [0.01, 1] without re-spreading). ``cap_at_prompt`` (default on) is the upper clamp
  at S. No re-allocation when budget >= S. ``exempt_layers`` (released code, off by default): layers 0, 1 and
  L-1 are never compressed; the others keep their softmax share, so the total memory exceeds budget * L (off
  by default for that reason: it is not an equal-memory comparison).

Other ambiguities, chosen and documented (parameterised where reasonable people differ):
  - eq. 12 writes w_e with the whole sum in the numerator; we give each evicted token its own exp(u_ij)
    (weights sum to 1, GAT-style, e = exp(1) being the conserved token's self-similarity). With one
    evicted token per step (the streaming case) both readings coincide. ``merge_weights="average"`` is the
    Table 8 ablation (equal weights 1 / (1 + count)); ``"released"`` is the released code's scatter-mean of
    similarity-scaled keys, (k_c + sum_i u_i k_i) / (1 + n) (weights do not sum to 1).
  - ``ema_scope="head"``: tau is per KV head (head_state); it is updated with the current step's u* before the
    comparison (for beta < 1 this equals comparing u* with tau_{t-1}); several evicted tokens in one step use
    their mean u*. ``"layer"`` (released code): one tau per layer, updated with the mean u* over heads and
    evicted tokens, and the r-th evicted token of every head (in position order) is merged when the mean over
    heads of their u* clears tau (``>=``). ``ema_threshold=False`` merges every evicted token (Table 6).
  - ``prompt="stream"`` (default): the prompt is streamed through ``step``, so the prompt scores are the causal
    accumulated attention and tau starts at the first eviction. ``"once"`` (released code): the prompt is
    selected once from its full column sums; the released code does this at the first decode step with that
    step's attention row added, kvsim at the end of the prompt (the engine's prefill hook), and the tokens it
    drops there are not merged (the prefill hook cannot merge; the released code merges them).
  - ``sinks_in_hh`` (released code): the recent window is ``recent_ratio`` of the whole budget and the sinks
    are part of the heavy-hitter share; otherwise (paper reading) the sinks come first and the ratio splits
    the rest.
  - n_sinks: the paper keeps "T" sink tokens without a value; 4 follows StreamingLLM and the released code.
  - a merged slot keeps its own accumulated score (the paper does not say how scores merge; so does the code).
``preset=reference`` fills every parameter not given explicitly with the released code's value
(``REFERENCE``): normalized allocation with exempt layers, prompt once, sinks in the heavy-hitter share with a
1:1 split (its run scripts' hh_ratio = recent_ratio), beta 0.5, one tau per layer, released merge weights.
Two differences the preset does not reproduce: the released code floors each half of a layer's budget S (heavy
hitters and recent window get floor(S / 2) each, so it holds 2 floor(S / 2), one slot less at odd S; kvsim keeps
S), and under GQA it keeps one cache per *query* head (each query head evicts and merges on its own and the
group's keys are stored G times); kvsim decides per KV head with ``group_reduce`` over its query group.
Keys are the cache's post-RoPE keys, as the authors' implementation sees them.

slot_state: [0] accumulated attention. head_state: [0] tau, [1] 1 once tau is initialised (head 0 holds the
layer's tau when ``ema_scope="layer"``).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from numba import njit

from policies.core.base import (PREFILL_SIG, STEP_SIG, Guarantees, Param, Policy, compiled, kernel, param_indices,
                           prompt_memo, stream_prefill)
from policies.core.shared_kernels import GROUP_REDUCE, evict_lowest, evict_lowest_sorted, group_rows_scores, group_score
from policies.core.registry import register

MERGE_WEIGHTS = ("weighted", "average", "released")
ALLOC = ("normalized", "literal")
EMA_SCOPE = ("head", "layer")
PROMPT = ("stream", "once")
PRESETS = ("paper", "reference")
#: the released code's values, applied by ``preset=reference`` to every parameter not given explicitly
REFERENCE = dict(alloc="normalized", exempt_layers=True, prompt="once", sinks_in_hh=True, recent_ratio=0.5,
                 beta=0.5, ema_scope="layer", merge_weights="released")
#: per-head budget of a layer that is never compressed (``exempt_layers``): larger than any trace
UNCOMPRESSED = 1 << 40

SCHEMA = (
    Param("n_sinks", 4, "int", 0, 64, doc="T: initial attention-sink tokens always kept"),
    Param("recent_ratio", 0.25, "float", 0.0, 1.0, doc="M / (N + M); N:M = 3:1 in the paper"),
    Param("beta", 0.7, "float", 0.0, 1.0, doc="EMA smoothing of the similarity threshold (paper: 0.5-0.9)"),
    Param("merge", True, "bool", doc="merge evicted tokens (False: eviction only)"),
    Param("ema_threshold", True, "bool", doc="drop evicted tokens below the EMA threshold (False: merge all)"),
    Param("merge_weights", "weighted", "choice", choices=MERGE_WEIGHTS,
          doc="eq. 12 weights, plain average, or the released (k_c + sum u_i k_i) / (1 + n)"),
    Param("layer_alloc", True, "bool", doc="variance-based layer budgets (False: uniform)"),
    Param("alloc", "normalized", "choice", choices=ALLOC,
          doc="F_l: per-head min-max normalised variance (released code) or the raw variance (eq. 4 literally)"),
    Param("var_scale", 1.0, "float", 0.0, 1e6, searchable=False,
          doc="multiplier of F_l in the layer softmax (1 = paper)"),
    Param("cap_at_prompt", True, "bool", searchable=False,
          doc="no layer gets more than the prompt length (alpha_l <= 1); the excess goes to the other layers"),
    Param("exempt_layers", False, "bool", searchable=False,
          doc="layers 0, 1 and L-1 are never compressed (released code; exceeds the total budget)"),
    Param("group_reduce", "mean", "choice", choices=GROUP_REDUCE, doc="GQA aggregation of query heads"),
    Param("prompt", "stream", "choice", choices=PROMPT,
          doc="prompt streamed through the decode rule, or selected once from its column sums (released)"),
    Param("sinks_in_hh", False, "bool", doc="sinks count in the heavy-hitter share (released code)"),
    Param("ema_scope", "head", "choice", choices=EMA_SCOPE,
          doc="one EMA threshold per KV head, or one per layer with head-mean merge decisions (released)"),
    Param("preset", "paper", "choice", choices=PRESETS, searchable=False,
          doc="reference: the released code's values for every parameter not given"),
)
P = param_indices(SCHEMA)


@njit(cache=True)
def head_split(budget, n_sinks, recent_ratio, sinks_in_hh):
    """(T, N, M) for a per-head budget: sinks, heavy hitters besides the sinks, recent window (M >= 1).

    Paper reading: the sinks come first and ``recent_ratio`` splits the rest; ``sinks_in_hh``: the ratio
    splits the whole budget and the sinks are part of the heavy-hitter share.
    """
    if sinks_in_hh:
        m = min(budget, max(1, int(round(budget * recent_ratio))))
        t = min(n_sinks, budget - m)
        return t, budget - m - t, m
    t = min(n_sinks, budget - 1)
    avail = budget - t
    m = min(avail, max(1, int(round(avail * recent_ratio))))
    return t, avail - m, m


def split_budget(budget: int, n_sinks: int, recent_ratio: float, sinks_in_hh: bool = False) -> tuple[int, int, int]:
    """(T, N, M) for a per-head budget: sinks, heavy hitters, recent window (M >= 1, T + N + M = budget)."""
    t, n, m = head_split(budget, n_sinks, recent_ratio, sinks_in_hh)
    return int(t), int(n), int(m)


def merge_weights(sims: np.ndarray, weighted: bool = True) -> tuple[float, np.ndarray]:
    """(w_c, w_e[i]) for a conserved token receiving evicted tokens with cosine similarities ``sims`` (eq. 12)."""
    sims = np.asarray(sims, np.float64)
    if not weighted:
        w = 1.0 / (1 + len(sims))
        return w, np.full(len(sims), w)
    ex = np.exp(sims)
    den = ex.sum() + math.e
    return math.e / den, ex / den


def prompt_column_sums(q: np.ndarray, k: np.ndarray, scale: float, tile: int = 128) -> np.ndarray:
    """Column sums of every query head's causal prompt attention: float64 [Hq, S].

    Column i is the attention token i receives from all prompt queries. Computed in query tiles with one
    float32 matrix product per (KV head, tile) over the query heads of its group (BLAS-sized blocks, O(G * tile
    * S) memory); only the tile's diagonal block needs the causal mask. Sums accumulate in float64.
    """
    q = np.asarray(q, np.float32)
    k = np.asarray(k, np.float32)
    s, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != s or hq % hkv or k.shape[2] != d:
        raise ValueError(f"prompt q {q.shape} and k {k.shape} do not match")
    g = hq // hkv
    out = np.zeros((hq, s), np.float64)
    upper = np.triu(np.full((tile, tile), -np.inf, np.float32), 1)
    for h in range(hkv):
        qg = np.ascontiguousarray(q[:, h * g:(h + 1) * g].transpose(1, 0, 2))      # [G, S, d]
        kt = np.ascontiguousarray(k[:, h].T)                                       # [d, S]
        for r0 in range(0, s, tile):
            r1 = min(s, r0 + tile)
            logits = qg[:, r0:r1] @ kt[:, :r1]                                       # [G, r1 - r0, r1]
            logits *= np.float32(scale)
            logits[:, :, r0:r1] += upper[:r1 - r0, :r1 - r0]
            logits -= logits.max(axis=2, keepdims=True)
            np.exp(logits, out=logits)
            logits /= logits.sum(axis=2, keepdims=True)
            out[h * g:(h + 1) * g, :r1] += logits.sum(axis=1, dtype=np.float64)
    return out


def layer_variances(prompt_layers: Sequence[tuple[np.ndarray, np.ndarray]], scale: float,
                    mode: str = "literal") -> np.ndarray:
    """F_l per layer from the prompt attention's column sums (see ``alloc`` in the module docstring).

    literal: the mean over query heads of each head's population variance (eq. 4). normalized: each head's
    unbiased variance, min-max normalised across the layer's heads, then averaged (F_l in [0, 1)).
    Long prompts over many layers run the layers side by side on as many threads as BLAS may use here (the
    caller's thread share, ``sim.replay.threads``), each with a one-thread BLAS: numpy releases the GIL in the
    products and the softmax, whose elementwise passes a multi-threaded BLAS leaves on one core (SmolLM2's 30
    layers at 7 936 prompt tokens: 32 -> 20-23 s of a first D2O replay on 2 cores). With fewer than
    ``_LAYERS_PER_THREAD`` layers a thread, the layers stay one at a time on the multi-threaded BLAS: Gemma-3's
    3 global layers (d 256, 32 k tokens) are GEMM-bound, and 3 layers on 2 threads leave a core idle for a third
    of the time (a first replay on 2 cores: 38-49 s threaded, 41-43 s one at a time, 2.1 GB peak against 2.0).
    Each layer's numbers are the serial ones, bit for bit.
    """
    if mode not in ALLOC:
        raise ValueError(f"unknown variance mode {mode!r}; one of {ALLOC}")

    def variance(layer: tuple[np.ndarray, np.ndarray]) -> float:
        sums = prompt_column_sums(layer[0], layer[1], scale)
        if mode == "literal":
            return float(sums.var(axis=1).mean())
        v = sums.var(axis=1, ddof=1) if sums.shape[1] > 1 else np.zeros(sums.shape[0])
        return float(((v - v.min()) / (v.max() - v.min() + 1e-6)).mean())

    long = bool(prompt_layers) and prompt_layers[0][0].shape[0] >= _THREADED_FROM
    threads = min(len(prompt_layers) // _LAYERS_PER_THREAD, _blas_threads()) if long else 1
    if threads < 2:
        return np.array([variance(layer) for layer in prompt_layers], np.float64)
    from concurrent.futures import ThreadPoolExecutor
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(threads) as pool:   # a layer read per task
        return np.array(list(pool.map(lambda j: variance(prompt_layers[j]), range(len(prompt_layers)))), np.float64)


#: prompt length from which ``layer_variances`` runs layers side by side (below it a layer takes milliseconds)
_THREADED_FROM = 2048
#: fewest layers per thread for which ``layer_variances`` runs layers side by side (fewer: a core idles at the end)
_LAYERS_PER_THREAD = 4


def _blas_threads() -> int:
    """The threads BLAS may use in this process now (its pools as capped by the caller), 1 when none is loaded."""
    from threadpoolctl import threadpool_info
    counts = [int(p["num_threads"]) for p in threadpool_info() if p.get("user_api") == "blas"]
    return max(1, min(counts)) if counts else 1


def allocate_layers(budget: int, variances: np.ndarray, min_budget: int, var_scale: float = 1.0,
                    max_budget: int | None = None) -> np.ndarray:
    """Per-layer budgets S_l = softmax(-var_scale F) * L * budget (eq. 5), clamped to [min_budget, max_budget]
    with the excess or shortfall re-spread proportionally over the free layers; rounded so sum = budget * L."""
    n = len(variances)
    total = budget * n
    hi = np.inf if max_budget is None else max(max_budget, budget)   # a cap below the mean cannot hold the total
    lo = min(min_budget, budget)
    z = -var_scale * np.asarray(variances, np.float64)
    alpha = np.exp(z - z.max())
    alpha /= alpha.sum()
    ideal = alpha * total
    fixed = np.zeros(n, bool)
    while True:
        out_lo = ~fixed & (ideal < lo)
        out_hi = ~fixed & (ideal > hi)
        if not (out_lo.any() or out_hi.any()):
            break
        # clamp the worse side first so that clamping one side never pushes the other past its bound
        clamp = out_lo if (lo - ideal[out_lo]).sum() >= (ideal[out_hi] - hi).sum() else out_hi
        ideal[clamp] = lo if clamp is out_lo else hi
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


@njit(cache=True, fastmath={"reassoc", "contract"})   # SIMD over d (rounding-level differences)
def _dot64(keys, h, a, b):
    """keys[h, a] . keys[h, b] accumulated in float64."""
    acc = 0.0
    for x in range(keys.shape[2]):
        acc += np.float64(keys[h, a, x]) * np.float64(keys[h, b, x])
    return acc


#: slot state fields: the accumulated attention score, and the key's norm (0 = not known: a new slot, or one that
#: received a merge and so has a new key)
F_SCORE, F_NORM = 0, 1


@njit(cache=True, fastmath={"reassoc", "contract"})   # SIMD over d (rounding-level differences)
def _key_dots(keys, h, a, n, af, out):
    """out[j] = keys[h, a] . keys[h, j] accumulated in float64 for j < n (af: float64 scratch [d]): the evicted key
    converted once, four keys per pass sharing its loads, so that the scan of the kept keys runs at SIMD speed
    rather than one short reduction per pair."""
    d = keys.shape[2]
    for x in range(d):
        af[x] = np.float64(keys[h, a, x])
    j = 0
    while j + 4 <= n:
        s0 = 0.0
        s1 = 0.0
        s2 = 0.0
        s3 = 0.0
        for x in range(d):
            ax = af[x]
            s0 += ax * np.float64(keys[h, j, x])
            s1 += ax * np.float64(keys[h, j + 1, x])
            s2 += ax * np.float64(keys[h, j + 2, x])
            s3 += ax * np.float64(keys[h, j + 3, x])
        out[j] = s0
        out[j + 1] = s1
        out[j + 2] = s2
        out[j + 3] = s3
        j += 4
    while j < n:
        acc = 0.0
        for x in range(d):
            acc += af[x] * np.float64(keys[h, j, x])
        out[j] = acc
        j += 1


@njit(cache=True)
def _nearest(h, n, keys, keep, evicted, near, sim, slot_state):
    """List head h's evicted slots (slot order = position order) with their nearest kept slot and its cosine
    similarity (0 against a zero key); returns how many. A key's norm is computed when first needed and kept in
    its slot state (``F_NORM``)."""
    ne = 0
    for i in range(n):
        if keep[h, i] == 0:
            evicted[h, ne] = i
            ne += 1
    if ne == 0:
        return 0
    norms = slot_state[h, :, F_NORM]
    for i in range(n):
        if norms[i] == 0.0:
            norms[i] = math.sqrt(_dot64(keys, h, i, i))
    af = np.empty(keys.shape[2], np.float64)
    dots = np.empty(n, np.float64)
    for e in range(ne):
        a = evicted[h, e]
        _key_dots(keys, h, a, n, af, dots)
        best = -1
        bu = -2.0
        for j in range(n):
            if keep[h, j] == 0:
                continue
            u = dots[j] / (norms[a] * norms[j]) if norms[a] > 0.0 and norms[j] > 0.0 else 0.0
            if u > bu:
                bu = u
                best = j
        near[h, e] = best
        sim[h, e] = bu
    return ne


@njit(cache=True)
def _ema(head_state, h, beta, mean_u):
    """Update and return the EMA threshold stored in head_state[h] (initialised to the first mean)."""
    if head_state[h, 1] == 0.0:
        head_state[h, 0] = mean_u
        head_state[h, 1] = 1.0
    else:
        head_state[h, 0] = beta * mean_u + (1.0 - beta) * head_state[h, 0]
    return head_state[h, 0]


@njit(cache=True)
def _assign_merges(params, h, ne, evicted, near, sim, merge_to, merge_w, slot_state):
    """Write the merges of head h's evicted slots whose ``near`` is still >= 0 (eq. 12 / average / released); a
    receiving slot's key changes, so its cached norm is cleared."""
    wmode = int(params[P.merge_weights])
    # per receiving slot j, merge_w[h, j] first accumulates the denominator (sum exp(u), or the count)
    for e in range(ne):
        j = near[h, e]
        if j < 0:
            continue
        if merge_to[h, j] != -2:
            merge_to[h, j] = -2          # marks j as a receiver while the sums are built
            merge_w[h, j] = 0.0
            slot_state[h, j, F_NORM] = 0.0
        merge_w[h, j] += math.exp(sim[h, e]) if wmode == 0 else 1.0
    self_w = math.e if wmode == 0 else 1.0
    for e in range(ne):
        j = near[h, e]
        if j < 0:
            continue
        den = merge_w[h, j] + self_w
        src = math.exp(sim[h, e]) if wmode == 0 else (1.0 if wmode == 1 else sim[h, e])
        merge_to[h, evicted[h, e]] = j
        merge_w[h, evicted[h, e]] = src / den
    for e in range(ne):
        j = near[h, e]
        if j >= 0 and merge_to[h, j] == -2:
            merge_w[h, j] = self_w / (merge_w[h, j] + self_w)
            merge_to[h, j] = -1


@njit(cache=True)
def _merge_layer(params, lengths, keys, slot_state, head_state, keep, merge_to, merge_w):
    """Match evicted slots to their nearest kept slot, apply the EMA threshold (per head or per layer), merge."""
    hkv = lengths.shape[0]
    cap = keys.shape[1]
    beta = params[P.beta]
    use_ema = params[P.ema_threshold] != 0.0
    per_layer = int(params[P.ema_scope]) == 1
    evicted = np.empty((hkv, cap), np.int64)
    near = np.empty((hkv, cap), np.int64)
    sim = np.empty((hkv, cap), np.float64)
    ne = np.zeros(hkv, np.int64)
    for h in range(hkv):
        ne[h] = _nearest(h, lengths[h], keys, keep, evicted, near, sim, slot_state)
    if per_layer:
        # released code: one tau per layer from the mean u* over heads and evicted tokens; the r-th evicted token
        # of every head is merged when the mean over heads of their u* clears tau (>=)
        tot = 0.0
        cnt = 0
        for h in range(hkv):
            for e in range(ne[h]):
                tot += sim[h, e]
                cnt += 1
        if cnt == 0:
            return
        tau = _ema(head_state, 0, beta, tot / cnt)
        if use_ema:
            for e in range(ne.max()):
                s = 0.0
                c = 0
                for h in range(hkv):
                    if e < ne[h]:
                        s += sim[h, e]
                        c += 1
                if s / c < tau:
                    for h in range(hkv):
                        if e < ne[h]:
                            near[h, e] = -1
    else:
        for h in range(hkv):
            if ne[h] == 0:
                continue
            mean_u = 0.0
            for e in range(ne[h]):
                mean_u += sim[h, e]
            tau = _ema(head_state, h, beta, mean_u / ne[h])
            if use_ema:
                for e in range(ne[h]):
                    if sim[h, e] < tau:
                        near[h, e] = -1
    for h in range(hkv):
        _assign_merges(params, h, ne[h], evicted, near, sim, merge_to, merge_w, slot_state)


@kernel(STEP_SIG)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    n_sinks = int(params[P.n_sinks])
    ratio = params[P.recent_ratio]
    mode = int(params[P.group_reduce])
    in_hh = params[P.sinks_in_hh] != 0.0
    evicting = False
    for h in range(lengths.shape[0]):
        n = lengths[h]
        for i in range(n):
            slot_state[h, i, F_SCORE] += group_score(probs, h, i, mode)
        b = budget[h]
        if n <= b:
            continue
        sinks, _, recent = head_split(b, n_sinks, ratio, in_hh)
        evict_lowest(slot_state[h, :, F_SCORE], positions[h], n, n - b, sinks, t - recent + 1, keep[h])
        evicting = True
    if evicting and params[P.merge] != 0.0:
        _merge_layer(params, lengths, keys, slot_state, head_state, keep, merge_to, merge_w)


@kernel(PREFILL_SIG)
def _prefill_once(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    """``prompt="once"``: score every prompt token by its full column sum (group-reduced) and keep sinks, the
    heaviest hitters and the recent window of each head in one selection."""
    s = q.shape[0]
    mode = int(params[P.group_reduce])
    in_hh = params[P.sinks_in_hh] != 0.0
    pos = np.arange(s)
    ring = np.zeros((1, 1), np.float64)
    for h in range(k.shape[1]):
        scores = np.zeros(s, np.float64)
        group_rows_scores(q, k, scale, h, 0, s, mode, scores, ring, 0)
        for i in range(s):
            slot_state[h, i, F_SCORE] = scores[i]
        b = budget[h]
        if s <= b:
            continue
        sinks, _, recent = head_split(b, int(params[P.n_sinks]), params[P.recent_ratio], in_hh)
        evict_lowest_sorted(scores, pos, s, s - b, sinks, s - recent, keep[h])


@register
class D2O(Policy):
    """D2O: variance-based layer budgets, sinks + accumulated-attention heavy hitters + recent window (N:M = 3:1),
    and EMA-thresholded similarity-weighted merging of evicted tokens (see the module docstring).
    ``preset=reference`` reproduces the authors' released code (AIoT-MLSys-Lab/D2O)."""

    name = "d2o"
    reads_values = False
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"recent_ratio": (0.25, 0.1, 0.5, 0.75)}
    summary = "layer budgets by attention variance + H2O-style eviction + EMA-threshold merging"
    schema = SCHEMA
    P = P
    presets = {"reference": REFERENCE}
    slot_fields = 2
    head_fields = 2
    step_fn = _step
    prefill_fn = _prefill_once

    @property
    def has_prefill(self) -> bool:
        return self.params["prompt"] == "once"

    def kernels(self) -> tuple:
        step, prefill, scale = super().kernels()
        return step, (prefill if self.has_prefill else compiled(stream_prefill)), scale

    def min_budget(self) -> int:
        return self.params["n_sinks"] + 1

    def guarantees(self, budget: int) -> Guarantees:
        # with layer allocation a layer may get only min_budget slots: then one recent slot is all that is promised
        p = self.params
        b = self.min_budget() if p["layer_alloc"] else budget
        t, _, m = split_budget(b, p["n_sinks"], p["recent_ratio"], p["sinks_in_hh"])
        return Guarantees(sinks=t if p["sinks_in_hh"] else p["n_sinks"], recent=m)

    def allocate(self, budget: int, n_kv_heads: int, prompt_layers: Sequence[tuple[np.ndarray, np.ndarray]],
                 scale: float) -> np.ndarray:
        n_layers = len(prompt_layers)
        n_prompt = prompt_layers[0][0].shape[0] if prompt_layers else 0
        if not self.params["layer_alloc"] or n_layers <= 1 or n_prompt < 2 or budget >= n_prompt:
            per_layer = np.full(n_layers, budget, np.int64)
        else:
            mode = self.params["alloc"]
            var = prompt_memo(prompt_layers, ("d2o.layer_variances", float(scale), mode),
                              lambda: layer_variances(prompt_layers, scale, mode))
            cap = n_prompt if self.params["cap_at_prompt"] else None
            lo = self.min_budget() if mode == "literal" else max(self.min_budget(), math.ceil(0.01 * n_prompt))
            per_layer = allocate_layers(budget, var, lo, self.params["var_scale"], cap)
        if self.params["exempt_layers"] and n_layers > 2:
            per_layer[[0, 1, n_layers - 1]] = UNCOMPRESSED
        return np.repeat(per_layer[:, None], n_kv_heads, axis=1)

