"""`DecodeSteps`: the host side of the closed loop's policy steps, all layers of a decode step in one round trip.

A decode step's policy decisions in layer l apply from the next step on (the step's own attention in layer l was
computed before them, and no other layer reads layer l's cache), so nothing in the model's forward waits for them: the
runner's routed attention only appends and attends, and after the forward `DecodeSteps.step` runs the policies of every
layer at once. On a device cache that is one round trip per decode step instead of two synchronisations per layer: one
device-to-host copy of what the steps read (each reading layer's probabilities, and its keys / values only where some
row's policy reads them, ``Policy.reads_keys`` / ``reads_values``), every layer's steps on the host
(`gpu_validate.closedloop.host_steps.step_layer`: one jitted call per layer for all its rows, layers on threads), one
host-to-device copy of the flat keep / merge decisions and one compaction of the model's whole cache
(`gpu_validate.kvcache.varlen_cache.layer_views`: every layer's cache is a view of one set of buffers). The host keeps a
mirror of each device layer's lengths and positions, exact because it applies the same decisions, so it never reads them
back and checks capacities itself (a device append needs no status read either). On the CPU's host cache the steps
compact the cache in place, as before; only the timing changed (after the forward instead of inside each layer's
attention), which the results do not see (tested: identical tokens, losses and kept sets).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from numba import typed, types

from gpu_validate.closedloop.host_steps import flatten_keep, flatten_merges, step_layer, unflatten
from gpu_validate.kvcache.kernels.kernel_errors import CacheCapacityError
from policies.core.base import STEP_SIG
from sim.replay.contract import raise_on
from sim.replay.plan import replay_threads
from sim.replay.step_plan import engine_kernels

_STEP = types.FunctionType(STEP_SIG)


@dataclass
class LayerPlan:
    """One layer's rows, as `step_layer` takes them: typed lists of each row's kernel and of its (params, budgets,
    slot state, head state, scratch, decisions), the per-row flags, and the layer's constants."""

    steps: Any
    rows: Any
    adaptive: np.ndarray
    bounded: np.ndarray
    views: np.ndarray
    row_p: np.ndarray
    caps: list[int]
    window: int
    compressed: bool
    reads_probs: bool
    read_k: bool
    read_v: bool
    row_k: np.ndarray
    row_v: np.ndarray


@dataclass
class Mirror:
    """The host's copy of one device layer's per-head state, padded to the layer's widest head ``W``: lengths
    [B*Hkv], positions [B*Hkv, W] (-1 past a length) and, for layers whose policies read them, keys / values
    [B*Hkv, W, d] (else [B*Hkv, 1, d] placeholders; the probabilities are read from the flat copy itself), the decisions
    ``row_post`` emits, and where the layer's heads lie in the flat cache (starts, capacities, offset)."""

    length: np.ndarray
    pos: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    keep: np.ndarray
    merge_to: np.ndarray
    merge_w: np.ndarray
    start: np.ndarray
    capacity: np.ndarray
    offset: int
    total: int


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(n: int) -> ThreadPoolExecutor | None:
    """The process's pool of ``n`` threads for the layers' steps (None for one thread)."""
    if n <= 1:
        return None
    if n not in _POOLS:
        _POOLS[n] = ThreadPoolExecutor(n, thread_name_prefix="kvsim-steps")
    return _POOLS[n]


def _chunks(n: int, k: int) -> list[np.ndarray]:
    """``range(n)`` dealt into ``min(n, k)`` chunks of rows, round robin (chunk c holds rows c, c + k, ...): a batch
    lists its configurations policy by policy, and a policy's step costs the same in each of its rows (SnapKV's
    sliding window, Ada-SnapKV's allocation: 12-25x PyramidKV's per row at 8 KV heads and 1 025 slots), so dealt
    rows balance the threads that contiguous pieces would leave waiting on the costliest policy's chunk."""
    return [np.arange(c, n, k, dtype=np.int64) for c in range(min(n, k))]


def _list(items: Sequence[Any], item_type: Any = None):
    out = typed.List.empty_list(item_type) if item_type is not None else typed.List()
    for x in items:
        out.append(x)
    return out


class DecodeSteps:
    """Every row's policy steps of a `gpu_validate.closedloop.batch_runner.BatchRunner` (module docstring): built once
    the rows' policies, budgets, states and caches are set up; `step` runs the steps of some layers at one step."""

    def __init__(self, runner: Any, caps: np.ndarray) -> None:
        self.runner = r = runner
        self.rows, self.caches, self.host = r.rows, r.caches, r.host
        self.H, self.G, self.d = r.n_kv, r.group, r.head_dim
        B, L = len(self.rows), r.n_layers
        threads = replay_threads(None, L * B)
        #: each layer's rows cut into chunks that step side by side (with the layers) when threads allow
        self.chunks = _chunks(B, max(1, min(B, -(-threads // L))))
        self.plans = [self._plan(layer, [int(caps[layer, b].max()) for b in range(B)]) for layer in range(L)]
        #: slots each row holds per layer after the last step ([B, L]; each row's ``held`` is its row of it)
        self.held = np.zeros((B, L), np.int64)
        for b, row in enumerate(self.rows):
            self.held[b] = row.held
            row.held = self.held[b]
        self.mirrors = None if self.host else [self._mirror(layer) for layer in range(L)]
        self._zero_probs: dict[int, np.ndarray] = {}
        #: per layer, the float64 buffer the steps widen the cache's float32 probabilities into (`_host_inputs`)
        self._probs64: dict[int, np.ndarray] = {}
        self._info = [[np.zeros(3, np.int64) for _ in self.chunks] for _ in range(L)]
        #: every layer's per-row step outcome (deviated, dropped, held), one array so a step reads them at once
        self._out_all = np.zeros((L, B, 3), np.int64)
        self._out = list(self._out_all)
        self._no_masks = (np.zeros((1, 1), np.uint8), np.zeros((1, 1), np.int64), np.zeros((1, 1)))
        self._no_flat = (np.zeros((1, 1), np.float32), np.zeros(0, np.int64))   # probabilities given padded
        self._no_probs32 = np.zeros((0, 1, 1), np.float32)                        # probabilities given as float64
        self._pool = _pool(threads)
        #: `_compact`'s flat keep mask over the device cache's slots, and the layers it last wrote
        self._keep_flat = None if self.host else np.ones(r.kv_group.total_capacity, np.uint8)
        self._written: list[int] = []
        self.host_seconds = 0.0      # wall time of `step`, for the runner's profile
        #: where that time went: reading what the steps read (on a device cache: the copy, which waits for the
        #: forward), the policy steps on the threads, the compaction (decisions copied to the device, one launch)
        self.phase_seconds = {"inputs": 0.0, "policy_steps": 0.0, "compaction": 0.0}

    # ----- set-up -----
    def _plan(self, layer: int, caps: list[int]) -> LayerPlan:
        r, H, G, d = self.runner, self.H, self.G, self.d
        policies = [row.layer_policy[layer] for row in self.rows]
        row_k = np.array([p.reads_keys for p in policies], np.bool_)
        row_v = np.array([p.reads_values for p in policies], np.bool_)
        read_k, read_v = bool(row_k.any()), bool(row_v.any())
        width = self.caches[layer].max_capacity
        views = np.array([self.host and c == width for c in caps], np.bool_)
        shared: dict[tuple, tuple] = {}
        decisions: dict[tuple, tuple] = {}
        scratch, dec = [], []
        zero_kv: dict[int, np.ndarray] = {}
        chunk_of = [0] * len(self.rows)
        for ci, members in enumerate(self.chunks):
            for b in members:
                chunk_of[b] = ci
        for b, cap in enumerate(caps):               # rows of one chunk step in turn and share their scratch
            if (chunk_of[b], cap) not in decisions:
                decisions[chunk_of[b], cap] = (np.ones((H, cap), np.uint8), np.full((H, cap), -1, np.int64),
                                               np.ones((H, cap)))
            dec.append(decisions[chunk_of[b], cap])
            c = 1 if views[b] else cap               # a row stepping on views uses no scratch
            key = (chunk_of[b], c, bool(row_k[b]), bool(row_v[b]))
            if key not in shared:
                if c not in zero_kv:                  # never written: rows that read neither share zeros
                    zero_kv[c] = np.zeros((H, c, d), np.float32)
                shared[key] = (np.zeros(H, np.int64), np.zeros((H, G, c)),
                               np.zeros((H, c, d), np.float32) if row_k[b] else zero_kv[c],
                               np.zeros((H, c, d), np.float32) if row_v[b] else zero_kv[c],
                               np.full((H, c), -1, np.int64))
            scratch.append(shared[key])
        # compiled functions, one numba type for all (a dispatcher is a type of its own: numba compiled the typed
        # list's append anew, uncached, for every policy in the batch, ~1.2 s each)
        steps = _list([engine_kernels(row.layer_policy[layer])[0][0] for row in self.rows], _STEP)
        rows = [(row.params[layer], np.ascontiguousarray(row.budgets[layer]), row.slot_state[layer],
                 np.ascontiguousarray(row.head_state[layer]), scratch[b], dec[b]) for b, row in enumerate(self.rows)]
        return LayerPlan(
            steps=steps, rows=_list(rows),
            adaptive=np.array([p.head_adaptive for p in policies], np.bool_),
            bounded=np.array([not p.unbounded for p in policies], np.bool_), views=views,
            row_p=np.array([p.reads_attention for p in policies], np.bool_),
            caps=caps, window=int(r.attn[layer].window or 0),
            compressed=bool(r.compressed[layer]), reads_probs=bool(r.layer_reads[layer]), read_k=read_k,
            read_v=read_v, row_k=row_k, row_v=row_v)

    def _mirror(self, layer: int) -> Mirror:
        cache, plan = self.caches[layer], self.plans[layer]
        BH, W, d = len(self.rows) * self.H, cache.max_capacity, self.d
        start = cache.start.cpu().numpy().astype(np.int64)
        capacity = cache.capacity.cpu().numpy().astype(np.int64)
        return Mirror(length=np.zeros(BH, np.int64), pos=np.full((BH, W), -1, np.int64),
                      keys=np.zeros((BH, W if plan.read_k else 1, d), np.float32),
                      values=np.zeros((BH, W if plan.read_v else 1, d), np.float32),
                      keep=np.zeros((BH, W), np.uint8), merge_to=np.full((BH, W), -1, np.int64),
                      merge_w=np.ones((BH, W)), start=start, capacity=capacity,
                      offset=int(getattr(cache, "flat_offset", 0)), total=int(cache.total_capacity))

    def sync_mirrors(self) -> None:
        """Read every device layer's lengths and positions once (after the prompt was loaded into the caches)."""
        for layer, (cache, m) in enumerate(zip(self.caches, self.mirrors)):
            m.length[:] = cache.length.cpu().numpy()
            m.pos[:] = cache.padded(cache.positions, -1).cpu().numpy()

    def check_append(self, layer: int, n_new: int, t0: int) -> None:
        """Before a device layer's append of ``n_new`` tokens at t0.. per head: refuse what exceeds a head's capacity
        (the error the cache would raise), then record the new slots in the mirror."""
        m = self.mirrors[layer]
        over = np.flatnonzero(m.length + n_new > m.capacity)
        if over.size:
            i = int(over[0])
            raise CacheCapacityError(f"head {i}: {int(m.length[i])} kept + {n_new} new slots exceed capacity "
                                     f"{int(m.capacity[i])}")
        rows = np.arange(m.length.size)
        for j in range(n_new):
            m.pos[rows, m.length + j] = t0 + j
        m.length += n_new

    def snapshot(self) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """The device mirrors' lengths and positions (before a decode graph's capture, whose Python appends)."""
        return None if self.host else [(m.length.copy(), m.pos.copy()) for m in self.mirrors]

    def restore(self, snap: list[tuple[np.ndarray, np.ndarray]] | None) -> None:
        for m, (length, pos) in zip(self.mirrors or [], snap or []):
            m.length[:] = length
            m.pos[:] = pos

    # ----- one step -----
    def step(self, layers: Sequence[int], t: int, n_new: int, summed: dict[int, np.ndarray] | None = None) -> bool:
        """Every row's policy step on ``layers`` at step t (``n_new`` new slots per head since the last step;
        ``summed[layer]``: a prompt chunk's summed attention [B*Hkv, G, W], else the cache's last attention), its
        window and its compaction. Returns True when some row's policy evicted or merged a slot of a layer it
        compresses (the cache no longer holds what the model's attention would see)."""
        t0 = time.perf_counter()
        summed = summed or {}
        layers = list(layers)
        if self.host:
            inputs = {layer: self._host_inputs(layer, summed.get(layer)) for layer in layers}
        else:
            inputs = self._device_inputs(layers, summed)
        t1 = time.perf_counter()

        def run(task: tuple[int, int]) -> int:
            layer, ci = task
            p, (lengths, probs, probs32, flat, keys, values, pos, masks) = self.plans[layer], inputs[layer]
            return step_layer(p.steps, p.rows, p.adaptive, p.bounded, p.views, p.row_p, self.chunks[ci], layer, t,
                              n_new, p.window, p.compressed, p.row_k, p.row_v, self.host, not self.host, lengths,
                              probs, probs32, *flat, keys, values, pos, *masks, self._info[layer][ci],
                              self._out[layer])

        tasks = [(layer, ci) for layer in layers for ci in range(len(self.chunks))]
        failed = list(self._pool.map(run, tasks)) if self._pool and len(tasks) > 1 else [run(x) for x in tasks]
        for (layer, ci), b in zip(tasks, failed):
            if b >= 0:
                raise_on(self.rows[b].layer_policy[layer], int(self._out[layer][b, 0]), self._info[layer][ci], layer)
        outs = self._out_all[layers]                     # [layers, B, 3]: one read of every layer's outcome
        flags = outs[:, :, :2].any(axis=1)
        deviated = bool(flags[:, 0].any())
        evicting = [layer for layer, e in zip(layers, flags[:, 1].tolist()) if e]
        self.held[:, layers] = outs[:, :, 2].T
        self._record(layers, t)
        t2 = time.perf_counter()
        if evicting and not self.host:
            self._compact(evicting)
        t3 = time.perf_counter()
        for phase, seconds in zip(self.phase_seconds, (t1 - t0, t2 - t1, t3 - t2)):
            self.phase_seconds[phase] += seconds
        self.host_seconds += t3 - t0
        return deviated

    def _host_inputs(self, layer: int, summed: np.ndarray | None) -> tuple:
        cache, plan = self.caches[layer], self.plans[layer]
        probs32 = self._no_probs32
        if summed is not None:
            probs = summed
        elif plan.reads_probs:        # the steps widen the cache's float32 probabilities into the layer's buffer
            probs32 = cache.p.numpy()
            probs = self._probs64.get(layer)
            if probs is None or probs.shape != probs32.shape:     # zeros: rows that read none leave theirs so
                probs = self._probs64[layer] = np.zeros(probs32.shape)
        else:
            probs = self._zeros(layer, cache.max_capacity)
        return cache.length, probs, probs32, self._no_flat, cache.k3, cache.v3, cache.pos, self._no_masks

    def _zeros(self, layer: int, width: int) -> np.ndarray:
        """Zero probabilities for a layer whose policies do not read them (one buffer per layer: layers step on
        threads)."""
        z = self._zero_probs.get(layer)
        if z is None or z.shape[2] != width:
            z = self._zero_probs[layer] = np.zeros((len(self.rows) * self.H, self.G, width))
        return z

    def _device_inputs(self, layers: Sequence[int], summed: dict[int, np.ndarray]) -> dict[int, tuple]:
        """One device-to-host copy of what ``layers``' steps read, laid out padded in their mirrors."""
        pieces, spans = [], []
        for layer in layers:
            cache, plan = self.caches[layer], self.plans[layer]
            for name, wanted, width in (("probs", plan.reads_probs and layer not in summed, self.G),
                                        ("k", plan.read_k, self.d), ("v", plan.read_v, self.d)):
                if wanted:
                    x = getattr(cache, name)
                    pieces.append(x.reshape(-1) if x.dtype == torch.float32 else x.float().reshape(-1))
                    spans.append((layer, name, width))
        flat = torch.cat(pieces).cpu().numpy() if pieces else None
        at, flat_probs = 0, {}
        for layer, name, width in spans:
            m = self.mirrors[layer]
            n = m.total * width
            rows = flat[at:at + n].reshape(m.total, width)
            at += n
            if name == "probs":              # read in place by the rows' `row_prep`
                flat_probs[layer] = (rows, m.start)
            else:
                unflatten(rows, m.start, m.length, m.keys if name == "k" else m.values, False)
        inputs = {}
        for layer in layers:
            m = self.mirrors[layer]
            width = m.pos.shape[1]
            probs = summed[layer] if layer in summed else self._zeros(layer, 1 if layer in flat_probs else width)
            inputs[layer] = (m.length, probs, self._no_probs32, flat_probs.get(layer, self._no_flat), m.keys,
                             m.values, m.pos, (m.keep, m.merge_to, m.merge_w))
        return inputs

    def _compact(self, layers: Sequence[int]) -> None:
        """One host-to-device copy of ``layers``' flat decisions and one compaction of the model's whole cache. The
        flat keep mask is the runner's own buffer, reset only where the last compaction wrote it (with three fresh
        flat arrays a step, this phase took 2.3 ms a step on the H200 at 16 rows of 8 KV heads and 1 100 slots over
        4 layers; its host side at that shape 4.2 -> 0.6 ms on the CPU); merges (D2O) are rare and build their
        arrays afresh."""
        group = self.runner.kv_group
        total = group.total_capacity
        keep = self._keep_flat
        for layer in self._written:
            m = self.mirrors[layer]
            keep[m.offset:m.offset + m.total] = 1
        merging = False
        for layer in layers:
            m = self.mirrors[layer]
            merging |= flatten_keep(m.keep, m.merge_to, m.start, m.capacity, m.offset, keep)
        self._written = list(layers)
        dev = group.device
        if merging:      # D2O-style merges: rare, three copies
            merge_to = np.full(total, -1, np.int32)
            merge_w = np.ones(total, np.float32)
            for layer in layers:
                m = self.mirrors[layer]
                flatten_merges(m.merge_to, m.merge_w, m.start, m.capacity, m.offset, merge_to, merge_w)
            group.compact(torch.from_numpy(keep).to(dev), torch.from_numpy(merge_to).to(dev),
                          torch.from_numpy(merge_w).to(dev), check=False)
        else:
            group.compact(torch.from_numpy(keep).to(dev), check=False)

    def _record(self, layers: Sequence[int], t: int) -> None:
        """Where asked (the runner's ``record_kept``), the rows' kept positions on ``layers`` after step t."""
        rec = self.runner.record_kept
        if not rec or not 0 <= t - rec[0] < rec[1]:
            return
        for layer in layers:
            pos = self.caches[layer].pos if self.host else self.mirrors[layer].pos
            for b, row in enumerate(self.rows):
                cap = self.plans[layer].caps[b]
                row.kept[layer, t - rec[0], :, :cap] = pos[b * self.H:(b + 1) * self.H, :cap]
