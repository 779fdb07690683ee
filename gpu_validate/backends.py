"""Cache backends for the runner: the Triton `VarlenKVCache`, or the same cache computed with batched torch ops.

Both share one layout and one API (append / attend / compact / padded / memory_bytes), so the runner is
backend-agnostic; the torch backend runs anywhere at full speed on CPU (every KV head of every batch row in one
padded matmul, compaction by one gather), the Triton one is what runs on GPU (and on CPU under
TRITON_INTERPRET=1, slowly). Both are checked against the per-head loops of `gpu_validate.reference`.
"""
from __future__ import annotations

import torch

from gpu_validate.cache import VarlenKVCache
from gpu_validate.kernels.errors import CacheCapacityError
from gpu_validate.reference import ref_compact

BACKENDS = ("torch", "triton")


class TorchVarlenKVCache(VarlenKVCache):
    """`VarlenKVCache` whose attention and compaction run as batched torch ops (semantics of the references)."""

    def attend(self, q: torch.Tensor, *, logit_scale: float | torch.Tensor = 1.0, want_probs: bool = True,
               update_acc: bool | None = None, update_ema: bool | None = None,
               num_splits: int | None = None,
               visible_from: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `VarlenKVCache.attend`; ``logit_scale`` may also be one factor per batch element ([B] tensor);
        ``visible_from`` hides the slots at earlier positions (a sliding window inside a prompt chunk).

        fp32 logits over every head's padded slots at once; acc/ema are not updated here (the runner keeps
        its statistics in the policy's slot state), so asking for them is an error."""
        if update_acc or update_ema:
            raise NotImplementedError("the torch backend does not update acc/ema; use the Triton cache")
        bsz, n_q, d = q.shape
        n_heads, g = self.batch * self.n_kv_heads, self.group
        scale = torch.as_tensor(logit_scale, dtype=torch.float32, device=self.device).flatten()
        scale = (scale if scale.numel() == 1 else scale.repeat_interleave(self.n_kv_heads))[:, None, None]
        idx = self.slot_rows
        kp = self.k[idx].float()             # [BH, C, d]; slots past a head's length hold stale finite values,
        vp = self.v[idx].float()             # masked out of the softmax below (so no fill is needed)
        qf = q.float().reshape(n_heads, g, d)
        logits = torch.bmm(qf, kp.transpose(1, 2)) * (self.softmax_scale * scale)   # [BH, G, C]
        valid = torch.arange(self.max_capacity, device=self.device)[None, :] < self.length.long()[:, None]
        seen = valid if visible_from is None else valid & (self.positions[idx] >= visible_from)
        logits = logits.masked_fill(~seen[:, None, :], float("-inf"))
        p = torch.softmax(logits, -1).nan_to_num(0.0)                     # an empty head gives p = o = 0
        o = torch.bmm(p, vp).reshape(bsz, n_q, d)
        self.probs[idx[valid]] = p.transpose(1, 2)[valid]          # hidden slots get probability 0
        return o.to(q.dtype), (self.probs if want_probs else None)

    def compact(self, keep: torch.Tensor | None, merge_to: torch.Tensor | None = None,
                merge_w: torch.Tensor | None = None, *, k_new: torch.Tensor | None = None,
                v_new: torch.Tensor | None = None, new_positions: torch.Tensor | None = None,
                check: bool = True) -> None:
        kn, vn, pn = self._new_tokens(k_new, v_new, new_positions)
        if merge_to is not None:   # merges are rare: the per-head reference has their exact semantics
            out = ref_compact(self.k, self.v, self.start, self.length, self.capacity, keep=keep,
                              merge_to=merge_to, merge_w=merge_w, k_new=kn, v_new=vn, positions=self.positions,
                              new_positions=pn, acc=self.acc, ema=self.ema)
            for name in ("k", "v", "positions", "acc", "ema", "length"):
                dst = getattr(self, name)
                if dst is not None:
                    dst.copy_(getattr(out, name).to(self.device))
            return
        start, length = self.start.long(), self.length.long()
        if keep is not None:
            local = torch.arange(self.total_capacity, device=self.device) - start[self.slot_owner.long()]
            kept = keep.bool() & (local < length[self.slot_owner.long()])
            src = torch.nonzero(kept).flatten()
            owner = self.slot_owner.long()[src]
            n_kept = torch.bincount(owner, minlength=length.numel())
            first = torch.cumsum(n_kept, 0) - n_kept
            dst = start[owner] + torch.arange(src.numel(), device=self.device) - first[owner]
            for buf in (self.k, self.v, self.positions, self.acc, self.ema):
                if buf is not None:
                    buf[dst] = buf[src]
            length = n_kept
        if kn is not None:
            n_new = kn.shape[1]
            if bool((length + n_new > self.capacity.long()).any()):
                i = int(torch.nonzero(length + n_new > self.capacity.long())[0])
                raise CacheCapacityError(f"head {i}: {int(length[i])} kept + {n_new} new slots exceed capacity "
                                         f"{int(self.capacity[i])}")
            rows = (start + length)[:, None] + torch.arange(n_new, device=self.device)[None, :]
            self.k[rows] = kn.to(self.dtype)
            self.v[rows] = vn.to(self.dtype)
            if pn is not None:
                self.positions[rows] = pn
            for stat in (self.acc, self.ema):
                if stat is not None:
                    stat[rows] = 0.0
            length = length + n_new
        self.length.copy_(length.to(torch.int32))


def make_cache(backend: str, **kwargs) -> VarlenKVCache:
    """A per-layer varlen cache for ``backend`` ('torch' or 'triton'); kwargs as `VarlenKVCache`."""
    if backend == "triton":
        return VarlenKVCache(**kwargs)
    if backend == "torch":
        return TorchVarlenKVCache(**kwargs)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
