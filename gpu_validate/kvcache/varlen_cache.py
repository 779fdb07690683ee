"""VarlenKVCache: one layer's per-head variable-length KV cache (flat Ada-KV layout) driving the Triton kernels.

It owns `k`, `v` [total_capacity, d], the side arrays `positions` (int64 original token positions) and the
score statistics `acc` / `ema` (float32), the scores buffer `probs` [total_capacity, G], and per KV head
(index `b * Hkv + h`) `start`, `capacity` and device-side `length`. Capacities are fixed at construction
(a per-head budget, e.g. from an Ada-KV allocator); only `length` changes. Slot `start[i] + j` for
`j < length[i]` is retained slot j of head i, so keep masks, merge targets and probs all use flat indices.
Allocation is the sum of the per-head capacities (the budgets, as in Ada-KV's flattened cache); the kernels
read only retained slots and `memory_bytes()` reports the retained ones.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from gpu_validate.kvcache.kernels.attention import varlen_decode_attention
from gpu_validate.kvcache.kernels.compaction import slot_heads, varlen_compact
from gpu_validate.kvcache.kernels.kernel_errors import CacheCapacityError, KernelInputError


class VarlenKVCache:
    """Per-head varlen KV cache of one layer; `attend` emits per-slot probabilities, `compact` evicts/merges.

    `ema_gamma` is the decay of the EMA statistic; the policy supplies its own (Cascading KV, for instance,
    uses exp(-N ln(100) / |C|)).
    """

    def __init__(
        self,
        *,
        batch: int,
        n_kv_heads: int,
        n_q_heads: int,
        head_dim: int,
        capacity: int | Sequence[int] | torch.Tensor,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cuda",
        softmax_scale: float | None = None,
        track_acc: bool = True,
        track_ema: bool = False,
        ema_gamma: float = 0.9,
    ) -> None:
        if batch < 1 or n_kv_heads < 1 or head_dim < 1 or n_q_heads % n_kv_heads:
            raise KernelInputError(
                f"need batch, n_kv_heads, head_dim >= 1 and n_q_heads a multiple of n_kv_heads; got B={batch}, "
                f"Hkv={n_kv_heads}, Hq={n_q_heads}, d={head_dim}"
            )
        if not 0.0 <= ema_gamma <= 1.0:
            raise KernelInputError(f"ema_gamma must be in [0, 1] (the policy's decay), got {ema_gamma}")
        n_heads = batch * n_kv_heads
        cap = torch.as_tensor(capacity, dtype=torch.int64).flatten()
        if cap.numel() == 1:
            cap = cap.expand(n_heads)
        if cap.numel() != n_heads or bool((cap < 0).any()):
            raise KernelInputError(f"capacity must be one int or {n_heads} (B*Hkv) ints >= 0, got {cap.tolist()}")
        self.device = torch.device(device)
        self.batch, self.n_kv_heads, self.n_q_heads, self.head_dim = batch, n_kv_heads, n_q_heads, head_dim
        self.group = n_q_heads // n_kv_heads
        self.dtype = dtype
        self.softmax_scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
        self.ema_gamma = float(ema_gamma)
        self.max_capacity = int(cap.max()) if n_heads else 0
        total = int(cap.sum())
        starts = torch.cumsum(cap, 0) - cap
        dev = self.device
        self.start = starts.to(torch.int32).to(dev)
        self.capacity = cap.to(torch.int32).to(dev)
        self.length = torch.zeros(n_heads, dtype=torch.int32, device=dev)
        self.k = torch.zeros(total, head_dim, dtype=dtype, device=dev)
        self.v = torch.zeros(total, head_dim, dtype=dtype, device=dev)
        self.positions = torch.full((total,), -1, dtype=torch.int64, device=dev)
        self.acc = torch.zeros(total, dtype=torch.float32, device=dev) if track_acc else None
        self.ema = torch.zeros(total, dtype=torch.float32, device=dev) if track_ema else None
        self.probs = torch.zeros(total, self.group, dtype=torch.float32, device=dev)
        self.slot_owner = slot_heads(self.start, self.capacity, total)

    @property
    def total_capacity(self) -> int:
        return self.k.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        """Retained slots per KV head, [B, Hkv] int32 (a view of the device buffer)."""
        return self.length.view(self.batch, self.n_kv_heads)

    def memory_bytes(self, *, include_side: bool = False) -> int:
        """Bytes of retained K+V (plus positions and statistics if `include_side`); syncs once."""
        per_slot = 2 * self.head_dim * self.k.element_size()
        if include_side:
            per_slot += 8 + 4 * ((self.acc is not None) + (self.ema is not None))
        return int(self.length.sum()) * per_slot

    def head_slice(self, b: int, h: int) -> slice:
        """Flat slice of the retained slots of KV head h of batch element b (syncs to read the length)."""
        i = b * self.n_kv_heads + h
        s0 = int(self.start[i])
        return slice(s0, s0 + int(self.length[i]))

    def padded(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Per-slot array x [total_capacity, ...] as [B*Hkv, max_capacity, ...], `fill` past each head's length.

        Device ops only (no sync); e.g. `padded(cache.probs).transpose(1, 2)` is the `probs[h, g, i]` layout the
        numba policies read, and `padded(cache.positions, -1)` their positions.
        """
        if x.shape[0] != self.total_capacity:
            raise KernelInputError(f"x must have {self.total_capacity} rows (one per slot), got {tuple(x.shape)}")
        idx = self.slot_rows
        valid = torch.arange(self.max_capacity, device=self.device)[None, :] < self.length.long()[:, None]
        out = x[idx]
        out[~valid] = fill
        return out

    @functools.cached_property
    def slot_rows(self) -> torch.Tensor:
        """[B*Hkv, max_capacity]: the flat buffer row of every head's slot i, clamped to the buffer (rows past a
        head's capacity hold another head's slots); fixed, since starts and capacities never change."""
        ar = torch.arange(self.max_capacity, device=self.device)
        return (self.start.long()[:, None] + ar[None, :]).clamp(max=max(self.total_capacity - 1, 0))

    def _per_head(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if x.ndim != 4 or tuple(x.shape[:2]) != (self.batch, self.n_kv_heads) or x.shape[3] != self.head_dim:
            raise KernelInputError(f"{name} must be [B={self.batch}, Hkv={self.n_kv_heads}, n_new, "
                                   f"d={self.head_dim}], got {tuple(x.shape)}")
        return x.reshape(self.batch * self.n_kv_heads, x.shape[2], self.head_dim)

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, positions: torch.Tensor | None = None, *,
               check: bool = True) -> None:
        """Append n_new tokens per head: k_new/v_new [B, Hkv, n_new, d], positions [B, n_new] or [B, Hkv, n_new]."""
        self.compact(None, k_new=k_new, v_new=v_new, new_positions=positions, check=check)

    def attend(self, q: torch.Tensor, *, logit_scale: float = 1.0, want_probs: bool = True,
               update_acc: bool | None = None, update_ema: bool | None = None,
               num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode attention of q [B, Hq, d] -> (o [B, Hq, d], probs [total_capacity, G] or None); updates acc/ema.

        `probs` rows outside retained slots are stale; it is valid until the next compact/append.
        update_acc / update_ema default to whether the statistic is tracked.
        """
        upd_acc = self.acc is not None if update_acc is None else update_acc
        upd_ema = self.ema is not None if update_ema is None else update_ema
        if (upd_acc and self.acc is None) or (upd_ema and self.ema is None):
            raise KernelInputError("cannot update a statistic the cache does not track (track_acc/track_ema)")
        out = varlen_decode_attention(
            q, self.k, self.v, self.start, self.length, max_len=self.max_capacity,
            softmax_scale=self.softmax_scale, logit_scale=logit_scale, probs=self.probs, want_probs=want_probs,
            acc=self.acc if upd_acc else None, ema=self.ema if upd_ema else None, ema_gamma=self.ema_gamma,
            num_splits=num_splits,
        )
        return out.o, out.probs

    def compact(
        self,
        keep: torch.Tensor | None,
        merge_to: torch.Tensor | None = None,
        merge_w: torch.Tensor | None = None,
        *,
        k_new: torch.Tensor | None = None,
        v_new: torch.Tensor | None = None,
        new_positions: torch.Tensor | None = None,
        check: bool = True,
    ) -> None:
        """Apply a flat keep mask [total_capacity] (None: keep all), optional merges, then append new tokens.

        Merge semantics: `gpu_validate.kvcache.kernel_reference.ref_compact`. New slots start with acc = ema = 0.
        """
        kn, vn, pn = self._new_tokens(k_new, v_new, new_positions)
        varlen_compact(
            self.k, self.v, self.start, self.length, self.capacity, keep=keep, merge_to=merge_to,
            merge_w=merge_w, slot_owner=self.slot_owner, k_new=kn, v_new=vn, positions=self.positions,
            new_positions=pn, acc=self.acc, ema=self.ema, check=check,
        )

    def _new_tokens(self, k_new: torch.Tensor | None, v_new: torch.Tensor | None,
                    new_positions: torch.Tensor | None) -> tuple:
        """Validate tokens to append and lay them out per (batch, KV head) row: (k, v, positions) or Nones."""
        if k_new is None and v_new is None:
            return None, None, None
        if k_new is None or v_new is None:
            raise KernelInputError("k_new and v_new must be given together")
        kn = self._per_head(k_new.to(self.dtype), "k_new")
        vn = self._per_head(v_new.to(self.dtype), "v_new")
        pn = None
        if new_positions is not None:
            p = torch.as_tensor(new_positions, dtype=torch.int64, device=self.device)
            if p.ndim == 2:
                p = p[:, None, :].expand(self.batch, self.n_kv_heads, p.shape[1])
            if tuple(p.shape) != (self.batch, self.n_kv_heads, kn.shape[1]):
                raise KernelInputError(f"new_positions must be [B, n_new] or [B, Hkv, n_new], got {tuple(p.shape)}")
            pn = p.reshape(self.batch * self.n_kv_heads, kn.shape[1])
        return kn, vn, pn

    def prefill(self, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> None:
        """Load a prompt's k/v [B, Hkv, T, d] into an empty cache, keeping per head the slots where keep [B, Hkv, T].

        Kept tokens keep their order; positions default to 0..T-1. Raises CacheCapacityError if a head keeps
        more tokens than its capacity.
        """
        bsz, n_kv, t_len, d = k.shape
        if (bsz, n_kv, d) != (self.batch, self.n_kv_heads, self.head_dim) or v.shape != k.shape:
            raise KernelInputError(f"prefill k/v must be [{self.batch}, {self.n_kv_heads}, T, {self.head_dim}]")
        if bool((self.length != 0).any()):
            raise KernelInputError("prefill needs an empty cache")
        keep = torch.ones(bsz, n_kv, t_len, dtype=torch.bool, device=self.device) if keep is None else keep.bool()
        if positions is None:
            positions = torch.arange(t_len, device=self.device).expand(bsz, n_kv, t_len)
        elif positions.ndim == 2:
            positions = positions[:, None, :].expand(bsz, n_kv, t_len)
        keep = keep.reshape(bsz * n_kv, t_len)
        n_keep = keep.sum(1, dtype=torch.int32)
        over = torch.nonzero(n_keep > self.capacity).flatten().tolist()
        if over:
            raise CacheCapacityError(f"prefill keeps more tokens than capacity in heads {over[:8]}")
        dest = self.start.long()[:, None] + torch.cumsum(keep.long(), 1) - 1
        rows = dest[keep]
        self.k[rows] = k.reshape(bsz * n_kv, t_len, d)[keep].to(self.dtype)
        self.v[rows] = v.reshape(bsz * n_kv, t_len, d)[keep].to(self.dtype)
        self.positions[rows] = positions.reshape(bsz * n_kv, t_len)[keep].to(torch.int64)
        for stat in (self.acc, self.ema):
            if stat is not None:
                stat[rows] = 0.0
        self.length.copy_(n_keep)


def layer_views(cache: VarlenKVCache, n_layers: int, softmax_scales: Sequence[float]) -> list[VarlenKVCache]:
    """The per-layer caches of a model laid out in one cache: ``cache`` holds ``n_layers`` layers' heads layer by
    layer (``batch`` = n_layers x B, heads ordered (layer, batch row, KV head)), and layer l's cache is a view of its
    slice of every buffer (k, v, positions, probs, statistics, lengths), with its own starts, capacities and
    softmax scale. A layer's attend / append / prefill write through its view, so the whole model's caches are one
    set of buffers: one device-to-host copy reads every layer's probabilities, and one ``compact`` of ``cache``
    applies every layer's keep and merge decisions (the closed loop's one round trip per decode step)."""
    if n_layers < 1 or cache.batch % n_layers or len(softmax_scales) != n_layers:
        raise KernelInputError(f"a cache of batch {cache.batch} cannot hold {n_layers} layers of equal batch "
                               f"(with {len(softmax_scales)} softmax scales)")
    per = cache.batch // n_layers * cache.n_kv_heads
    starts, caps = cache.start.long(), cache.capacity.long()
    out = []
    for layer in range(n_layers):
        h0, h1 = layer * per, (layer + 1) * per
        lo = int(starts[h0])
        hi = int(starts[h1 - 1] + caps[h1 - 1])
        view = object.__new__(type(cache))
        view.__dict__.update({k: v for k, v in cache.__dict__.items() if k != "slot_rows"})
        view.batch = cache.batch // n_layers
        view.softmax_scale = float(softmax_scales[layer])
        view.start = (cache.start[h0:h1] - lo).contiguous()
        view.capacity = cache.capacity[h0:h1]
        view.length = cache.length[h0:h1]
        view.max_capacity = int(caps[h0:h1].max())
        for name in ("k", "v", "positions", "probs", "acc", "ema"):
            buf = getattr(cache, name)
            setattr(view, name, None if buf is None else buf[lo:hi])
        view.slot_owner = slot_heads(view.start, view.capacity, hi - lo)
        view.flat_offset = lo
        out.append(view)
    return out


__all__ = ["CacheCapacityError", "KernelInputError", "VarlenKVCache", "layer_views"]
