"""BUZZ (Zhao et al., 2024): beehive-structured sparse KV cache with segmented heavy hitters, and its log-n variant.

Cache layout, oldest to newest: ``k`` sink tokens | old tokens (survivors of earlier passes) | new tokens
(left the window since the last pass) | a sliding window of the last ``w`` tokens. Nothing is evicted per
step; once the buffered count reaches the threshold ``T`` one pass runs: old tokens are interval-sampled
with stride s_hat = floor((s+1)/2) (no scores), new tokens are cut into hives of ``s`` consecutive tokens
and each hive keeps its local maximum of accumulated attention (Algorithm 2); all survivors become old.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from policies._buzz_model import CountRule, held_after_prefill, held_trajectory
from typing import Any, Sequence

from policies.core.base import (LOGIT_SCALE_SIG, PREFILL_SIG, STEP_SIG, Guarantees, Param, Policy, PolicyError, kernel,
                           param_indices)
from policies.core.shared_kernels import GROUP_REDUCE, group_score, prompt_attention, prompt_attention_table
from policies.core.registry import register

PREFILL = ("fit", "one_pass")
SCHEMA = (
    Param("n_sinks", 4, "int", 0, 1024, doc="attention-sink tokens k always kept"),
    Param("stride", 5, "int", 3, 64, doc="hive stride s for new tokens (s_hat = (s+1)//2 for old; s>=3 so "
                                        "old tokens are thinned)"),
    Param("t_over_w", 0.0, "float", 0.0, 32.0, doc="T/w when deriving from the budget; 0 = Theorem 3.1's value"),
    Param("window", 0, "int", 0, 1 << 20, doc="sliding window w; 0 = derive from the budget", searchable=False),
    Param("threshold", 0, "int", 0, 1 << 20, doc="threshold T; 0 = derive from the budget", searchable=False),
    Param("threshold_on", "total", "choice", choices=("total", "new"),
          doc="tokens counted toward T: old+new (eq. 10, Fig. 3, Remark 2) or new only (Algorithm 1)"),
    Param("inclusive_bounds", True, "bool", doc="pass fires when the count exceeds T (Alg. 1 `<=`) vs reaches T"),
    Param("hive_tail", "keep", "choice", choices=("keep", "drop"), doc="partial hive keeps its max or is evicted"),
    Param("hive_align", "left", "choice", choices=("left", "right"), doc="hives from the oldest or newest token"),
    Param("score_scope", "head", "choice", choices=("head", "layer"), doc="scores per KV head or per layer"),
    Param("group_reduce", "sum", "choice", choices=GROUP_REDUCE, doc="GQA aggregation of query-head attention"),
    Param("prefill", "fit", "choice", choices=PREFILL, searchable=False,
          doc="prompt thinned until it fits (Remark 2) or one pass per forward call (released code)"),
)
P = param_indices(SCHEMA)
LOGN_SCHEMA = SCHEMA + (
    Param("logn_base", 512.0, "float", 2.0, 1e9, doc="log base: the length at which attention is unchanged"),
    Param("logn_clamp", False, "bool", doc="floor the multiplier at 1 (not in the paper)"),
)
PL = param_indices(LOGN_SCHEMA)          # SCHEMA is its prefix: the BUZZ kernels read both through P
# slot_state fields: accumulated attention, old flag; head_state fields: window, threshold, initialised
_SCORE, _OLD = 0, 1
_HW, _HT, _HINIT = 0, 1, 2
_HEAD_FIELDS = 3


@njit(cache=True)
def _kept(m, stride, drop):
    return m // stride if drop else (m + stride - 1) // stride


@njit(cache=True)
def middle_peak(T, s, on_new, incl, drop):
    """Most middle (non-sink, non-window) slots held after any step, prefill transient included."""
    lim = T if incl else T - 1
    if not on_new:
        return lim
    # Algorithm 1 counting: up to lim buffered new tokens on top of the old ones; the old count follows the
    # monotone map a -> kept(a, s_hat) + kept(fire, s) from at most lim (Remark 2's prefill), so its supremum
    # is the larger of lim and the fixed point the sequence climbs to.
    sh = (s + 1) // 2
    per_pass = lim + 1
    a = lim
    top = a
    for _ in range(1_000_000):
        nxt = _kept(a, sh, drop) + _kept(per_pass, s, drop)
        if nxt == a:
            break
        a = nxt
        top = max(top, a)
    return lim + top


@njit(cache=True)
def _largest_threshold(avail, s, on_new, incl, drop):
    """Largest T >= s whose middle peak fits in ``avail`` slots (s when none does)."""
    lo, hi = s, max(s, avail + 1)
    if middle_peak(lo, s, on_new, incl, drop) > avail:
        return s
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if middle_peak(mid, s, on_new, incl, drop) <= avail:
            lo = mid
        else:
            hi = mid - 1
    return lo


@njit(cache=True)
def derive_window_threshold(params, budget):
    """(w, T) for a budget: explicit values win; otherwise the largest w with T ~ ratio * w whose peak fits."""
    k = int(params[P.n_sinks])
    s = int(params[P.stride])
    on_new = params[P.threshold_on] == 1.0
    incl = params[P.inclusive_bounds] != 0.0
    drop = params[P.hive_tail] == 1.0
    ratio = params[P.t_over_w]
    if ratio <= 0.0:
        ratio = (s * s + 1.0) / (s + 1.0) if s % 2 == 1 else s - 1.0
    w0 = int(params[P.window])
    t0 = int(params[P.threshold])
    room = budget - k
    if w0 > 0 and t0 > 0:
        return w0, t0
    if w0 > 0:
        return w0, _largest_threshold(room - w0, s, on_new, incl, drop)
    if t0 > 0:
        return max(1, room - middle_peak(t0, s, on_new, incl, drop)), t0
    lo, hi = 1, max(1, room)
    while lo < hi:      # largest w whose (w, max(s, round(ratio * w))) fits
        mid = (lo + hi + 1) // 2
        tm = max(s, int(np.floor(ratio * mid + 0.5)))
        if mid + middle_peak(tm, s, on_new, incl, drop) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo, _largest_threshold(room - lo, s, on_new, incl, drop)


@njit(cache=True)
def _sample(idx, m, stride, by_score, scores, drop, right, keep_row):
    """One BUZZ sampling pass over slots ``idx[:m]`` (position order): hives of ``stride`` consecutive slots,
    each keeping its local max of ``scores`` (Algorithm 2, ties to the older token) or, without scores, its
    first slot (interval sampling; the last one under right alignment). Evicts the rest in ``keep_row`` and
    returns how many survivors it wrote to the front of ``idx``."""
    n_groups = (m + stride - 1) // stride
    out = np.empty(n_groups, np.int64)
    n_out = 0
    for gi in range(n_groups):
        if right:   # hives anchored at the newest slot; the partial hive (if any) is the oldest
            g1 = m - gi * stride
            g0 = max(0, g1 - stride)
        else:
            g0 = gi * stride
            g1 = min(m, g0 + stride)
        pick = -1
        if g1 - g0 == stride or not drop:
            if by_score:
                pick = g0
                for j in range(g0 + 1, g1):
                    if scores[idx[j]] > scores[idx[pick]]:
                        pick = j
            else:
                pick = g1 - 1 if right else g0
        for j in range(g0, g1):
            if j != pick:
                keep_row[idx[j]] = 0
        if pick >= 0:
            out[n_out] = idx[pick]
            n_out += 1
    res = np.sort(out[:n_out])
    idx[:n_out] = res
    return n_out


@njit(cache=True)
def _head_pass(h, n, t, k, w, s, drop, right, positions, slot_state, keep):
    """Algorithm 1's pass on KV head h: interval-sample old, local-max-sample new, survivors become old."""
    old = np.empty(n, np.int64)
    new = np.empty(n, np.int64)
    a = 0
    b = 0
    for i in range(n):
        p = positions[h, i]
        if p < k or p > t - w:
            continue
        if slot_state[h, i, _OLD] != 0.0:
            old[a] = i
            a += 1
        else:
            new[b] = i
            b += 1
    _sample(old, a, (s + 1) // 2, False, slot_state[h, :, _SCORE], drop, right, keep[h])
    kept_new = _sample(new, b, s, True, slot_state[h, :, _SCORE], drop, right, keep[h])
    for j in range(kept_new):
        slot_state[h, new[j], _OLD] = 1.0


@njit(cache=True)
def _init_heads(params, budget, head_state):
    for h in range(head_state.shape[0]):
        if head_state[h, _HINIT] == 0.0:
            w, T = derive_window_threshold(params, budget[h])
            head_state[h, _HW] = w
            head_state[h, _HT] = T
            head_state[h, _HINIT] = 1.0


@kernel(STEP_SIG)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    hkv = lengths.shape[0]
    k = int(params[P.n_sinks])
    s = int(params[P.stride])
    on_new = params[P.threshold_on] == 1.0
    incl = params[P.inclusive_bounds] != 0.0
    drop = params[P.hive_tail] == 1.0
    right = params[P.hive_align] == 1.0
    layer_scope = params[P.score_scope] == 1.0
    mode = int(params[P.group_reduce])
    _init_heads(params, budget, head_state)
    if layer_scope:   # every head holds the same positions: one shared score per slot
        for i in range(lengths[0]):
            acc = 0.0
            for h in range(hkv):
                acc += group_score(probs, h, i, mode)
            for h in range(hkv):
                slot_state[h, i, _SCORE] += acc
    else:
        for h in range(hkv):
            for i in range(lengths[h]):
                slot_state[h, i, _SCORE] += group_score(probs, h, i, mode)
    for h in range(hkv):
        w = int(head_state[h, _HW])
        T = int(head_state[h, _HT])
        n = lengths[h]
        counted = 0
        for i in range(n):
            p = positions[h, i]
            if p >= k and p <= t - w and ((not on_new) or slot_state[h, i, _OLD] == 0.0):
                counted += 1
        if counted >= (T + 1 if incl else T):
            _head_pass(h, n, t, k, w, s, drop, right, positions, slot_state, keep)


@kernel(PREFILL_SIG)
def _prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    """Remark 2: sample the prompt's middle until it fits in T (+ k + w): one local-max pass with stride s,
    then interval passes with s_hat over the survivors (they are old tokens by then). ``prefill=one_pass``
    (released code, one pass per forward call): the local-max pass only, whatever it leaves."""
    n_prompt = q.shape[0]
    hkv = k.shape[1]
    n_sinks = int(params[P.n_sinks])
    s = int(params[P.stride])
    incl = params[P.inclusive_bounds] != 0.0
    drop = params[P.hive_tail] == 1.0
    right = params[P.hive_align] == 1.0
    _init_heads(params, budget, head_state)
    if head_state.shape[1] == _HEAD_FIELDS + n_prompt:      # a replay's trace table (replay_head_state)
        scores = head_state[:, _HEAD_FIELDS:].copy()
    else:
        scores = prompt_attention(q, k, scale, int(params[P.group_reduce]))
    if params[P.score_scope] == 1.0:
        total = scores.sum(axis=0)
        for h in range(hkv):
            scores[h] = total
    for h in range(hkv):
        for i in range(n_prompt):
            slot_state[h, i, _SCORE] = scores[h, i]
        w = int(head_state[h, _HW])
        T = int(head_state[h, _HT])
        lim = T if incl else T - 1
        lo = min(n_sinks, n_prompt)
        hi = max(lo, n_prompt - w)
        m = hi - lo
        if m <= lim:
            continue
        idx = np.arange(lo, hi)
        m = _sample(idx, m, s, True, slot_state[h, :, _SCORE], drop, right, keep[h])
        while m > lim and params[P.prefill] == 0.0:
            m = _sample(idx, m, (s + 1) // 2, False, slot_state[h, :, _SCORE], drop, right, keep[h])
        for j in range(m):
            slot_state[h, idx[j], _OLD] = 1.0


@kernel(LOGIT_SCALE_SIG)
def _logn_scale(params, n):
    # n = 1 attends a single token, where any positive multiplier is exact; log(1) = 0 would be rejected
    m = np.log(max(n, 2)) / np.log(params[PL.logn_base])
    if params[PL.logn_clamp] != 0.0 and m < 1.0:
        m = 1.0
    return m


@register
class Buzz(Policy):
    """BUZZ: sinks + beehive-sampled middle + sliding window, evicting in passes every threshold T.

    Budget mapping: ``budget`` is the most slots per KV head BUZZ may ever hold. Unless ``window`` and
    ``threshold`` are given, w is the largest window with T = max(s, round(t_over_w * w)) whose peak
    k + w + (middle peak) fits, then T grows into any slot left over. With the default counting the peak is
    exactly k + w + T = budget, so "equal cache size" comparisons against other policies are peak-to-peak;
    ``footprint`` gives BUZZ's actual (sawtooth) slot count over time.

    Choices where the paper is ambiguous (all parameters):
      * ``threshold_on``: what counts toward T. "total" (default) = old + new middle tokens, as in Appendix
        D.1's recurrence (eq. 10: T - a_{n-1} new tokens per pass), Figure 3 ("once the total token count
        reaches the threshold"), Remark 2 (a container of T + k + w) and the authors' released code; the
        cache then never exceeds k + w + T. "new" = Algorithm 1 read literally (T new tokens buffered per
        pass whatever the old count): peak k + w + T + max(T, old steady state).
      * ``inclusive_bounds``: Algorithm 1's `while m <= T` buffers T + 1 tokens, i.e. the pass fires when the
        count exceeds T (default, also the released code's `size <= T: skip`); False fires when it reaches T
        (eq. 10's a_1 = floor(T/s)). The fill loop's extra first-pass token is not reproduced (off by one).
      * ``hive_tail``: a partial hive (count not a multiple of s or s_hat) yields its local max ("keep",
        Algorithm 2's `A[idx:idx+s]` slice) or is evicted ("drop", the floors of eq. 10).
      * ``hive_align``: hives start at the oldest token ("left", Algorithm 2) or end at the newest ("right").
        Interval sampling keeps the first token of each interval (python's [::s_hat]), mirrored when right.
      * ``score_scope``/``group_reduce``: accumulated attention (sum over all queries since a token was
        cached, H2O-style) per KV head with the G query heads reduced by sum/mean/max, or one score per layer
        shared by all heads (all heads keep the same positions). GQA support is kvsim's choice: the released
        code scores per attention head and has no GQA path (its query-head folding is commented out); the
        default sum is what that folding would have done.
      * the window holds the last w tokens including the newest; n_sinks=4 and s=5 follow the paper's
        experiments; t_over_w=0 means Theorem 3.1's value for s (eq. 6: 4.33 at s = 5).
      * ``prefill="fit"`` (default, Remark 2): when the prompt's middle exceeds what a pass leaves, one
        local-max pass with s, then interval passes with s_hat over the survivors (old tokens by then) until it
        fits; otherwise the middle stays buffered as new tokens. ``"one_pass"`` (the released code,
        danielfang001/buzz-llm ``BuzzKVCacheWithAccumulation``, which runs one pass per forward call): the
        local-max pass only, so after a long prompt it holds k + w + ceil((P - k - w) / s) slots, more than
        k + w + T (e.g. 156 against 36 at P = 700, k = 4, w = 16, T = 40, s = 5); the next decode steps thin
        the excess with s_hat passes (old + new > T fires every step until it fits). Its budget is not the
        peak then: it needs explicit ``window`` and ``threshold`` (the released code is configured by them),
        and ``allocate`` gives each head the slots it really holds, max(budget, that prefill count). With
        ceil((P - k - w) / s) <= T both modes keep the same sets at every step.

    Theorem 3.1 against this implementation: with "total" counting, strict bounds and dropped tails the old
    count after each pass is exactly eq. 10 with a/s_hat (the printed 2a/s_hat is a typo); its limit equals w
    at T/w = (s^2+1)/(s+1) for odd s and s-1 for even s, i.e. the statement (eq. 6); the proof's eq. 13-14
    swap the parity labels. With "new" counting the same criterion gives T/w = s(s_hat-1)/s_hat (3.33 at s=5).
    """

    name = "buzz"
    reads_keys = False
    reads_values = False
    #: what a configuration search tries (``Policy.search_grid``), the paper default first
    search_grid = {"t_over_w": (0.0, 1.0, 2.0, 8.0)}
    summary = "sinks + beehive local-max sampling + window, threshold passes"
    schema = SCHEMA
    P = P
    slot_fields = 2
    head_fields = _HEAD_FIELDS
    step_fn = _step
    prefill_fn = _prefill

    def replay_head_state(self, n_kv_heads: int, head_dim: int, layer: Any, memo: dict | None = None,
                          n_prompt: int = 0) -> np.ndarray:
        """The head fields, then the attention every prompt key accumulates over the prompt [Hkv, n_prompt] (the
        prefill's hive scores, O(P^2 G d), most of a long replay): the trace table
        ``policies.core.shared_kernels.prompt_attention_table``, computed once per trace and shared with BumbleBee; the prefill
        reads it (the same bits) instead of recomputing. The closed loop's prefill computes it itself."""
        head = super().replay_head_state(n_kv_heads, head_dim, layer, memo, n_prompt)
        if n_prompt < 1:
            return head
        mode = int(self.param_vector(layer.attention)[P.group_reduce])
        return np.concatenate([head, prompt_attention_table(layer, memo, n_prompt, mode)], axis=1)

    def validate(self) -> None:
        T = self.params["threshold"]
        if T and T < self.params["stride"]:
            raise PolicyError(f"{self.name}.threshold: {T} is below the stride {self.params['stride']} "
                              f"(a pass must cover at least one full hive)")
        # T >= s is also sufficient: a pass then never leaves more than it found room for (tested)
        if self.params["prefill"] == "one_pass" and not (self.params["window"] and self.params["threshold"]):
            raise PolicyError(f"{self.name}.prefill=one_pass needs explicit window and threshold (the released "
                              f"code's configuration): one pass can hold more than a budget-derived peak")

    def rule(self, w: int, T: int) -> CountRule:
        """The count conventions of this instance for a given window and threshold."""
        p = self.params
        return CountRule(p["n_sinks"], w, T, p["stride"], p["threshold_on"] == "new", p["inclusive_bounds"],
                         p["hive_tail"] == "drop", p["prefill"] == "one_pass")

    def window_threshold(self, budget: int) -> tuple[int, int]:
        """The (w, T) this policy uses at ``budget`` (the kernels derive the same)."""
        w, T = derive_window_threshold(self.param_vector(), int(budget))
        return int(w), int(T)

    def peak(self, budget: int) -> int:
        """Most slots per KV head ever held at ``budget`` (<= budget once the budget is valid)."""
        w, T = self.window_threshold(budget)
        r = self.rule(w, T)
        return r.k + w + int(middle_peak(T, r.s, r.threshold_on_new, r.inclusive, r.drop_tail))

    def min_budget(self) -> int:
        p = self.params
        w = p["window"] or 1
        T = p["threshold"] or p["stride"]
        return p["n_sinks"] + w + int(middle_peak(T, p["stride"], p["threshold_on"] == "new",
                                                  p["inclusive_bounds"], p["hive_tail"] == "drop"))

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(sinks=self.params["n_sinks"], recent=self.window_threshold(budget)[0])

    def allocate(self, budget: int, n_kv_heads: int, prompt_layers: Sequence[tuple[np.ndarray, np.ndarray]],
                 scale: float) -> np.ndarray:
        """``budget`` everywhere; with ``prefill=one_pass`` at least the slots the one prompt pass leaves."""
        n_prompt = prompt_layers[0][0].shape[0] if prompt_layers else 0
        b = budget
        if self.params["prefill"] == "one_pass" and n_prompt:
            b = max(budget, held_after_prefill(self.rule(*self.window_threshold(budget)), n_prompt))
        return np.full((len(prompt_layers), n_kv_heads), b, dtype=np.int64)

    def footprint(self, budget: int, n_tokens: int, *, n_prompt: int = 0) -> int:
        """Slots per KV head held after ``n_tokens`` tokens (a prompt of ``n_prompt`` compressed at once).

        Trajectories are memoised per (budget, n_prompt), so tabulating n = 1..N costs O(N), not O(N^2).
        """
        if n_tokens <= 0:
            return 0
        rule = self.rule(*self.window_threshold(budget))
        if n_tokens <= n_prompt:
            return held_after_prefill(rule, n_tokens)
        cache = self.__dict__.setdefault("_held_cache", {})
        traj = cache.get((budget, n_prompt), [])
        if len(traj) < n_tokens:
            traj = held_trajectory(rule, max(n_tokens, 2 * len(traj), 1024), n_prompt)
            cache[(budget, n_prompt)] = traj
        return traj[n_tokens - 1]


@register
class BuzzLogN(Buzz):
    """BUZZ with log n (Section 3.5, eq. 7-8): BUZZ eviction plus attention logits multiplied by log_512(n).

    n is the number of tokens seen so far (the sequence length), not the number of cached slots: eq. 8
    keeps the same log_512 n after compressing K. For n < 512 the multiplier is below 1 (softer attention),
    as eq. 7 says; ``logn_clamp`` (not in the paper) floors it at 1. The simulator measures against the
    model's unscaled attention, so the scaling alone already costs accuracy there, even without eviction.
    """

    name = "buzz_logn"
    summary = "BUZZ + log_512(n) attention-logit scaling"
    schema = LOGN_SCHEMA
    P = PL
    logit_scale_fn = _logn_scale
