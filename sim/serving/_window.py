"""Numba kernel: advance an unchanged decode batch by up to ``max_steps`` iterations in one call."""
from __future__ import annotations

from numba import njit


@njit(cache=True)
def decode_window(n, rem, rid, count, held, read, clock, fixed_s, spb, pool, admit_limit, max_steps, head_time,
                  head_need, room_for_head, stats, finished):
    """Run decode iterations of the first ``count`` requests until the batch would change.

    Returns (k iterations run, clock after them, number of requests that finished); finished requests'
    ids are written to ``finished`` and removed from ``n``/``rem``/``rid`` (the others keep their order).

    Iteration j appends one token to every request (cache length n + j) and lasts
    ``fixed_s + sum(read[n + j]) * spb``. It stops before an iteration whose held memory would exceed
    ``pool`` (k may be 0: the caller must preempt), after the iteration in which a request finishes
    (``rem`` reaches 0), or after an iteration at whose end the queue head (present from ``head_time``,
    needing ``head_need`` bytes) could be admitted. With ``max_steps == 1`` this is exactly one iteration,
    so aggregated and per-step runs take the same decisions on the same float clock.
    ``stats`` accumulates [byte-seconds held, request-seconds running, peak bytes, iterations, tokens,
    max batch size].
    """
    min_rem = rem[0]
    for i in range(1, count):
        if rem[i] < min_rem:
            min_rem = rem[i]
    k = 0
    while k < max_steps:
        mem = 0
        rb = 0
        for i in range(count):
            m = n[i] + k + 1
            mem += held[m]
            rb += read[m]
        if mem > pool:
            break
        dur = fixed_s + rb * spb
        clock += dur
        k += 1
        stats[0] += mem * dur
        stats[1] += count * dur
        if mem > stats[2]:
            stats[2] = mem
        stats[3] += 1
        stats[4] += count
        if count > stats[5]:
            stats[5] = count
        if k == min_rem:
            break
        if room_for_head and clock >= head_time and mem + head_need <= admit_limit:
            break
    n_fin = 0
    m = 0
    for i in range(count):
        if rem[i] == k:
            finished[n_fin] = rid[i]
            n_fin += 1
        else:
            n[m] = n[i] + k
            rem[m] = rem[i] - k
            rid[m] = rid[i]
            m += 1
    return k, clock, n_fin


@njit(cache=True)
def held_bytes(held, n, count):
    """Bytes held by the first ``count`` requests at cache lengths ``n``."""
    total = 0
    for i in range(count):
        total += held[n[i]]
    return total
