"""Triton in-place compaction of a per-head variable-length KV cache: keep masks, D2O-style merges, appends.

Semantics are exactly those of `gpu_validate.kvcache.kernel_reference.ref_compact` (read its docstring): per head, an
evicted slot e with `merge_to[e] = j` (local index of a kept slot of the same head) is merged into j as
`x_j <- merge_w[j] * x_j + sum_e merge_w[e] * x_e` (fp32, sources in slot order, rounded once; `merge_w[j]` is ignored
when j receives no source), then kept slots move to the front of the head's region in order (with positions, acc, ema),
then the new tokens are appended.

Two launches:
  * `_merge_kernel` (only when merges are given), grid over tiles of slots: the sources of each target come
    from a CSR built with one device sort (no host sync). It reads evicted sources and writes kept targets,
    never a slot that another program reads, so it is race-free in place.
  * `_compact_kernel`, one program per KV head walking its region in tiles: an exclusive prefix sum of the
    keep mask gives each kept slot's destination `w + cumsum - 1 <= source`; the whole tile is loaded, a
    barrier separates those loads from the stores (a destination may be a slot of the same tile that
    another warp has not read yet), and later tiles only read rows above this tile, so the walk is a
    stable in-place compaction. Tiles that are fully kept before the first eviction are skipped (only the
    mask is read), so evicting one slot costs O(slots after it).
A head whose kept + new slots exceed its capacity keeps the compaction, appends nothing and sets
`status[i] = 1` (the wrapper raises CacheCapacityError when asked to check).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_validate.kvcache.kernels.kernel_errors import CacheCapacityError, KernelInputError


@triton.jit
def _merge_kernel(
    K, V, KEEP_ACTIVE, MERGE_W, ORDER, SEG_LO, SEG_HI, TOTAL, stride_kn, stride_vn,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < TOTAL
    active = tl.load(KEEP_ACTIVE + offs_t, mask=mask_t, other=0) != 0
    lo = tl.load(SEG_LO + offs_t, mask=mask_t, other=0)
    cnt = tl.where(active, tl.load(SEG_HI + offs_t, mask=mask_t, other=0) - lo, 0)
    max_cnt = tl.max(cnt, 0)
    if max_cnt > 0:
        offs_d = tl.arange(0, BLOCK_D)
        tgt = cnt > 0
        mask = tgt[:, None] & (offs_d < HEAD_DIM)[None, :]
        rows = offs_t.to(tl.int64)
        w_self = tl.load(MERGE_W + offs_t, mask=tgt, other=0.0)
        k = w_self[:, None] * tl.load(K + rows[:, None] * stride_kn + offs_d[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        v = w_self[:, None] * tl.load(V + rows[:, None] * stride_vn + offs_d[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        for r in range(0, max_cnt):
            has = r < cnt
            src = tl.load(ORDER + lo + r, mask=has, other=0)
            w = tl.load(MERGE_W + src, mask=has, other=0.0)
            # masked on w (0 where the row has no r-th source) rather than on `has`: Triton 3.6 fails to compile
            # `has[:, None] & ...` here (RemoveLayoutConversions: "mask type matches ptr type"), seen on an H100;
            # a zero weight adds nothing either way
            smask = (w[:, None] != 0.0) & (offs_d < HEAD_DIM)[None, :]
            k += w[:, None] * tl.load(K + src[:, None] * stride_kn + offs_d[None, :], mask=smask, other=0.0).to(
                tl.float32
            )
            v += w[:, None] * tl.load(V + src[:, None] * stride_vn + offs_d[None, :], mask=smask, other=0.0).to(
                tl.float32
            )
        tl.store(K + rows[:, None] * stride_kn + offs_d[None, :], k.to(K.dtype.element_ty), mask=mask)
        tl.store(V + rows[:, None] * stride_vn + offs_d[None, :], v.to(V.dtype.element_ty), mask=mask)


@triton.jit
def _compact_kernel(
    K, V, POS, ACC, EMA, KEEP, START, LENGTH, CAPACITY, STATUS, K_NEW, V_NEW, POS_NEW,
    stride_kn, stride_vn, stride_knh, stride_knn, stride_vnh, stride_vnn, N_NEW, acc_init, ema_init,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    KEEP_ALL: tl.constexpr, HAS_POS: tl.constexpr, HAS_ACC: tl.constexpr, HAS_EMA: tl.constexpr,
    HAS_POS_NEW: tl.constexpr,
):
    pid = tl.program_id(0)
    base = tl.load(START + pid).to(tl.int64)
    n_len = tl.load(LENGTH + pid)
    cap = tl.load(CAPACITY + pid)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    w = n_len
    if not KEEP_ALL:
        w = tl.full([], 0, tl.int32)
        for n0 in range(0, n_len, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_len
            keep = (tl.load(KEEP + base + offs_n, mask=mask_n, other=0) != 0) & mask_n
            keep_i = keep.to(tl.int32)
            n_keep = tl.sum(keep_i, 0)
            if (w != n0) | (n_keep != BLOCK_N):
                src = base + offs_n
                dst = base + w + tl.cumsum(keep_i, 0) - 1
                kv_mask = keep[:, None] & mask_d[None, :]
                k = tl.load(K + src[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(V + src[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
                if HAS_POS:
                    pos = tl.load(POS + src, mask=keep, other=0)
                if HAS_ACC:
                    acc = tl.load(ACC + src, mask=keep, other=0.0)
                if HAS_EMA:
                    ema = tl.load(EMA + src, mask=keep, other=0.0)
                tl.debug_barrier()
                tl.store(K + dst[:, None] * stride_kn + offs_d[None, :], k, mask=kv_mask)
                tl.store(V + dst[:, None] * stride_vn + offs_d[None, :], v, mask=kv_mask)
                if HAS_POS:
                    tl.store(POS + dst, pos, mask=keep)
                if HAS_ACC:
                    tl.store(ACC + dst, acc, mask=keep)
                if HAS_EMA:
                    tl.store(EMA + dst, ema, mask=keep)
                tl.debug_barrier()
            w += n_keep
    fits = w + N_NEW <= cap
    if fits:
        for n0 in range(0, N_NEW, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N_NEW
            dst = base + w + offs_n
            nm = mask_n[:, None] & mask_d[None, :]
            src_k = K_NEW + pid.to(tl.int64) * stride_knh + offs_n[:, None] * stride_knn + offs_d[None, :]
            src_v = V_NEW + pid.to(tl.int64) * stride_vnh + offs_n[:, None] * stride_vnn + offs_d[None, :]
            tl.store(K + dst[:, None] * stride_kn + offs_d[None, :], tl.load(src_k, mask=nm, other=0.0), mask=nm)
            tl.store(V + dst[:, None] * stride_vn + offs_d[None, :], tl.load(src_v, mask=nm, other=0.0), mask=nm)
            if HAS_POS & HAS_POS_NEW:
                tl.store(POS + dst, tl.load(POS_NEW + pid.to(tl.int64) * N_NEW + offs_n, mask=mask_n), mask=mask_n)
            if HAS_ACC:
                tl.store(ACC + dst, tl.zeros([BLOCK_N], tl.float32) + acc_init, mask=mask_n)
            if HAS_EMA:
                tl.store(EMA + dst, tl.zeros([BLOCK_N], tl.float32) + ema_init, mask=mask_n)
        tl.store(LENGTH + pid, w + N_NEW)
        tl.store(STATUS + pid, 0)
    else:
        tl.store(LENGTH + pid, w)
        tl.store(STATUS + pid, 1)


def slot_heads(start: torch.Tensor, capacity: torch.Tensor, total: int) -> torch.Tensor:
    """Head index of every flat slot ([total] int64; -1 for rows in no head's region); built once per cache."""
    owner = torch.full((total,), -1, dtype=torch.int64, device=start.device)
    for i, (s, c) in enumerate(zip(start.tolist(), capacity.tolist())):
        owner[s : s + c] = i
    return owner


def _merge_plan(keep: torch.Tensor, merge_to: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
                owner: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """CSR of merge sources grouped by flat target slot, with device ops only; plus a count of bad merges."""
    total = keep.numel()
    slot = torch.arange(total, device=keep.device)
    head = owner.clamp(min=0)
    local = slot - start.long()[head]
    valid = (owner >= 0) & (local < length.long()[head])
    kept = keep.bool() & valid
    mt = merge_to.long()
    src = valid & ~kept & (mt >= 0)
    in_range = mt < length.long()[head]
    tgt = torch.where(src & in_range, start.long()[head] + mt, torch.full_like(mt, total))
    bad = src & (~in_range | ~kept[tgt.clamp(max=total - 1)])
    sorted_tgt, order = torch.sort(tgt, stable=True)
    seg_lo = torch.searchsorted(sorted_tgt, slot)
    seg_hi = torch.searchsorted(sorted_tgt, slot, right=True)
    return kept.to(torch.uint8), order, seg_lo, seg_hi, bad.sum()


def _check_cache_inputs(k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
                        capacity: torch.Tensor, positions: torch.Tensor | None, acc: torch.Tensor | None,
                        ema: torch.Tensor | None) -> tuple[int, int]:
    """(total slots, head dim) of the cache, after checking its buffers, the per-head ``start/length/capacity``
    and the per-slot side arrays (a `KernelInputError` naming the first that is wrong)."""
    dev = k_cache.device
    total, d = k_cache.shape if k_cache.ndim == 2 else (None, None)
    if total is None or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise KernelInputError(f"k_cache/v_cache must be equal [total, d] tensors, got {tuple(k_cache.shape)}")
    if k_cache.stride(1) != 1 or v_cache.stride(1) != 1:
        raise KernelInputError("k_cache and v_cache need a contiguous last dimension")
    n_heads = start.numel()
    for name, t in (("start", start), ("length", length), ("capacity", capacity)):
        if t.dtype != torch.int32 or t.numel() != n_heads or t.device != dev or not t.is_contiguous():
            raise KernelInputError(f"{name} must be a contiguous int32 [{n_heads}] tensor on {dev}")
    for name, t, dt in (("positions", positions, torch.int64), ("acc", acc, torch.float32),
                        ("ema", ema, torch.float32)):
        if t is not None and (t.shape != (total,) or t.dtype != dt or t.device != dev or not t.is_contiguous()):
            raise KernelInputError(f"{name} must be a contiguous {dt} [{total}] tensor on {dev}")
    return total, d


def _check_new_rows(k_cache: torch.Tensor, n_heads: int, k_new: torch.Tensor | None, v_new: torch.Tensor | None,
                    new_positions: torch.Tensor | None) -> tuple[int, torch.Tensor | None]:
    """(rows appended per head, their positions made contiguous) after checking the appended K/V rows."""
    if k_new is None and v_new is None:
        return 0, new_positions
    d = k_cache.shape[1]
    if k_new is None or v_new is None or k_new.shape != v_new.shape or k_new.ndim != 3 \
            or k_new.shape[0] != n_heads or k_new.shape[2] != d:
        raise KernelInputError(f"k_new/v_new must both be [{n_heads}, n_new, {d}]")
    if k_new.dtype != k_cache.dtype or v_new.dtype != k_cache.dtype or k_new.stride(2) != 1 \
            or v_new.stride(2) != 1:
        raise KernelInputError(f"k_new/v_new must be {k_cache.dtype} with a contiguous last dimension")
    n_new = k_new.shape[1]
    if new_positions is not None:
        if new_positions.shape != (n_heads, n_new) or new_positions.dtype != torch.int64:
            raise KernelInputError(f"new_positions must be int64 [{n_heads}, {n_new}]")
        new_positions = new_positions.contiguous()
    return n_new, new_positions


def _merge(k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
           keep: torch.Tensor | None, merge_to: torch.Tensor, merge_w: torch.Tensor | None,
           slot_owner: torch.Tensor | None, check: bool) -> None:
    """Step 1 of `varlen_compact`: each kept slot's K/V become the weighted sum of itself and the evicted slots
    merging into it (`_merge_plan` orders the sources; ``check`` syncs once to refuse a merge into an evicted or
    out-of-range slot)."""
    total, d = k_cache.shape
    if keep is None or merge_w is None or slot_owner is None:
        raise KernelInputError("merges need keep, merge_to, merge_w and slot_owner")
    if merge_to.shape != (total,) or merge_w.shape != (total,) or merge_w.dtype != torch.float32:
        raise KernelInputError(f"merge_to (int) and merge_w (float32) must be [{total}]")
    active, order, seg_lo, seg_hi, n_bad = _merge_plan(keep, merge_to, start, length, slot_owner)
    if check and int(n_bad) > 0:
        raise KernelInputError(f"{int(n_bad)} evicted slots merge into an evicted or out-of-range slot")
    block_t = 32
    _merge_kernel[(triton.cdiv(total, block_t),)](
        k_cache, v_cache, active, merge_w.contiguous(), order, seg_lo, seg_hi, total,
        k_cache.stride(0), v_cache.stride(0),
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_T=block_t,
    )


def varlen_compact(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    capacity: torch.Tensor,
    *,
    keep: torch.Tensor | None = None,
    merge_to: torch.Tensor | None = None,
    merge_w: torch.Tensor | None = None,
    slot_owner: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    new_positions: torch.Tensor | None = None,
    acc: torch.Tensor | None = None,
    ema: torch.Tensor | None = None,
    acc_init: float = 0.0,
    ema_init: float = 0.0,
    check: bool = True,
    block_n: int = 128,
) -> torch.Tensor:
    """Merge, compact and append in place (see module docstring); updates `length`; returns status [n_heads] int32.

    keep: [total_capacity] bool/uint8 per flat slot (None = keep all, i.e. a pure append). merge_to: int32
    local target index or -1, merge_w: float32 weights, both [total_capacity]. k_new/v_new: [n_heads, n_new, d]
    with new_positions [n_heads, n_new] int64. `slot_owner` ([total] int64 from `slot_heads`) is required
    with merges. check=True syncs once and raises on bad merges or capacity overflow.
    """
    if block_n < 16 or block_n & (block_n - 1):
        raise KernelInputError(f"block_n must be a power of two >= 16, got {block_n}")
    total, d = _check_cache_inputs(k_cache, v_cache, start, length, capacity, positions, acc, ema)
    dev, n_heads = k_cache.device, start.numel()
    if keep is not None:
        if keep.shape != (total,) or keep.dtype not in (torch.bool, torch.uint8) or keep.device != dev:
            raise KernelInputError(f"keep must be a bool/uint8 [{total}] tensor on {dev}, got {keep.dtype} "
                                   f"{tuple(keep.shape)}")
        keep = keep.contiguous().view(torch.uint8)
    n_new, new_positions = _check_new_rows(k_cache, n_heads, k_new, v_new, new_positions)
    if merge_to is not None:
        _merge(k_cache, v_cache, start, length, keep, merge_to, merge_w, slot_owner, check)
    status = torch.empty(n_heads, dtype=torch.int32, device=dev)
    if n_heads == 0:
        return status
    dummy_f = status if acc is None and ema is None else (acc if acc is not None else ema)
    _compact_kernel[(n_heads,)](
        k_cache, v_cache,
        positions if positions is not None else status,
        acc if acc is not None else dummy_f,
        ema if ema is not None else dummy_f,
        keep if keep is not None else status,
        start, length, capacity, status,
        k_new if k_new is not None else k_cache, v_new if v_new is not None else v_cache,
        new_positions if new_positions is not None else status,
        k_cache.stride(0), v_cache.stride(0),
        k_new.stride(0) if n_new else 0, k_new.stride(1) if n_new else 0,
        v_new.stride(0) if n_new else 0, v_new.stride(1) if n_new else 0,
        n_new, float(acc_init), float(ema_init),
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=block_n,
        KEEP_ALL=keep is None, HAS_POS=positions is not None, HAS_ACC=acc is not None, HAS_EMA=ema is not None,
        HAS_POS_NEW=new_positions is not None, num_stages=1,
    )
    if check:
        over = torch.nonzero(status).flatten().tolist()
        if over:
            raise CacheCapacityError(f"heads {over[:8]} cannot hold {n_new} new slots (capacity "
                                     f"{capacity[over[:8]].tolist()}); compaction applied, nothing appended")
    return status


__all__ = ["slot_heads", "varlen_compact"]
