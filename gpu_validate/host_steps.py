"""The jitted host-side work around a batch row's policy step (numba, no Python per slot).

The closed-loop runner (`gpu_validate.batch_runner`) steps each row's policy on numpy arrays, exactly as the
simulator does; these functions are what it does around that step for one row of one layer: `row_prep` copies
the row's slots out of the layer's padded arrays into the step's contiguous inputs, `row_post` checks the step
against the contract (``sim.contract``), applies the layer's window and compacts (merges included) -- in place on
the CPU's host cache, or into masks for the device cache's compaction (`keep_kept_first` moves the row's slot
state along) -- and `map_prompt_probs` spreads a prompt chunk's summed attention over every row's cached slots
(the fast-forward, `gpu_validate.prompt_loading`). Kept jitted and apart from the runner so a step costs no
interpreter time per slot.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from sim.contract import OK, apply_window, check_step


@njit(cache=True, nogil=True)
def keep_kept_first(keep, lengths, slot_state, positions):
    """Apply one step's keep mask to a row's host-side slot state: clear ``keep`` past each head's length, move
    the kept slots' state and positions to the front in order (what the cache's compaction does to k/v), zero
    the freed tail (positions -1). Returns the kept count per head."""
    H, cap = keep.shape
    kept_n = np.zeros(H, np.int64)
    for h in range(H):
        j = 0
        for i in range(cap):
            if i < lengths[h] and keep[h, i] != 0:
                if j != i:
                    slot_state[h, j, :] = slot_state[h, i, :]
                    positions[h, j] = positions[h, i]
                j += 1
            else:
                keep[h, i] = 0
        slot_state[h, j:, :] = 0.0
        positions[h, j:] = -1
        kept_n[h] = j
    return kept_n


@njit(cache=True, nogil=True)
def row_prep(r0, n_new, lengths, probs, keys, values, pos, sst, ln, pr, ks, vs, ps):
    """One batch row's inputs to its policy step, from the layer's padded host arrays (rows r0 .. r0+Hkv-1 of
    ``lengths`` [B*Hkv], ``probs`` [B*Hkv, G, W] (float32 or float64), ``keys``/``values`` [B*Hkv, W, d],
    ``pos`` [B*Hkv, W]) into the row's contiguous scratch of its own width ``cap`` (``pr`` [Hkv, G, cap] float64,
    ``ks``/``vs``, ``ps``): zero / -1 past each head's length, exactly the arrays ``padded`` gives. The step's
    ``n_new`` new slots start with zero slot state. (keep / merge_to / merge_w come reset by `row_post`.)"""
    H, G, cap = pr.shape
    d = ks.shape[2]
    for h in range(H):
        r = r0 + h
        n = lengths[r]
        ln[h] = n
        for g in range(G):
            for i in range(n):
                pr[h, g, i] = probs[r, g, i]
            for i in range(n, cap):
                pr[h, g, i] = 0.0
        for i in range(n):
            for x in range(d):
                ks[h, i, x] = keys[r, i, x]
                vs[h, i, x] = values[r, i, x]
            ps[h, i] = pos[r, i]
        for i in range(n, cap):
            for x in range(d):
                ks[h, i, x] = 0.0
                vs[h, i, x] = 0.0
            ps[h, i] = -1
        for i in range(max(0, n - n_new), n):
            for f in range(sst.shape[2]):
                sst[h, i, f] = 0.0


@njit(cache=True, nogil=True)
def row_post(t, budget, head_adaptive, bounded, window, compressed, ln, keep, merge_to, merge_w, ps, sst, info, out,
              host, r0, k3, v3, pos, lengths, keep_all, mt_all, mw_all):
    """After a row's policy step: the contract's checks (a status code of ``sim.contract`` is returned), whether
    the step evicted or merged a slot of a compressed layer (``out[0]``), the layer's window, then the row's
    compaction. ``host``: merges (fp32, `gpu_validate.reference.ref_compact`'s order) and compaction applied in
    place to the host cache's rows (k3, v3, pos, lengths) and the slot state; otherwise the slot state and ``ps``
    are compacted (``keep_kept_first``) and keep/merge_to/merge_w go to rows r0.. of ``keep_all``/``mt_all``/
    ``mw_all`` for the device cache's compaction. out[1]: some slot dropped; out[2]: slots held after the step.
    The host cache keeps zero k/v and position -1 past each head's length (what ``padded`` gives), so a row as
    wide as the layer steps on views of it. keep / merge_to / merge_w are reset (1, -1, 1) for the next step."""
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
    dropped = 0
    total = 0
    if host:
        d = k3.shape[2]
        W = k3.shape[1]
        for h in range(H):
            r = r0 + h
            n = ln[h]
            n_src = 0
            for i in range(n):
                if keep[h, i] == 0 and merge_to[h, i] >= 0:
                    n_src += 1
            if n_src > 0:                    # x_j <- w_j x_j + sum_e w_e x_e over sources e in slot order
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
            j = 0
            for i in range(n):
                if keep[h, i] != 0:
                    if j != i:
                        for x in range(d):
                            k3[r, j, x] = k3[r, i, x]
                            v3[r, j, x] = v3[r, i, x]
                        pos[r, j] = pos[r, i]
                        for f in range(sst.shape[2]):
                            sst[h, j, f] = sst[h, i, f]
                    j += 1
            for i in range(j, n):            # freed slots read as the padded arrays: zero k/v, position -1
                for x in range(d):
                    k3[r, i, x] = 0.0
                    v3[r, i, x] = 0.0
            for i in range(j, cap):
                for f in range(sst.shape[2]):
                    sst[h, i, f] = 0.0
            for i in range(j, W):
                pos[r, i] = -1
            if j < n:
                dropped = 1
            lengths[r] = j
            total += j
    else:
        kept_n = keep_kept_first(keep, ln, sst, ps)
        for h in range(H):
            if kept_n[h] < ln[h]:
                dropped = 1
            total += kept_n[h]
            for i in range(cap):
                keep_all[r0 + h, i] = keep[h, i]
                mt_all[r0 + h, i] = merge_to[h, i]
                mw_all[r0 + h, i] = merge_w[h, i]
    out[1] = dropped
    out[2] = total
    for h in range(H):                       # the scratch's entry state for the next step that uses it
        for i in range(cap):
            keep[h, i] = 1
            merge_to[h, i] = -1
            merge_w[h, i] = 1.0
    return OK


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
