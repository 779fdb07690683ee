"""Cache backends for the runner: the Triton `VarlenKVCache`, or the same cache driven by the torch references.

Both share one layout and one API (append / attend / compact / padded / memory_bytes), so the runner is
backend-agnostic; the torch backend runs anywhere at full speed on CPU, the Triton one is what runs on GPU
(and on CPU under TRITON_INTERPRET=1, slowly).
"""
from __future__ import annotations

import torch

from gpu_validate.cache import VarlenKVCache
from gpu_validate.reference import ref_compact, ref_decode_attention

BACKENDS = ("torch", "triton")


class TorchVarlenKVCache(VarlenKVCache):
    """`VarlenKVCache` whose attention and compaction run the plain torch references (same semantics)."""

    def attend(self, q: torch.Tensor, *, logit_scale: float = 1.0, want_probs: bool = True,
               update_acc: bool | None = None, update_ema: bool | None = None,
               num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        ref = ref_decode_attention(q, self.k, self.v, self.start, self.length, softmax_scale=self.softmax_scale,
                                   logit_scale=logit_scale)
        self.probs.copy_(ref.probs.to(self.device))
        return ref.o.to(self.device), (self.probs if want_probs else None)

    def compact(self, keep: torch.Tensor | None, merge_to: torch.Tensor | None = None,
                merge_w: torch.Tensor | None = None, *, k_new: torch.Tensor | None = None,
                v_new: torch.Tensor | None = None, new_positions: torch.Tensor | None = None,
                check: bool = True) -> None:
        kn, vn, pn = self._new_tokens(k_new, v_new, new_positions)
        out = ref_compact(self.k, self.v, self.start, self.length, self.capacity, keep=keep, merge_to=merge_to,
                          merge_w=merge_w, k_new=kn, v_new=vn, positions=self.positions, new_positions=pn)
        self.k.copy_(out.k.to(self.device))
        self.v.copy_(out.v.to(self.device))
        self.positions.copy_(out.positions.to(self.device))
        self.length.copy_(out.length.to(self.device))


def make_cache(backend: str, **kwargs) -> VarlenKVCache:
    """A per-layer varlen cache for ``backend`` ('torch' or 'triton'); kwargs as `VarlenKVCache`."""
    if backend == "triton":
        return VarlenKVCache(**kwargs)
    if backend == "torch":
        return TorchVarlenKVCache(**kwargs)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
