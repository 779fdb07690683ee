"""BUZZ slot-count dynamics in plain Python: how many old and buffered tokens a cache holds over time.

Counts do not depend on attention scores (hives keep one token each whatever the scores), so the whole
trajectory of held slots follows from (k, w, T, s) and the rounding/threshold conventions. This model is
the reference the numba kernel is tested against, feeds ``Buzz.footprint``, and states Appendix D.1's
recurrence (eq. 10) as the implementation realises it.
"""
from __future__ import annotations

from dataclasses import dataclass


def small_stride(s: int) -> int:
    """Stride for old tokens, s_hat = floor((s + 1) / 2) (Section 3.3)."""
    return (s + 1) // 2


def kept(m: int, stride: int, drop_tail: bool) -> int:
    """Tokens one sampling pass keeps out of ``m``: one per hive, a partial last hive counts unless dropped."""
    return m // stride if drop_tail else -(-m // stride)


def theorem_ratio(s: int) -> float:
    """T/w that Theorem 3.1 (eq. 6) predicts optimal: (s^2+1)/(s+1) for odd s, s-1 for even s."""
    return (s * s + 1) / (s + 1) if s % 2 else float(s - 1)


@dataclass(frozen=True)
class CountRule:
    """The conventions that fix BUZZ's counts: see ``policies.buzz.Buzz`` for what each one means."""

    k: int
    w: int
    T: int
    s: int
    threshold_on_new: bool = False   # False: old + new tokens count toward T (eq. 10); True: new only (Alg. 1)
    inclusive: bool = True           # pass fires when the count exceeds T (Alg. 1's `<=` loops) vs reaches it
    drop_tail: bool = False          # a partial hive is evicted instead of yielding its local max
    one_pass_prefill: bool = False   # the prompt gets one local-max pass whatever it leaves (released code)

    @property
    def fire(self) -> int:
        """Counted tokens that trigger a pass."""
        return self.T + 1 if self.inclusive else self.T

    @property
    def limit(self) -> int:
        """Most counted tokens held without a pass (also Remark 2's prefill target)."""
        return self.fire - 1

    def after_pass(self, old: int, new: int) -> int:
        """Old tokens after one pass over ``old`` old and ``new`` new tokens."""
        return kept(old, small_stride(self.s), self.drop_tail) + kept(new, self.s, self.drop_tail)

    def prefill(self, n_prompt: int) -> tuple[int, int]:
        """(old, new) middle tokens after Remark 2's prefill of ``n_prompt`` tokens."""
        m = n_prompt - self.k - self.w
        if m <= self.limit:
            return 0, max(m, 0)
        old = kept(m, self.s, self.drop_tail)
        while old > self.limit and not self.one_pass_prefill:
            old = kept(old, small_stride(self.s), self.drop_tail)
        return old, 0


def held_after_prefill(rule: CountRule, n_prompt: int) -> int:
    """Slots held once a prompt of ``n_prompt`` tokens has been compressed (Remark 2)."""
    old, new = rule.prefill(n_prompt)
    return min(n_prompt, rule.k) + min(max(n_prompt - rule.k, 0), rule.w) + old + new


def held_trajectory(rule: CountRule, n_tokens: int, n_prompt: int = 0) -> list[int]:
    """Slots held after each token 0..n_tokens-1 is processed (prompt tokens all report the post-prefill count)."""
    k, w = rule.k, rule.w
    out: list[int] = []
    old = new = 0
    start = 0
    if n_prompt > 0:
        old, new = rule.prefill(n_prompt)
        out = [held_after_prefill(rule, n_prompt)] * n_prompt
        start = n_prompt
    for t in range(start, n_tokens):
        n = t + 1
        if n > k + w:
            new += 1
        counted = new if rule.threshold_on_new else old + new
        if counted >= rule.fire:
            old, new = rule.after_pass(old, new), 0
        out.append(min(n, k) + min(max(n - k, 0), w) + old + new)
    return out


def old_sequence(rule: CountRule, n_passes: int) -> list[int]:
    """Old-token counts a_1, a_2, ... after successive decode passes starting from an empty cache."""
    seq: list[int] = []
    old = 0
    for _ in range(n_passes):
        new = rule.fire if rule.threshold_on_new else rule.fire - old
        old = rule.after_pass(old, new)
        seq.append(old)
    return seq


def paper_recurrence(s: int, T: int, n_passes: int, *, literal: bool = False) -> list[int]:
    """Eq. 10 of Appendix D.1: a_n = floor(c * a_{n-1} / s_hat) + floor((T - a_{n-1}) / s), a_1 = floor(T / s).

    ``literal=True`` uses the printed c = 2; ``False`` uses c = 1, which is what interval sampling with
    stride s_hat does (eq. 11 then reads 2a/(s+1), exact for odd s).
    """
    c = 2 if literal else 1
    sh = small_stride(s)
    seq = [T // s]
    for _ in range(n_passes - 1):
        a = seq[-1]
        seq.append((c * a) // sh + (T - a) // s)
    return seq


def steady_old_fraction(s: int, threshold_on_new: bool = False) -> float:
    """lim a_n / T of the implementation's recurrence without rounding: the fixed point of
    a = a/s_hat + (T - a)/s ("total" counting) or a = a/s_hat + T/s ("new" counting, Algorithm 1)."""
    sh = small_stride(s)
    if threshold_on_new:
        return sh / (s * (sh - 1))
    return 1.0 / (s - s / sh + 1.0)


def predicted_ratio(s: int, threshold_on_new: bool = False) -> float:
    """T/w at which the steady-state old count equals the window, the optimality criterion of Appendix D.1.

    For "total" counting this is Theorem 3.1's eq. 6 for every s; for Algorithm 1's "new" counting it is
    s(s_hat - 1)/s_hat (odd s: s(s-1)/(s+1); even s: s - 2).
    """
    return 1.0 / steady_old_fraction(s, threshold_on_new)
