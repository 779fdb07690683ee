"""The jitted host-side work of the closed loop's policy steps (numba, no Python per row, slot or head).

The closed-loop runner (`gpu_validate.closedloop.batch_runner`) steps each row's policy on numpy arrays, exactly as the
simulator does. `step_layer` runs every row of one layer in one call: each row's policy ``step`` (a first-class function
of ``STEP_SIG`` in a typed list, so one compiled loop serves every mix of policies) on views of the layer's padded host
arrays when the row is as wide as the layer, else on contiguous copies of its width (`row_prep`); then `row_post` checks
the step against the contract (``sim.replay.contract``), applies the layer's window and compacts the row: the CPU's host
cache in place (keys and values too, merges included), or the host's mirror of a device cache (positions, lengths, slot
state), with the keep / merge decisions written out for the device's compaction. `unflatten` lays a device cache's flat
per-slot rows out padded per head, `flatten_keep` / `flatten_merges` gather the padded decisions back into a device
cache's flat layout, and `map_prompt_probs` spreads a prompt chunk's summed attention over every row's cached slots
(the fast-forward, `gpu_validate.closedloop.prompt_loading`). Kept jitted and apart from the runner so that a step
costs no interpreter time per row or slot.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from sim.replay.contract import OK, apply_window, check_step
from sim.replay.row_moves import move_rows


@njit(cache=True, nogil=True)
def row_prep(r0, n_new, read_k, read_v, lengths, probs, flat_probs, start, keys, values, pos, sst, ln, pr, ks, vs,
             ps):
    """One batch row's inputs to its policy step, from the layer's padded host arrays (rows r0 .. r0+Hkv-1 of
    ``lengths`` [B*Hkv], ``probs`` [B*Hkv, G, W] float64 -- or, where ``start`` is not empty, a device cache's
    flat ``flat_probs`` [total, G] float32 read at ``start[r] + i`` --, ``keys``/``values`` [B*Hkv, W, d],
    ``pos`` [B*Hkv, W])
    into the row's contiguous scratch of its own width ``cap`` (``pr`` [Hkv, G, cap], ``ks``/``vs``, ``ps``): zero
    / -1 past each head's length, exactly the arrays ``padded`` gives. Keys / values are copied only when some
    policy of the layer reads them (``read_k`` / ``read_v``; else the scratch stays zero). The step's ``n_new``
    new slots start with zero slot state. (keep / merge_to / merge_w come reset by `row_post`.)"""
    H, G, cap = pr.shape
    d = ks.shape[2]
    for h in range(H):
        r = r0 + h
        n = lengths[r]
        ln[h] = n
        for g in range(G):
            if start.shape[0]:
                s0 = start[r]
                for i in range(n):
                    pr[h, g, i] = flat_probs[s0 + i, g]
            else:
                for i in range(n):
                    pr[h, g, i] = probs[r, g, i]
            for i in range(n, cap):
                pr[h, g, i] = 0.0
        for i in range(n):
            if read_k:
                for x in range(d):
                    ks[h, i, x] = keys[r, i, x]
            if read_v:
                for x in range(d):
                    vs[h, i, x] = values[r, i, x]
            ps[h, i] = pos[r, i]
        for i in range(n, cap):
            if read_k:
                for x in range(d):
                    ks[h, i, x] = 0.0
            if read_v:
                for x in range(d):
                    vs[h, i, x] = 0.0
            ps[h, i] = -1
        for i in range(max(0, n - n_new), n):
            for f in range(sst.shape[2]):
                sst[h, i, f] = 0.0


@njit(cache=True, nogil=True)
def _merge_in_place(r, h, n, keep, merge_to, merge_w, k3, v3):
    """Row r's merges on the host cache: x_j <- w_j x_j + sum_e w_e x_e over sources e in slot order, in float32
    (`gpu_validate.kvcache.kernel_reference.ref_compact`'s order)."""
    d = k3.shape[2]
    has = np.zeros(n, np.uint8)
    for i in range(n):
        if keep[h, i] == 0 and merge_to[h, i] >= 0:
            has[merge_to[h, i]] = 1
    tk = np.empty((n, d), np.float32)
    tv = np.empty((n, d), np.float32)
    for j in range(n):
        if has[j]:
            w = np.float32(merge_w[h, j])
            for x in range(d):
                tk[j, x] = w * k3[r, j, x]
                tv[j, x] = w * v3[r, j, x]
    for e in range(n):
        if keep[h, e] == 0 and merge_to[h, e] >= 0:
            j = merge_to[h, e]
            w = np.float32(merge_w[h, e])
            for x in range(d):
                tk[j, x] = tk[j, x] + w * k3[r, e, x]
                tv[j, x] = tv[j, x] + w * v3[r, e, x]
    for j in range(n):
        if has[j]:
            for x in range(d):
                k3[r, j, x] = tk[j, x]
                v3[r, j, x] = tv[j, x]


@njit(cache=True, nogil=True)
def row_post(t, budget, head_adaptive, bounded, window, compressed, ln, keep, merge_to, merge_w, ps, sst, info, out,
             kv_in_place, emit, r0, k3, v3, pos, lengths, keep_all, mt_all, mw_all):
    """After a row's policy step: the contract's checks (a status code of ``sim.replay.contract`` is returned), whether
    the step evicted or merged a slot of a compressed layer (``out[0]``), the layer's window, then the row's
    compaction, in place on the layer's host arrays (rows r0.. of ``pos`` and ``lengths``, the row's slot state):
    with ``kv_in_place`` (the CPU's host cache) merges (fp32) and the compaction of ``k3``/``v3`` too; otherwise
    those arrays are the host's mirror of a device cache and, with ``emit``, keep / merge_to / merge_w go to rows
    r0.. of ``keep_all`` / ``mt_all`` / ``mw_all`` for the device's compaction. out[1]: some slot dropped;
    out[2]: slots held after the step. Freed slots read as the padded arrays do (zero k/v, position -1), so a row
    as wide as the layer steps on views of them. keep / merge_to / merge_w are reset (1, -1, 1) for the next
    step."""
    status = check_step(ln, keep, merge_to, budget, head_adaptive, bounded, t, info)
    if status != OK:
        return status
    H, cap = keep.shape
    deviated = 0
    if compressed:
        for h in range(H):
            held = 0
            for i in range(cap):
                if merge_to[h, i] >= 0:
                    deviated = 1
                if i < ln[h] and keep[h, i] != 0:
                    held += 1
            if held < ln[h]:
                deviated = 1
    out[0] = deviated
    apply_window(ln, keep, merge_to, ps, t, window)
    if emit:
        for h in range(H):
            for i in range(cap):
                keep_all[r0 + h, i] = keep[h, i] if i < ln[h] else 0
                mt_all[r0 + h, i] = merge_to[h, i]
                mw_all[r0 + h, i] = merge_w[h, i]
    dropped = 0
    total = 0
    W = pos.shape[1]
    for h in range(H):
        r = r0 + h
        n = ln[h]
        if kv_in_place:
            for i in range(n):
                if keep[h, i] == 0 and merge_to[h, i] >= 0:
                    _merge_in_place(r, h, n, keep, merge_to, merge_w, k3, v3)
                    break
        j = 0                                # compaction: one block move per run of kept slots
        i = 0
        while i < n:
            if keep[h, i] == 0:
                i += 1
                continue
            s = i
            while i < n and keep[h, i] != 0:
                i += 1
            if j != s:
                if kv_in_place:
                    move_rows(k3[r], s, i, j)
                    move_rows(v3[r], s, i, j)
                move_rows(pos[r], s, i, j)
                move_rows(sst[h], s, i, j)
            j += i - s
        if kv_in_place:                      # freed slots read as the padded arrays: zero k/v, position -1
            k3[r, j:n] = 0.0
            v3[r, j:n] = 0.0
        sst[h, j:] = 0.0
        pos[r, j:W] = -1
        if j < n:
            dropped = 1
        lengths[r] = j
        total += j
    out[1] = dropped
    out[2] = total
    keep[:] = 1                              # the scratch's entry state for the next step that uses it
    merge_to[:] = -1
    merge_w[:] = 1.0
    return OK


@njit(cache=True, nogil=True)
def _widen(src, dst, r0, r1):
    """dst[r0:r1] = src[r0:r1]: float32 probabilities into the float64 the policies read (exact)."""
    for r in range(r0, r1):
        for g in range(src.shape[1]):
            for i in range(src.shape[2]):
                dst[r, g, i] = src[r, g, i]


@njit(cache=True, nogil=True)
def step_layer(steps, rows, adaptive, bounded, views, row_p, members, layer, t, n_new, window, compressed, read_k,
               read_v, kv_in_place, emit, lengths, probs, probs32, flat_probs, start, keys, values, pos, keep_all,
               mt_all, mw_all, info, out):
    """The policy steps of the rows ``members`` (in that order) on one layer. Row b's ``steps[b]`` (a first-class
    function of ``STEP_SIG``) runs with ``rows[b]`` = (params, budgets, slot state, head state, scratch, decisions):
    one typed list for the arrays, not one per field (numba types each typed-list argument through Python at every
    call, ~0.7 µs a list). It steps on views of rows b*Hkv.. of the layer's padded host arrays when ``views[b]``,
    else on its own scratch (lengths, probs, keys, values, positions of its width, filled by `row_prep`, which
    copies keys / values only where the row's policy reads them, ``read_k[b]`` / ``read_v[b]``, and reads the
    probabilities from the flat ``flat_probs`` where ``start`` is not empty), with its decision arrays (keep,
    merge_to, merge_w); then `row_post`. Where ``probs32`` is not empty (the host cache's float32 probabilities,
    [B*Hkv, G, W]), the rows whose policy reads them (``row_p[b]``) first widen theirs into ``probs``: here, row by
    row, instead of one torch conversion of the whole layer. ``out[b]``: (deviated, dropped, held). Returns -1, or
    the first row whose step broke the contract (its status in ``out[b, 0]``, the (step, head, value) in ``info``)."""
    H = lengths.shape[0] // len(rows)
    for b in members:
        r0 = b * H
        params, budget, sst, head, scratch, decisions = rows[b]
        keep, merge_to, merge_w = decisions
        if probs32.shape[0] and row_p[b]:
            _widen(probs32, probs, r0, r0 + H)
        if views[b]:
            ln = lengths[r0:r0 + H]
            pr = probs[r0:r0 + H]
            ks = keys[r0:r0 + H]
            vs = values[r0:r0 + H]
            ps = pos[r0:r0 + H]
        else:
            ln, pr, ks, vs, ps = scratch
            row_prep(r0, n_new, read_k[b], read_v[b], lengths, probs, flat_probs, start, keys, values, pos, sst, ln,
                     pr, ks, vs, ps)
        steps[b](params, layer, t, budget, ln, pr, ks, vs, ps, sst, head, keep, merge_to, merge_w)
        row_out = out[b]
        status = row_post(t, budget, adaptive[b], bounded[b], window, compressed, ln, keep, merge_to, merge_w,
                          ps, sst, info, row_out, kv_in_place, emit, r0, keys, values, pos, lengths, keep_all, mt_all,
                          mw_all)
        if status != OK:
            row_out[0] = status
            return b
    return -1


@njit(cache=True, nogil=True)
def unflatten(flat, start, lengths, out, transpose):
    """A device cache's flat per-slot rows (``flat`` [total, F], slot ``start[r] + i`` holding slot i of head r)
    laid out padded per head into ``out``, zero past each head's length: [B*Hkv, W, F], or with ``transpose``
    [B*Hkv, F, W] (probabilities as the policies read them)."""
    R = lengths.shape[0]
    F = flat.shape[1]
    W = out.shape[2] if transpose else out.shape[1]
    for r in range(R):
        s = start[r]
        n = lengths[r]
        for i in range(W):
            if transpose:
                for f in range(F):
                    out[r, f, i] = flat[s + i, f] if i < n else 0.0
            else:
                for f in range(F):
                    out[r, i, f] = flat[s + i, f] if i < n else 0.0


@njit(cache=True, nogil=True)
def flatten_keep(keep_all, mt_all, start, capacity, offset, keep):
    """A layer's padded keep decisions (``keep_all`` [B*Hkv, W], as `row_post` emits them) written into a device
    cache's flat mask at ``offset + start[r] + i`` for each head's ``capacity[r]`` slots (the compaction reads those
    below the head's length). Returns whether any slot merges (``mt_all`` >= 0): then `flatten_merges` too."""
    merging = False
    for r in range(capacity.shape[0]):
        s = offset + start[r]
        for i in range(capacity[r]):
            keep[s + i] = keep_all[r, i]
            merging |= mt_all[r, i] >= 0
    return merging


@njit(cache=True, nogil=True)
def flatten_merges(mt_all, mw_all, start, capacity, offset, merge_to, merge_w):
    """`flatten_keep` for the merge targets and weights (``mt_all`` / ``mw_all``), where a step merges."""
    for r in range(capacity.shape[0]):
        s = offset + start[r]
        for i in range(capacity[r]):
            merge_to[s + i] = mt_all[r, i]
            merge_w[s + i] = mw_all[r, i]


@njit(cache=True, nogil=True)
def map_prompt_probs(summed, rows, H, slot_pos, probs):
    """probs[b*H + h, g, i] = summed[h, g, slot_pos[b*H + h, i]] for every row b in ``rows`` and every held slot
    (slot_pos >= 0): a prompt chunk's summed attention over each row's cached slots."""
    G = summed.shape[1]
    for b in rows:
        for h in range(H):
            r = b * H + h
            for i in range(slot_pos.shape[1]):
                p = slot_pos[r, i]
                if p >= 0:
                    for g in range(G):
                        probs[r, g, i] = summed[h, g, p]
