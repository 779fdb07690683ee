"""The ``ada`` stage: Ada-KV (Feng et al., 2024) head-wise budget allocation, its class and its kernels.

``ada(x)`` allocates a layer's budget across its KV heads from x's prompt scores, with the safeguard
``floor_alpha`` (``ada_prompt``: top-k over the flattened candidate scores of the layer's heads, mixed with the
uniform split); at decode every head keeps its prefill-allocated size (``decode_alloc='fixed'``, the authors'),
or the layer re-allocates over the flattened scores at every step (``'flat'``, ``ada_evict_flat``). ``rounding``
chooses the safeguard's rounding. The protected recent window is the layer's smallest, kept by every head.
The paper's policies ``ada_snapkv``, ``ada_pyramidkv`` and ``ada_h2o`` are names of ``ada(snapkv)``,
``ada(pyramidkv)`` and ``ada(h2o)`` (policies/adakv.py). Against the released code (FFY0/AdaKV, GQA path): with
``group_reduce=mean, floor_alpha=0`` Ada-SnapKV's prefill is the released selection apart from equal-score ties;
``rounding=released`` is its rounding; at a budget equal to the prompt length the released code still compresses
(and its ``int()`` floor can drop a slot per head) where kvsim keeps the prompt, and below the window (B < 32) it
fails where kvsim keeps the window (``window_only``), so "as the released code" holds at B = 32 only.

Ada-KV (Feng et al., 2024). Eviction loss and its bound (Theorems 1-2, rebuilt from the prose; the symbols were
lost in extraction): for one head with full attention weights ``A_j`` and values ``v_j``, keeping the set ``I``
gives post-eviction weights ``A_j 1[j in I] / F`` with retained mass ``F = sum_{j in I} A_j`` (Theorem 1), so
with ``C = max_j ||v_j||_1``, ``||o - o'||_1 <= C sum_j A_j |1 - 1[j in I] / F| = 2 C (1 - F)``. The paper states
it after the output projection and summed over the heads of a layer (Theorem 2); the per-head form is that
statement with ``W^O_i`` the identity and a per-head ``C``, which is tighter, and the engine's metrics ``l1`` and
``l1_bound`` are exactly it (tests check both forms). Top-k selection maximises ``F`` for given budgets
(Theorem 3); Ada-KV picks the budgets by a top-k over the flattened scores of all heads of a layer, which
maximises ``sum_i F_i`` for the layer's total, hence its bound is never above the uniform allocation's
(Theorem 4) -- with the safeguard too, see ``ada_allocate``.

Ada-KV state (2 head-state columns): [0] 1 once the head's decode-time size is set, [1] that size.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from policies.core.base import Param, Policy
from policies.core.kvpress_press import KvpressPress, NoKvpressPress
from policies.core.scorer import ScorerPolicy, StageCode
from policies.core.stage_base import Stage

#: rounding of Ada-KV's safeguard mixture: exact total by largest remainder, or the released code's int() floor,
#: round-half-even, no total correction (``ada_allocate``)
ROUNDING_RULES = ("largest_remainder", "released")


@njit(cache=True)
def ada_allocate(scores, base, alpha, released=False):
    """Ada-KV head budgets for one layer: int64 [H] summing exactly to ``sum(base)``.

    scores [H, C]: observed (pooled) scores of each head's C candidate tokens; base [H]: the uniform per-head
    budgets (each <= C). Algorithm 2: take the top ``K = sum(base)`` entries of the flattened scores of all
    heads; head h's adaptive count ``n_h`` is how many of them are its own. Safeguard (authors' code): the
    budget is the mixture ``(1 - alpha) * n_h + alpha * base_h``, so every head keeps at least
    ``floor(alpha * base_h)`` and ``alpha = 1`` is the uniform allocation. The authors round each head
    independently (``round``) after truncating the floor with ``int``, which can miss the total by a few
    slots; here the mixture is rounded by largest remainder (ties: larger n_h, then lower head), so the sum is
    exact and each budget stays between ``n_h`` and ``base_h`` -- which keeps Theorem 4 (the adaptive
    bound is never above the uniform one) true for every alpha. Flattened ties go to the lower head index.
    ``released``: the released rounding, ``round_half_even((1 - alpha) * n_h + int(alpha * base_h))``, whose
    total can fall short of ``sum(base)`` (left short) or exceed it by up to H / 2 slots; an excess would break
    the layer budget, so it is taken back one slot at a time from the heads that rounded up the most (ties:
    the higher head), the one deviation from the released code.
    """
    h_n, c_n = scores.shape
    total = 0
    for h in range(h_n):
        total += base[h]
    flat = np.empty(h_n * c_n, np.float64)
    for h in range(h_n):
        for i in range(c_n):
            flat[h * c_n + i] = -scores[h, i]
    order = np.argsort(flat, kind="mergesort")
    counts = np.zeros(h_n, np.int64)
    for j in range(min(total, h_n * c_n)):
        counts[order[j] // c_n] += 1
    out = np.zeros(h_n, np.int64)
    if released:
        gain = np.zeros(h_n, np.float64)
        got = 0
        for h in range(h_n):
            x = (1.0 - alpha) * counts[h] + np.float64(np.int64(alpha * base[h]))
            out[h] = np.int64(np.round(x))
            gain[h] = out[h] - x
            got += out[h]
        for _ in range(got - total):
            best = 0
            for h in range(1, h_n):
                if gain[h] >= gain[best]:
                    best = h
            out[best] -= 1
            gain[best] -= 1.0
        return out
    rem = np.zeros(h_n, np.float64)
    given = 0
    for h in range(h_n):
        x = (1.0 - alpha) * counts[h] + alpha * base[h]
        f = np.floor(x + 1e-9)
        out[h] = np.int64(f)
        rem[h] = max(0.0, x - f)
        given += out[h]
    for _ in range(total - given):
        best = -1
        for h in range(h_n):
            if best < 0 or rem[h] > rem[best] or (rem[h] == rem[best] and counts[h] > counts[best]):
                best = h
        out[best] += 1
        rem[best] = -1.0
    return out


@njit(cache=True)
def target_size(base, head_state, off, h):
    """A head's size after each decode step: its prefill allocation, else its base size."""
    return np.int64(head_state[h, off + 1]) if head_state[h, off] > 0 else base[h]


@njit(cache=True)
def ada_sizes(head_state, off, base, sizes):
    """Ada-KV at decode (the authors' fixed allocation): every head keeps its prefill-allocated size."""
    for h in range(sizes.shape[0]):
        sizes[h] = target_size(base, head_state, off, h)


@njit(cache=True)
def ada_prompt(scores, base, w_e, alpha, released, lo, hi, head_state, off, sizes):
    """Ada-KV's prompt selection (Algorithm 1 with Algorithm 2's budgets) over any scores [Hkv, P]: sinks (the
    positions below ``lo[h]``) rank first (+inf; other scores are capped at 1e300), the last ``w_e`` prompt
    tokens are kept by every head, and the layer's candidate budget ``sum(base - w_e)`` is split across heads by
    ``ada_allocate`` over the flattened candidate scores (safeguard ``alpha``; ``released`` rounding). Sets
    ``sizes`` (what each head keeps of the prompt) and ``lo``/``hi`` (its candidates: positions [0, P - w_e)),
    and stores each head's decode-time size. Heads whose prompt fits keep everything."""
    h_n, P = scores.shape
    for h in range(h_n):
        for i in range(P):
            scores[h, i] = np.inf if i < lo[h] else min(scores[h, i], 1e300)
    c_n = P - w_e
    fits = True
    for h in range(h_n):
        lo[h] = 0
        hi[h] = max(c_n, 0)
        if base[h] < P:
            fits = False
    if fits or c_n <= 0:
        for h in range(h_n):
            head_state[h, off] = 1.0
            head_state[h, off + 1] = base[h]
            sizes[h] = P
        return
    cand = np.empty(h_n, np.int64)
    for h in range(h_n):
        cand[h] = min(max(base[h] - w_e, 0), c_n)
    alloc = ada_allocate(np.ascontiguousarray(scores[:, :c_n]), cand, alpha, released)
    for h in range(h_n):
        sizes[h] = alloc[h] + w_e
        head_state[h, off] = 1.0
        head_state[h, off + 1] = alloc[h] + w_e if base[h] < P else base[h]


@njit(cache=True)
def evict_flat(scores, positions, lengths, lo_pos, hi_pos, floors, head_state, off, keep):
    """Ada-KV re-allocation at decode: the layer drops ``sum(lengths) - sum(targets)`` slots, each time the
    lowest-scored candidate (position in [lo_pos[h], hi_pos[h])) of any head still above its floor (ties: lower
    head, older token); the heads' new sizes become their targets."""
    hkv = lengths.shape[0]
    excess = 0
    left = np.empty(hkv, np.int64)
    for h in range(hkv):
        left[h] = lengths[h]
        excess += lengths[h] - np.int64(head_state[h, off + 1])
    for _ in range(excess):
        bh = -1
        bi = -1
        for h in range(hkv):
            if left[h] <= floors[h]:
                continue
            for i in range(lengths[h]):
                if keep[h, i] == 0 or positions[h, i] < lo_pos[h] or positions[h, i] >= hi_pos[h]:
                    continue
                if bh < 0 or scores[h, i] < scores[bh, bi]:
                    bh = h
                    bi = i
        if bh < 0:
            break
        keep[bh, bi] = 0
        left[bh] -= 1
    for h in range(hkv):
        head_state[h, off] = 1.0
        head_state[h, off + 1] = left[h]


@njit(cache=True)
def ada_evict_flat(alpha, base, recent, lo, hi, lengths, positions, scores, head_state, off, sizes, keep):
    """``decode_alloc='flat'``: Algorithm 2 carried into decode. When a head is over its size, the layer evicts
    its lowest-scored candidates over the flattened scores of all heads, every head keeping its recent window
    plus ``floor(alpha * (base - recent))`` slots, so head sizes keep adapting."""
    hkv = lengths.shape[0]
    floors = np.empty(hkv, np.int64)
    over = False
    for h in range(hkv):
        floors[h] = recent[h] + int(alpha * (base[h] - recent[h]))
        if lengths[h] > sizes[h]:
            over = True
    if not over:
        return
    for h in range(hkv):
        if head_state[h, off] == 0.0:
            head_state[h, off] = 1.0
            head_state[h, off + 1] = base[h]
    evict_flat(scores, positions, lengths, lo, hi, floors, head_state, off, keep)


def allocation_bound(weights: np.ndarray, budgets: np.ndarray, vmax1: np.ndarray | float = 1.0) -> float:
    """The layer's Theorem 2 bound ``sum_h 2 C_h (1 - top_{b_h}(weights[h]))`` for per-head budgets (Theorem 3:
    the top-k kept set maximises the retained mass). weights [H, N] observed attention, budgets [H]."""
    w = np.sort(np.asarray(weights, np.float64), axis=1)[:, ::-1]
    kept = np.array([w[h, : int(b)].sum() for h, b in enumerate(budgets)])
    return float((2.0 * np.asarray(vmax1, np.float64) * (1.0 - kept)).sum())


FLOOR_ALPHA = Param("floor_alpha", 0.5, "float", 0.0, 1.0,
                    doc="safeguard: head budget = (1-a) * adaptive + a * uniform (0: pure Algorithm 2, 1: uniform)")
DECODE_ALLOC = Param("decode_alloc", "fixed", "choice", choices=("fixed", "flat"),
                     doc="decode: heads keep their prefill allocation (authors) or re-allocate over flattened scores")
ROUNDING = Param("rounding", "largest_remainder", "choice", choices=ROUNDING_RULES, searchable=False,
                 doc="safeguard rounding: exact total, or the released int() floor + round-half-even")


class AdaStage(Stage):
    name = "ada"
    summary = "Ada-KV head-wise budget allocation"
    params = (FLOOR_ALPHA, DECODE_ALLOC, ROUNDING)
    head_fields = 2
    needs_prompt_score = True
    policy_attrs = {"head_adaptive": True}

    @classmethod
    def refuse(cls, inner: type[ScorerPolicy]) -> str | None:
        if inner.scorer.ranks_by_position:
            return (f"{inner.scorer.name} ranks tokens by position only, and Ada-KV allocates a layer's budget by "
                    f"importance scores: every head ties and the first heads would take the whole budget")
        if inner.scorer.score_prompt is None:
            return (f"{inner.scorer.name} has no prompt score, and Ada-KV allocates the layer's budget across heads "
                    f"from the prompt's scores")
        if getattr(inner.scorer, "allocates_heads", False):
            return (f"{inner.scorer.name} gives every head its own budget from its scores already (ranked across "
                    f"heads and layers); Ada-KV would allocate the layer's budget a second time")
        return None

    @classmethod
    def code(cls, pol: type[ScorerPolicy]) -> StageCode:
        off = pol.head_offsets[cls.name]
        a, flat, rnd = (cls.index(pol, p.name) for p in cls.params)
        evict = (f"        if params[{flat}] == 1.0:\n"
                 f"            ada_evict_flat(params[{a}], base, recent, lo, hi, lengths, positions, scores, "
                 f"head_state, {off}, sizes, keep)\n"
                 f"        else:\n"
                 f"            evict_to(sizes, lo, hi, lengths, positions, scores, keep)\n")
        return StageCode(step=f"    ada_sizes(head_state, {off}, base, sizes)\n",
                         prompt=f"    ada_prompt(scores, base, recent[0], params[{a}], params[{rnd}] == 1.0, lo, hi, "
                                f"head_state, {off}, sizes)\n",
                         evict=evict, layer_window=True, sets_sizes=True,
                         globals=(("ada_sizes", ada_sizes), ("ada_prompt", ada_prompt),
                                  ("ada_evict_flat", ada_evict_flat)))

    @classmethod
    def kvpress_prompt_at_once(cls, params: dict[str, Any]) -> bool:
        return params["floor_alpha"] == 1.0         # uniform budgets: the scorer's prompt selection

    @classmethod
    def kvpress(cls, policy: Policy, inner: KvpressPress) -> KvpressPress:
        """Only ``floor_alpha=1`` (uniform head budgets, the prompt selected at once by the scorer's prompt score):
        kvpress's ``AdaKVPress`` guarantees each head its top alpha share by score, another safeguard than the
        Ada-KV authors' mixture kvsim runs."""
        if policy.params["floor_alpha"] != 1.0:
            raise NoKvpressPress(
                f"{policy.label()}: kvpress's AdaKVPress guarantees every head its top alpha_safeguard x budget "
                "tokens by score and shares the rest by a flat top-k; kvsim's ada is the Ada-KV authors' "
                "safeguard (head budget = (1 - floor_alpha) x its share + floor_alpha x uniform), and the head "
                "budgets differ (SmolLM2 at 512: kvpress 148-929 tokens per head, kvsim 221-846); only "
                "floor_alpha=1 (uniform budgets) has a counterpart, the inner press")
        return inner
