"""How a batch's prompt enters the compressed caches: prefilled, or streamed without the model for as long as
nothing is evicted.

A policy with a prefill selector picks the prompt tokens to keep from the captured q/k/v at once (`_prefill`;
without one every token is kept, under the layer's window). A streamed prompt goes through the policy chunk by
chunk, as in the simulator; until a row first drops or merges a slot of a layer it compresses, its attention reads
exactly what the model's own attention read in the prompt forward, so those chunks are appended from the captures
and stepped on their summed attention without running the model (`_fast_forward`). Both read the prompt forward's
captures (`gpu_validate.closedloop.prompt_store`), load the layers' caches and step the rows' policies
(`gpu_validate.closedloop.batch_runner`); apart here because they run once per batch, before decoding.
"""
from __future__ import annotations

import numpy as np
import torch

from gpu_validate.closedloop.host_steps import map_prompt_probs
from gpu_validate.validate_error import ValidateError
from gpu_validate.kvcache.kernels.kernel_errors import CacheCapacityError
from sim.replay.contract import check_kept, raise_on


class PromptLoading:
    """`BatchRunner`'s prompt-loading steps (a mixin): they read and fill the runner's state after its setup --
    ``rows``, ``caches``, ``capture``, ``prompt_of``, ``attn`` / ``compressed``, ``host`` -- and step through its
    ``steps`` (`gpu_validate.closedloop.decode_steps.DecodeSteps`) and ``_mults``."""

    def _fast_forward(self, P: int) -> int:
        """Stream the prompt's first chunks without the model, as long as no row has evicted anything.

        Until a row's cache first drops or merges a slot of a layer it compresses, its attention at step t reads
        every token the model's own attention reads, with unit logit scale: the causal prompt forward already
        computed that token's q/k/v (and everything the model does with them). So a chunk's tokens are appended
        from the captured k/v and the policy steps on their summed attention, computed once per distinct prompt
        from the captured q/k (`PromptCapture.chunk_probs`); the model streams only from the chunk after the first
        eviction in any row. With the whole prompt as one chunk the model never streams it. Returns that chunk's
        first token."""
        rows, dev, C, cap = self.rows, self.device, self.chunk, self.capture
        idx = self.prompt_of.cpu().numpy()
        groups = [(int(u), np.flatnonzero(idx == u)) for u in np.unique(idx)]
        B = len(rows)
        for t0 in range(0, P, C):
            stop = min(P, t0 + C)
            if any(m is not None and (m != 1.0).any() for m in (self._mults(t) for t in range(t0, stop))):
                return t0
            self.t = t0
            pos = None if self.host else (t0 + torch.arange(stop - t0, device=dev, dtype=torch.int64))[None, :].expand(
                B, -1)
            summed = {}
            for layer in range(self.n_layers):   # (an open loop's dense copy already holds the prompt)
                cache = self.caches[layer]
                if self.host:
                    k, v = (cap.rows(a, layer, idx, t0, stop) for a in (cap.k, cap.v))
                    cache.append(k, v, t0)
                else:
                    k, v = (cap.rows(a, layer, idx, t0, stop).to(dev, self.cache_dtype)
                            for a in (cap.k, cap.v))                                        # [B, Hkv, C, d]
                    self.steps.check_append(layer, stop - t0, t0)
                    cache.append(k, v, positions=pos, check=False)
                del k, v
                probs = summed[layer] = self._probs_buffer(layer, cache.max_capacity)
                if self.compressed[layer] and self.reads_attention:   # a kept window's policy does not read it
                    slot_pos = cache.pos if self.host else self.steps.mirrors[layer].pos
                    for u, bs in groups:
                        chunk = cap.chunk_probs(layer, u, t0, stop, self.attn[layer].window)   # [Hkv, G, stop]
                        map_prompt_probs(chunk, bs, self.n_kv, slot_pos, probs)
            if self.steps.step(range(self.n_layers), stop - 1, stop - t0, summed):
                return stop
        return P

    def _probs_buffer(self, layer: int, width: int) -> np.ndarray:
        """A zeroed [B*Hkv, G, width] float64 buffer for a fast-forwarded chunk's attention in ``layer`` (reused;
        one per layer, since the layers' steps run side by side)."""
        buf = self._probs_buf.get(layer)
        if buf is None or buf.shape[2] != width:
            buf = self._probs_buf[layer] = np.zeros((len(self.rows) * self.n_kv, self.group, width))
        else:
            buf.fill(0.0)
        return buf

    def _prefill(self, P: int) -> None:
        """Each row's prefill selector on its prompt's q/k/v (none: keep all), then the kept tokens loaded, one
        layer at a time (a layer's prompt is read as float32 only while that layer is loaded)."""
        H, B, cap = self.n_kv, len(self.rows), self.capture
        idx = self.prompt_of.cpu().numpy()
        for layer in range(self.n_layers):
            window = self.attn[layer].window
            lo = max(0, P - window + 1) if window else 0    # the window's rule after any selection
            keep_all = np.ones((B, H, P), np.uint8)
            cache = self.caches[layer]
            for b, row in enumerate(self.rows):
                u = int(idx[b])
                keep = keep_all[b]
                policy = row.layer_policy[layer]
                pst = np.zeros((H, P, policy.slot_fields))
                budget = row.budgets[layer]
                if policy.has_prefill:
                    q, k, v = (cap.prompt(a, layer, u) for a in (cap.q, cap.k, cap.v))
                    row.kernels[layer][1](row.params[layer], layer, budget, q, k, v, float(self.layer_scale[layer]),
                                          keep, pst, row.head_state[layer])
                    del q, k, v
                keep[:, :lo] = 0
                kept_n = keep.sum(1).astype(np.int64)
                info = np.zeros(3, np.int64)
                raise_on(policy, check_kept(kept_n, budget, policy.head_adaptive, not policy.unbounded,
                                            -1, info), info, layer)
                sst = row.slot_state[layer]
                order = np.argsort(1 - keep, axis=1, kind="stable")
                n = min(P, sst.shape[1])
                sst[:, :n] = np.take_along_axis(pst, order[:, :n, None], 1)
                sst[np.arange(sst.shape[1])[None, :] >= kept_n[:, None]] = 0.0
                row.held[layer] = int(kept_n.sum())
                if self.host:
                    src = cap.prompt(cap.k, layer, u, lo), cap.prompt(cap.v, layer, u, lo)
                    for h in range(H):
                        sel = np.flatnonzero(keep[h])
                        r = b * H + h
                        if sel.size > cache.capacity[r]:
                            raise CacheCapacityError(f"prefill keeps more tokens than capacity in head {r}")
                        cache.k3[r, :sel.size] = src[0][sel - lo, h]
                        cache.v3[r, :sel.size] = src[1][sel - lo, h]
                        cache.pos[r, :sel.size] = sel
                        cache.length[r] = sel.size
            if not self.host:                    # the kept tokens only (a long prompt is never copied per row)
                width = max(1, int(keep_all.sum(2).max()))
                kk = torch.zeros((B, H, width, self.head_dim), dtype=self.cache_dtype)
                vv = torch.zeros_like(kk)
                pos = torch.zeros((B, H, width), dtype=torch.int64)
                kept = torch.zeros((B, H, width), dtype=torch.bool)
                for b in range(B):
                    u = int(idx[b])
                    src = cap.k[layer], cap.v[layer]
                    for h in range(H):
                        sel = np.flatnonzero(keep_all[b, h])
                        n = sel.size
                        if n and sel[0] < src[0].base:
                            raise ValidateError(f"layer {layer}: prompt k/v from {sel[0]} were not kept")
                        rows_ = torch.from_numpy(sel - src[0].base)
                        kk[b, h, :n] = src[0].x[u, rows_, h]
                        vv[b, h, :n] = src[1].x[u, rows_, h]
                        pos[b, h, :n] = torch.from_numpy(sel)
                        kept[b, h, :n] = True
                dev = self.device
                cache.prefill(kk.to(dev), vv.to(dev), kept.to(dev), positions=pos.to(dev))
