"""Plain-numpy replay with the engine's semantics: the oracle the numba engine is tested and benchmarked against.

Per step and KV head it appends the new token, computes attention with numpy over the cached slots, calls the
same policy kernels, applies merges and compacts with boolean masks. Slow by design (Python per step and
head), so it is only used on small traces in tests and as the side-by-side baseline of benchmarks/replay.py.
"""
from __future__ import annotations

from dataclasses import dataclass
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
    chunk = 1 if policy.has_prefill else int(chunk)
    cap = int(slot_capacity(policy, budget, T, chunk).max())
    info = np.zeros(3, np.int64)
    cache = _Cache.empty(hkv, d, policy.slot_fields)
    head_state = policy.head_state_init(hkv, d, li.wo) if head_state is None else np.array(head_state, np.float64)
    t0 = 0
    if policy.has_prefill and n_prompt > 0:
        pkeep = np.ones((hkv, n_prompt), np.uint8)
        pst = np.zeros((hkv, n_prompt, policy.slot_fields))
        prefill(params, layer, budget, li.q[:n_prompt], li.k[:n_prompt], li.v[:n_prompt], scale, pkeep, pst,
                head_state)
        raise_on(policy, check_kept(pkeep.sum(axis=1).astype(np.int64), budget, policy.head_adaptive,
                                    not policy.unbounded, -1, info), info, layer)
        if window:
            pkeep[:, : max(0, n_prompt - window + 1)] = 0
        cache.load_prompt(li, pkeep, pst)
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
                cache.append(h, t, li)
                lengths[h] = len(cache.pos[h])
                _attend(li, t, h, scale, mult, window, n_prompt, cache, probs, metrics)
        t = t_next - 1
        ck, cv, cpos, cst = cache.slot_arrays(lengths, cap)
        keep = np.ones((hkv, cap), np.uint8)
        merge_to = np.full((hkv, cap), -1, np.int64)
        merge_w = np.ones((hkv, cap))
        step(params, layer, t, budget, lengths, probs, ck, cv, cpos, cst, head_state, keep, merge_to, merge_w)
        raise_on(policy, check_step(lengths, keep, merge_to, budget, policy.head_adaptive, not policy.unbounded, t,
                                    info), info, layer)
        apply_window(lengths, keep, merge_to, cpos, t, window)
        for h in range(hkv):
            cache.apply_step(h, lengths[h], keep, merge_to, merge_w, ck, cv, cpos, cst)
            if t >= n_prompt:
                slots[t - n_prompt, h] = len(cache.pos[h])
        kept_log.append([p.copy() for p in cache.pos])
    return metrics, slots, kept_log


@dataclass
class _Cache:
    """Every KV head's cache as arrays that grow and shrink: keys, values, positions, slot state, merged flags."""

    keys: list[np.ndarray]
    vals: list[np.ndarray]
    pos: list[np.ndarray]
    state: list[np.ndarray]
    dirty: list[np.ndarray]

    @classmethod
    def empty(cls, hkv: int, d: int, n_slot_fields: int) -> "_Cache":
        return cls(keys=[np.zeros((0, d), np.float32) for _ in range(hkv)],
                   vals=[np.zeros((0, d), np.float32) for _ in range(hkv)],
                   pos=[np.zeros(0, np.int64) for _ in range(hkv)],
                   state=[np.zeros((0, n_slot_fields)) for _ in range(hkv)],
                   dirty=[np.zeros(0, bool) for _ in range(hkv)])

    def load_prompt(self, li: LayerInputs, pkeep: np.ndarray, pst: np.ndarray) -> None:
        """Hold the prompt tokens the prefill kept (``pkeep`` [Hkv, P]) with their slot state ``pst``."""
        n_prompt = pkeep.shape[1]
        for h in range(len(self.keys)):
            sel = pkeep[h].astype(bool)
            self.keys[h], self.vals[h] = li.k[:n_prompt, h][sel], li.v[:n_prompt, h][sel]
            self.pos[h], self.state[h] = np.arange(n_prompt)[sel], pst[h][sel]
            self.dirty[h] = np.zeros(int(sel.sum()), bool)

    def append(self, h: int, t: int, li: LayerInputs) -> None:
        """Add token t to head h as a clean slot with zero slot state."""
        self.keys[h] = np.vstack([self.keys[h], li.k[t, h][None]])
        self.vals[h] = np.vstack([self.vals[h], li.v[t, h][None]])
        self.pos[h] = np.append(self.pos[h], t)
        self.state[h] = np.vstack([self.state[h], np.zeros((1, self.state[h].shape[1]))])
        self.dirty[h] = np.append(self.dirty[h], False)

    def slot_arrays(self, lengths: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The caches as the step kernel takes them: keys, values, positions and slot state in ``cap`` slots a
        head."""
        hkv, d = len(self.keys), self.keys[0].shape[1]
        ck = np.zeros((hkv, cap, d), np.float32)
        cv = np.zeros((hkv, cap, d), np.float32)
        cpos = np.full((hkv, cap), -1, np.int64)
        cst = np.zeros((hkv, cap, self.state[0].shape[1]))
        for h in range(hkv):
            n = lengths[h]
            ck[h, :n], cv[h, :n], cpos[h, :n], cst[h, :n] = self.keys[h], self.vals[h], self.pos[h], self.state[h]
        return ck, cv, cpos, cst

    def apply_step(self, h: int, n: int, keep: np.ndarray, merge_to: np.ndarray, merge_w: np.ndarray,
                   ck: np.ndarray, cv: np.ndarray, cpos: np.ndarray, cst: np.ndarray) -> None:
        """Head h after the step's decisions over its n slots: the merges folded in float64 (each target scaled
        by its self weight, then the weighted sources added), the kept slots only, the merge targets dirty."""
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
        self.keys[h], self.vals[h] = newk[sel].astype(np.float32), newv[sel].astype(np.float32)
        self.pos[h], self.state[h] = cpos[h, :n][sel], cst[h, :n][sel]
        self.dirty[h] = (self.dirty[h] | merged)[sel]


def _attend(li: LayerInputs, t: int, h: int, scale: float, mult: float, window: int, n_prompt: int, cache: _Cache,
            probs: np.ndarray, metrics: np.ndarray) -> None:
    """Query t's G heads of KV head h over the head's cache (logits ``scale * mult``): their attention added to
    ``probs[h]`` (summed over a prompt chunk) and, for a measured step, their metrics against the full-attention
    reference written into ``metrics``."""
    g_n = probs.shape[1]
    n = len(cache.pos[h])
    qg = li.q[t, h * g_n:(h + 1) * g_n]                              # [G, d]
    dots = (qg @ cache.keys[h].T).astype(np.float64)     # [G, n], float32 like the engine
    logits = dots * scale * mult
    if window:
        logits[:, cache.pos[h] <= t - window] = -np.inf   # a chunk-mate's window may have moved on
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    probs[h, :, :n] += p
    if t < n_prompt:
        return
    orig = np.where(cache.dirty[h][None], (qg @ li.k[cache.pos[h], h].T).astype(np.float64), dots)
    lse = li.lse[t, h * g_n:(h + 1) * g_n].astype(np.float64)[:, None]
    log_pfull = orig * scale - lse
    o_cache = np.ascontiguousarray(p @ cache.vals[h].astype(np.float64))
    mass = np.exp(log_pfull).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(p > 0, p * (np.log(p) - log_pfull), 0.0).sum(axis=1)
    for g in range(g_n):
        hq = h * g_n + g
        measure(float(mass[g]), float(kl[g]), li.o[t, hq], o_cache[g], 1.0, float(li.vmax1[t, h]),
                metrics[t - n_prompt, hq])
