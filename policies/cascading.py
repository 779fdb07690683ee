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
  - The decision is layer-level, so the kernel reads the budget of KV head 0 (the default allocation is
    uniform) and writes the same keep mask and state to every KV head.

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

from policies.base import PREFILL_SIG, STEP_SIG, Guarantees, Param, Policy, stream_prefill
from policies.registry import register

HEAD_REDUCE = ("mean", "max", "median")
WARMUP = ("keep_all", "algorithm1")
CLOCK = ("step", "offers")
PREFILL = ("stream", "window")
MAX_CASCADES = 16
_SINK = 1.0
_TAG0 = 2.0

# parameter vector indices (schema order)
_N_SINKS, _N_CASC, _BASE, _GAMMA, _TARGET, _REDUCE, _WARMUP, _CLOCK = range(8)


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
def _reduced_score(probs, lengths, i, mode, buf):
    """Attention on slot i reduced over all query heads of the layer (0 mean, 1 max, 2 median)."""
    n = 0
    for h in range(probs.shape[0]):
        for g in range(probs.shape[1]):
            buf[n] = probs[h, g, i]
            n += 1
    if mode == 0:
        return buf[:n].mean()
    if mode == 1:
        return buf[:n].max()
    return np.median(buf[:n])


@njit(cache=True)
def _accepts(params, head_state, k, t):
    """Whether sub-cache k accepts the token offered to it at step t (and count the offer)."""
    base = int(params[_BASE])
    if k == 0 or base == 1:
        return True
    if int(params[_CLOCK]) == 0:
        return t % (base ** k) == 0
    offers = int(head_state[0, k])
    for h in range(head_state.shape[0]):
        head_state[h, k] = offers + 1
    return offers % base == 0


@njit(cache=True)
def _assign_full(params, sizes, n, tags):
    """Tag n held slots (position order): the first as sinks, then the newest to C_0, C_1... up to their sizes
    (with n < budget the oldest sub-caches stay short). Used at the keep_all overflow and by the window prefill."""
    n_sinks = int(params[_N_SINKS])
    for i in range(min(n_sinks, n)):
        tags[i] = _SINK
    j = n - 1
    for k in range(sizes.shape[0]):
        for _ in range(sizes[k]):
            if j >= n_sinks:
                tags[j] = _TAG0 + k
                j -= 1


@njit(PREFILL_SIG, cache=True)
def _window_prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    P = k.shape[0]
    n_sinks = int(params[_N_SINKS])
    n_casc = int(params[_N_CASC])
    sizes = _sizes(budget[0], n_sinks, n_casc)
    held = np.empty(min(P, budget[0]), np.int64)
    for i in range(min(P, n_sinks)):
        held[i] = i
    for j in range(held.shape[0] - min(P, n_sinks)):
        held[held.shape[0] - 1 - j] = P - 1 - j
    tags = np.zeros(held.shape[0], np.float64)
    if P > budget[0] or int(params[_WARMUP]) == 1:   # keep_all with room left keeps warming up untagged
        _assign_full(params, sizes, held.shape[0], tags)
    for h in range(keep.shape[0]):
        for i in range(P):
            keep[h, i] = 0
        for j in range(held.shape[0]):
            keep[h, held[j]] = 1
            slot_state[h, held[j], 0] = tags[j]


@njit(STEP_SIG, cache=True)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    hkv = lengths.shape[0]
    n = lengths[0]
    n_sinks = int(params[_N_SINKS])
    n_casc = int(params[_N_CASC])
    c = budget[0] - n_sinks
    sizes = _sizes(budget[0], n_sinks, n_casc)
    gamma = params[_GAMMA]
    if gamma <= 0.0:
        gamma = np.exp(-n_casc * np.log(params[_TARGET]) / c)
    mode = int(params[_REDUCE])
    buf = np.empty(probs.shape[0] * probs.shape[1], np.float64)
    tags = np.empty(n, np.float64)
    ema = np.empty(n, np.float64)
    for i in range(n):
        ema[i] = gamma * slot_state[0, i, 1] + (1.0 - gamma) * _reduced_score(probs, lengths, i, mode, buf)
        tags[i] = slot_state[0, i, 0]
    new = n - 1
    drop = -1
    if int(params[_WARMUP]) == 0 and tags[0] == 0.0:
        # keep_all warm-up: nothing is discarded until the cache overflows, then it is split into full sub-caches
        if n > budget[0]:
            _assign_full(params, sizes, n - 1, tags)
    if tags[0] != 0.0 or int(params[_WARMUP]) == 1:
        held_sinks = 0
        for i in range(new):
            if tags[i] == _SINK:
                held_sinks += 1
        if held_sinks < n_sinks:
            tags[new] = _SINK
        else:
            item = new
            tags[item] = 0.0
            placed = False
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
                if _accepts(params, head_state, k, t):
                    tags[item] = tag
                    if count < sizes[k]:
                        placed = True
                        break
                    tags[oldest] = 0.0
                    item = oldest
                elif count == 0:
                    tags[item] = tag
                    placed = True
                    break
                else:
                    if ema[item] > ema[newest]:
                        tags[item] = tag
                        drop = newest
                    else:
                        drop = item
                    placed = True
                    break
            if not placed:
                drop = item
    for h in range(hkv):
        for i in range(n):
            slot_state[h, i, 0] = tags[i]
            slot_state[h, i, 1] = ema[i]
        if drop >= 0:
            keep[h, drop] = 0


def _held_after(budget: int, n_sinks: int, n_cascades: int, base: int, warmup: str, clock: str, n_tokens: int) -> int:
    """Slots held after ``n_tokens`` tokens; the counts never depend on the scores, so this is exact."""
    if warmup == "keep_all" or n_tokens <= n_sinks:
        return min(n_tokens, budget)
    sizes = sub_cache_sizes(budget, n_sinks, n_cascades)
    counts = [0] * n_cascades
    offers = [0] * n_cascades
    for t in range(n_sinks, n_tokens):
        for k in range(n_cascades):
            if k == 0 or base == 1:
                acc = True
            elif clock == "step":
                acc = t % base ** k == 0
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
    summary = "sinks + cascading sub-caches with EMA-scored token selection"
    schema = (
        Param("n_sinks", 4, "int", 0, 1024, doc="initial tokens always kept (attention sinks)"),
        Param("n_cascades", 4, "int", 1, MAX_CASCADES, doc="number of sub-caches N"),
        Param("accept_base", 2, "int", 1, 8, doc="sub-cache k accepts every base^k-th token (1 = sliding window)"),
        Param("ema_gamma", 0.0, "float", 0.0, 0.9999,
              doc="EMA decay; 0 = paper formula exp(-N ln(ema_target) / |C|)"),
        Param("ema_target", 100.0, "float", 1.001, 1e6, log=True,
              doc="decay factor of a score one sub-cache old (paper: 100, i.e. < 1%)"),
        Param("head_reduce", "mean", "choice", choices=HEAD_REDUCE, doc="reduction of scores over the layer's heads"),
        Param("warmup", "keep_all", "choice", choices=WARMUP, doc="behaviour before the cache is full"),
        Param("clock", "step", "choice", choices=CLOCK, doc="what the acceptance period counts"),
        Param("prefill", "stream", "choice", choices=PREFILL, doc="how the prompt enters the cache"),
    )
    slot_fields = 2
    head_fields = MAX_CASCADES
    step_fn = _step

    @property
    def has_prefill(self) -> bool:
        return self.params["prefill"] == "window"

    def kernels(self) -> tuple:
        step, _, scale = super().kernels()
        return step, (_window_prefill if self.has_prefill else stream_prefill), scale

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
        return _held_after(budget, self._p("n_sinks"), self._p("n_cascades"), self._p("accept_base"),
                           self._p("warmup"), self._p("clock"), n_tokens)
