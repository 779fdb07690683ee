"""Numba replay engine: walks one layer of a trace step by step over per-head variable-length caches.

For every step t the new token's k/v is appended to each KV head's cache, the step's queries attend over
the cached slots only (O(budget * d) per head), metrics are taken against the trace's full-attention
reference, then the policy's jitted ``step`` decides evictions/merges and the caches are compacted (one memmove
per field and run of kept slots; the keys and values of a policy whose step reads neither close up toward whichever
side moves fewer rows, so evicting the oldest slot moves none: ``_compact``). Unmeasured (prompt) steps skip the
attention when the policy's step does not read it (``Policy.reads_attention``), and leave the cached keys (values)
unwritten and unmoved when neither they nor the step read them, filled from the trace before anything does
(``_deferred_rows``). The engine is compiled once
(the policy kernels are first-class functions with fixed signatures, the other inputs three named tuples) and cached
on disk; it releases the GIL so layers replay in parallel threads.
The step contract is checked by ``sim.replay.contract``'s jitted checks, the same ones the numpy reference and the
closed-loop runner call.

The attention of a KV head's G query heads (q.k, softmax, p.v) is ``sim.replay.attention_kernels``.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np
import time

from numba import njit, objmode

from sim.replay.attention_kernels import qk_dot32, qk_dots, weighted_sums
from sim.replay.row_moves import move_rows as _move_rows
from sim.replay.contract import OK, OVER_CAPACITY, apply_window, check_kept, check_merges, check_scale
from sim.replay.metrics import N_METRICS, measure
from sim.replay.softmax_kernels import softmax_rows

@njit(cache=True, nogil=True)
def _merged_mass_kl(t, h, g, hq, n, q, k, lse, scale, cpos, dirty, probs, dots, lse_cache):
    """Retained mass and KL of query head hq (group member g) over a cache where some slots hold merges (``dirty``,
    ``mult`` = 1): the slots nothing was merged into have their true logits, p_full(i) = p(i) exp(lse_cache -
    lse_full), so they need their p summed only (one exp for all of them); a merged slot stands for the token it
    was, measured with that token's original key (log p(i) = logit(i) - lse_cache: the cache's own softmax)."""
    lse_full = lse[t, hq]
    f = np.float32(scale)
    clean = 0.0
    mass = 0.0
    kl = 0.0
    for i in range(n):
        p = probs[h, g, i]
        if dirty[h, i] == 0:
            clean += p
            continue
        log_pfull = np.float64(qk_dot32(q, t, hq, k, cpos[h, i], h)) * scale - lse_full
        mass += np.exp(log_pfull)
        kl += p * ((np.float64(dots[g, i] * f) - lse_cache) - log_pfull)
    return mass + clean * np.exp(lse_cache - lse_full), kl + clean * (lse_full - lse_cache)


@njit(cache=True, nogil=True)
def _attend_and_measure(t, h, g_n, n, q, k, lse, o, vmax1, scale, mult, ck, cv, b, cpos, dirty, probs, metric_row,
                        want, dots, dmax, ebuf, ibuf, fbuf, oacc, oacc32, inv, lse_caches):
    """Attention of the G query heads of KV head h over its n cached slots (keys / values from row b) into
    ``probs[h]``; when ``want``, also the step's metrics (``sim.replay.metrics.measure``) against the
    full-attention reference into ``metric_row[hq]``.
    The last nine arguments are ``_attention_scratch``'s buffers (passed one by one: no reference counting)."""
    qk_dots(q, t, h, g_n, ck, b, n, dots, dmax)
    softmax_rows(dots, dmax, h, g_n, n, np.float32(scale * mult), probs, ebuf, ibuf, fbuf, inv, lse_caches)
    if not want:
        return
    any_dirty = False
    for i in range(n):
        any_dirty |= dirty[h, i] != 0
    weighted_sums(ebuf, inv, h, g_n, cv, b, n, oacc, oacc32)
    for g in range(g_n):
        hq = h * g_n + g
        lse_cache = lse_caches[g]
        if mult == 1.0 and not any_dirty:
            # cached logits are the true logits: p_full(i) = p(i) * exp(lse_cache - lse_full) for every slot
            mass = np.exp(min(0.0, lse_cache - lse[t, hq]))
            kl = max(0.0, lse[t, hq] - lse_cache)
        elif mult == 1.0:
            mass, kl = _merged_mass_kl(t, h, g, hq, n, q, k, lse, scale, cpos, dirty, probs, dots, lse_cache)
        else:
            mass = 0.0
            kl = 0.0
            for i in range(n):
                dot = np.float64(dots[g, i])
                if dirty[h, i] != 0:   # merged slot: measure the token it stands for with its original key
                    dot = np.float64(qk_dot32(q, t, hq, k, cpos[h, i], h))
                log_pfull = dot * scale - lse[t, hq]
                mass += np.exp(log_pfull)
                p = probs[h, g, i]
                if p > 0.0:
                    kl += p * (np.log(p) - log_pfull)
        measure(mass, kl, o[t, hq], oacc[g], 1.0, vmax1[t, h], metric_row[hq])


@njit(cache=True, nogil=True)
def _move_slots(cpos, dirty, cst, i, j, dst):
    """Move the slot fields of slots [i, j) to [dst, dst + j - i) (the regions may overlap)."""
    _move_rows(cpos, i, j, dst)
    _move_rows(dirty, i, j, dst)
    _move_rows(cst, i, j, dst)


@njit(cache=True, nogil=True)
def _move_kv(ck, cv, i, j, dst, move_k, move_v):
    """Move key / value rows [i, j) to [dst, dst + j - i) (the regions may overlap), each only where ``move_k`` /
    ``move_v`` (see ``_deferred_rows``)."""
    if move_k:
        _move_rows(ck, i, j, dst)
    if move_v:
        _move_rows(cv, i, j, dst)


#: the policy and run settings of one layer's replay (numba reads it as a typed named tuple)
#:   params float64[n_params]; layer; scale softmax scale; has_prefill; metric_start first measured step (the
#:   prompt length); budget int64[Hkv]; head_adaptive; bounded (checks the budget); cap slots per head buffer;
#:   n_slot_fields state width; head_init [Hkv, head state width] the initial head state (Policy.head_state_init;
#:   a fresh array per replay, which the replay writes into);
#:   rec_start first step whose kept positions are recorded; reads_attention: the step reads ``probs`` (when
#:   not, unmeasured steps skip the attention); window > 0 makes the layer a sliding one
#:   (``sim.replay.contract.apply_window`` after every step and after the prompt's selection), 0 a global one;
#:   chunk: prompt tokens per policy step when the prompt is streamed (1: token by token; see sim.replay.policy_replay);
#:   reads_keys / reads_values: the step reads the cached keys / values (``Policy.reads_keys``; see ``_deferred_rows``)
EngineConfig = namedtuple("EngineConfig", "params layer scale has_prefill metric_start budget head_adaptive bounded "
                                          "cap n_slot_fields head_init rec_start reads_attention window chunk "
                                          "reads_keys reads_values")
#: one layer of the trace: q [T,Hq,d], k/v [T,Hkv,d] float32 (C-contiguous: the SIMD kernels index q by rows);
#: lse [T,Hq], o [T,Hq,d] the full-attention
#: reference; vmax1 [T,Hkv] running max of ||v||_1 (for the Ada-KV bound); prompt_acc [Hkv,G,P] float64 the
#: prompt's summed attention per key (``traces.reference.causal_column_sums``) when the whole prompt is one chunk
#: of a streamed policy (the chunk's tokens are then appended without a per-token attention), else [0,0,0]
LayerData = namedtuple("LayerData", "q k v lse o vmax1 prompt_acc")
#: what a replay writes: metrics [T - metric_start, Hq, N_METRICS] float64, slots [T - metric_start, Hkv] held
#: after eviction, kept [n_rec, Hkv, cap] kept positions (-1 padded) of steps rec_start.., info int64[3] the
#: (step, head, value) of a contract failure
EngineOutputs = namedtuple("EngineOutputs", "metrics slots kept info")


@njit(cache=True, nogil=True)
def _new_buffers(hkv, g_n, d, cap, kv_rows, n_slot_fields, head_init):
    """Per-head slot buffers of a layer (keys and values in ``kv_rows`` >= ``cap`` rows: ``_compact``; positions,
    slot state, merged flags), the head state (``head_init`` itself: the replay owns it, so a large, mostly
    untouched zero block -- expected attention's statistics laid out for d <= 256 -- costs only the pages a policy
    writes) and the step's decision arrays, all for ``cap`` slots per KV head."""
    ck = np.zeros((hkv, kv_rows, d), np.float32)
    cv = np.zeros((hkv, kv_rows, d), np.float32)
    cpos = np.full((hkv, cap), -1, np.int64)
    cst = np.zeros((hkv, cap, n_slot_fields), np.float64)
    hst = head_init
    dirty = np.zeros((hkv, cap), np.uint8)
    probs = np.zeros((hkv, g_n, cap), np.float64)
    keep = np.ones((hkv, cap), np.uint8)
    merge_to = np.full((hkv, cap), -1, np.int64)
    merge_w = np.ones((hkv, cap), np.float64)
    return ck, cv, cpos, cst, hst, dirty, probs, keep, merge_to, merge_w


@njit(cache=True, nogil=True)
def _kv_slack(cap):
    """Rows of room past ``cap`` for keys / values whose rows may start anywhere (``_compact``): a quarter more, so
    that moving the rows back to row 0 (``_append``) costs at most four rows per slot dropped."""
    return max(cap // 4, 16)


@njit(cache=True, nogil=True)
def _attention_scratch(g_n, d, cap):
    """Scratch of ``_attend_and_measure`` for up to ``cap`` slots: float32 dots [G, cap] and their maxima [G], the
    softmax numerators [G, cap], exponent bits [cap] (and the same bits as float32), the float64 outputs of the G
    query heads [G, d] with their float32 block sums, and per head the normaliser and the cache's log-sum-exp."""
    ibuf = np.zeros(cap, np.int32)
    return (np.zeros((g_n, cap), np.float32), np.zeros(g_n, np.float32), np.zeros((g_n, cap), np.float32), ibuf,
            ibuf.view(np.float32), np.zeros((g_n, d), np.float64), np.zeros((g_n, d), np.float32),
            np.zeros(g_n, np.float64), np.zeros(g_n, np.float64))


@njit(cache=True, nogil=True)
def _apply_merges(h, n, keep, merge_to, merge_w, ck, cv, b, dirty):
    """Fold the merged slots of head h (keys / values from row b): scale each receiving slot by its self weight
    once, then add the weighted sources (``dirty`` = 2 marks a slot merged this step). The merges were checked
    (``check_merges``)."""
    d = ck.shape[2]
    for i in range(n):
        j = merge_to[h, i]
        if j >= 0 and dirty[h, j] != 2:
            w = merge_w[h, j]
            for x in range(d):
                ck[h, b + j, x] = np.float32(w * ck[h, b + j, x])
                cv[h, b + j, x] = np.float32(w * cv[h, b + j, x])
            dirty[h, j] = 2
    for i in range(n):
        j = merge_to[h, i]
        if j >= 0:
            w = merge_w[h, i]
            for x in range(d):
                ck[h, b + j, x] = np.float32(ck[h, b + j, x] + w * ck[h, b + i, x])
                cv[h, b + j, x] = np.float32(cv[h, b + j, x] + w * cv[h, b + i, x])


@njit(cache=True, nogil=True)
def _decision(h, n, keep, merge_to, merge_w, summary):
    """One pass over head h's decision for its n slots, into ``summary[h]``: slots kept, the first and the last slot
    dropped (n and -1 if none), whether some slot merges and whether some merge weight is not 1 (the eviction then
    skips what these say is not needed: ``_evict``). Branch-free, so that LLVM vectorises it."""
    kept = 0
    first = n
    last = -1
    merges = 0
    weights = 0
    for i in range(n):
        kept += keep[h, i] != 0
        first = min(first, n if keep[h, i] != 0 else i)
        last = max(last, -1 if keep[h, i] != 0 else i)
        merges |= merge_to[h, i] >= 0
        weights |= merge_w[h, i] != 1.0
    summary[h, 0] = kept
    summary[h, 1] = first
    summary[h, 2] = last
    summary[h, 3] = merges
    summary[h, 4] = weights


@njit(cache=True, nogil=True)
def _compact(h, n, kept, first, last, merges, weights, keep, merge_to, merge_w, ck, cv, kv_base, cpos, dirty, cst,
             move_k, move_v, shift):
    """Stable compaction of head h's ``kept`` slots, its first and last dropped slots ``first`` and ``last``;
    resets the decision arrays for the next step (the merge targets, marks and weights only where ``merges`` /
    ``weights``). Returns the slots held.

    The slot fields (positions, marks, state) close up to the left, each run of kept slots one block copy. The keys
    and values (only where ``move_k`` / ``move_v``) move with them or, where ``shift`` lets their rows start
    anywhere (``kv_base[h]``: the row of slot 0; the buffer has room for it, ``_append``), close up to the right --
    the kept slots before ``last`` move right and the base moves on by the slots dropped -- when that moves fewer
    rows: evicting the oldest slot then moves none instead of all."""
    b = kv_base[h]
    right = shift and (move_k or move_v) and last - (n - kept) + 1 < kept - first   # fewer kept before `last`
    wpos = first
    i = first
    while i < n:
        if keep[h, i] == 0:
            i += 1
            continue
        j = i
        while j < n and keep[h, j] != 0:
            j += 1
        _move_slots(cpos[h], dirty[h], cst[h], i, j, wpos)
        if not right:
            _move_kv(ck[h], cv[h], b + i, b + j, b + wpos, move_k, move_v)
        wpos += j - i
        i = j
    if right:
        end = b + last + 1
        i = last
        while i > 0:
            if keep[h, i - 1] == 0:
                i -= 1
                continue
            j = i
            while i > 0 and keep[h, i - 1] != 0:
                i -= 1
            end -= j - i
            _move_kv(ck[h], cv[h], b + i, b + j, end, move_k, move_v)
        kv_base[h] = b + n - kept
    for i in range(first, n):
        keep[h, i] = 1
    if merges:
        for i in range(wpos):
            if dirty[h, i] == 2:
                dirty[h, i] = 1
        for i in range(n):
            merge_to[h, i] = -1
    if weights:
        for i in range(n):
            merge_w[h, i] = 1.0
    return wpos


@njit(cache=True, nogil=True)
def _mask_before(probs, h, g_n, n, cpos, oldest):
    """Zero the attention on slots at positions <= ``oldest`` (outside a sliding window) and renormalise: the
    softmax over the visible slots, for a query of a prompt chunk whose window starts after a cached token."""
    for g in range(g_n):
        tot = 0.0
        for i in range(n):
            if cpos[h, i] <= oldest:
                probs[h, g, i] = 0.0
            else:
                tot += probs[h, g, i]
        inv = 1.0 / tot if tot > 0.0 else 0.0
        for i in range(n):
            probs[h, g, i] *= inv


@njit(cache=True, nogil=True)
def _cache_prompt(pkeep, pst, k, v, window, budget, head_adaptive, bounded, cap, ck, cv, cpos, cst, clen, info):
    """Load the prompt tokens the prefill kernel kept (``pkeep`` [Hkv, P], their slot state ``pst``) into the
    per-head caches, in position order; on a sliding layer only the last ``window - 1`` prompt tokens stay (the
    first decode query sees them). Returns OVER_CAPACITY when a head leaves no free slot for the first decode token,
    else ``check_kept``'s status."""
    hkv, P = pkeep.shape
    if window > 0:
        for h in range(hkv):
            for i in range(min(P, P - window + 1)):
                pkeep[h, i] = 0
    for h in range(hkv):
        n = 0
        for i in range(P):
            if pkeep[h, i] != 0:
                if n >= cap - 1:     # the first decode token needs a free slot
                    info[0] = -1
                    info[1] = h
                    info[2] = n + 1
                    return OVER_CAPACITY
                ck[h, n] = k[i, h]
                cv[h, n] = v[i, h]
                cpos[h, n] = i
                for f in range(pst.shape[2]):
                    cst[h, n, f] = pst[h, i, f]
                n += 1
        clen[h] = n
    return check_kept(clen, budget, head_adaptive, bounded, -1, info)


@njit(cache=True, nogil=True, inline="always")
def _chunk_end(t_first, P, chunk):
    """The step after the policy step that starts at ``t_first``: a streamed prompt goes in chunks of ``chunk``
    tokens (the last one ends at the prompt's end); every decode step is one token."""
    return min(P, t_first + chunk) if t_first < P else t_first + 1


@njit(cache=True, nogil=True, inline="always")
def _append(t, h, k, v, cap, ck, cv, kv_base, cpos, dirty, cst, clen, info, lazy_k, lazy_v):
    """Append token t's key and value to KV head h's cache as a fresh slot (clean, zero slot state; a deferred key
    or value is not written, ``_deferred_rows``). Returns OVER_CAPACITY (with the step, head and slots needed in
    ``info``) when the head's buffer is full. Keys and values whose rows ran into the end of their buffer
    (``_compact`` moved them right) move back to row 0 first."""
    s = clen[h]
    if s >= cap:
        info[0] = t
        info[1] = h
        info[2] = s + 1
        return OVER_CAPACITY
    b = kv_base[h]
    if b + s >= cv.shape[1]:
        _move_kv(ck[h], cv[h], b, b + s, 0, not lazy_k, not lazy_v)
        b = 0
        kv_base[h] = 0
    if not lazy_k:
        ck[h, b + s] = k[t, h]
    if not lazy_v:
        cv[h, b + s] = v[t, h]
    cpos[h, s] = t
    dirty[h, s] = 0
    for f in range(cst.shape[2]):
        cst[h, s, f] = 0.0
    clen[h] = s + 1
    return OK


@njit(cache=True, nogil=True, inline="always")
def _add_chunk_attention(probs, acc, h, g_n, n, cpos, t, window):
    """Add query t's attention over head h's n slots to the chunk's sum ``acc``; on a sliding layer the slots its
    window has left behind (older chunk-mates still see them) are masked out first."""
    if window > 0:
        _mask_before(probs, h, g_n, n, cpos, t - window)
    for g in range(g_n):
        for i in range(n):
            acc[h, g, i] += probs[h, g, i]


@njit(cache=True, nogil=True, inline="always")
def _store_metrics(metrics, row, metric_row, h, g_n):
    """Copy the measured metrics of KV head h's G query heads into the output row of their step."""
    for g in range(g_n):
        hq = h * g_n + g
        for m in range(N_METRICS):
            metrics[row, hq, m] = metric_row[hq, m]


@njit(cache=True, nogil=True)
def _evict(t, budget, head_adaptive, bounded, window, clen, keep, merge_to, merge_w, ck, cv, kv_base, cpos, dirty, cst,
           info, move_k, move_v, shift, summary):
    """Carry out the policy step's decisions at step t: check them (``sim.replay.contract.check_step``'s checks, in
    its order), evict what left a sliding window, fold the merges and compact every head (keys / values only where
    ``move_k`` / ``move_v``; to the right where ``shift``: ``_compact``). Returns the contract status.
    ``summary`` [Hkv, 5] int64 scratch (``_decision``): one pass over each head's decision decides what the rest
    skips -- a step that drops nothing and merges nothing moves nothing, the merge checks and folds run only where
    something merges."""
    hkv = clen.shape[0]
    for h in range(hkv):
        _decision(h, clen[h], keep, merge_to, merge_w, summary)
    for h in range(hkv):
        if summary[h, 3]:
            status = check_merges(h, clen[h], keep, merge_to, t, info)
            if status != OK:
                return status
    status = check_kept(summary[:, 0], budget, head_adaptive, bounded, t, info)
    if status != OK:
        return status
    if window > 0:
        apply_window(clen, keep, merge_to, cpos, t, window)
        for h in range(hkv):
            _decision(h, clen[h], keep, merge_to, merge_w, summary)
    for h in range(hkv):
        n = clen[h]
        merges = summary[h, 3] != 0
        if merges:
            _apply_merges(h, n, keep, merge_to, merge_w, ck, cv, kv_base[h], dirty)
        clen[h] = _compact(h, n, summary[h, 0], summary[h, 1], summary[h, 2], merges, summary[h, 4] != 0, keep,
                           merge_to, merge_w, ck, cv, kv_base, cpos, dirty, cst, move_k, move_v, shift)
    return OK


@njit(cache=True, nogil=True)
def _merges_due(clen, merge_to):
    """Whether the step's decision merges some held slot."""
    for h in range(clen.shape[0]):
        for i in range(clen[h]):
            if merge_to[h, i] >= 0:
                return True
    return False


@njit(cache=True, nogil=True)
def _deferred_rows(k, v, clen, cpos, ck, cv, kv_base, fill_k, fill_v):
    """Deferred keys / values: a streamed prompt's steps that neither attend (``reads_attention`` off, unmeasured)
    nor read the cached keys / values (``reads_keys`` / ``reads_values`` off) leave ck / cv unwritten and unmoved
    -- the compaction's block moves of them are most of such a step's cost -- and track positions only. Before
    the first step that reads them (the first measured step, or a merge) this fills every held slot's key / value
    from the trace by its position: exactly the rows the eager cache would hold, as nothing was merged into them."""
    for h in range(clen.shape[0]):
        b = kv_base[h]
        for i in range(clen[h]):
            p = cpos[h, i]
            if fill_k:
                ck[h, b + i] = k[p, h]
            if fill_v:
                cv[h, b + i] = v[p, h]


@njit(cache=True, nogil=True)
def _record(t, P, rec_start, clen, cpos, slots, kept):
    """Write what step t left in the caches: the slots held per head (measured steps, from ``P`` on) and, for the
    steps of ``rec_start`` on that ``kept`` has room for, the kept positions."""
    if t >= P:
        for h in range(clen.shape[0]):
            slots[t - P, h] = clen[h]
    r = t - rec_start
    if 0 <= r < kept.shape[0]:
        for h in range(clen.shape[0]):
            for i in range(clen[h]):
                kept[r, h, i] = cpos[h, i]


@njit(cache=True, nogil=True)
def replay_layer(kernels, cfg, data, out):
    """Replay one layer of a trace. Returns a status code of ``sim.replay.contract`` (OK, or the failed check, with
    its (step, head, value) in ``out.info``).

    kernels: the policy's ((step,), (prefill,), (logit_scale,)), each in a 1-tuple so that numba types it as a
    first-class function of its fixed signature (one compiled engine for every policy); cfg: EngineConfig;
    data: LayerData; out: EngineOutputs. Metrics are written for steps t >= cfg.metric_start.

    A policy with a prefill selector compresses the prompt first (``_cache_prompt``); then every policy step
    appends its tokens (a streamed prompt's chunk, or one decode token), attends and measures them, and lets the
    policy's ``step`` decide what to evict or merge (``_evict``).
    """
    step = kernels[0][0]
    prefill = kernels[1][0]
    logit_scale = kernels[2][0]
    q, k, v, lse, o, vmax1 = data.q, data.k, data.v, data.lse, data.o, data.vmax1
    params, budget, cap, info = cfg.params, cfg.budget, cfg.cap, out.info
    T, hq_n, d = q.shape
    hkv = k.shape[1]
    g_n = hq_n // hkv
    shift = not cfg.reads_keys and not cfg.reads_values   # the step never sees where the key / value rows start
    ck, cv, cpos, cst, hst, dirty, probs, keep, merge_to, merge_w = _new_buffers(hkv, g_n, d, cap,
                                                                                 cap + _kv_slack(cap) if shift else cap,
                                                                                 cfg.n_slot_fields, cfg.head_init)
    kv_base = np.zeros(hkv, np.int64)
    metric_row = np.zeros((hq_n, N_METRICS), np.float64)
    dots, dmax, ebuf, ibuf, fbuf, oacc, oacc32, inv, lse_caches = _attention_scratch(g_n, d, cap)
    clen = np.zeros(hkv, np.int64)
    summary = np.zeros((hkv, 5), np.int64)

    t0 = 0
    P = cfg.metric_start
    if cfg.has_prefill:
        if P > 0:
            pkeep = np.ones((hkv, P), np.uint8)
            pst = np.zeros((hkv, P, cfg.n_slot_fields), np.float64)
            prefill(params, cfg.layer, budget, q[:P], k[:P], v[:P], cfg.scale, pkeep, pst, hst)
            status = _cache_prompt(pkeep, pst, k, v, cfg.window, budget, cfg.head_adaptive, cfg.bounded, cap, ck, cv,
                                   cpos, cst, clen, info)
            if status != OK:
                return status
        t0 = P

    acc = np.zeros((hkv, g_n, cap), np.float64) if cfg.chunk > 1 else probs   # a chunk's summed attention
    lazy_k = t0 < P and not cfg.reads_keys and not cfg.reads_attention         # ``_deferred_rows``
    lazy_v = t0 < P and not cfg.reads_values
    t_next = t0
    while t_next < T:
        t_first = t_next
        if (lazy_k or lazy_v) and t_first >= P:
            _deferred_rows(k, v, clen, cpos, ck, cv, kv_base, lazy_k, lazy_v)
            lazy_k = lazy_v = False
        t_next = _chunk_end(t_first, P, cfg.chunk)
        chunked = t_next - t_first > 1
        given = chunked and t_first == 0 and t_next == P and data.prompt_acc.shape[2] == P
        for t in range(t_first, t_next):
            mult = logit_scale(params, t + 1)
            status = check_scale(mult, t, info)
            if status != OK:
                return status
            want = t >= P
            for h in range(hkv):
                status = _append(t, h, k, v, cap, ck, cv, kv_base, cpos, dirty, cst, clen, info, lazy_k, lazy_v)
                if status != OK:
                    return status
                if want or (cfg.reads_attention and not given):
                    _attend_and_measure(t, h, g_n, clen[h], q, k, lse, o, vmax1, cfg.scale, mult, ck, cv, kv_base[h],
                                        cpos, dirty, probs, metric_row, want, dots, dmax, ebuf, ibuf, fbuf, oacc,
                                        oacc32, inv, lse_caches)
                    if chunked:                  # query t over the slots it sees, summed over the chunk
                        _add_chunk_attention(probs, acc, h, g_n, clen[h], cpos, t, cfg.window)
                if want:
                    _store_metrics(out.metrics, t - P, metric_row, h, g_n)
        t = t_next - 1
        if given:
            acc[:, :, :P] = data.prompt_acc
        step(params, cfg.layer, t, budget, clen, acc if chunked else probs, ck, cv, cpos, cst, hst, keep, merge_to,
             merge_w)
        if chunked:
            acc[:] = 0.0
        if (lazy_k or lazy_v) and _merges_due(clen, merge_to):
            _deferred_rows(k, v, clen, cpos, ck, cv, kv_base, lazy_k, lazy_v)
            lazy_k = lazy_v = False
        status = _evict(t, budget, cfg.head_adaptive, cfg.bounded, cfg.window, clen, keep, merge_to, merge_w, ck, cv,
                        kv_base, cpos, dirty, cst, info, not lazy_k, not lazy_v, shift, summary)
        if status != OK:
            return status
        _record(t, P, cfg.rec_start, clen, cpos, out.slots, out.kept)
    return OK


# ---------------------------------------------------------------- calling the engine from Python

#: compiled entry points of ``replay_layer`` by the fingerprint of their arguments' numba types (``call_replay_layer``)
_ENTRY_POINTS: dict[tuple, object] = {}


def _fingerprint(x) -> object:
    """What numba's ``typeof`` reads of an argument: an array's dtype, dimensions, layout, write and alignment flags;
    a tuple's items (and its class, for a named tuple); a scalar's or a kernel's Python type."""
    if isinstance(x, np.ndarray):
        f = x.flags
        return x.dtype.str, x.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned
    if isinstance(x, tuple):
        return type(x), tuple(_fingerprint(v) for v in x)
    return type(x)


def call_replay_layer(kernels, cfg, data, out) -> int:
    """``replay_layer(kernels, cfg, data, out)`` through its compiled overload's entry point. Called through the
    dispatcher, numba types every argument at every call (the policy kernels as first-class functions, the named
    tuples field by field: ~0.9 ms a call, 14% of a search's replays of 640-token traces, where a call replays one
    layer of one cell); here the overload is found once per fingerprint of those types (``_fingerprint``: exactly what
    ``typeof`` reads) and later calls go straight to its machine code. The first call of a fingerprint, or one whose
    overload numba keys otherwise, goes through the dispatcher."""
    args = (kernels, cfg, data, out)
    key = _fingerprint(args)
    entry = _ENTRY_POINTS.get(key)
    if entry is not None:
        return entry(*args)
    status = replay_layer(*args)
    cres = replay_layer.overloads.get(tuple(replay_layer.typeof_pyval(a) for a in args))
    if cres is not None:
        _ENTRY_POINTS[key] = cres.entry_point
    return status


# ---------------------------------------------------------------- profiling hooks (the replay benchmark)

@njit(cache=True)
def profile_attention(q, k, v, lse, o, vmax1, scale, start, stop, n_slots, probs, metric_row, out):
    """Profiling hook (benchmarks/replay.py): the engine's per-(step, KV head) attention + metric pass of steps
    [start, stop) over ``n_slots`` fixed cached slots (the trace's keys and values just before ``start``), that is
    ``replay_layer`` minus the policy and the copies. ``out[0]`` accumulates one error per step (keeps the work
    observable). Returns the seconds of the steps alone (not the setting up of the cache and the buffers)."""
    T, hq_n, d = q.shape
    hkv = k.shape[1]
    g_n = hq_n // hkv
    ck, cv, cpos, cst, hst, dirty, probs_, keep, merge_to, merge_w = _new_buffers(hkv, g_n, d, n_slots, n_slots, 1,
                                                                                  np.zeros((hkv, 0)))
    dots, dmax, ebuf, ibuf, fbuf, oacc, oacc32, inv, lse_caches = _attention_scratch(g_n, d, n_slots)
    for h in range(hkv):
        for i in range(n_slots):
            src = start - n_slots + i
            ck[h, i] = k[src, h]
            cv[h, i] = v[src, h]
            cpos[h, i] = src
    with objmode(t0="f8"):
        t0 = time.perf_counter()
    for t in range(start, stop):
        for h in range(hkv):
            _attend_and_measure(t, h, g_n, n_slots, q, k, lse, o, vmax1, scale, 1.0, ck, cv, 0, cpos, dirty, probs,
                                metric_row, True, dots, dmax, ebuf, ibuf, fbuf, oacc, oacc32, inv, lse_caches)
            out[0] += metric_row[h * g_n, 1]
    with objmode(t1="f8"):
        t1 = time.perf_counter()
    return t1 - t0


@njit(cache=True)
def profile_parts(q, k, v, lse, o, vmax1, scale, t, n, rounds, keep_at, secs):
    """Profiling hook (benchmarks/replay.py): seconds per (step, KV head) of the engine's parts over ``n`` cached
    slots of real keys/values at step t, each run ``rounds`` times in a row: secs[0] q.k, [1] softmax, [2] p.v and
    metrics (a measured step's attention less an unmeasured one's), [3] one eviction's compaction (slot
    ``keep_at`` dropped)."""
    T, hq_n, d = q.shape
    hkv = k.shape[1]
    g_n = hq_n // hkv
    ck, cv, cpos, cst, hst, dirty, probs, keep, merge_to, merge_w = _new_buffers(hkv, g_n, d, n + 1, n + 1, 1,
                                                                                 np.zeros((hkv, 0)))
    for h in range(hkv):
        for i in range(n):
            ck[h, i] = k[t - n + i, h]
            cv[h, i] = v[t - n + i, h]
            cpos[h, i] = t - n + i
    dots, dmax, ebuf, ibuf, fbuf, oacc, oacc32, inv, lse_caches = _attention_scratch(g_n, d, n + 1)
    kv_base = np.zeros(hkv, np.int64)
    row = np.zeros((hq_n, N_METRICS))
    f = np.float32(scale)
    with objmode(t0="f8"):
        t0 = time.perf_counter()
    for _ in range(rounds):
        for h in range(hkv):
            qk_dots(q, t, h, g_n, ck, 0, n, dots, dmax)
    with objmode(t1="f8"):
        t1 = time.perf_counter()
    for _ in range(rounds):
        for h in range(hkv):
            softmax_rows(dots, dmax, h, g_n, n, f, probs, ebuf, ibuf, fbuf, inv, lse_caches)
    with objmode(t2="f8"):
        t2 = time.perf_counter()
    for _ in range(rounds):
        for h in range(hkv):
            _attend_and_measure(t, h, g_n, n, q, k, lse, o, vmax1, scale, 1.0, ck, cv, 0, cpos, dirty, probs, row,
                                True, dots, dmax, ebuf, ibuf, fbuf, oacc, oacc32, inv, lse_caches)
    with objmode(t3="f8"):
        t3 = time.perf_counter()
    for _ in range(rounds):
        for h in range(hkv):
            _attend_and_measure(t, h, g_n, n, q, k, lse, o, vmax1, scale, 1.0, ck, cv, 0, cpos, dirty, probs, row,
                                False, dots, dmax, ebuf, ibuf, fbuf, oacc, oacc32, inv, lse_caches)
    with objmode(t4="f8"):
        t4 = time.perf_counter()
    for _ in range(rounds):
        for h in range(hkv):
            keep[h, keep_at] = 0
            _compact(h, n, n - 1, keep_at, keep_at, False, False, keep, merge_to, merge_w, ck, cv, kv_base, cpos,
                     dirty, cst, True, True, False)   # the slots after keep_at move left
    with objmode(t5="f8"):
        t5 = time.perf_counter()
    per = 1.0 / (rounds * hkv)
    secs[0] = (t1 - t0) * per
    secs[1] = (t2 - t1) * per
    secs[2] = max(0.0, (t3 - t2) - (t4 - t3)) * per     # measured step less unmeasured: p.v and the metrics
    secs[3] = (t5 - t4) * per
