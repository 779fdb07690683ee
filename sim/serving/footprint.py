"""KV memory a request holds over its life, tabulated once per policy/budget from the policy's footprint.

A footprint is any callable ``footprint(n_tokens) -> slots`` (slots per KV head per layer after ``n_tokens``
tokens); ``policy_footprint`` builds one from a registered policy (``Policy.footprint(budget, n)``).
Tables are indexed by cache length and hold int64 bytes so that memory checks are exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from sim.serving.hardware import ModelMemory, ServingConfigError

ACCOUNTING = ("varlen", "block")
PREFILL_PEAK = ("full", "compressed")


@dataclass(frozen=True)
class MemoryTables:
    """Bytes per request by cache length ``n``: ``held`` (allocated), ``read`` (attended per decode step),
    ``peak`` (transient during a prefill over ``n`` tokens)."""

    held: np.ndarray
    read: np.ndarray
    peak: np.ndarray
    slots: np.ndarray
    bytes_per_slot: int


def tabulate_footprint(footprint: Callable[[int], int], max_tokens: int) -> np.ndarray:
    """``slots[n]`` for n = 0..max_tokens, checked to be integers in [0, n] (no policy holds more than it saw)."""
    if max_tokens < 1:
        raise ServingConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    slots = np.zeros(max_tokens + 1, dtype=np.int64)
    for n in range(1, max_tokens + 1):
        s = footprint(n)
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)) or not 0 <= s <= n:
            raise ServingConfigError(f"footprint({n}) = {s!r}: must be an integer slot count in [0, {n}]")
        slots[n] = s
    return slots


def memory_tables(footprint: Callable[[int], int], model: ModelMemory, max_tokens: int, *,
                  accounting: str = "varlen", block_size: int = 16, prefill_peak: str = "full") -> MemoryTables:
    """Byte tables for one policy/budget.

    ``accounting``: "varlen" charges exactly the slots held (per-head variable-length cache, Ada-KV layout);
    "block" rounds each request up to whole blocks of ``block_size`` slots (paged KV, vLLM-style).
    ``prefill_peak``: "full" = the whole context is materialised before the policy compresses it
    (compress-after-prefill, as kvpress/SnapKV do); "compressed" = the policy bounds memory during prefill too.
    """
    if accounting not in ACCOUNTING:
        raise ServingConfigError(f"accounting must be one of {ACCOUNTING}, got {accounting!r}")
    if prefill_peak not in PREFILL_PEAK:
        raise ServingConfigError(f"prefill_peak must be one of {PREFILL_PEAK}, got {prefill_peak!r}")
    if block_size < 1:
        raise ServingConfigError(f"block_size must be >= 1, got {block_size}")
    slots = tabulate_footprint(footprint, max_tokens)
    bps = model.bytes_per_slot

    def charged(s: np.ndarray) -> np.ndarray:
        if accounting == "block":
            s = -(-s // block_size) * block_size
        return s * bps

    held = charged(slots)
    peak = charged(np.arange(max_tokens + 1, dtype=np.int64)) if prefill_peak == "full" else held.copy()
    return MemoryTables(held=held, read=slots * bps, peak=np.maximum(peak, held), slots=slots, bytes_per_slot=bps)


def policy_footprint(policy: Any, budget: int | None) -> tuple[Callable[[int], int], str, int | None]:
    """``(footprint(n), label, budget)`` of a ``policies.core.base.Policy`` at ``budget``.

    Unbounded policies (the full cache) ignore the budget and report ``None``; others must accept it.
    """
    if getattr(policy, "unbounded", False):
        return (lambda n: policy.footprint(0, n)), policy.label(), None
    if budget is None:
        raise ServingConfigError(f"policy {policy.label()!r} needs a budget")
    policy.check_budget(budget)
    return (lambda n: policy.footprint(budget, n)), f"{policy.label()}@{budget}", budget
