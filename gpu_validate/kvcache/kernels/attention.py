"""Triton decode attention over a per-head variable-length KV cache that also emits per-slot scores.

Layout (Ada-KV style flat buffer): `k_cache[total_capacity, d]`, `v_cache[...]`; KV head `i = b*Hkv + h`
owns rows `start[i] : start[i] + length[i]` (retained slots only are read). GQA: the G = Hq/Hkv query heads
of a group are processed by the same program, so each retained K/V row is read from memory once.

Two launches per call (flash-decoding split-K):
  1. `_attn_split_kernel`, grid (B*Hkv, n_splits): a program streams one chunk of one KV head, keeps an
     online softmax (max, sum, weighted V) per query head of the group and, when scores are wanted, writes
     the scaled raw logits (log2 domain) into the fp32 scores buffer `[total_capacity, G]`.
  2. `_attn_reduce_kernel`, grid (B*Hkv, n_splits if scores else 1): every program recombines the split
     partials into the final log-sum-exp; split 0 writes o and lse; each program rewrites its own chunk's
     logits in place as probabilities and updates `acc += sum_g p`, `ema = gamma*ema + (1-gamma)*mean_g p`.
Choice and cost: probabilities need the final lse, which only exists after all splits, so the first pass
writes raw logits and the second normalises them. The extra traffic is 4G bytes written in pass 1 plus 8G
bytes read+written in pass 2 and 8 bytes per statistic per slot, i.e. (12G+16)/(4d) of the fp16 K+V bytes
(G=4, d=128: 12.5%), plus one launch; statistics without probs skip the 4G-byte write-back. Without
scores pass 2 only combines the partials (grid B*Hkv).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu_validate.kvcache.kernels.kernel_errors import KernelInputError

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, DOT_MODE: tl.constexpr):
    """fp16: native; bf16: exact via fp32 operands on tf32 cores (bf16 fits tf32); fp32: full precision."""
    if DOT_MODE == 0:
        out = tl.dot(a, b)
    elif DOT_MODE == 1:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def _attn_split_kernel(
    Q, K, V, START, LENGTH, LOGITS, M_PART, L_PART, O_PART,
    qk_scale, stride_qb, stride_qh, stride_kn, stride_vn,
    N_KV_HEADS, CHUNK, N_SPLITS,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, WRITE_LOGITS: tl.constexpr, DOT_MODE: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_h // N_KV_HEADS
    hkv = pid_h % N_KV_HEADS
    base = tl.load(START + pid_h).to(tl.int64)
    n_len = tl.load(LENGTH + pid_h)
    lo = pid_s * CHUNK
    hi = tl.minimum(lo + CHUNK, n_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < HEAD_DIM
    q_ptrs = Q + b.to(tl.int64) * stride_qb + (hkv * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        rows = base + offs_n
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + rows[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DOT_MODE) * qk_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        if WRITE_LOGITS:
            tl.store(LOGITS + rows[None, :] * G + offs_g[:, None], s, mask=mask_g[:, None] & mask_n[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + rows[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_MODE)
        m_i = m_new
    part = pid_h * N_SPLITS + pid_s
    tl.store(M_PART + part * BLOCK_G + offs_g, m_i)
    tl.store(L_PART + part * BLOCK_G + offs_g, l_i)
    o_ptrs = O_PART + (part * G + offs_g)[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, acc, mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _attn_reduce_kernel(
    LOGITS, ACC, EMA, M_PART, L_PART, O_PART, O, LSE, START, LENGTH,
    ema_gamma, stride_ob, stride_oh, N_KV_HEADS, CHUNK, N_SPLITS,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    SCORES: tl.constexpr, WRITE_PROBS: tl.constexpr, UPDATE_ACC: tl.constexpr, UPDATE_EMA: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    mask_g = offs_g < G
    mask_d = offs_d < HEAD_DIM
    first = pid_h * N_SPLITS
    # global max, then rescaled sum, over the split partials (chunks of BLOCK_S splits)
    m_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s0 in range(0, N_SPLITS, BLOCK_S):
        ms = (s0 + offs_s) < N_SPLITS
        m = tl.load(M_PART + (first + s0 + offs_s)[:, None] * BLOCK_G + offs_g[None, :], mask=ms[:, None],
                    other=float("-inf"))
        m_max = tl.maximum(m_max, tl.max(m, 0))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_tot = tl.zeros([BLOCK_G], tl.float32)
    for s0 in range(0, N_SPLITS, BLOCK_S):
        ms = (s0 + offs_s) < N_SPLITS
        ptrs = (first + s0 + offs_s)[:, None] * BLOCK_G + offs_g[None, :]
        m = tl.load(M_PART + ptrs, mask=ms[:, None], other=float("-inf"))
        l_tot += tl.sum(tl.exp2(m - m_safe[None, :]) * tl.load(L_PART + ptrs, mask=ms[:, None], other=0.0), 0)
    lse2 = tl.where(l_tot > 0, m_safe + tl.log2(tl.where(l_tot > 0, l_tot, 1.0)), float("-inf"))
    if pid_s == 0:
        b = pid_h // N_KV_HEADS
        hq0 = (pid_h % N_KV_HEADS) * G
        tl.store(LSE + b.to(tl.int64) * N_KV_HEADS * G + hq0 + offs_g, lse2 * 0.6931471805599453, mask=mask_g)
        for gi in tl.static_range(G):
            sel = offs_g == gi
            m_g = tl.sum(tl.where(sel, m_safe, 0.0), 0)
            l_g = tl.sum(tl.where(sel, l_tot, 0.0), 0)
            o = tl.zeros([BLOCK_D], tl.float32)
            for s0 in range(0, N_SPLITS, BLOCK_S):
                ms = (s0 + offs_s) < N_SPLITS
                m_s = tl.load(M_PART + (first + s0 + offs_s) * BLOCK_G + gi, mask=ms, other=float("-inf"))
                w = tl.exp2(m_s - m_g)
                rows = ((first + s0 + offs_s) * G + gi).to(tl.int64)
                part_o = tl.load(O_PART + rows[:, None] * HEAD_DIM + offs_d[None, :],
                                 mask=ms[:, None] & mask_d[None, :], other=0.0)
                o += tl.sum(w[:, None] * part_o, 0)
            o = o / tl.where(l_g > 0, l_g, 1.0)
            tl.store(O + b.to(tl.int64) * stride_ob + (hq0 + gi) * stride_oh + offs_d, o.to(O.dtype.element_ty),
                     mask=mask_d)
    if SCORES:
        base = tl.load(START + pid_h).to(tl.int64)
        n_len = tl.load(LENGTH + pid_h)
        lo = pid_s * CHUNK
        hi = tl.minimum(lo + CHUNK, n_len)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            rows = base + offs_n
            ptrs = LOGITS + rows[:, None] * G + offs_g[None, :]
            mask = mask_n[:, None] & mask_g[None, :]
            p = tl.exp2(tl.load(ptrs, mask=mask, other=float("-inf")) - lse2[None, :])
            if WRITE_PROBS:
                tl.store(ptrs, p, mask=mask)
            p_sum = tl.sum(p, 1)
            if UPDATE_ACC:
                a = tl.load(ACC + rows, mask=mask_n, other=0.0)
                tl.store(ACC + rows, a + p_sum, mask=mask_n)
            if UPDATE_EMA:
                e = tl.load(EMA + rows, mask=mask_n, other=0.0)
                tl.store(EMA + rows, ema_gamma * e + (1.0 - ema_gamma) * (p_sum / G), mask=mask_n)


class AttentionOut(NamedTuple):
    """Kernel results: o [B, Hq, d] (q.dtype), lse [B, Hq] fp32 natural log, probs [total_capacity, G] or None."""

    o: torch.Tensor
    lse: torch.Tensor
    probs: torch.Tensor | None


_DOT_MODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_splits(n_heads: int, max_len: int, block_n: int, device: torch.device, min_chunk: int = 128) -> int:
    """Number of split-K chunks: enough programs to fill ~4 waves of SMs, chunks of at least `min_chunk` slots."""
    target = 4 * _sm_count(device)
    by_fill = max(1, -(-target // max(n_heads, 1)))
    by_len = max(1, -(-max_len // max(min_chunk, block_n)))
    return min(by_fill, by_len)


def _check(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise KernelInputError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise KernelInputError(f"{name} dtype {t.dtype} not in {[str(d) for d in dtypes]}")
    if t.device != device:
        raise KernelInputError(f"{name} is on {t.device}, expected {device}")


def _check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
                            length: torch.Tensor, acc: torch.Tensor | None,
                            ema: torch.Tensor | None) -> tuple[int, int, int, int]:
    """(B, Hq, d, Hkv) of a decode call, after checking every input's rank, dtype, device, shape and layout (a
    `KernelInputError` naming the first that is wrong)."""
    if q.ndim != 3:
        raise KernelInputError(f"q must be [B, Hq, d], got shape {tuple(q.shape)}")
    dev = q.device
    _check("q", q, 3, tuple(_DOT_MODES), dev)
    _check("k_cache", k_cache, 2, (q.dtype,), dev)
    _check("v_cache", v_cache, 2, (q.dtype,), dev)
    _check("start", start, 1, (torch.int32,), dev)
    _check("length", length, 1, (torch.int32,), dev)
    bsz, n_q, d = q.shape
    n_heads = start.numel()
    if length.numel() != n_heads or n_heads % bsz:
        raise KernelInputError(f"start/length must have B*Hkv entries (B={bsz}), got {n_heads}/{length.numel()}")
    n_kv = n_heads // bsz
    if n_q % n_kv:
        raise KernelInputError(f"Hq={n_q} is not a multiple of Hkv={n_kv}")
    if k_cache.shape != v_cache.shape or k_cache.shape[1] != d:
        raise KernelInputError(f"k_cache/v_cache must be [total_capacity, {d}], got {tuple(k_cache.shape)}")
    if k_cache.stride(1) != 1 or v_cache.stride(1) != 1 or q.stride(2) != 1:
        raise KernelInputError("q, k_cache and v_cache need a contiguous last dimension")
    total = k_cache.shape[0]
    for name, t in (("acc", acc), ("ema", ema)):
        if t is not None:
            _check(name, t, 1, (torch.float32,), dev)
            if t.numel() != total or not t.is_contiguous():
                raise KernelInputError(f"{name} must be a contiguous [{total}] float32 tensor")
    return bsz, n_q, d, n_kv


def _split_plan(length: torch.Tensor, max_len: int | None, num_splits: int | None, block_n: int) -> tuple[int, int]:
    """(split-K chunks, slots per chunk): ``num_splits`` (else `choose_splits`) chunks of a whole number of
    ``block_n`` tiles covering ``max_len`` slots (read from ``length`` when not given: one device sync), fewer
    when the last would be empty."""
    if block_n < 16 or block_n & (block_n - 1):
        raise KernelInputError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is not None and num_splits < 1:
        raise KernelInputError(f"num_splits must be >= 1, got {num_splits}")
    n_heads = length.numel()
    if max_len is None:
        max_len = int(length.max().item()) if n_heads else 0
    max_len = max(int(max_len), 1)
    if num_splits is None:
        num_splits = choose_splits(n_heads, max_len, block_n, length.device)
    chunk = -(-max(-(-max_len // num_splits), 1) // block_n) * block_n
    return -(-max_len // chunk), chunk


def varlen_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    *,
    max_len: int | None = None,
    softmax_scale: float | None = None,
    logit_scale: float = 1.0,
    probs: torch.Tensor | None = None,
    want_probs: bool = True,
    acc: torch.Tensor | None = None,
    ema: torch.Tensor | None = None,
    ema_gamma: float = 0.9,
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> AttentionOut:
    """Decode attention of q [B, Hq, d] over the varlen cache; optionally emits probs and updates acc/ema in place.

    `max_len` is a host-side upper bound on `length` (e.g. the largest capacity; avoids a device sync).
    Logits are `q.k * softmax_scale * logit_scale` (softmax_scale defaults to d**-0.5; logit_scale is the
    BUZZ log-n variant's multiplier). `probs` (fp32 [total_capacity, G], written in place, also used as logit
    scratch) is allocated when None and scores are needed; it is returned only when `want_probs`, and without
    it pass 2 reads the logits but does not write probabilities back (statistics only).
    """
    bsz, n_q, d, n_kv = _check_attention_inputs(q, k_cache, v_cache, start, length, acc, ema)
    dev = q.device
    n_heads = start.numel()
    g = n_q // n_kv
    total = k_cache.shape[0]
    scores = want_probs or acc is not None or ema is not None
    if scores:
        if probs is None:
            probs = torch.empty(total, g, dtype=torch.float32, device=dev)
        _check("probs", probs, 2, (torch.float32,), dev)
        if tuple(probs.shape) != (total, g) or not probs.is_contiguous():
            raise KernelInputError(f"probs must be a contiguous [{total}, {g}] float32 tensor")
    if not 0.0 <= ema_gamma <= 1.0:
        raise KernelInputError(f"ema_gamma must be in [0, 1], got {ema_gamma}")
    num_splits, chunk = _split_plan(length, max_len, num_splits, block_n)
    scale = (d**-0.5 if softmax_scale is None else float(softmax_scale)) * float(logit_scale)
    block_g = max(16, triton.next_power_of_2(g))
    block_d = max(16, triton.next_power_of_2(d))
    o = torch.empty(bsz, n_q, d, dtype=q.dtype, device=dev)
    lse = torch.empty(bsz, n_q, dtype=torch.float32, device=dev)
    m_part = torch.empty(n_heads * num_splits * block_g, dtype=torch.float32, device=dev)
    l_part = torch.empty_like(m_part)
    o_part = torch.empty(n_heads * num_splits * g * d, dtype=torch.float32, device=dev)
    logits = probs if scores else m_part  # dummy pointer when unused
    if n_heads == 0:
        return AttentionOut(o, lse, probs if want_probs else None)
    block_s = min(32, max(2, triton.next_power_of_2(num_splits)))
    _attn_split_kernel[(n_heads, num_splits)](
        q, k_cache, v_cache, start, length, logits, m_part, l_part, o_part,
        scale * _LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), v_cache.stride(0),
        n_kv, chunk, num_splits,
        G=g, HEAD_DIM=d, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        WRITE_LOGITS=scores, DOT_MODE=_DOT_MODES[q.dtype], num_warps=num_warps, num_stages=num_stages,
    )
    dummy = m_part
    _attn_reduce_kernel[(n_heads, num_splits if scores else 1)](
        logits, dummy if acc is None else acc, dummy if ema is None else ema, m_part, l_part, o_part, o, lse,
        start, length, float(ema_gamma), o.stride(0), o.stride(1), n_kv, chunk, num_splits,
        G=g, HEAD_DIM=d, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_S=block_s, BLOCK_N=block_n, SCORES=scores,
        WRITE_PROBS=want_probs, UPDATE_ACC=acc is not None,
        UPDATE_EMA=ema is not None,
        num_warps=num_warps,
    )
    return AttentionOut(o, lse, probs if want_probs else None)


def attention_bytes(lengths_total: int, head_dim: int, elem_bytes: int, g: int, *, scores: bool,
                    write_probs: bool = True, n_stats: int = 0) -> int:
    """Bytes a call moves: retained K+V once, plus logits written+read (8G/slot), probs written (4G/slot)
    and each statistic read+written (8/slot) when scores are on."""
    kv = 2 * lengths_total * head_dim * elem_bytes
    if not scores:
        return kv
    return kv + lengths_total * ((12 if write_probs else 8) * g + 8 * n_stats)


__all__ = ["AttentionOut", "attention_bytes", "choose_splits", "varlen_decode_attention"]
