"""Cache backends for the runner: the Triton `VarlenKVCache`, or the same cache computed with batched torch ops.

Both share one layout and one API (append / attend / compact / padded / memory_bytes), so the runner is
backend-agnostic; the torch backend runs anywhere at full speed on CPU (every KV head of every batch row in one
padded matmul, compaction by one gather), the Triton one is what runs on GPU (and on CPU under
TRITON_INTERPRET=1, slowly). Both are checked against the per-head loops of `gpu_validate.kvcache.kernel_reference`.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numba import njit

from gpu_validate.kvcache.varlen_cache import VarlenKVCache
from gpu_validate.kvcache.kernels.kernel_errors import CacheCapacityError
from gpu_validate.kvcache.kernel_reference import ref_compact

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


@njit(cache=True, nogil=True)
def _host_append(k3, v3, pos, length, capacity, k_new, v_new, t0):
    """Append n_new tokens per head (k_new/v_new [B, Hkv, n_new, d], any strides) at positions t0, t0+1, ...
    Returns -1, or the first head that has no room (nothing appended then)."""
    bsz, hkv, n_new, d = k_new.shape
    for r in range(bsz * hkv):
        if length[r] + n_new > capacity[r]:
            return r
    for b in range(bsz):
        for h in range(hkv):
            r = b * hkv + h
            s = length[r]
            for j in range(n_new):
                for x in range(d):
                    k3[r, s + j, x] = k_new[b, h, j, x]
                    v3[r, s + j, x] = v_new[b, h, j, x]
                pos[r, s + j] = t0 + j
            length[r] = s + n_new
    return -1


class HostKVCache:
    """The torch backend's cache on the CPU, padded: every KV head of every batch row owns ``max_capacity`` rows
    of float32 numpy arrays ``k3``/``v3`` [B*Hkv, W, d], ``pos`` [B*Hkv, W] int64 (-1 past a head's length) and
    ``length`` [B*Hkv] int64, with torch views of the same memory. The runner's policy steps read and compact them
    in place (no gather, no per-step tensor copies); ``attend`` is `TorchVarlenKVCache.attend`'s arithmetic on
    the padded views (same shapes, so the same results), and it keeps the step's probabilities as ``p``
    [B*Hkv, G, W] (0 past each head's length). ``capacity`` stays each head's own (budget + new tokens)."""

    def __init__(self, *, batch: int, n_kv_heads: int, n_q_heads: int, head_dim: int,
                 capacity: int | Sequence[int], dtype: torch.dtype = torch.float32, device="cpu",
                 softmax_scale: float | None = None, track_acc: bool = False) -> None:
        if dtype != torch.float32 or torch.device(device).type != "cpu":
            raise ValueError("HostKVCache holds float32 on the CPU")
        n_heads = batch * n_kv_heads
        cap = np.asarray(capacity, np.int64).reshape(-1)
        if cap.size == 1:
            cap = np.full(n_heads, int(cap[0]), np.int64)
        if cap.size != n_heads or (cap < 0).any():
            raise CacheCapacityError(f"capacity must be one int or {n_heads} (B*Hkv) ints >= 0")
        self.batch, self.n_kv_heads, self.n_q_heads, self.head_dim = batch, n_kv_heads, n_q_heads, head_dim
        self.group = n_q_heads // n_kv_heads
        self.dtype, self.device = dtype, torch.device("cpu")
        self.softmax_scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
        self.capacity = cap
        self.max_capacity = W = int(cap.max()) if n_heads else 0
        self.k3 = np.zeros((n_heads, W, head_dim), np.float32)
        self.v3 = np.zeros((n_heads, W, head_dim), np.float32)
        self.pos = np.full((n_heads, W), -1, np.int64)
        self.length = np.zeros(n_heads, np.int64)
        self.kt, self.vt = torch.from_numpy(self.k3), torch.from_numpy(self.v3)
        self.post, self.lengtht = torch.from_numpy(self.pos), torch.from_numpy(self.length)
        self._slots = torch.arange(W)[None, :]
        self._unit_factor = self.softmax_scale * torch.ones(1, 1, 1)   # as attend(logit_scale=1.0) computes it
        self.p: torch.Tensor | None = None

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, t0: int) -> None:
        """Append k_new/v_new [B, Hkv, n_new, d] (float32) at positions t0, t0+1, ... to every head."""
        k, v = k_new.detach(), v_new.detach()
        if k.dtype != torch.float32:
            k, v = k.float(), v.float()
        r = _host_append(self.k3, self.v3, self.pos, self.length, self.capacity, k.numpy(), v.numpy(), int(t0))
        if r >= 0:
            raise CacheCapacityError(f"head {r}: {int(self.length[r])} kept + {k.shape[2]} new slots exceed "
                                     f"capacity {int(self.capacity[r])}")

    def attend(self, q: torch.Tensor, *, logit_scale: float | torch.Tensor = 1.0,
               visible_from: int | None = None) -> torch.Tensor:
        """Decode attention of q [B, Hq, d] over each head's slots -> o [B, Hq, d] (q's dtype); the per-slot
        probabilities are left in ``p``. As `TorchVarlenKVCache.attend` (fp32 logits, padded slots masked)."""
        bsz, n_q, d = q.shape
        n_heads, g = self.batch * self.n_kv_heads, self.group
        if isinstance(logit_scale, float) and logit_scale == 1.0:
            factor = self._unit_factor
        else:
            scale = torch.as_tensor(logit_scale, dtype=torch.float32).flatten()
            scale = (scale if scale.numel() == 1 else scale.repeat_interleave(self.n_kv_heads))[:, None, None]
            factor = self.softmax_scale * scale
        qf = q.float().reshape(n_heads, g, d)
        logits = torch.bmm(qf, self.kt.transpose(1, 2)) * factor                   # [BH, G, W]
        if visible_from is None:
            hidden = self._slots >= self.lengtht[:, None]
        else:
            hidden = ~((self._slots < self.lengtht[:, None]) & (self.post >= visible_from))
        p = torch.softmax(logits.masked_fill(hidden[:, None, :], float("-inf")), -1)
        if visible_from is not None or not self.length.all():
            p = p.nan_to_num(0.0)                                       # an empty head gives p = o = 0
        self.p = p
        return torch.bmm(p, self.vt).reshape(bsz, n_q, d).to(q.dtype)

    def memory_bytes(self) -> int:
        return int(self.length.sum()) * 2 * self.head_dim * 4


def make_cache(backend: str, **kwargs) -> VarlenKVCache:
    """A per-layer varlen cache for ``backend`` ('torch' or 'triton'); kwargs as `VarlenKVCache`."""
    if backend == "triton":
        return VarlenKVCache(**kwargs)
    if backend == "torch":
        return TorchVarlenKVCache(**kwargs)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def pick_device(device: str | None = None, backend: str | None = None) -> tuple[str, str]:
    """(device, backend) of a closed-loop run where ``device`` / ``backend`` are not given: CUDA when a GPU is
    present, else the CPU; the Triton cache on CUDA, the torch one elsewhere. The one place the model commands
    (`validate`, `fidelity`, `needle`, `generate`, `recommend`) choose them."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, backend or ("triton" if device.startswith("cuda") else "torch")
