"""Plain-numpy replay with the engine's semantics: the oracle the numba engine is tested and benchmarked against.

Per step and KV head it appends the new token, computes attention with numpy over the cached slots, calls the
same policy kernels, applies merges and compacts with boolean masks. Slow by design (Python per step and
head), so it is only used on small traces in tests and as the side-by-side baseline of benchmarks/replay.py.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from policies.core.base import Policy
from sim.replay.contract import apply_window, check_kept, check_scale, check_step, raise_on, slot_capacity
from sim.replay.metrics import N_METRICS, measure
from sim.replay.layer_inputs import LayerInputs, PromptLayers
from traces.format import Trace


def reference_head_state(policy: Policy, trace: Trace, inputs: Sequence[LayerInputs], layers: Sequence[int],
                         j: int) -> np.ndarray:
    """The initial head state a replay gives compressed layer ``layers[j]`` (``Policy.head_state_init`` and what
    ``Policy.prompt_head_state`` adds from the prompt view), for ``reference_replay_layer``."""
    li = inputs[layers[j]]
    head = policy.head_state_init(li.k.shape[1], li.k.shape[2], li.wo)
    return policy.prompt_head_state(head, PromptLayers(trace, inputs, layers, trace.meta.n_prompt), j)


def reference_replay_layer(policy: Policy, layer: int, li: LayerInputs, budget: np.ndarray, n_prompt: int,
                           scale: float, chunk: int = 1, head_state: np.ndarray | None = None
                           ) -> tuple[np.ndarray, np.ndarray, list[list[np.ndarray]]]:
    """Replay one layer; returns metrics [S, Hq, N_METRICS], slots [S, Hkv] and the kept positions per policy
    step and head. A streamed prompt goes ``chunk`` tokens per step (``sim.replay.policy_replay.replay_step``). ``head_state``:
    the initial head state (default ``policy.head_state_init``; a policy with a prompt table of its own, KVzip,
    needs the replay's, ``Policy.prompt_head_state``)."""
    step, prefill, logit_scale = policy.kernels()
    params = policy.param_vector(li.attention)
    window = int(li.attention.window or 0)
    T, hq_n, d = li.q.shape
    hkv = li.k.shape[1]
    g_n = hq_n // hkv
    S = policy.slot_fields
    chunk = 1 if policy.has_prefill else int(chunk)
    cap = int(slot_capacity(policy, budget, T, chunk).max())
    info = np.zeros(3, np.int64)
    keys = [np.zeros((0, d), np.float32) for _ in range(hkv)]
    vals = [np.zeros((0, d), np.float32) for _ in range(hkv)]
    pos = [np.zeros(0, np.int64) for _ in range(hkv)]
    state = [np.zeros((0, S)) for _ in range(hkv)]
    dirty = [np.zeros(0, bool) for _ in range(hkv)]
    head_state = policy.head_state_init(hkv, d, li.wo) if head_state is None else np.array(head_state, np.float64)
    t0 = 0
    if policy.has_prefill and n_prompt > 0:
        pkeep = np.ones((hkv, n_prompt), np.uint8)
        pst = np.zeros((hkv, n_prompt, S))
        prefill(params, layer, budget, li.q[:n_prompt], li.k[:n_prompt], li.v[:n_prompt], scale, pkeep, pst,
                head_state)
        raise_on(policy, check_kept(pkeep.sum(axis=1).astype(np.int64), budget, policy.head_adaptive,
                                    not policy.unbounded, -1, info), info, layer)
        if window:
            pkeep[:, : max(0, n_prompt - window + 1)] = 0
        for h in range(hkv):
            sel = pkeep[h].astype(bool)
            keys[h], vals[h] = li.k[:n_prompt, h][sel], li.v[:n_prompt, h][sel]
            pos[h], state[h] = np.arange(n_prompt)[sel], pst[h][sel]
            dirty[h] = np.zeros(int(sel.sum()), bool)
        t0 = n_prompt
    metrics = np.zeros((T - n_prompt, hq_n, N_METRICS))
    slots = np.zeros((T - n_prompt, hkv), np.int32)
    kept_log: list[list[np.ndarray]] = []
    t_next = t0
    while t_next < T:
        t_first = t_next
        t_next = min(n_prompt, t_first + chunk) if t_first < n_prompt else t_first + 1
        probs = np.zeros((hkv, g_n, cap))
        lengths = np.zeros(hkv, np.int64)
        for t in range(t_first, t_next):
            mult = logit_scale(params, t + 1)
            raise_on(policy, check_scale(mult, t, info), info, layer)
            for h in range(hkv):
                keys[h] = np.vstack([keys[h], li.k[t, h][None]])
                vals[h] = np.vstack([vals[h], li.v[t, h][None]])
                pos[h] = np.append(pos[h], t)
                state[h] = np.vstack([state[h], np.zeros((1, S))])
                dirty[h] = np.append(dirty[h], False)
                n = len(pos[h])
                lengths[h] = n
                qg = li.q[t, h * g_n:(h + 1) * g_n]                              # [G, d]
                dots = (qg @ keys[h].T).astype(np.float64)     # [G, n], float32 like the engine
                logits = dots * scale * mult
                if window:
                    logits[:, pos[h] <= t - window] = -np.inf   # a chunk-mate's window may have moved on
                p = np.exp(logits - logits.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                probs[h, :, :n] += p                         # summed over a prompt chunk
                if t >= n_prompt:
                    orig = np.where(dirty[h][None], (qg @ li.k[pos[h], h].T).astype(np.float64), dots)
                    lse = li.lse[t, h * g_n:(h + 1) * g_n].astype(np.float64)[:, None]
                    log_pfull = orig * scale - lse
                    o_cache = np.ascontiguousarray(p @ vals[h].astype(np.float64))
                    mass = np.exp(log_pfull).sum(axis=1)
                    with np.errstate(divide="ignore", invalid="ignore"):
                        kl = np.where(p > 0, p * (np.log(p) - log_pfull), 0.0).sum(axis=1)
                    for g in range(g_n):
                        hq = h * g_n + g
                        measure(float(mass[g]), float(kl[g]), li.o[t, hq], o_cache[g], 1.0, float(li.vmax1[t, h]),
                                metrics[t - n_prompt, hq])
        ck = np.zeros((hkv, cap, d), np.float32)
        cv = np.zeros((hkv, cap, d), np.float32)
        cpos = np.full((hkv, cap), -1, np.int64)
        cst = np.zeros((hkv, cap, S))
        for h in range(hkv):
            n = lengths[h]
            ck[h, :n], cv[h, :n], cpos[h, :n], cst[h, :n] = keys[h], vals[h], pos[h], state[h]
        t = t_next - 1
        keep = np.ones((hkv, cap), np.uint8)
        merge_to = np.full((hkv, cap), -1, np.int64)
        merge_w = np.ones((hkv, cap))
        step(params, layer, t, budget, lengths, probs, ck, cv, cpos, cst, head_state, keep, merge_to, merge_w)
        raise_on(policy, check_step(lengths, keep, merge_to, budget, policy.head_adaptive, not policy.unbounded, t,
                                    info), info, layer)
        apply_window(lengths, keep, merge_to, cpos, t, window)
        step_kept = []
        for h in range(hkv):
            n = lengths[h]
            kh, vh = ck[h, :n].astype(np.float64), cv[h, :n].astype(np.float64)
            src = np.nonzero(merge_to[h, :n] >= 0)[0]
            targets = np.unique(merge_to[h, src])
            newk, newv = kh.copy(), vh.copy()
            newk[targets] *= merge_w[h, targets][:, None]
            newv[targets] *= merge_w[h, targets][:, None]
            for i in src:
                newk[merge_to[h, i]] += merge_w[h, i] * kh[i]
                newv[merge_to[h, i]] += merge_w[h, i] * vh[i]
            sel = keep[h, :n].astype(bool)
            merged = np.zeros(n, bool)
            merged[targets] = True
            keys[h], vals[h] = newk[sel].astype(np.float32), newv[sel].astype(np.float32)
            pos[h], state[h] = cpos[h, :n][sel], cst[h, :n][sel]
            dirty[h] = (dirty[h] | merged)[sel]
            step_kept.append(pos[h].copy())
            if t >= n_prompt:
                slots[t - n_prompt, h] = len(pos[h])
        kept_log.append(step_kept)
    return metrics, slots, kept_log
