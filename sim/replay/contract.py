"""The policy step contract, checked in one place for every executor of a policy.

The numba replay engine (``sim/replay/engine.py`` via ``sim/replay/policy_replay.py``), the plain-numpy reference
(``sim/replay/numpy_reference.py``) and the closed-loop model runner (``gpu_validate/closedloop/runner.py``) all run the same
policy kernels (``policies/core/base.py`` states the contract). They size their slot buffers with
``slot_capacity``, validate ``allocate()`` with ``check_allocation``, and after each step (or prefill) call the
jitted checks below, which return a status code and fill ``info = (step, head, value)``; ``contract_error``
turns a status into the one exception type, ``PolicyContractError``, with a message naming the policy, layer,
step, head and what broke. The engine calls the same jitted checks inside its nopython loop, so there is one
definition of "over budget", "bad merge" and "bad logit scale".
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import njit

from policies.core.base import Policy, PolicyError

#: status codes of the checks (and of the engine's ``replay_layer``)
OK, OVER_BUDGET, BAD_MERGE, BAD_SCALE, OVER_CAPACITY = 0, 1, 2, 3, 4


class PolicyContractError(PolicyError):
    """A policy broke the step contract: bad ``allocate()`` budgets, over budget or over its buffer, a bad
    merge target, or a bad attention-logit scale."""


def slot_capacity(policy: Policy, budgets: np.ndarray, n_tokens: int, chunk: int = 1) -> np.ndarray:
    """Slots each KV head's buffer needs for one layer: int64 [Hkv] for that layer's budgets [Hkv].

    A step appends its new tokens (one, or a prompt chunk of ``chunk``) before the policy evicts, so a bounded
    head holds at most its budget plus that many (a head-adaptive layer: the layer's total plus that many, in
    any head); nothing holds more than the ``n_tokens`` the run has.
    """
    budgets = np.asarray(budgets, np.int64)
    new = max(1, int(chunk))
    if policy.unbounded:
        need = np.full(budgets.shape, n_tokens, np.int64)
    elif policy.head_adaptive:
        need = np.full(budgets.shape, int(budgets.sum()) + new, np.int64)
    else:
        need = budgets + new
    return np.minimum(need, max(int(n_tokens), 1))


def check_allocation(policy: Policy, budgets: object, n_layers: int, n_kv_heads: int) -> np.ndarray:
    """``allocate()``'s result as contiguous int64 [L, Hkv], or PolicyContractError when its shape or values
    are wrong (every head needs at least one slot, for the newest token)."""
    try:
        arr = np.ascontiguousarray(budgets, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise PolicyContractError(f"policy {policy.label()}: allocate() returned {type(budgets).__name__}, "
                                  f"not integer budgets: {exc}") from None
    if arr.shape != (n_layers, n_kv_heads) or (arr < 1).any():
        low = f", smallest {int(arr.min())}" if arr.size else ""
        raise PolicyContractError(f"policy {policy.label()}: allocate() returned budgets of shape {arr.shape}"
                                  f"{low} (need ({n_layers}, {n_kv_heads}), all >= 1)")
    return arr


@njit(cache=True, nogil=True)
def check_scale(mult, t, info):
    """BAD_SCALE unless the logit multiplier ``logit_scale(params, t + 1)`` of step t is finite and positive."""
    if not np.isfinite(mult) or mult <= 0.0:
        info[0] = t
        return BAD_SCALE
    return OK


@njit(cache=True, nogil=True)
def check_kept(kept_n, budget, head_adaptive, bounded, t, info):
    """OVER_BUDGET when a head holds more than its budget (head-adaptive: the layer more than the sum) after
    step t (-1: the prefill). ``kept_n`` [Hkv] slots held after the eviction; unbounded policies pass."""
    if not bounded:
        return OK
    if head_adaptive:
        held = 0
        total = 0
        for h in range(kept_n.shape[0]):
            held += kept_n[h]
            total += budget[h]
        if held > total:
            info[0] = t
            info[1] = -1
            info[2] = held
            return OVER_BUDGET
        return OK
    for h in range(kept_n.shape[0]):
        if kept_n[h] > budget[h]:
            info[0] = t
            info[1] = h
            info[2] = kept_n[h]
            return OVER_BUDGET
    return OK


@njit(cache=True, nogil=True)
def check_merges(h, n, keep, merge_to, t, info):
    """BAD_MERGE when a slot i < n of KV head h merges (``merge_to[h, i] = j >= 0``) while kept itself, or into
    a slot j that is not a kept slot < n other than i."""
    for i in range(n):
        j = merge_to[h, i]
        if j >= 0 and (keep[h, i] != 0 or j >= n or keep[h, j] == 0 or j == i):
            info[0] = t
            info[1] = h
            info[2] = i
            return BAD_MERGE
    return OK


@njit(cache=True, nogil=True)
def check_step(lengths, keep, merge_to, budget, head_adaptive, bounded, t, info):
    """All checks of one step's decision before it is applied: merges valid and, counting the kept slots of
    ``keep[h, :lengths[h]]``, the budget held. Returns OK or the first failure's status."""
    hkv = lengths.shape[0]
    kept_n = np.zeros(hkv, np.int64)
    for h in range(hkv):
        status = check_merges(h, lengths[h], keep, merge_to, t, info)
        if status != OK:
            return status
        for i in range(lengths[h]):
            if keep[h, i] != 0:
                kept_n[h] += 1
    return check_kept(kept_n, budget, head_adaptive, bounded, t, info)


@njit(cache=True, nogil=True)
def apply_window(lengths, keep, merge_to, positions, t, window):
    """A sliding layer's own rule, applied on top of a policy's checked decision at step t: every slot the next
    query (position t + 1) cannot see -- position <= t + 1 - window -- is dropped, and so is any merge into or
    out of a dropped slot. ``window`` 0 (a global layer): nothing changes. After the prompt's selection, call
    it with t = P - 1."""
    if window <= 0:
        return
    oldest = t + 1 - window
    for h in range(lengths.shape[0]):
        n = lengths[h]
        for i in range(n):
            if positions[h, i] <= oldest:
                keep[h, i] = 0
                merge_to[h, i] = -1
        for i in range(n):
            j = merge_to[h, i]
            if j >= 0 and keep[h, j] == 0:
                merge_to[h, i] = -1


def contract_error(policy: Policy, status: int, info: Sequence[int], layer: int) -> PolicyContractError:
    """The exception for a failed check: ``info = (step or -1 for the prefill, KV head or -1, value)``."""
    t, h, n = (int(x) for x in info)
    at = "prefill" if t < 0 else f"step {t}"
    what = {
        OVER_BUDGET: f"holds {n} slots in {'the layer' if h < 0 else f'KV head {h}'}, over its budget",
        OVER_CAPACITY: f"KV head {h} would hold {n} slots, more than its buffer (budget + 1)",
        BAD_MERGE: f"KV head {h} slot {n} has a merge target that is not a kept slot, or is itself kept",
        BAD_SCALE: "returned a non-finite or non-positive attention-logit scale",
    }.get(status, f"unknown status {status}")
    return PolicyContractError(f"policy {policy.label()} broke its contract at layer {layer}, {at}: {what}")


def raise_on(policy: Policy, status: int, info: Sequence[int], layer: int) -> None:
    """Raise ``contract_error`` unless ``status`` is OK."""
    if status != OK:
        raise contract_error(policy, status, info, layer)
