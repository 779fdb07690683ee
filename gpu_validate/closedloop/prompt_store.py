"""The prompt forward of a closed-loop batch, and what the runs keep of its q/k/v.

Each distinct prompt of a batch goes through the model once, with the model's own causal attention
(`PromptCapture.forward`, `PROMPT_CHUNK` tokens per forward); every layer's attention call runs SDPA and keeps,
at the model's dtype and preallocated (`PromptStore`), only what the runs read: q on the layers the policies
compress (their allocators and prefill selectors read it), k/v of a kept sliding layer only over its last window
unless every token is needed (a streamed prompt's fast-forward, an open loop). On Gemma-3 that is 18 KB per prompt
token (its 3 global layers), not every layer's fp32 q/k/v twice over (parts, then concatenated).

A prompt memo (one dict that `gpu_validate.closedloop.runner.run_batch` shares among the batches of a call) keeps the
captures, the layers' scales and windows, the last logits, and work derived from them (each chunk's summed
attention, `PromptCapture.chunk_probs`; an allocator's per-layer work, `PromptLayers`), so the streamed and the
prefilled batches of a prompt, and each budget tier, share one prompt forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gpu_validate.validate_error import ValidateError
from policies.core.base import PolicyError, prompt_memo
from traces.hf.forward import DEFAULT_CHUNK, forward_in_chunks
from traces.hf.geometry import output_projection
from traces.hf.geometry import rope_theta as model_rope_theta
from traces.hf.reconstruction_pass import plan_for, run_reconstruction
from traces.hf.routing import model_attention
from traces.reference import causal_column_sums

#: prompt tokens per model forward when a batch's prompts go through the model with its own attention
PROMPT_CHUNK = DEFAULT_CHUNK


@dataclass
class PromptStore:
    """One layer's captured prompt q, k or v: ``x`` [U, P - base, H, d] at the model's dtype holds positions
    base .. P-1 of each distinct prompt (base > 0: a kept sliding layer's last window only)."""

    x: torch.Tensor
    base: int = 0


class PromptCapture:
    """The distinct prompts (all P tokens long) through the model, and the q/k/v captured from them.

    ``q``, ``k``, ``v``: layer -> `PromptStore`; ``scale``, ``window``: each layer's softmax scale and sliding
    window (None: global) as its prompt call ran it. ``sliding``: the batch's ``"keep"`` or ``"compress"`` (a kept
    sliding layer needs no q and, prefilled, only its last window of k/v). ``memo``: the prompt memo, or None.
    """

    def __init__(self, model, P: int, sliding: str, memo: dict | None) -> None:
        self.model, self.P, self.sliding, self.memo = model, P, sliding, memo
        self.q: dict[int, PromptStore] = {}
        self.k: dict[int, PromptStore] = {}
        self.v: dict[int, PromptStore] = {}
        self.scale: dict[int, float] = {}
        self.window: dict[int, int | None] = {}

    def attention(self, call, module, query, key, value, attention_mask, /, **kwargs):
        """A layer's attention call during the prompt forward: the model's own (`traces.hf.routing.model_attention`),
        with the layer's softmax scale and window noted (``call``: `traces.hf.routing.AttentionCall`) and its q/k/v
        captured (`_capture`)."""
        self.scale[call.layer] = call.scale
        self.window[call.layer] = call.window
        out, w = model_attention(module, query, key, value, attention_mask, **kwargs)
        self._capture(call.layer, query, key, value)
        return out, w

    def _capture(self, layer: int, query, key, value) -> None:
        """Keep what the runs need of one prompt chunk's q/k/v in this layer's preallocated store, at the model's
        dtype (`PromptStore`): q only on a layer the policies compress, k/v of a kept sliding layer only over
        its last window unless every token is needed (a streamed prompt's fast-forward, an open loop)."""
        t = query.shape[2]             # this prompt chunk's tokens: the last t of the keys the layer sees
        window = self.window[layer]
        compressed = self.sliding == "compress" or not window
        c0 = self._captured.get(layer, 0)
        self._captured[layer] = c0 + t
        U, P = query.shape[0], self._capture_len
        base = 0 if compressed or self._capture_full else max(0, P - int(window))
        for store, x, want in ((self.q, query, compressed), (self.k, key[:, :, -t:], True),
                               (self.v, value[:, :, -t:], True)):
            if not want:
                continue
            if layer not in store:
                store[layer] = PromptStore(torch.empty((U, P - base, x.shape[1], x.shape[3]), dtype=x.dtype), base)
            st = store[layer]
            lo = max(c0, st.base)
            if lo < c0 + t:
                st.x[:, lo - st.base:c0 + t - st.base].copy_(x[:, :, lo - c0:].transpose(1, 2))

    def forward(self, prompts: list[tuple[int, ...]], device, full: bool) -> torch.Tensor:
        """The distinct prompts through the model (routed here by the caller) with its own attention,
        ``PROMPT_CHUNK`` tokens per forward and the model's KV cache between chunks (no layer builds a P x P mask;
        a long prompt's memory stays bounded), capturing each layer's q/k/v as far as the runs need them
        (`_capture`; ``full``: every token of every layer's k/v); returns the logits after the last prompt token.
        Only that position's prediction is read, so the LM head runs on it alone (Gemma-3: 262 k x 640 weights).
        With a ``memo`` the captures of the same prompts are reused: a prompt goes through the model once for its
        streamed and its prefilled rows (again only when a batch needs the whole of a kept sliding layer's prompt
        and the memo holds its window)."""
        memo = self.memo
        self.prompts = [list(p) for p in prompts]
        if (memo is not None and memo.get("prompts") == tuple(prompts) and memo.get("sliding") == self.sliding
                and (memo["full"] or not full)):
            self.q, self.k, self.v = memo["q"], memo["k"], memo["v"]
            self.scale.update(memo["scale"])
            self.window.update(memo["window"])
            return memo["logits"]
        if memo is not None:
            memo.clear()       # drop the previous prompt's captures before this one's are taken
        ids = torch.tensor(prompts, device=device)
        self._capture_len, self._capture_full, self._captured = ids.shape[1], full, {}
        for _, _, logits in forward_in_chunks(self.model, ids, PROMPT_CHUNK, lambda c0, c1: 1):
            pass        # the layers capture q/k/v as the chunks go; only the last chunk's logits are read
        last = logits[:, -1].float()
        full = full or not any(st.base for st in self.k.values())   # (no layer kept its window only)
        if memo is not None:
            memo.update(prompts=tuple(prompts), sliding=self.sliding, full=full, q=self.q, k=self.k, v=self.v,
                        scale=dict(self.scale), window=dict(self.window), logits=last)
        return last

    def prompt(self, store: dict, layer: int, u: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Prompt u's captured q, k or v of ``layer`` at positions lo..hi-1 as float32 numpy [n, H, d] (a view when
        the model computes in float32)."""
        st = store[layer]
        hi = self.P if hi is None else hi
        if lo < st.base:
            raise ValidateError(f"layer {layer}: prompt positions from {lo} were not kept (from {st.base})")
        x = st.x[u, lo - st.base:hi - st.base]
        return x.numpy() if x.dtype == torch.float32 else x.float().numpy()

    def rows(self, store: dict, layer: int, idx: np.ndarray, t0: int, stop: int) -> torch.Tensor:
        """The captured k or v of every row's prompt (row b's is prompt ``idx[b]``) at positions t0..stop-1:
        [B, Hkv, stop - t0, d]."""
        st = store[layer]
        if t0 < st.base:
            raise ValidateError(f"layer {layer}: prompt positions from {t0} were not kept (from {st.base})")
        return st.x[torch.from_numpy(idx), t0 - st.base:stop - st.base].transpose(1, 2)

    def chunk_probs(self, layer: int, u: int, t0: int, stop: int, window: int | None) -> np.ndarray:
        """[Hkv, G, stop] float64: the attention of prompt u's tokens t0..stop-1 on every key before stop, summed
        over those queries (causal, and the layer's ``window``), from the captured q/k by
        ``traces.reference.causal_column_sums`` -- the simulator's sums for the same chunk; kept in the prompt memo,
        so the batches of one prompt (prefilled, streamed, each budget tier) compute them once."""
        memo, key = self.memo, ("column_sums", layer, u, t0, stop)    # every batch of a prompt needs them
        if memo is not None and key in memo:
            return memo[key]
        sums = causal_column_sums(self.prompt(self.q, layer, u, 0, stop), self.prompt(self.k, layer, u, 0, stop),
                                  float(self.scale[layer]), start=t0, stop=stop, window=window or None)
        if memo is not None:
            memo[key] = sums
        return sums


class PromptLayers(Sequence):
    """``Policy.allocate``'s view of prompt u's compressed layers: (q, k) float32 of one layer when asked, with
    the prompt memo's ``cache`` (work an allocator does on them, D2O's variances, is shared by the batches)."""

    def __init__(self, capture: PromptCapture, u: int, layers: list[int], cache: dict | None) -> None:
        self.capture, self.u, self.layers, self.cache = capture, u, layers, cache

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, j):   # type: ignore[override]
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        c, layer = self.capture, self.layers[j]
        return c.prompt(c.q, layer, self.u), c.prompt(c.k, layer, self.u)

    def rope_theta(self, j: int) -> float | None:
        """Layer j's RoPE base as the model declares it (``traces.hf.geometry.rope_theta``)."""
        return model_rope_theta(self.capture.model, self.layers[j])

    def reconstruction(self, j: int, chunk_size: int) -> tuple:
        """KVzip's context-reconstruction pass over prompt u, run in the model (``traces.hf.reconstruction_pass``) once
        per chunk size for every compressed layer (kept in the view's ``cache``, shared by the batches of the
        prompt): layer j's (plan, recon_q, recon_k, prompt keys, softmax scale), as
        ``sim.replay.layer_inputs.PromptLayers`` reads them from a trace."""
        c, layer = self.capture, self.layers[j]
        plan, arrays = self._reconstruction(chunk_size)
        return plan, *arrays[layer][:2], c.prompt(c.k, layer, self.u), float(c.scale[layer])

    def _reconstruction(self, chunk_size: int) -> tuple:
        """(plan, {layer: (recon_q, recon_k, recon_h)}) of the pass, run once per chunk size."""
        c = self.capture

        def run() -> tuple:
            ids = c.prompts[self.u]
            plan = plan_for(c.model, ids, chunk_size)
            return plan, run_reconstruction(c.model, ids, plan, self.layers)

        return prompt_memo(self, ("reconstruction", int(chunk_size)), run)

    def reconstruction_extras(self, j: int, chunk_size: int) -> tuple:
        """What KVzip+ reads beside the pass (``policies.kvzip_plus``): layer j's repeat tokens' hidden-state norms
        [R], the prompt's values [P, Hkv, d] and the layer's W_O [hidden, Hq * d]."""
        c, layer = self.capture, self.layers[j]
        _, arrays = self._reconstruction(chunk_size)
        wo = output_projection(c.model, layer)
        if arrays[layer][2] is None or wo is None:
            raise PolicyError("KVzip+ needs the attention modules' input norms and W_O (self_attn.o_proj), which "
                              "this architecture does not expose")
        return arrays[layer][2], c.prompt(c.v, layer, self.u), wo
