"""Plain torch references for the varlen decode-attention and compaction kernels (slow, per-head loops, fp32).

Layout shared with the kernels: one flat buffer `k_cache[total_capacity, d]` (and `v_cache`); KV head
`i = b * Hkv + h` owns rows `start[i] : start[i] + capacity[i]`, of which the first `length[i]` are retained
slots. Query head `hq` of batch element `b` reads KV head `hq // G` with `G = Hq // Hkv` (HF `repeat_kv`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gpu_validate.kvcache.kernels.kernel_errors import CacheCapacityError, KernelInputError


class RefAttention(NamedTuple):
    """Reference decode-attention results; `probs` is [total_capacity, G] (only retained rows are defined)."""

    o: torch.Tensor  # [B, Hq, d], q.dtype
    lse: torch.Tensor  # [B, Hq] float32, natural log-sum-exp of the scaled logits
    probs: torch.Tensor  # [total_capacity, G] float32
    acc: torch.Tensor | None  # [total_capacity] float32, updated copy
    ema: torch.Tensor | None  # [total_capacity] float32, updated copy


def ref_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    *,
    softmax_scale: float,
    logit_scale: float = 1.0,
    acc: torch.Tensor | None = None,
    ema: torch.Tensor | None = None,
    ema_gamma: float = 0.0,
) -> RefAttention:
    """Decode attention of one query token per (b, query head) over each KV head's retained slots.

    Logits are `q.k * softmax_scale * logit_scale` computed in fp32 from the stored dtype; `acc += sum_g p`
    and `ema = gamma * ema + (1 - gamma) * mean_g p` over the G query heads of the group (copies returned).
    A head with length 0 gives o = 0 and lse = -inf.
    """
    bsz, n_q, d = q.shape
    n_heads = start.numel()
    if n_heads % bsz or n_q % (n_heads // bsz):
        raise KernelInputError(f"q has {n_q} heads per batch element, not a multiple of Hkv={n_heads // bsz}")
    n_kv = n_heads // bsz
    g = n_q // n_kv
    scale = float(softmax_scale) * float(logit_scale)
    o = torch.zeros(bsz, n_q, d, dtype=torch.float32)
    lse = torch.full((bsz, n_q), float("-inf"), dtype=torch.float32)
    probs = torch.zeros(k_cache.shape[0], g, dtype=torch.float32)
    acc = None if acc is None else acc.detach().cpu().float().clone()
    ema = None if ema is None else ema.detach().cpu().float().clone()
    kc, vc, qf = k_cache.detach().cpu().float(), v_cache.detach().cpu().float(), q.detach().cpu().float()
    for i in range(n_heads):
        b, h = divmod(i, n_kv)
        s0, n = int(start[i]), int(length[i])
        if n == 0:
            continue
        k = kc[s0 : s0 + n]
        v = vc[s0 : s0 + n]
        qg = qf[b, h * g : (h + 1) * g]  # [G, d]
        logits = (qg @ k.T) * scale  # [G, n]
        head_lse = torch.logsumexp(logits, dim=1)
        p = torch.exp(logits - head_lse[:, None])
        o[b, h * g : (h + 1) * g] = p @ v
        lse[b, h * g : (h + 1) * g] = head_lse
        probs[s0 : s0 + n] = p.T
        if acc is not None:
            acc[s0 : s0 + n] += p.sum(0)
        if ema is not None:
            ema[s0 : s0 + n] = ema_gamma * ema[s0 : s0 + n] + (1.0 - ema_gamma) * p.mean(0)
    return RefAttention(o.to(q.dtype), lse, probs, acc, ema)


class RefCache(NamedTuple):
    """Reference compaction results (copies): cache buffers, side arrays and the new lengths."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor | None
    acc: torch.Tensor | None
    ema: torch.Tensor | None
    length: torch.Tensor


def _ref_merge_head(k: torch.Tensor, v: torch.Tensor, head: int, slots: slice, kp: torch.Tensor,
                    merge_to: torch.Tensor, merge_w: torch.Tensor) -> None:
    """Step 1 of `ref_compact` for one head's ``slots`` (``kp`` its kept mask), in place on the CPU copies ``k``,
    ``v``: each kept slot becomes its weighted sum with the evicted slots merging into it, in fp32, rounded once."""
    n = slots.stop - slots.start
    mt = merge_to[slots].detach().cpu().long()
    mw = merge_w[slots].detach().cpu().float()
    kf, vf = k[slots].float(), v[slots].float()
    k_out, v_out = kf.clone(), vf.clone()
    sources: dict[int, list[int]] = {}
    for e in torch.nonzero(~kp & (mt >= 0)).flatten().tolist():
        j = int(mt[e])
        if j >= n or not kp[j]:
            raise KernelInputError(f"head {head}: evicted slot {e} merges into evicted/out-of-range slot {j}")
        sources.setdefault(j, []).append(e)
    for j, srcs in sources.items():
        kj, vj = mw[j] * kf[j], mw[j] * vf[j]
        for e in srcs:
            kj = kj + mw[e] * kf[e]
            vj = vj + mw[e] * vf[e]
        k_out[j], v_out[j] = kj, vj
    k[slots], v[slots] = k_out.to(k.dtype), v_out.to(v.dtype)


def ref_compact(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    capacity: torch.Tensor,
    *,
    keep: torch.Tensor | None = None,
    merge_to: torch.Tensor | None = None,
    merge_w: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    new_positions: torch.Tensor | None = None,
    acc: torch.Tensor | None = None,
    ema: torch.Tensor | None = None,
    acc_init: float = 0.0,
    ema_init: float = 0.0,
) -> RefCache:
    """Merge, compact and append per head, with the exact semantics the compaction kernel must match.

    For head i with old length n (local slot indices 0..n-1; `keep`, `merge_to`, `merge_w` are flat
    [total_capacity] arrays indexed by `start[i] + local`):
      1. merge: an evicted slot e with `merge_to[e] = j >= 0` is a source of kept slot j (local index, same
         head). For each kept j with sources S_j (in increasing slot order), in fp32:
         `x_j <- merge_w[j] * x_j + sum_{e in S_j} merge_w[e] * x_e` for x in (k, v), rounded once to the
         cache dtype. `merge_w[j]` is ignored for kept slots that receive no source. Positions and score
         statistics of j are unchanged; the sources' are dropped.
      2. compact: kept slots move to local indices 0..kept-1 in their original order, with k, v,
         positions, acc and ema.
      3. append: the head's `k_new[i]` rows (`[n_heads, n_new, d]`) go to kept..kept+n_new-1 with
         `new_positions[i]`, acc = acc_init, ema = ema_init. Raises CacheCapacityError if they do not fit.
    A merge into an evicted or out-of-range slot raises KernelInputError.
    """
    n_heads = start.numel()
    k, v = k_cache.detach().cpu().clone(), v_cache.detach().cpu().clone()
    pos = None if positions is None else positions.detach().cpu().clone()
    acc = None if acc is None else acc.detach().cpu().clone()
    ema = None if ema is None else ema.detach().cpu().clone()
    new_len = length.detach().cpu().clone()
    n_new = 0 if k_new is None else k_new.shape[1]
    for i in range(n_heads):
        s0, n, cap = int(start[i]), int(length[i]), int(capacity[i])
        kp = torch.ones(n, dtype=torch.bool) if keep is None else keep[s0 : s0 + n].detach().cpu().bool()
        if merge_to is not None:
            _ref_merge_head(k, v, i, slice(s0, s0 + n), kp, merge_to, merge_w)
        idx = torch.nonzero(kp).flatten() + s0
        kept = idx.numel()
        if kept + n_new > cap:
            raise CacheCapacityError(f"head {i}: {kept} kept + {n_new} new slots exceed capacity {cap}")
        dst = slice(s0, s0 + kept)
        k[dst], v[dst] = k[idx].clone(), v[idx].clone()
        for arr in (pos, acc, ema):
            if arr is not None:
                arr[dst] = arr[idx].clone()
        if n_new:
            new = slice(s0 + kept, s0 + kept + n_new)
            k[new], v[new] = k_new[i].cpu().to(k.dtype), v_new[i].cpu().to(v.dtype)
            if pos is not None and new_positions is not None:
                pos[new] = new_positions[i].cpu()
            if acc is not None:
                acc[new] = acc_init
            if ema is not None:
                ema[new] = ema_init
        new_len[i] = kept + n_new
    return RefCache(k, v, pos, acc, ema, new_len)
