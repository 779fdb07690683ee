"""The ``critical`` stage: CriticalKV (Feng et al., 2025, arXiv 2502.03805), its class, its kernels and its
slice of the head state (the group's W_O, packed).

A token's output contribution is its attention times its value *after* the output projection, so the score alone misjudges tokens whose values W_O shrinks
or amplifies. Two stages per head: the top ``first_stage_ratio`` share of the head's slots for candidates
(its size less the protected tokens it holds) is kept by the current score; the other candidates compete on
``(score + critical_epsilon) * mean_j ||W_O^(j) v||_1`` over the group's query heads j (kvpress's L1 norm and
group mean; paper and kvpress defaults 0.5 and 1e-4). The size is the head's budget, or its allocation when an
``ada`` stage runs inside. Choices: (a) kvpress applies it once, at prefill; here the two stages run at every
eviction too; (b) stage 1 ranks the candidates only: kvpress protects nothing and ranks every prompt token,
here protected tokens are kept anyway, so they take no first-stage slot (with ``first_stage_ratio=1`` the
policy is the scorer's, as in kvpress); (c) the rescaling assumes non-negative attention-like scores (``expected_attention``
with ``use_vnorm=False``, SnapKV-like); over a negative score (``knorm``) the product inverts the ranking
exactly as kvpress's does. W_O comes from the trace (``wo`` arrays, written by ``kvsim record``) or, closed
loop, from the model's ``o_proj``.

CriticalKV state: [0] the index of its slot field (the slot's projected value norm, 0 = not yet computed),
[1] G*d, [2] hidden, then the query group's W_O, transposed [d, G * hidden], as float32 pairs packed into the
float64 head state; in a replay of a recorded trace, then every position's projected value norm (the table
``projected_norms`` computes once per trace layer), which the steps read instead of projecting each new value.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
from numba import njit

from policies.core.base import Param, Policy, PolicyError
from policies.core.kvpress_press import KvpressPress
from policies.core.scorer import ScorerPolicy, StageCode
from policies.core.stage_ada import AdaStage
from policies.core.stage_base import Stage

EPSILON = Param("critical_epsilon", 1e-4, "float", 0.0, 1.0,
                doc="added to the score before the W_O rescaling (CriticalKV, kvpress: epsilon)", searchable=False)
FIRST_STAGE_RATIO = Param("first_stage_ratio", 0.5, "float", 0.0, 1.0,
                          doc="share of the size selected by the plain score before the W_O rescaling (CriticalKV)")


#: value rows projected side by side in one pass over their group's W_O block (``_projected_l1_rows``): the block is
#: read once for them all, and their float32 products ([_ROWS, G * hidden]) stay in the core's L2
_ROWS = 16


@njit(cache=True, nogil=True)
def _projected_l1_rows(bt, vecs, rows, g_n, out):
    """``out[k]`` = mean_j ||W_O^(j) vecs[rows[k]]||_1 for each k < len(rows) (``vecs`` [n, d] float32) against the
    group's W_O stacked and transposed as ``bt`` [d, G * hidden]: per row, the products in float32 (a scratch of
    up to `_ROWS` rows of G * hidden), summed over x = 0, 1, ... in that order (four x per pass, SIMD over the entries),
    their absolute values summed in float64 in four fixed partial sums. Up to `_ROWS` rows share each pass over
    ``bt``, which is what a decode step's single new row pays for in full (the block is hundreds of KB, the layer's
    several MB).

    No fast-math, and each row's operations are the same whichever rows are projected beside it: a norm taken for
    one new slot at a step (closed loop, ``sim.replay.numpy_reference``), for a window of slots, for a prompt, or
    for a whole trace at once (``projected_norms``) is bit for bit the same, and replays with and without the
    precomputed table agree.
    """
    d, J = bt.shape
    m = rows.shape[0]
    prods = np.empty((min(m, _ROWS), J), np.float32)
    for k0 in range(0, m, _ROWS):
        k1 = min(k0 + _ROWS, m)
        for k in range(k0, k1):
            a = vecs[rows[k], 0]
            p = prods[k - k0]
            for j in range(J):
                p[j] = a * bt[0, j]
        for xx in range((d - 1) // 4):
            x = 1 + 4 * xx
            for k in range(k0, k1):
                v = vecs[rows[k]]
                a0 = v[x]
                a1 = v[x + 1]
                a2 = v[x + 2]
                a3 = v[x + 3]
                p = prods[k - k0]
                for j in range(J):
                    p[j] = (((p[j] + a0 * bt[x, j]) + a1 * bt[x + 1, j]) + a2 * bt[x + 2, j]) + a3 * bt[x + 3, j]
        for x in range(1 + 4 * ((d - 1) // 4), d):
            for k in range(k0, k1):
                a = vecs[rows[k], x]
                p = prods[k - k0]
                for j in range(J):
                    p[j] = p[j] + a * bt[x, j]
        for k in range(k0, k1):
            p = prods[k - k0]
            s0 = 0.0
            s1 = 0.0
            s2 = 0.0
            s3 = 0.0
            for jj in range(J // 4):
                j = 4 * jj
                s0 += abs(np.float64(p[j]))
                s1 += abs(np.float64(p[j + 1]))
                s2 += abs(np.float64(p[j + 2]))
                s3 += abs(np.float64(p[j + 3]))
            for j in range(4 * (J // 4), J):
                s0 += abs(np.float64(p[j]))
            out[k] = ((s0 + s1) + (s2 + s3)) / g_n


@njit(cache=True)
def _wo_block(head_state, off, h, d):
    """KV head h's W_O block [d, G * hidden] (float32, read in place from the head state) and G."""
    gd = int(head_state[h, off + 1])
    hidden = int(head_state[h, off + 2])
    g_n = gd // d
    m = g_n * hidden * d
    base = off + 4
    return head_state[h, base:base + (m + 1) // 2].view(np.float32)[:m].reshape((d, g_n * hidden)), g_n


@njit(cache=True)
def norm_table(head_state, off):
    """First column of the precomputed per-position norm table in the head state (``projected_norms``, after the
    W_O block), or -1 when the head state has none (closed loop: norms are computed as slots arrive)."""
    start = off + 4 + (int(head_state[0, off + 1]) * int(head_state[0, off + 2]) + 1) // 2
    return start if head_state[0, off + 3] > 0.0 else -1


@njit(cache=True)
def wo_l1(head_state, off, h, vecs):
    """CriticalKV's projected value norms of KV head h for the rows of ``vecs`` [n, d] (float32): the L1 norm of
    W_O^(j) v averaged over the query heads j of its group (``_projected_l1_rows``). The stage's head-state slice
    at ``off``: slot-field index, G*d, hidden, norm-table width, then the group's W_O transposed, [d, G * hidden],
    as float32 pairs packed into float64 slots (``CriticalStage.head_state_init``)."""
    bt, g_n = _wo_block(head_state, off, h, vecs.shape[1])
    out = np.empty(vecs.shape[0])
    _projected_l1_rows(bt, vecs, np.arange(vecs.shape[0]), g_n, out)
    return out


def projected_norms(head_state: np.ndarray, off: int, v: np.ndarray) -> np.ndarray:
    """Every token's projected value norm [Hkv, T] for the values v [T, Hkv, d] of a whole trace layer: the table a
    replay appends to the head state (``Combined.replay_head_state``), so that neither the prompt nor the decode
    steps project a value again. Bit for bit what ``wo_l1`` gives each row."""
    out = np.empty((v.shape[1], v.shape[0]))
    _projected_norms_into(head_state, off, v, out)
    return out


@njit(cache=True, nogil=True)
def _projected_norms_into(head_state, off, v, out):
    """``projected_norms`` into ``out``, the GIL released (layer threads side by side) and no array returned (see
    ``policies.core.shared_kernels.prompt_attention_into``: a returned array races on a first concurrent call)."""
    T, hkv, d = v.shape
    rows = np.arange(T)
    for h in range(hkv):
        bt, g_n = _wo_block(head_state, off, h, d)
        _projected_l1_rows(bt, v[:, h, :], rows, g_n, out[h])


@njit(cache=True)
def _sort_desc(a, m):
    """Insertion sort of a[:m], largest first."""
    for i in range(1, m):
        x = a[i]
        j = i - 1
        while j >= 0 and a[j] < x:
            a[j + 1] = a[j]
            j -= 1
        a[j + 1] = x


@njit(cache=True)
def _quickselect_desc(vals, m, k):
    """The k-th largest (1 <= k <= m) of vals[:m] (reordered): quickselect, median-of-three pivot, three-way
    partition (runs of equal scores cost one pass)."""
    lo = 0
    hi = m - 1
    t = k - 1
    while hi - lo >= 16:
        a = vals[lo]
        b = vals[(lo + hi) >> 1]
        c = vals[hi]
        if a < b:
            a, b = b, a
        if b < c:
            b = c
            if a < b:
                b = a
        pivot = b
        lt = lo
        i = lo
        gt = hi
        while i <= gt:
            x = vals[i]
            if x > pivot:
                vals[i] = vals[lt]
                vals[lt] = x
                lt += 1
                i += 1
            elif x < pivot:
                vals[i] = vals[gt]
                vals[gt] = x
                gt -= 1
            else:
                i += 1
        if t < lt:
            hi = lt - 1
        elif t > gt:
            lo = gt + 1
        else:
            return pivot
    _sort_desc(vals[lo:hi + 1], hi - lo + 1)
    return vals[t]


_SAMPLE = 32      # values sampled per narrowing round of ``kth_largest``
_MARGIN = 4       # sample ranks kept on either side of the expected rank


@njit(cache=True)
def kth_largest(vals, m, k, buf, samp):
    """The k-th largest (1 <= k <= m) of vals[:m], in O(m) with few mispredicted branches (vals and buf, each at
    least m long, and samp, _SAMPLE long, are overwritten): while many values are left, two pivots bracket the
    expected rank in a sorted sample, one branch-free pass counts the values above, between and below them, and
    a second copies the part that holds the k-th value; the last few dozen go to a quickselect."""
    while m > 2 * _SAMPLE:
        for i in range(_SAMPLE):
            samp[i] = vals[(i * m) // _SAMPLE + m // (2 * _SAMPLE)]
        _sort_desc(samp, _SAMPLE)
        r = ((k - 1) * _SAMPLE) // m
        hi_p = samp[r - _MARGIN] if r >= _MARGIN else np.inf
        lo_p = samp[r + _MARGIN] if r + _MARGIN < _SAMPLE else -np.inf
        above = 0
        mid = 0
        for i in range(m):
            x = vals[i]
            above += x > hi_p
            mid += (x >= lo_p) & (x <= hi_p)
        w = 0
        if k <= above:
            for i in range(m):
                x = vals[i]
                buf[w] = x
                w += x > hi_p
        elif k <= above + mid:
            k -= above
            if lo_p == hi_p:
                return lo_p
            for i in range(m):
                x = vals[i]
                buf[w] = x
                w += (x >= lo_p) & (x <= hi_p)
        else:
            k -= above + mid
            for i in range(m):
                x = vals[i]
                buf[w] = x
                w += x < lo_p
        if w == m:
            break
        vals, buf = buf, vals
        m = w
    return _quickselect_desc(vals, m, k)


@njit(cache=True)
def critical_stages(eps, ratio, size, lo, hi, positions, h, n, scores, norms):
    """CriticalKV's two stages on head h's first n slots. Stage 1 keeps outright (+inf) the top ``ratio`` share,
    by the current score, of the slots the head has for candidates (``size`` less its protected slots held);
    the other candidates (positions in [lo, hi)) are rescored ``(score + eps) * ||W_O v||_1`` (+inf stays +inf).
    Protected slots are never evicted and keep their score. With ``ratio = 1`` the stage changes no decision.

    Stage 1 is a selection, not a sort (O(n) per step, ``kth_largest``): the candidates scored above the n1-th
    largest candidate score, then as many of those equal to it as are left, newest first (equal scores keep the
    newer token, as the eviction, whose ties evict the older, would)."""
    work = np.empty(2 * n + _SAMPLE, np.float64)
    vals = work[:n]
    m = 0
    for i in range(n):
        if lo <= positions[i] < hi:
            vals[m] = scores[h, i]
            m += 1
    n1 = min(int(max(size - (n - m), 0) * ratio), m)
    kth = np.inf           # n1 = 0: no candidate is stage 1's
    ties = 0               # how many of the candidates scored kth stage 1 takes (the newest)
    n_eq = 0
    eq = work              # the slots of the candidates scored kth, in slot order (free again)
    if n1 > 0:
        kth = kth_largest(vals, m, n1, work[n:2 * n], work[2 * n:])
        ties = n1
        for i in range(n):
            if lo <= positions[i] < hi:
                s = scores[h, i]
                ties -= s > kth
                if s == kth:
                    eq[n_eq] = i
                    n_eq += 1
    for i in range(n):      # branch-free (SIMD); the candidates scored kth are settled below
        s = scores[h, i]
        rescored = np.inf if (s > kth) | (s == np.inf) else (s + eps) * norms[i]
        scores[h, i] = rescored if (lo <= positions[i] < hi) & (s != kth) else s
    for e in range(n_eq - 1, -1, -1):
        i = int(eq[e])
        s = scores[h, i]
        scores[h, i] = np.inf if ties > 0 or s == np.inf else (s + eps) * norms[i]
        ties -= 1


@njit(cache=True)
def _project_missing(head_state, off, h, n, lo, hi, positions, values, norms):
    """Head h's projected value norms of its first n slots where a candidate (position in [lo, hi)) lacks one:
    then every slot lacking one, in one pass over the group's W_O (``_projected_l1_rows``). The slots of the recent
    window wait until the first of them leaves it, and are projected together: a decode step's new value reads the
    whole W_O block for itself alone otherwise (a window of w slots, w times less W_O read). A slot's norm is
    the same whenever it is taken (its value never changes while it is held: scorers merge nothing), so the
    decisions are exactly those of projecting every slot as it arrives."""
    m = 0
    due = False
    for i in range(n):
        if norms[i] == 0.0:
            m += 1
            due |= lo <= positions[i] < hi
    if not due:              # most steps: nothing to project, nothing allocated
        return
    rows = np.empty(m, np.int64)
    k = 0
    for i in range(n):
        if norms[i] == 0.0:
            rows[k] = i
            k += 1
    bt, g_n = _wo_block(head_state, off, h, values.shape[1])
    out = np.empty(m)
    _projected_l1_rows(bt, values, rows, g_n, out)
    for k in range(m):
        norms[rows[k]] = out[k]


@njit(cache=True)
def critical_step(eps, ratio, sizes, lo, hi, lengths, positions, values, slot_state, head_state, off, scores,
                  every_head):
    """CriticalKV at a decode step: a slot's projected value norm is set once (kept in the stage's slot field; 0 =
    not yet): read from the head state's per-position table when the replay precomputed it, else projected when
    some candidate first needs one (`_project_missing`); then the two stages within each head's current size.
    Heads within their size are left as they are unless ``every_head`` (an ``ada`` stage outside compares the
    scores of all heads)."""
    f = int(head_state[0, off])
    tab = norm_table(head_state, off)
    for h in range(lengths.shape[0]):
        n = lengths[h]
        if n <= sizes[h] and not every_head:
            continue
        norms = slot_state[h, :, f]
        if tab >= 0:
            for i in range(n):
                if norms[i] == 0.0:
                    norms[i] = head_state[h, tab + positions[h, i]]
        else:
            _project_missing(head_state, off, h, n, lo[h], hi[h], positions[h], values[h], norms)
        critical_stages(eps, ratio, sizes[h], lo[h], hi[h], positions[h], h, n, scores, norms)


@njit(cache=True)
def critical_prompt(eps, ratio, sizes, lo, hi, v, slot_state, head_state, off, scores):
    """CriticalKV on the prompt (v [P, Hkv, d]): every token's projected value norm (from the head state's table
    when the replay precomputed it, else ``wo_l1`` per KV head), then the two stages within each head's size."""
    f = int(head_state[0, off])
    tab = norm_table(head_state, off)
    P = v.shape[0]
    pos = np.arange(P)
    for h in range(v.shape[1]):
        if tab >= 0:
            norms = head_state[h, tab:tab + P].copy()
        else:
            norms = wo_l1(head_state, off, h, np.ascontiguousarray(v[:, h, :]))
        slot_state[h, :, f] = norms
        critical_stages(eps, ratio, sizes[h], lo[h], hi[h], pos, h, P, scores, norms)


class CriticalStage(Stage):
    name = "critical"
    summary = "CriticalKV's W_O rescaling"
    params = (EPSILON, FIRST_STAGE_RATIO)
    head_fields = 4          # its slot-field index, G*d, hidden, norm-table width; the W_O block follows
    slot_fields = 1          # the slot's projected value norm, computed once
    policy_attrs = {"needs_wo": True, "reads_values": True}

    @classmethod
    def refuse(cls, inner: type[ScorerPolicy]) -> str | None:
        if inner.scorer.ranks_by_position:
            return (f"{inner.scorer.name} ranks tokens by position only: rescaling a position by the W_O-projected "
                    f"value norm has no meaning")
        return None

    @classmethod
    def code(cls, pol: type[ScorerPolicy]) -> StageCode:
        off = pol.head_offsets[cls.name]
        eps, ratio = (cls.index(pol, p.name) for p in cls.params)
        # the rescored scores of a head within its size are read only by an ``ada`` stage around this one (its flat
        # eviction compares every head's); else the eviction (evict_to, per head) reads only the heads over size
        every = any(s is AdaStage for s in pol.chain[pol.chain.index(cls) + 1:])
        return StageCode(step=f"    critical_step(params[{eps}], params[{ratio}], sizes, lo, hi, lengths, positions, "
                              f"values, slot_state, head_state, {off}, scores, {every})\n",
                         prompt=f"    critical_prompt(params[{eps}], params[{ratio}], sizes, lo, hi, v, slot_state, "
                                f"head_state, {off}, scores)\n",
                         globals=(("critical_step", critical_step),
                                  ("critical_prompt", critical_prompt)))

    @classmethod
    def kvpress(cls, policy: Policy, inner: KvpressPress) -> KvpressPress:
        """``CriticalKVPress`` around the inner press: kvpress counts the sinks inside stage 1, kvsim outside, so
        stage 1 differs by about sinks x (1 - first_stage_ratio) tokens."""
        p = policy.params
        sinks = int(inner.press.get("n_sink", inner.press.get("num_sinks", 0)))
        off = math.ceil(sinks * (1.0 - p["first_stage_ratio"]))
        return replace(inner, press={"cls": "CriticalKVPress", "press": inner.press, "epsilon": p["critical_epsilon"],
                                     "first_stage_ratio": p["first_stage_ratio"]}, differs_by=inner.differs_by + off,
                       differs_why=("kvpress counts the sinks inside stage 1" if off else inner.differs_why))

    @classmethod
    def replay_head_state(cls, policy: Policy, n_kv_heads: int, head_dim: int, layer: Any,
                          memo: dict | None) -> np.ndarray:
        """``head_state`` with every position's projected value norm of the trace layer appended (``projected_norms``,
        computed once per layer and kept in ``memo`` for the other replays of the same inputs)."""
        key = ("critical.projected_norms", n_kv_heads, head_dim)
        table = None if memo is None else memo.get(key)
        if table is None:
            head = cls.head_state(policy, n_kv_heads, head_dim, layer.wo)
            table = projected_norms(head, policy.head_offsets[cls.name], np.ascontiguousarray(layer.v, np.float32))
            if memo is not None:
                memo[key] = table
        return cls.head_state(policy, n_kv_heads, head_dim, layer.wo, table)

    @classmethod
    def head_state(cls, policy: Policy, n_kv_heads: int, head_dim: int, wo: np.ndarray | None,
                   table: np.ndarray | None = None) -> np.ndarray:
        """The policy's head state with this stage's slice filled: the index of its slot field, G*d, hidden, the
        width of the norm table (0 without one), then per KV head its query group's W_O transposed, float32
        [d, G * hidden] (C order), packed in pairs into the float64 head state (read by ``wo_l1``), then the norm
        table [Hkv, T] when given."""
        if wo is None:
            raise PolicyError(f"{policy.label()} needs the layer's output projection W_O, and this trace has none: "
                              "record it again with `kvsim record` (which stores W_O for Llama-family models)")
        wo = np.asarray(wo, np.float32)
        hidden, width = wo.shape
        if width % n_kv_heads:
            raise PolicyError(f"{policy.label()}: W_O has {width} columns, not a multiple of {n_kv_heads} KV heads")
        gd, d = width // n_kv_heads, head_dim
        if gd % d:
            raise PolicyError(f"{policy.label()}: W_O's {gd} columns per KV head are not whole heads of {d}")
        # [Hkv, d, G, hidden]: row x of a KV head's block is input channel x of its G heads' W_O columns
        blocks = wo.reshape(hidden, n_kv_heads, gd // d, d).transpose(1, 3, 2, 0).reshape(n_kv_heads, hidden * gd)
        words = (blocks.shape[1] + 1) // 2          # whole float64 slots: an odd count pads one float32 (never read)
        off = policy.head_offsets[cls.name]
        field = policy.slot_fields - sum(s.slot_fields for s in policy.chain[policy.chain.index(cls):])
        n_table = 0 if table is None else table.shape[1]
        # filled in place: the scorer's (possibly large, mostly untouched) zero block stays lazily allocated
        out = np.zeros((n_kv_heads, policy.head_fields + words + n_table))
        out[:, off:off + 4] = [float(field), float(gd), float(hidden), float(n_table)]
        packed = out[:, policy.head_fields:policy.head_fields + words]
        flat = packed.view(np.float32)              # bit-for-bit; copies of the head state keep the bits
        flat[:, :blocks.shape[1]] = blocks
        if table is not None:
            out[:, policy.head_fields + words:] = table
        return out
