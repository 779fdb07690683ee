"""Cascading KV cache (Willette et al., 2024): sinks plus a chain of sub-caches that each accept a
fraction of the tokens evicted from the previous one, choosing survivors by an EMA of attention.

Layout: ``budget`` slots per KV head = ``n_sinks`` sinks + ``N = n_cascades`` sub-caches C_0..C_{N-1}
(C_0 newest). ``|C| = budget - n_sinks``; sub-cache sizes are ``|C| // N`` and the remainder
``|C| % N`` goes one slot each to the newest sub-caches (C_0 first), so sizes sum to ``|C|`` exactly.

One step (Algorithm 1 of the paper, once the cache is full): the new token enters C_0. Sub-cache k
"accepts" when ``t % accept_base**k == 0`` (f(i) = 2^(i-1), the paper's eq. 4 with i = k + 1). An
accepting sub-cache takes the incoming token and passes its oldest token on (or keeps both if it has
room); a non-accepting one compares the incoming token with its own newest token by EMA score, keeps
the higher (ties keep the resident) and drops the other. The token leaving C_{N-1} is dropped.

Scores: every step each cached token's EMA is updated, mu <- gamma mu + (1 - gamma) s, where s is its
attention probability reduced over ALL query heads of the layer (``head_reduce``: mean, max, median),
so all KV heads of a layer take the same decision and each token keeps one position (Appendix C).
gamma defaults to exp(-N ln(ema_target) / |C|) with ema_target = 100 (Appendix B, eq. 14).

Ambiguities, chosen and parameterised:
  - ``warmup``: "keep_all" (default) discards nothing while the cache has a free slot; when it first
    overflows the held tokens are split by position into sinks and full sub-caches (newest to C_0),
    exactly the split a full cascade would have. "algorithm1" follows the pseudocode literally from the
    first token: a non-accepting sub-cache takes a token for free only when empty, so sub-caches fill
    slowly and tokens are dropped long before the budget is used (it is not the full cache at budget = T).
  - ``clock``: "step" (default) makes sub-cache k accept on steps t divisible by base^k (the paper's
    "every 4th iteration"); "offers" counts the tokens offered to each sub-cache instead and accepts
    every base-th offer ("accepts half of the tokens evicted from the previous one").
  - ``prefill``: "stream" (default; the paper streams PG19 books token by token through the cascade) or
    "window": keep the sinks and the newest prompt tokens, split by position into full sub-caches (the
    newest to C_0) with zero EMA: the keep_all overflow split applied to the prompt, no prompt attention.
    ``footprint`` assumes a streamed prompt.
  - Positions: slots keep their original positions (the engine's ``positions``). The paper re-indexes
    RoPE consecutively over the cached tokens (its Positional Encoding paragraph); ``pe_indices`` gives
    that mapping for the GPU path, which must re-rotate keys from their original positions.
  - ``decision="layer"`` (default, the paper's Appendix C): the kernel reads the budget of KV head 0 (the
    default allocation is uniform) and writes the same keep mask and state to every KV head. ``"head"``: each
    KV head decides on its own from its query group's scores reduced by ``head_reduce``.

The authors' released code (jeffwillette/cascading_cache_2, ``cascade/models/cascading_cache.py``) differs
from the paper in five places; ``preset=reference`` sets them (``REFERENCE``; explicit values win):
  - ``decision="head"``: its cache state is per (batch, head), so every KV head decides on its own;
  - ``clock_phase="sinks"``: sub-cache k accepts when (t - n_sinks) % base^k == 0;
  - ``eager_fill``: every sub-cache accepts while t <= n_sinks + |C|, i.e. also at the first overflow step
    (the cache shifts as a FIFO once);
  - ``ema_gamma=0.9999`` (the paper's formula is commented out there);
  - ``ties="incoming"``: the incoming token wins equal scores (``>=``);
  - not a parameter: RoPE indices are re-assigned consecutively over the cache (``pe_indices``; closed loop).
One more difference is not in the code but in how its jobs run: the model, and with it the EMA state, is float16.
At gamma = 0.9999 an update adds (1 - gamma) s ~ 1e-4 s, less than half a float16 step of most scores, so the
increments round away and the scores freeze; compared step by step with a float16 run, the float64 preset agrees
on 14-100% of steps depending on the layer. ``score_dtype=float16`` rounds every stored score to float16 after its
update (the update itself in float64: one rounding where float16 arithmetic has three), which reproduces that
freezing; it is not part of the preset, whose float64 scores are what the code computes.
Like kvsim's engine, the released attention of step t covers the cached tokens and the new one before the
cache update, and the EMA (new token included) takes that step's scores before the placement, so the preset
keeps the released sets at every step given the same scores (tested against a step-by-step reading).
The paper's reading stays the default: it is what the paper states and evaluates, and layer-level decisions
keep one position per token across heads (Appendix C).

Effective context (eq. 4, tested): once warm, no non-sink token older than L~ = sum_k |C_k| base^k positions
is held, the span reaches L~ exactly under the fixed pattern (an offered token never wins), and token
selection can shorten it by at most 2 (base^(N-1) - 1) positions (found by property tests, not in the paper).

slot_state: [0] tag (0 unassigned, 1 sink, 2 + k for sub-cache k), [1] EMA score.
head_state: [0, k] offers seen by sub-cache k (clock = "offers"); identical across the KV heads.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from policies.core.base import (PREFILL_SIG, STEP_SIG, Guarantees, Param, Policy, compiled, kernel, param_indices,
                           stream_prefill)
from policies.core.registry import register

HEAD_REDUCE = ("mean", "max", "median")
WARMUP = ("keep_all", "algorithm1")
CLOCK = ("step", "offers")
PREFILL = ("stream", "window")
DECISION = ("layer", "head")
CLOCK_PHASE = ("t", "sinks")
TIES = ("resident", "incoming")
PRESETS = ("paper", "reference")
SCORE_DTYPES = ("float64", "float16")
MAX_CASCADES = 16
_SINK = 1.0
_TAG0 = 2.0
#: the released code's values, applied by ``preset=reference`` to every parameter not given explicitly
REFERENCE = dict(ema_gamma=0.9999, decision="head", clock="step", clock_phase="sinks", eager_fill=True,
                 ties="incoming", warmup="keep_all")

SCHEMA = (
    Param("n_sinks", 4, "int", 0, 1024, doc="initial tokens always kept (attention sinks)"),
    Param("n_cascades", 4, "int", 1, MAX_CASCADES, doc="number of sub-caches N"),
    Param("accept_base", 2, "int", 1, 8, doc="sub-cache k accepts every base^k-th token (1 = sliding window)"),
    Param("ema_gamma", 0.0, "float", 0.0, 0.9999,
          doc="EMA decay; 0 = paper formula exp(-N ln(ema_target) / |C|) (released code: 0.9999)"),
    Param("ema_target", 100.0, "float", 1.001, 1e6, log=True,
          doc="decay factor of a score one sub-cache old (paper: 100, i.e. < 1%)"),
    Param("head_reduce", "mean", "choice", choices=HEAD_REDUCE,
          doc="reduction of scores over the deciding unit's query heads"),
    Param("warmup", "keep_all", "choice", choices=WARMUP, doc="behaviour before the cache is full"),
    Param("clock", "step", "choice", choices=CLOCK, doc="what the acceptance period counts"),
    Param("prefill", "stream", "choice", choices=PREFILL, doc="how the prompt enters the cache"),
    Param("decision", "layer", "choice", choices=DECISION,
          doc="one decision per layer (paper, Appendix C) or per KV head over its query group (released code)"),
    Param("clock_phase", "t", "choice", choices=CLOCK_PHASE,
          doc="step clock counts t or t - n_sinks (released code)"),
    Param("eager_fill", False, "bool", doc="every sub-cache accepts up to the first overflow step (released code)"),
    Param("ties", "resident", "choice", choices=TIES, doc="equal EMA scores keep the resident or the incoming token"),
    Param("score_dtype", "float64", "choice", choices=SCORE_DTYPES, searchable=False,
          doc="precision of the stored EMA scores: float16 rounds each update as the released jobs' float16 "
              "state does"),
    Param("preset", "paper", "choice", choices=PRESETS, searchable=False,
          doc="reference: the released code's values for every parameter not given"),
)
P = param_indices(SCHEMA)


@njit(cache=True)
def _sizes(budget, n_sinks, n_cascades):
    """Sizes of C_0..C_{N-1}: ``(budget - n_sinks) // N`` each, the remainder to the newest ones."""
    c = budget - n_sinks
    sizes = np.empty(n_cascades, np.int64)
    for k in range(n_cascades):
        sizes[k] = c // n_cascades + (1 if k < c % n_cascades else 0)
    return sizes


def sub_cache_sizes(budget: int, n_sinks: int, n_cascades: int) -> list[int]:
    """Sizes of C_0..C_{N-1}: ``(budget - n_sinks) // N`` each, the remainder to the newest ones."""
    return [int(x) for x in _sizes(budget, n_sinks, n_cascades)]


def paper_gamma(budget: int, n_sinks: int, n_cascades: int, target: float = 100.0) -> float:
    """EMA decay exp(-N ln(target) / |C|) (Appendix B): a score older than one sub-cache decays below 1/target."""
    return math.exp(-n_cascades * math.log(target) / (budget - n_sinks))


def approximate_context_length(budget: int, n_sinks: int, n_cascades: int, accept_base: int = 2) -> int:
    """Eq. 4: sum_k |C_k| * base^k, the span of positions a full cascade covers (sinks excluded)."""
    return sum(s * accept_base ** k for k, s in enumerate(sub_cache_sizes(budget, n_sinks, n_cascades)))


def pe_indices(positions: np.ndarray) -> np.ndarray:
    """The paper's consecutive RoPE indices of cached tokens: rank of each original position (0, 1, 2...)."""
    pos = np.asarray(positions)
    return np.argsort(np.argsort(pos, kind="stable"), kind="stable")


@njit(cache=True)
def round_to_float16(x):
    """x rounded to the nearest float16 value (ties to even; float16's subnormals below 2^-14 and overflow to
    inf above 65504), returned as float64: the value a float16 score store keeps."""
    if x == 0.0 or not np.isfinite(x):
        return x
    e = math.frexp(x)[1]                      # |x| in [2^(e-1), 2^e)
    q = 2.0 ** (e - 11) if e - 1 >= -14 else 2.0 ** -24    # 11 significant bits, or the subnormal step
    r = np.round(x / q) * q
    return r if abs(r) <= 65504.0 else np.inf * np.sign(r)


@njit(cache=True, inline="always")
def _reduced_score(probs, h0, h1, i, mode, buf):
    """Attention on slot i reduced over the query heads of KV heads h0..h1-1 by their max (mode 1) or median
    (mode 2); ``buf`` is the caller's scratch. The mean (mode 0) is `_mean_scores`, for all slots at once."""
    n = 0
    for h in range(h0, h1):
        for g in range(probs.shape[1]):
            buf[n] = probs[h, g, i]
            n += 1
    if mode == 1:
        return buf[:n].max()
    return np.median(buf[:n])


@njit(cache=True)
def _mean_scores(probs, h0, h1, n, out):
    """out[i] = the mean attention on slot i over the query heads of KV heads h0..h1-1, for every slot i < n: each
    slot's float64 sum in head order, then divided by the head count (the order and arithmetic the step has always
    used), summed head by head over contiguous rows of ``probs`` (a step's hot loop: 3.6x faster than slot by slot
    across the rows)."""
    for i in range(n):
        out[i] = 0.0
    for h in range(h0, h1):
        for g in range(probs.shape[1]):
            for i in range(n):
                out[i] += probs[h, g, i]
    count = (h1 - h0) * probs.shape[1]
    for i in range(n):
        out[i] /= count


@njit(cache=True)
def _accepts(params, head_state, u, k, t, eager):
    """Whether sub-cache k accepts the token offered to it at step t (and count the offer in head_state[u])."""
    base = int(params[P.accept_base])
    if k == 0 or base == 1 or eager:
        return True
    if int(params[P.clock]) == 0:
        phase = int(params[P.n_sinks]) if int(params[P.clock_phase]) == 1 else 0
        return (t - phase) % (base ** k) == 0
    offers = int(head_state[u, k])
    head_state[u, k] = offers + 1
    return offers % base == 0


@njit(cache=True)
def _assign_full(params, sizes, n, tags):
    """Tag n held slots (position order): the first as sinks, then the newest to C_0, C_1... up to their sizes
    (with n < budget the oldest sub-caches stay short). Used at the keep_all overflow and by the window prefill."""
    n_sinks = int(params[P.n_sinks])
    for i in range(min(n_sinks, n)):
        tags[i] = _SINK
    j = n - 1
    for k in range(sizes.shape[0]):
        for _ in range(sizes[k]):
            if j >= n_sinks:
                tags[j] = _TAG0 + k
                j -= 1


@kernel(PREFILL_SIG)
def _window_prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    n_prompt = k.shape[0]
    n_sinks = int(params[P.n_sinks])
    n_casc = int(params[P.n_cascades])
    sizes = _sizes(budget[0], n_sinks, n_casc)
    held = np.empty(min(n_prompt, budget[0]), np.int64)
    for i in range(min(n_prompt, n_sinks)):
        held[i] = i
    for j in range(held.shape[0] - min(n_prompt, n_sinks)):
        held[held.shape[0] - 1 - j] = n_prompt - 1 - j
    tags = np.zeros(held.shape[0], np.float64)
    if n_prompt > budget[0] or int(params[P.warmup]) == 1:   # keep_all with room left keeps warming up untagged
        _assign_full(params, sizes, held.shape[0], tags)
    for h in range(keep.shape[0]):
        for i in range(n_prompt):
            keep[h, i] = 0
        for j in range(held.shape[0]):
            keep[h, held[j]] = 1
            slot_state[h, held[j], 0] = tags[j]


@njit(cache=True)
def _place(params, head_state, u, budget, t, tags, ema, n):
    """Algorithm 1 for one decision unit (a layer or a KV head): route the newest slot through the sinks and
    sub-caches given the slots' tags and the EMA scores the decisions read; returns the slot to drop or -1."""
    n_sinks = int(params[P.n_sinks])
    n_casc = int(params[P.n_cascades])
    sizes = _sizes(budget, n_sinks, n_casc)
    keep_all = int(params[P.warmup]) == 0
    incoming_wins_ties = int(params[P.ties]) == 1
    new = n - 1
    drop = -1
    if keep_all and tags[0] == 0.0:
        # keep_all warm-up: nothing is discarded until the cache overflows, then it is split into full sub-caches
        if n > budget:
            _assign_full(params, sizes, n - 1, tags)
    if tags[0] == 0.0 and keep_all:
        return -1
    held_sinks = 0
    for i in range(new):
        if tags[i] == _SINK:
            held_sinks += 1
    if held_sinks < n_sinks:
        tags[new] = _SINK
        return -1
    # released code: every sub-cache accepts until the first overflow step t = n_sinks + |C| included
    eager = params[P.eager_fill] != 0.0 and t <= budget
    item = new
    tags[item] = 0.0
    for k in range(n_casc):
        tag = _TAG0 + k
        count = 0
        oldest = -1
        newest = -1
        for i in range(n):
            if tags[i] == tag and i != item:
                count += 1
                if oldest < 0:
                    oldest = i
                newest = i
        if _accepts(params, head_state, u, k, t, eager):
            tags[item] = tag
            if count < sizes[k]:
                return drop
            tags[oldest] = 0.0
            item = oldest
        elif count == 0:
            tags[item] = tag
            return drop
        else:
            if ema[item] > ema[newest] or (incoming_wins_ties and ema[item] == ema[newest]):
                tags[item] = tag
                tags[newest] = 0.0
                return newest
            return item
    return item


@kernel(STEP_SIG)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    hkv = lengths.shape[0]
    n_casc = int(params[P.n_cascades])
    gamma = params[P.ema_gamma]
    if gamma <= 0.0:
        gamma = np.exp(-n_casc * np.log(params[P.ema_target]) / (budget[0] - int(params[P.n_sinks])))
    mode = int(params[P.head_reduce])
    per_head = int(params[P.decision]) == 1
    half = int(params[P.score_dtype]) == 1
    buf = np.empty(probs.shape[0] * probs.shape[1], np.float64)
    for u in range(hkv if per_head else 1):
        n = lengths[u]
        tags = np.empty(n, np.float64)
        ema = np.empty(n, np.float64)
        h0, h1 = (u, u + 1) if per_head else (0, hkv)
        if mode == 0:
            _mean_scores(probs, h0, h1, n, ema)
        else:
            for i in range(n):
                ema[i] = _reduced_score(probs, h0, h1, i, mode, buf)
        for i in range(n):
            ema[i] = gamma * slot_state[u, i, 1] + (1.0 - gamma) * ema[i]
            if half:
                ema[i] = round_to_float16(ema[i])
            tags[i] = slot_state[u, i, 0]
        drop = _place(params, head_state, u, budget[u], t, tags, ema, n)
        for h in range(u, u + 1) if per_head else range(hkv):
            for i in range(n):
                slot_state[h, i, 0] = tags[i]
                slot_state[h, i, 1] = ema[i]
            if drop >= 0:
                keep[h, drop] = 0
            if not per_head:
                for f in range(head_state.shape[1]):
                    head_state[h, f] = head_state[0, f]


def _held_after(budget: int, n_sinks: int, n_cascades: int, base: int, warmup: str, clock: str, n_tokens: int,
                phase: int = 0, eager: bool = False) -> int:
    """Slots held after ``n_tokens`` tokens; the counts never depend on the scores, so this is exact.
    ``phase``: what the step clock subtracts from t; ``eager``: every sub-cache accepts while t <= budget."""
    if warmup == "keep_all" or n_tokens <= n_sinks:
        return min(n_tokens, budget)
    sizes = sub_cache_sizes(budget, n_sinks, n_cascades)
    counts = [0] * n_cascades
    offers = [0] * n_cascades
    for t in range(n_sinks, n_tokens):
        for k in range(n_cascades):
            if k == 0 or base == 1 or (eager and t <= budget):
                acc = True
            elif clock == "step":
                acc = (t - phase) % base ** k == 0
            else:
                acc = offers[k] % base == 0
                offers[k] += 1
            if acc:
                if counts[k] < sizes[k]:
                    counts[k] += 1
                    break
            else:
                counts[k] += counts[k] == 0
                break
    return n_sinks + sum(counts)


@register
class Cascading(Policy):
    """Cascading KV cache: ``n_sinks`` sinks + ``n_cascades`` equal sub-caches accepting every
    ``accept_base^k``-th token, survivors chosen by an EMA of head-reduced attention (paper: 4 sinks,
    4 cascades, base 2, gamma = exp(-N ln 100 / |C|), mean over heads). See the module docstring.
    """

    name = "cascading"
    reads_keys = False
    reads_values = False
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"n_cascades": (4, 1, 2, 8)}
    summary = "sinks + cascading sub-caches with EMA-scored token selection"
    schema = SCHEMA
    P = P
    presets = {"reference": REFERENCE}
    multi_token_steps = False   # one token is offered to the cascade per step (Algorithm 1)
    slot_fields = 2
    head_fields = MAX_CASCADES
    step_fn = _step

    @property
    def has_prefill(self) -> bool:
        return self.params["prefill"] == "window"

    def kernels(self) -> tuple:
        step, _, scale = super().kernels()
        return step, compiled(_window_prefill if self.has_prefill else stream_prefill), scale

    def _p(self, name: str):
        return self.params[name]

    def min_budget(self) -> int:
        return self._p("n_sinks") + self._p("n_cascades")

    def sizes(self, budget: int) -> list[int]:
        """Sub-cache sizes at this budget (C_0 first)."""
        return sub_cache_sizes(budget, self._p("n_sinks"), self._p("n_cascades"))

    def gamma(self, budget: int) -> float:
        """The EMA decay used at this budget."""
        g = self._p("ema_gamma")
        return g if g > 0 else paper_gamma(budget, self._p("n_sinks"), self._p("n_cascades"), self._p("ema_target"))

    def guarantees(self, budget: int) -> Guarantees:
        # C_0 accepts every token and is FIFO, so the newest |C_0| tokens are always held once warm;
        # with the literal algorithm1 warm-up C_0 only starts filling after the sinks, which is the same window
        return Guarantees(sinks=self._p("n_sinks"), recent=self.sizes(budget)[0])

    def footprint(self, budget: int, n_tokens: int) -> int:
        phase = self._p("n_sinks") if self._p("clock_phase") == "sinks" else 0
        return _held_after(budget, self._p("n_sinks"), self._p("n_cascades"), self._p("accept_base"),
                           self._p("warmup"), self._p("clock"), n_tokens, phase, self._p("eager_fill"))
