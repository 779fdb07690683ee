"""Closed-loop runner: an HF decoder model whose attention runs over a policy-compressed varlen KV cache.

The model's attention modules are routed (transformers' AttentionInterface, as the recorder does) to this runner.
The prompt runs once with the model's own causal attention, in chunks; of its q/k/v each layer keeps, at the
model's dtype and preallocated, only what the runs read (q on the layers the policies compress, for their allocator
and prefill selector; a kept sliding layer's k/v over its last window, unless a streamed prompt needs them all:
`BatchRunner._capture`): on Gemma-3 18 KB per prompt token (its 3 global layers), not every layer's fp32 q/k/v
twice over (parts, then concatenated). Then every token is fed alone: its k/v are appended to each layer's cache,
the query attends over the retained slots, the per-slot probabilities go to the policy's jitted ``step`` -- the
very function the simulator replays -- and its keep mask / merges are applied. On a GPU the cache is the Triton
`VarlenKVCache` (compaction kernel); on the CPU it is `HostKVCache`, padded numpy arrays that the steps read as
views and compact in place (numba), with torch's attention arithmetic. Policies without a prefill selector get the
prompt streamed token by token through the compressed cache, exactly as the replay engine does.

RoPE: keys are cached *post-RoPE* at their original positions (what the model hands the attention function),
so an eviction never re-rotates the survivors; this is also what the recorder stores and the simulator
replays. The query of step t is rotated at position t, so relative offsets to every kept key are exact.
BUZZ-style log-n scaling: ``logit_scale(params, t + 1)`` multiplies the scaled logits of step t.

``open_loop=True`` is for fidelity checks: the model's output uses the full cache (so every layer's q/k/v
equal a trace recorded from the same model and text), while the compressed cache and the policy run
alongside on the kernel's probabilities; kept sets can then be compared slot for slot with the simulator.

Hybrid models (Gemma-3): each layer's attention is what its call says (``scaling``, ``sliding_window``). With
``sliding="keep"`` (default, as in ``sim.replay``) a sliding layer holds the model's own window (the
``window`` policy at budget window - 1, which is exactly it) and the row's policy compresses the global layers;
with ``sliding="compress"`` the policy runs on the sliding layers too, under their window
(``sim.contract.apply_window``). Parameters that come from the layer (expected attention's RoPE base) are read
from the model's config per layer.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from numba import njit

from gpu_validate.backends import BACKENDS, HostKVCache, TorchVarlenKVCache, make_cache
from gpu_validate.kernels.errors import CacheCapacityError
from policies.base import Policy, PolicyError, compiled, unit_logit_scale
from sim.contract import (OK, apply_window, check_allocation, check_kept, check_scale, check_step, raise_on,
                          slot_capacity)

IMPL_NAME = "kvsim_validate"
#: prompt tokens per model forward when a batch's prompts go through the model with its own attention
PROMPT_CHUNK = 512
_ACTIVE: list["CompressedRunner"] = []


@njit(cache=True, nogil=True)
def keep_kept_first(keep, lengths, slot_state, positions):
    """Apply one step's keep mask to a row's host-side slot state: clear ``keep`` past each head's length, move
    the kept slots' state and positions to the front in order (what the cache's compaction does to k/v), zero
    the freed tail (positions -1). Returns the kept count per head."""
    H, cap = keep.shape
    kept_n = np.zeros(H, np.int64)
    for h in range(H):
        j = 0
        for i in range(cap):
            if i < lengths[h] and keep[h, i] != 0:
                if j != i:
                    slot_state[h, j, :] = slot_state[h, i, :]
                    positions[h, j] = positions[h, i]
                j += 1
            else:
                keep[h, i] = 0
        slot_state[h, j:, :] = 0.0
        positions[h, j:] = -1
        kept_n[h] = j
    return kept_n


@njit(cache=True, nogil=True)
def _row_prep(r0, n_new, lengths, probs, keys, values, pos, sst, ln, pr, ks, vs, ps):
    """One batch row's inputs to its policy step, from the layer's padded host arrays (rows r0 .. r0+Hkv-1 of
    ``lengths`` [B*Hkv], ``probs`` [B*Hkv, G, W] (float32 or float64), ``keys``/``values`` [B*Hkv, W, d],
    ``pos`` [B*Hkv, W]) into the row's contiguous scratch of its own width ``cap`` (``pr`` [Hkv, G, cap] float64,
    ``ks``/``vs``, ``ps``): zero / -1 past each head's length, exactly the arrays ``padded`` gives. The step's
    ``n_new`` new slots start with zero slot state. (keep / merge_to / merge_w come reset by `_row_post`.)"""
    H, G, cap = pr.shape
    d = ks.shape[2]
    for h in range(H):
        r = r0 + h
        n = lengths[r]
        ln[h] = n
        for g in range(G):
            for i in range(n):
                pr[h, g, i] = probs[r, g, i]
            for i in range(n, cap):
                pr[h, g, i] = 0.0
        for i in range(n):
            for x in range(d):
                ks[h, i, x] = keys[r, i, x]
                vs[h, i, x] = values[r, i, x]
            ps[h, i] = pos[r, i]
        for i in range(n, cap):
            for x in range(d):
                ks[h, i, x] = 0.0
                vs[h, i, x] = 0.0
            ps[h, i] = -1
        for i in range(max(0, n - n_new), n):
            for f in range(sst.shape[2]):
                sst[h, i, f] = 0.0


@njit(cache=True, nogil=True)
def _row_post(t, budget, head_adaptive, bounded, window, compressed, ln, keep, merge_to, merge_w, ps, sst, info, out,
              host, r0, k3, v3, pos, lengths, keep_all, mt_all, mw_all):
    """After a row's policy step: the contract's checks (a status code of ``sim.contract`` is returned), whether
    the step evicted or merged a slot of a compressed layer (``out[0]``), the layer's window, then the row's
    compaction. ``host``: merges (fp32, `gpu_validate.reference.ref_compact`'s order) and compaction applied in
    place to the host cache's rows (k3, v3, pos, lengths) and the slot state; otherwise the slot state and ``ps``
    are compacted (``keep_kept_first``) and keep/merge_to/merge_w go to rows r0.. of ``keep_all``/``mt_all``/
    ``mw_all`` for the device cache's compaction. out[1]: some slot dropped; out[2]: slots held after the step.
    The host cache keeps zero k/v and position -1 past each head's length (what ``padded`` gives), so a row as
    wide as the layer steps on views of it. keep / merge_to / merge_w are reset (1, -1, 1) for the next step."""
    status = check_step(ln, keep, merge_to, budget, head_adaptive, bounded, t, info)
    if status != OK:
        return status
    H, cap = keep.shape
    deviated = 0
    if compressed:
        for h in range(H):
            held = 0
            for i in range(cap):
                if merge_to[h, i] >= 0:
                    deviated = 1
                if i < ln[h] and keep[h, i] != 0:
                    held += 1
            if held < ln[h]:
                deviated = 1
    out[0] = deviated
    apply_window(ln, keep, merge_to, ps, t, window)
    dropped = 0
    total = 0
    if host:
        d = k3.shape[2]
        W = k3.shape[1]
        for h in range(H):
            r = r0 + h
            n = ln[h]
            n_src = 0
            for i in range(n):
                if keep[h, i] == 0 and merge_to[h, i] >= 0:
                    n_src += 1
            if n_src > 0:                    # x_j <- w_j x_j + sum_e w_e x_e over sources e in slot order
                has = np.zeros(n, np.uint8)
                for i in range(n):
                    if keep[h, i] == 0 and merge_to[h, i] >= 0:
                        has[merge_to[h, i]] = 1
                tk = np.empty((n, d), np.float32)
                tv = np.empty((n, d), np.float32)
                for j in range(n):
                    if has[j]:
                        w = np.float32(merge_w[h, j])
                        for x in range(d):
                            tk[j, x] = w * k3[r, j, x]
                            tv[j, x] = w * v3[r, j, x]
                for e in range(n):
                    if keep[h, e] == 0 and merge_to[h, e] >= 0:
                        j = merge_to[h, e]
                        w = np.float32(merge_w[h, e])
                        for x in range(d):
                            tk[j, x] = tk[j, x] + w * k3[r, e, x]
                            tv[j, x] = tv[j, x] + w * v3[r, e, x]
                for j in range(n):
                    if has[j]:
                        for x in range(d):
                            k3[r, j, x] = tk[j, x]
                            v3[r, j, x] = tv[j, x]
            j = 0
            for i in range(n):
                if keep[h, i] != 0:
                    if j != i:
                        for x in range(d):
                            k3[r, j, x] = k3[r, i, x]
                            v3[r, j, x] = v3[r, i, x]
                        pos[r, j] = pos[r, i]
                        for f in range(sst.shape[2]):
                            sst[h, j, f] = sst[h, i, f]
                    j += 1
            for i in range(j, n):            # freed slots read as the padded arrays: zero k/v, position -1
                for x in range(d):
                    k3[r, i, x] = 0.0
                    v3[r, i, x] = 0.0
            for i in range(j, cap):
                for f in range(sst.shape[2]):
                    sst[h, i, f] = 0.0
            for i in range(j, W):
                pos[r, i] = -1
            if j < n:
                dropped = 1
            lengths[r] = j
            total += j
    else:
        kept_n = keep_kept_first(keep, ln, sst, ps)
        for h in range(H):
            if kept_n[h] < ln[h]:
                dropped = 1
            total += kept_n[h]
            for i in range(cap):
                keep_all[r0 + h, i] = keep[h, i]
                mt_all[r0 + h, i] = merge_to[h, i]
                mw_all[r0 + h, i] = merge_w[h, i]
    out[1] = dropped
    out[2] = total
    for h in range(H):                       # the scratch's entry state for the next step that uses it
        for i in range(cap):
            keep[h, i] = 1
            merge_to[h, i] = -1
            merge_w[h, i] = 1.0
    return OK


@njit(cache=True, nogil=True)
def _map_prompt_probs(summed, rows, H, slot_pos, probs):
    """probs[b*H + h, g, i] = summed[h, g, slot_pos[b*H + h, i]] for every row b in ``rows`` and every held slot
    (slot_pos >= 0): a prompt chunk's summed attention over each row's cached slots."""
    G = summed.shape[1]
    for b in rows:
        for h in range(H):
            r = b * H + h
            for i in range(slot_pos.shape[1]):
                p = slot_pos[r, i]
                if p >= 0:
                    for g in range(G):
                        probs[r, g, i] = summed[h, g, p]


class ValidateError(ValueError):
    """Bad runner input (policy, budget, backend, model, token counts) or a policy that broke its contract."""


@dataclass
class RunResult:
    """One run: per prediction of a decoded position, its NLL (teacher-forced) and argmax; memory and speed.

    Prediction r is made by the query at position ``positions[r]`` (the first by the prompt's last token).
    """

    positions: np.ndarray
    top1: np.ndarray
    nll: np.ndarray | None
    generated: list[int]
    kv_bytes: np.ndarray           # K+V bytes held over all layers after each decode step
    decode_seconds: float
    n_decode_steps: int
    budgets: np.ndarray
    kept: np.ndarray | None = None  # [L, n_rec, Hkv, width] positions kept after steps kept_steps (-1 padded)
    kept_steps: np.ndarray | None = None
    logits: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.n_decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def _layer_idx(module) -> int:
    idx = getattr(module, "layer_idx", None)
    if idx is None:
        raise ValidateError(f"{type(module).__name__} has no layer_idx; cannot route its attention")
    return int(idx)


def _routed_attention(module, query, key, value, attention_mask, **kwargs):
    return _ACTIVE[-1].attention(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPL_NAME, _routed_attention)
    AttentionMaskInterface.register(IMPL_NAME, sdpa_mask)


@contextlib.contextmanager
def routed(model, runner: "CompressedRunner") -> Iterator[None]:
    """Send the model's attention to ``runner`` for the duration of the block, then restore it."""
    _register()
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(IMPL_NAME)
    except Exception as exc:  # transformers raises several types here
        raise ValidateError(f"{type(model).__name__} does not support a pluggable attention function: {exc}") from exc
    _ACTIVE.append(runner)
    try:
        yield
    finally:
        _ACTIVE.remove(runner)
        model.set_attn_implementation(previous)


def model_geometry(model) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head_dim) of a Llama/Qwen2/Mistral/GPT-2-style HF config."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    n_q = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if not n_layers or not n_q:
        raise ValidateError(f"config of model_type={cfg.model_type!r} has no layer/head counts")
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_q
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")
    head_dim = getattr(cfg, "head_dim", None) or hidden // n_q
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or getattr(cfg, "reorder_and_upcast_attn", False):
        raise ValidateError("GPT-2 variants with scale_attn_by_inverse_layer_idx/reorder_and_upcast_attn are not "
                            "supported")
    return int(n_layers), int(n_q), int(n_kv), int(head_dim)


def check_run_args(policy: Policy, budget: int, backend: str) -> None:
    """Reject what cannot run closed-loop, with a message naming the problem."""
    if backend not in BACKENDS:
        raise ValidateError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if policy.is_oracle:
        raise ValidateError(f"policy {policy.label()} is the future-attention oracle: it needs attention rows of "
                            "tokens not generated yet and cannot run closed-loop (use the simulator for it)")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
        raise ValidateError(f"budget must be an integer >= 1 (slots per KV head and layer), got {budget!r}")
    try:
        policy.check_budget(int(budget))
    except PolicyError as exc:
        raise ValidateError(str(exc)) from None


@dataclass
class BatchJob:
    """One closed-loop configuration of a batch: a policy at a budget on a prompt, then either teacher-forced
    ``continuation`` (NLL of each token) or ``n_generate`` greedy tokens."""

    policy: Policy
    budget: int
    prompt: Sequence[int]
    continuation: Sequence[int] | None = None
    n_generate: int = 0
    chunk: int = 1      # chunked prefill of a streamed prompt (``sim.replay.replay_step``)

    @property
    def n_pred(self) -> int:
        return len(self.continuation) if self.continuation is not None else int(self.n_generate)

    @property
    def streams(self) -> bool:
        """True when the prompt is streamed token by token through the compressed cache (no prefill selector,
        and not an unscaled full cache, which keeps the prompt exactly as the model computed it)."""
        p = self.policy
        return not (p.has_prefill or (p.unbounded and p.logit_scale_fn is None))

    @property
    def prompt_chunk(self) -> int:
        """Prompt tokens per policy step: ``chunk`` for a streamed prompt of a policy that can take several new
        tokens per step, else 1 (as the simulator's ``sim.replay.effective_chunk``)."""
        from sim.replay import effective_chunk

        return effective_chunk(self.policy, self.chunk) if self.streams else 1

    @property
    def batch_key(self) -> tuple:
        """Jobs with equal keys go through the model together."""
        return self.streams, len(self.prompt), self.n_pred, self.prompt_chunk


@dataclass
class PromptStore:
    """One layer's captured prompt q, k or v: ``x`` [U, P - base, H, d] at the model's dtype holds positions
    base .. P-1 of each distinct prompt (base > 0: a kept sliding layer's last window only)."""

    x: torch.Tensor
    base: int = 0


class _PromptLayers(Sequence):
    """``Policy.allocate``'s view of prompt u's compressed layers: (q, k) float32 of one layer when asked, with
    the prompt memo's ``cache`` (work an allocator does on them, D2O's variances, is shared by the batches)."""

    def __init__(self, runner: "BatchRunner", u: int, layers: list[int], cache: dict | None) -> None:
        self.runner, self.u, self.layers, self.cache = runner, u, layers, cache

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, j):   # type: ignore[override]
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        r, layer = self.runner, self.layers[j]
        return r._prompt(r.prompt_q, layer, self.u), r._prompt(r.prompt_k, layer, self.u)


class _Row:
    """Per-configuration state of a batch row: per-layer policies and kernels (the row's policy on the layers
    it compresses, the model's own window on a kept sliding layer), budgets, slot/head states, outputs."""

    def __init__(self, job: BatchJob, n_layers: int, n_kv: int) -> None:
        self.job, self.policy = job, job.policy
        self.scale_fn = job.policy.kernels()[2]
        self.scale_params: np.ndarray | None = None     # the policy's parameters on a layer it compresses
        self.layer_policy: list[Policy] = []
        self.kernels: list[tuple] = []
        self.params: list[np.ndarray] = []
        self.prompt = [int(x) for x in job.prompt]
        self.cont = None if job.continuation is None else [int(x) for x in job.continuation]
        self.held = [0] * n_layers
        self.preds_top1: list[int] = []
        self.nlls: list[float] = []
        self.logits: list[torch.Tensor] = []
        self.generated: list[int] = []
        self.kv_bytes: list[float] = []
        self.kept = None

    def next_token(self, r: int) -> int:
        """Decode input r: the teacher-forced token, or the greedy argmax of the previous prediction."""
        return self.cont[r] if self.cont is not None else self.preds_top1[-1]

    def logit_scale(self, t: int) -> float:
        """The policy's attention-logit multiplier at step t (BUZZ's log n; 1 for every other policy)."""
        return float(self.scale_fn(self.scale_params, t + 1))


class BatchRunner:
    """Runs many closed-loop configurations as one batch through the model.

    Every batch row is a (policy, budget, prompt) configuration with its own per-head varlen cache: one cache
    per layer holds all rows (``batch = rows``, capacities per row and KV head; `HostKVCache` on the CPU,
    `VarlenKVCache` on a device), so attention is one call per layer and the model's weight matmuls are shared by
    the rows. The policy step runs per row on that row's slice of the layer (one jitted call, with a jitted
    check-and-compact after it), exactly as a one-row run does, so a batch gives the results of running each
    configuration alone (tested). Work every row does identically is shared: each
    distinct prompt goes through the model once, and streamed prompts skip the model until the first eviction
    in any row (`_fast_forward`). Rows must agree on whether the prompt is streamed, on the prompt length, on
    the number of predictions and on the prompt chunk (`BatchJob.batch_key`; `run_batch` groups jobs that way).

    Chunked prefill (``BatchJob.chunk``): a streamed prompt goes C tokens per model forward; in every layer each
    of the C tokens is appended and attends over the cache (a sliding layer's window masking its older
    chunk-mates' slots), their probabilities are summed per slot, and the policy steps once, as in the
    simulator.
    """

    #: the torch backend on the CPU at float32 keeps its caches as `HostKVCache` (stepped in place); False: the
    #: device cache path (`TorchVarlenKVCache`, flat masks, one ``compact`` per layer), as on a GPU
    _host_cache: bool = True

    def __init__(self, model, jobs: Sequence[BatchJob], *, backend: str = "torch", open_loop: bool = False,
                 record_kept: tuple[int, int] | None = None, cache_dtype: torch.dtype | None = None,
                 keep_logits: bool = False, sliding: str = "keep", prompt_memo: dict | None = None) -> None:
        if not jobs:
            raise ValidateError("a batch needs at least one job")
        for j in jobs:
            check_run_args(j.policy, j.budget, backend)
        keys = {j.batch_key for j in jobs}
        if len(keys) != 1:
            raise ValidateError(f"a batch needs one (streams prompt, prompt length, predictions, prompt chunk) key, "
                                f"got {keys}")
        self.chunk = jobs[0].prompt_chunk
        if sliding not in ("keep", "compress"):
            raise ValidateError(f"sliding must be 'keep' or 'compress', got {sliding!r}")
        self.model, self.jobs, self.backend, self.sliding = model, list(jobs), backend, sliding
        self.open_loop, self.record_kept, self.keep_logits = open_loop, record_kept, keep_logits
        self.n_layers, self.n_q, self.n_kv, self.head_dim = model_geometry(model)
        self.group = self.n_q // self.n_kv
        self.device = next(model.parameters()).device
        self.cache_dtype = cache_dtype or next(model.parameters()).dtype
        self.mode = "prompt"
        self.layer_scale: dict[int, float] = {}
        self.layer_window: dict[int, int | None] = {}
        self._wo_cache: dict[int, np.ndarray] = {}
        self.prompt_memo = prompt_memo

    # ----- attention entry point (called by every attention module) -----
    def attention(self, module, query, key, value, attention_mask, **kwargs):
        layer = _layer_idx(module)
        scaling = kwargs.get("scaling")
        scaling = float(scaling if scaling is not None else getattr(module, "scaling", query.shape[-1] ** -0.5))
        if self.mode == "prompt":
            self.layer_scale[layer] = scaling
            self.layer_window[layer] = kwargs.get("sliding_window") or None
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            kwargs.setdefault("dropout", 0.0)
            out, w = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
            self._capture(layer, query, key, value)
            return out, w
        C = query.shape[2]
        if query.shape[0] != len(self.rows) or key.shape[2] != C or not 1 <= C <= self.chunk:
            raise ValidateError(f"decode steps feed one token (or a prompt chunk of {self.chunk}) per batch row at a "
                                "time (no HF KV cache)")
        return self._decode_attention(layer, query, key, value), None

    def _decode_attention(self, layer: int, query, key, value, *, extend_dense: bool = True) -> torch.Tensor:
        """Append the C new tokens one by one, each attending over the cache; one policy step after the last.
        Open loop, the output is the full cache's (a dense copy, extended by the new tokens)."""
        t0, B, C = self.t, len(self.rows), query.shape[2]
        cache = self.caches[layer]
        window = self.attn[layer].window
        summed = None
        outs = []
        for j in range(C):
            t = t0 + j
            if self.host:
                cache.append(key[:, :, j:j + 1], value[:, :, j:j + 1], t)
            else:
                cache.append(key[:, :, j:j + 1].to(self.cache_dtype), value[:, :, j:j + 1].to(self.cache_dtype),
                             positions=torch.full((B, 1), t, device=self.device, dtype=torch.int64))
            mults = self._mults(t) if self.compressed[layer] else None   # a kept window is the model's own
            visible_from = t - window + 1 if window and C > 1 else None       # older chunk-mates' windows moved
            outs.append(self._attend(cache, query[:, :, j, :].to(self.cache_dtype), mults, visible_from))
            if C > 1:
                if self.host:
                    p = cache.p.numpy().astype(np.float64)
                else:
                    p = self._host_padded(layer, cache, cache.probs, 0.0).transpose(0, 2, 1).astype(np.float64)
                summed = p if summed is None else summed + p
        self._last_deviated = self._policy_step(layer, t0 + C - 1, cache, probs=summed)
        o = outs[0][:, None] if C == 1 else torch.stack(outs, 1)                # [B, C, Hq, d]
        if self.open_loop and extend_dense:
            dk, dv = self.dense[layer]
            dk, dv = torch.cat([dk, key], 2), torch.cat([dv, value], 2)
            self.dense[layer] = [dk, dv]
            S = dk.shape[2]
            kpos = torch.arange(S, device=dk.device)[None, :]
            qpos = torch.arange(S - C, S, device=dk.device)[:, None]
            seen = kpos <= qpos                                                  # causal within the chunk
            if window:                                   # the model's own attention on a sliding layer
                seen &= kpos > qpos - window
            rep = self.group
            kk = dk.repeat_interleave(rep, dim=1) if rep > 1 else dk
            vv = dv.repeat_interleave(rep, dim=1) if rep > 1 else dv
            o = torch.nn.functional.scaled_dot_product_attention(query, kk, vv, attn_mask=seen,
                                                                 scale=self.layer_scale[layer]).transpose(1, 2)
        return o.to(query.dtype).reshape(B, C, self.n_q, self.head_dim)

    def _mults(self, t: int) -> np.ndarray | None:
        """Every row's logit multiplier at step t, checked (computed once per step for all layers); None when
        every row's is 1 (no row has a logit scale)."""
        if not self._scaled_rows:
            return None
        m = self._mults_memo.get(t)
        if m is None:
            m = np.ones(len(self.rows))
            info = np.zeros(3, np.int64)
            for b in self._scaled_rows:
                row = self.rows[b]
                m[b] = row.logit_scale(t)
                raise_on(row.policy, check_scale(float(m[b]), t, info), info, -1)
            if len(self._mults_memo) > 64:
                self._mults_memo.clear()
            self._mults_memo[t] = m
        return m

    def _attend(self, cache, q: torch.Tensor, mults: np.ndarray | None, visible_from: int | None) -> torch.Tensor:
        """The cache's attention for one query per row (``visible_from``: slots at earlier positions hidden)."""
        if self.host:
            if mults is None or (mults == 1.0).all():
                return cache.attend(q, visible_from=visible_from)
            return cache.attend(q, logit_scale=torch.as_tensor(mults, dtype=torch.float32), visible_from=visible_from)
        kw = {"update_acc": False, "update_ema": False}
        if visible_from is not None:
            if not isinstance(cache, TorchVarlenKVCache):
                raise ValidateError("chunked prefill on a sliding-window layer needs the torch backend")
            kw["visible_from"] = visible_from
        if mults is None or (mults == 1.0).all():
            o, _ = cache.attend(q, **kw)
        elif isinstance(cache, TorchVarlenKVCache):
            o, _ = cache.attend(q, logit_scale=torch.as_tensor(mults, dtype=torch.float32), **kw)
        elif (mults == mults[0]).all():
            o, _ = cache.attend(q, logit_scale=float(mults[0]), **kw)
        else:
            raise ValidateError("rows with different logit scales need the torch backend (or one batch each)")
        return o

    def _host_padded(self, layer: int, cache, x: torch.Tensor, fill: float) -> np.ndarray:
        """``cache.padded(x)`` as one numpy gather: [B*Hkv, width, ...] with ``fill`` past each head's length."""
        lengths = cache.length.cpu().numpy()
        out = x.detach().cpu().numpy()[self.slot_index[layer]]
        out[~(np.arange(cache.max_capacity)[None, :] < lengths[:, None])] = fill
        return out

    # ----- the policy step of every row on host arrays, as sim/engine.py calls it -----
    def _scratch(self, cap: int) -> tuple:
        """Contiguous per-row step inputs of width ``cap`` (shared by the rows of that width: they step in turn)."""
        sc = self._scratches.get(cap)
        if sc is None:
            H, G, d = self.n_kv, self.group, self.head_dim
            sc = self._scratches[cap] = (
                np.zeros(H, np.int64), np.zeros((H, G, cap)), np.zeros((H, cap, d), np.float32),
                np.zeros((H, cap, d), np.float32), np.full((H, cap), -1, np.int64), np.ones((H, cap), np.uint8),
                np.full((H, cap), -1, np.int64), np.ones((H, cap)))
        return sc

    def _policy_step(self, layer: int, t: int, cache, probs: np.ndarray | None = None) -> bool:
        """Every row's policy step on this layer, then the layer's window; True when some row's policy evicted or
        merged a slot of a layer it compresses (so the cache no longer holds what the model's attention sees).
        ``probs`` [B*Hkv, G, width]: a prompt chunk's summed attention (default: the cache's last attention).

        Per row: the policy's jitted step runs on the row's slots -- views of the host cache when the row is as
        wide as the layer, else (or from a device cache) contiguous copies of the row's width (`_row_prep`) --
        then `_row_post` checks the contract, applies the window and compacts: in place on the host cache's
        arrays, or into flat masks for one ``compact`` of the layer's device cache."""
        H, host = self.n_kv, self.host
        if host:
            lengths_all, keys_all, values_all, pos_all = cache.length, cache.k3, cache.v3, cache.pos
            if probs is None:
                probs = (cache.p.double().numpy() if self.layer_reads[layer]
                         else self._probs_buffer(cache.max_capacity))
            keep_all, mt_all, mw_all = self._no_masks
        else:
            lengths_all = cache.length.cpu().numpy().astype(np.int64)
            if probs is None:
                probs = self._host_padded(layer, cache, cache.probs, 0.0).transpose(0, 2, 1).astype(np.float64)
            keys_all = self._host_padded(layer, cache, cache.k, 0.0).astype(np.float32, copy=False)
            values_all = self._host_padded(layer, cache, cache.v, 0.0).astype(np.float32, copy=False)
            pos_all = self._host_padded(layer, cache, cache.positions, -1)
            width = cache.max_capacity
            keep_all = np.zeros((len(self.rows) * H, width), np.uint8)
            mt_all = np.full((len(self.rows) * H, width), -1, np.int64)
            mw_all = np.ones((len(self.rows) * H, width), np.float64)
        window = int(self.attn[layer].window or 0)
        compressed = bool(self.compressed[layer])
        n_new = t - self.t + 1                    # the step's new slots (a prompt chunk's) start at zero state
        deviated = evicted = False
        info, out = self._info, self._out
        for b, row in enumerate(self.rows):
            r0 = b * H
            step, params, budget, adaptive, bounded, sst, hst, cap, views = row.plan[layer]
            ln, pr, ks, vs, ps, keep, merge_to, merge_w = self._scratch(cap)
            if views is not None:               # the row's slots as they lie in the host cache
                ln, ks, vs, ps = views
                pr = probs[r0:r0 + H]
            else:
                _row_prep(r0, n_new, lengths_all, probs, keys_all, values_all, pos_all, sst, ln, pr, ks, vs, ps)
            step(params, layer, t, budget, ln, pr, ks, vs, ps, sst, hst, keep, merge_to, merge_w)
            status = _row_post(t, budget, adaptive, bounded, window, compressed, ln, keep, merge_to, merge_w, ps,
                               sst, info, out, host, r0, keys_all, values_all, pos_all, lengths_all, keep_all, mt_all,
                               mw_all)
            if status != OK:
                raise_on(row.layer_policy[layer], status, info, layer)
            deviated |= bool(out[0])
            evicted |= bool(out[1])
            row.held[layer] = int(out[2])
            if row.kept is not None:
                r = t - self.record_kept[0]
                if 0 <= r < row.kept.shape[1]:
                    row.kept[layer, r, :, :cap] = pos_all[r0:r0 + H, :cap] if host else ps
        if evicted and not host:
            idx, valid_all = self.slot_index[layer], np.arange(cache.max_capacity)[None, :] < lengths_all[:, None]
            flat = idx[valid_all]
            total = cache.total_capacity
            flat_keep = np.zeros(total, np.uint8)
            flat_keep[flat] = keep_all[valid_all]
            merging = bool((mt_all[valid_all] >= 0).any())
            flat_mt = flat_mw = None
            dev = self.device
            if merging:
                flat_mt = np.full(total, -1, np.int32)
                flat_mw = np.ones(total, np.float32)
                flat_mt[flat] = mt_all[valid_all]
                flat_mw[flat] = mw_all[valid_all]
                flat_mt, flat_mw = torch.from_numpy(flat_mt).to(dev), torch.from_numpy(flat_mw).to(dev)
            cache.compact(torch.from_numpy(flat_keep).to(dev), flat_mt, flat_mw)
        return deviated

    # ----- setup -----
    def _capture(self, layer: int, query, key, value) -> None:
        """Keep what the runs need of one prompt chunk's q/k/v in this layer's preallocated store, at the model's
        dtype (`PromptStore`): q only on a layer the policies compress, k/v of a kept sliding layer only over
        its last window unless every token is needed (a streamed prompt's fast-forward, an open loop)."""
        t = query.shape[2]             # this prompt chunk's tokens: the last t of the keys the layer sees
        window = self.layer_window[layer]
        compressed = self.sliding == "compress" or not window
        c0 = self._captured.get(layer, 0)
        self._captured[layer] = c0 + t
        U, P = query.shape[0], self._capture_len
        base = 0 if compressed or self._capture_full else max(0, P - int(window))
        for store, x, want in ((self.prompt_q, query, compressed), (self.prompt_k, key[:, :, -t:], True),
                               (self.prompt_v, value[:, :, -t:], True)):
            if not want:
                continue
            if layer not in store:
                store[layer] = PromptStore(torch.empty((U, P - base, x.shape[1], x.shape[3]), dtype=x.dtype), base)
            st = store[layer]
            lo = max(c0, st.base)
            if lo < c0 + t:
                st.x[:, lo - st.base:c0 + t - st.base].copy_(x[:, :, lo - c0:].transpose(1, 2))

    def _prompt_forward(self, prompts: list[tuple[int, ...]]) -> torch.Tensor:
        """The distinct prompts through the model with its own attention, ``PROMPT_CHUNK`` tokens per forward and
        the model's KV cache between chunks (no layer builds a P x P mask; a long prompt's memory stays bounded),
        capturing each layer's q/k/v as far as the runs need them (`_capture`); returns the logits after the last
        prompt token. Only that position's prediction is read, so the LM head runs on it alone (Gemma-3: 262 k x
        640 weights). With a ``prompt_memo`` (`run_batch` shares one among the batches of a call) the captures of
        the same prompts are reused: a prompt goes through the model once for its streamed and its prefilled rows
        (again only when a batch needs the whole of a kept sliding layer's prompt and the memo holds its window)."""
        memo = self.prompt_memo
        full = bool(self.jobs[0].streams or self.open_loop)
        if (memo is not None and memo.get("prompts") == tuple(prompts) and memo.get("sliding") == self.sliding
                and (memo["full"] or not full)):
            self.prompt_q, self.prompt_k, self.prompt_v = memo["q"], memo["k"], memo["v"]
            self.layer_scale.update(memo["scale"])
            self.layer_window.update(memo["window"])
            last = memo["logits"]
        else:
            if memo is not None:
                memo.clear()       # drop the previous prompt's captures before this one's are taken
            ids = torch.tensor(prompts, device=self.device)
            self._capture_len, self._capture_full, self._captured = ids.shape[1], full, {}
            for _, _, logits in forward_in_chunks(self.model, ids, PROMPT_CHUNK, lambda c0, c1: 1):
                pass        # the layers capture q/k/v as the chunks go; only the last chunk's logits are read
            last = logits[:, -1].float()
            full = full or not any(st.base for st in self.prompt_k.values())   # (no layer kept its window only)
            if memo is not None:
                memo.update(prompts=tuple(prompts), sliding=self.sliding, full=full, q=self.prompt_q, k=self.prompt_k,
                            v=self.prompt_v, scale=dict(self.layer_scale), window=dict(self.layer_window), logits=last)
        if self.open_loop:
            dev, dtype = self.device, next(self.model.parameters()).dtype
            self.dense = {layer: [a[layer].x.to(dev, dtype).transpose(1, 2)[self.prompt_of]
                                  for a in (self.prompt_k, self.prompt_v)] for layer in self.prompt_k}
        return last

    def _prompt(self, store: dict, layer: int, u: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Prompt u's captured q, k or v of ``layer`` at positions lo..hi-1 as float32 numpy [n, H, d] (a view when
        the model computes in float32)."""
        st = store[layer]
        hi = self._P if hi is None else hi
        if lo < st.base:
            raise ValidateError(f"layer {layer}: prompt positions from {lo} were not kept (from {st.base})")
        x = st.x[u, lo - st.base:hi - st.base]
        return x.numpy() if x.dtype == torch.float32 else x.float().numpy()

    def _forward(self, tokens: Sequence[Sequence[int]], t: int, *, logits: bool = True):
        """Feed each row's tokens (one, or a prompt chunk) at positions t, t+1, ...; the logits after the last,
        or None with ``logits=False`` (streamed prompt tokens: their predictions are never read, so the LM head
        -- a fifth of SmolLM2's decode FLOPs -- is skipped by running only the decoder stack)."""
        self.t = t
        ids = torch.tensor([[int(x) for x in row] for row in tokens], device=self.device)
        pos = (t + torch.arange(ids.shape[1], device=self.device, dtype=torch.int64))[None, :].expand(len(tokens), -1)
        if not logits:
            self.model.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False)
            return None
        out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
        return out.logits[:, -1].float()

    def _record(self, rows: list[_Row], logits: torch.Tensor, r: int) -> None:
        """Store prediction r of every row (argmax, NLL of the teacher-forced token, logits if asked)."""
        top1 = logits.argmax(-1).tolist()
        nll = None
        if rows[0].cont is not None:
            logp = torch.log_softmax(logits, -1)
            tgt = torch.tensor([row.cont[r] for row in rows], device=logits.device)
            nll = (-logp.gather(1, tgt[:, None])[:, 0]).double().cpu().numpy()
        for b, row in enumerate(rows):
            row.preds_top1.append(int(top1[b]))
            if nll is not None:
                row.nlls.append(float(nll[b]))
            if self.keep_logits:
                row.logits.append(logits[b].cpu())

    def run(self) -> list[RunResult]:
        """Run every job of the batch; results in job order."""
        jobs = self.jobs
        P, n_pred, streams = len(jobs[0].prompt), jobs[0].n_pred, jobs[0].streams
        if P < 1 or n_pred < 1:
            raise ValidateError(f"need a prompt of >= 1 token and >= 1 token to predict, got {P} and {n_pred}")
        max_pos = getattr(self.model.config, "max_position_embeddings", None) or getattr(
            self.model.config, "n_positions", None)
        if max_pos and P + n_pred - 1 > max_pos:
            raise ValidateError(f"{P + n_pred - 1} positions exceed the model's context of {max_pos}")
        n_total = P + n_pred - 1   # tokens the cache will have seen after the last decode step
        rows = self.rows = [_Row(j, self.n_layers, self.n_kv) for j in jobs]
        prompts: dict[tuple[int, ...], int] = {}
        for row in rows:
            prompts.setdefault(tuple(row.prompt), len(prompts))
        self.prompt_of = torch.tensor([prompts[tuple(row.prompt)] for row in rows], device=self.device)
        self.prompt_q, self.prompt_k, self.prompt_v, self.dense = {}, {}, {}, {}
        self.layer_scale, self.layer_window = {}, {}
        self._P = P
        self.mode = "prompt"
        self.model.eval()
        with torch.no_grad(), routed(self.model, self):
            last = self._prompt_forward(list(prompts))[self.prompt_of]
            if len(self.prompt_k) != self.n_layers:
                raise ValidateError(f"only {len(self.prompt_k)} of {self.n_layers} layers called the attention "
                                    "interface; this model is not supported")
            self._layer_attention()
            caps = []
            for b, row in enumerate(rows):
                self._setup_row(row, int(self.prompt_of[b]), n_total)
                cap = np.stack([slot_capacity(p, b, n_total, self.chunk)
                                for p, b in zip(row.layer_policy, row.budgets)])
                caps.append(cap)
                row.slot_state = [np.zeros((self.n_kv, int(cap[l].max()), row.layer_policy[l].slot_fields))
                                  for l in range(self.n_layers)]
                row.head_state = [row.layer_policy[l].head_state_init(
                    self.n_kv, self.head_dim, self._wo(l) if row.layer_policy[l].needs_wo else None)
                    for l in range(self.n_layers)]
                row.plan = [(row.kernels[l][0], row.params[l], np.ascontiguousarray(row.budgets[l]),
                             bool(row.layer_policy[l].head_adaptive), not row.layer_policy[l].unbounded,
                             row.slot_state[l], row.head_state[l], int(cap[l].max())) for l in range(self.n_layers)]
                if self.record_kept:
                    row.kept = np.full((self.n_layers, self.record_kept[1], self.n_kv, int(cap.max())), -1, np.int32)
            caps_all = np.stack(caps, 1)   # [L, B, Hkv]
            B = len(rows)
            self.host = (self._host_cache and self.backend == "torch" and self.device.type == "cpu"
                         and self.cache_dtype == torch.float32)
            self.caches = [(HostKVCache if self.host else functools.partial(make_cache, self.backend))(
                batch=B, n_kv_heads=self.n_kv, n_q_heads=self.n_q, head_dim=self.head_dim,
                capacity=caps_all[l].reshape(-1).tolist(), dtype=self.cache_dtype, device=self.device,
                softmax_scale=self.layer_scale[l], track_acc=False) for l in range(self.n_layers)]
            self.slot_index = None if self.host else [c.slot_rows.cpu().numpy() for c in self.caches]
            H = self.n_kv
            for b, row in enumerate(rows):   # a row as wide as its layer's host cache steps on views of it
                row.plan = [plan + ((c.length[b * H:(b + 1) * H], c.k3[b * H:(b + 1) * H], c.v3[b * H:(b + 1) * H],
                                     c.pos[b * H:(b + 1) * H]) if self.host and plan[7] == c.max_capacity else None,)
                            for plan, c in zip(row.plan, self.caches)]
            self._scratches, self._probs_buf, self._mults_memo = {}, {}, {}
            self._info, self._out = np.zeros(3, np.int64), np.zeros(3, np.int64)
            self._no_masks = (np.zeros((1, 1), np.uint8), np.zeros((1, 1), np.int64), np.zeros((1, 1)))
            unit = compiled(unit_logit_scale)
            self._scaled_rows = [b for b, row in enumerate(rows) if row.scale_fn is not unit]
            self.reads_attention = any(row.policy.reads_attention for row in rows)
            self.layer_reads = [any(row.layer_policy[l].reads_attention for row in rows) for l in range(self.n_layers)]
            self.mode = "decode"
            if not streams:
                self._prefill(P)
            else:
                t_model = self._fast_forward(P)
                for l, (dk, dv) in self.dense.items():   # the dense copy holds the tokens the cache has seen
                    self.dense[l] = [dk[:, :, :t_model], dv[:, :, :t_model]]
                for t in range(t_model, P, self.chunk):
                    stop = min(P, t + self.chunk)
                    last = self._forward([row.prompt[t:stop] for row in rows], t, logits=stop == P)
            elem = torch.empty((), dtype=self.cache_dtype).element_size()
            self._record(rows, last, 0)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for r in range(n_pred - 1):
                t = P + r
                tokens = [row.next_token(r) for row in rows]
                for row, tok in zip(rows, tokens):
                    row.generated.append(tok)
                logits = self._forward([[tok] for tok in tokens], t)
                self._record(rows, logits, r + 1)
                for row in rows:
                    row.kv_bytes.append(sum(row.held) * 2 * self.head_dim * elem)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        results = []
        for row in rows:
            if row.cont is None:
                row.generated.append(row.preds_top1[-1])
            results.append(RunResult(
                positions=np.arange(P - 1, P - 1 + n_pred), top1=np.asarray(row.preds_top1, np.int64),
                nll=None if row.cont is None else np.asarray(row.nlls, np.float64), generated=row.generated,
                kv_bytes=np.asarray(row.kv_bytes, np.float64), decode_seconds=seconds / len(rows),
                n_decode_steps=n_pred - 1, budgets=row.budgets, kept=row.kept,
                kept_steps=None if row.kept is None else np.arange(self.record_kept[0],
                                                                     self.record_kept[0] + self.record_kept[1]),
                logits=torch.stack(row.logits).numpy() if self.keep_logits else None,
                extra={"cache_elem_bytes": elem, "batch_rows": len(rows)}))
        return results

    def _fast_forward(self, P: int) -> int:
        """Stream the prompt's first chunks without the model, as long as no row has evicted anything.

        Until a row's cache first drops or merges a slot of a layer it compresses, its attention at step t reads
        every token the model's own attention reads, with unit logit scale: the causal prompt forward already
        computed that token's q/k/v (and everything the model does with them). So a chunk's tokens are appended
        from the captured k/v and the policy steps on their summed attention, computed once per distinct prompt
        from the captured q/k (`_prompt_chunk_probs`); the model streams only from the chunk after the first
        eviction in any row. With the whole prompt as one chunk the model never streams it. Returns that chunk's
        first token."""
        rows, dev, C = self.rows, self.device, self.chunk
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
            evicted = False
            for layer in range(self.n_layers):   # (an open loop's dense copy already holds the prompt)
                cache = self.caches[layer]
                if self.host:
                    k, v = (self._prompt_rows(a, layer, idx, t0, stop) for a in (self.prompt_k, self.prompt_v))
                    cache.append(k, v, t0)
                else:
                    k, v = (self._prompt_rows(a, layer, idx, t0, stop).to(dev, self.cache_dtype)
                            for a in (self.prompt_k, self.prompt_v))                        # [B, Hkv, C, d]
                    cache.append(k, v, positions=pos)
                del k, v
                probs = self._probs_buffer(cache.max_capacity)
                if self.compressed[layer] and self.reads_attention:   # a kept window's policy does not read it
                    slot_pos = cache.pos if self.host else self._host_padded(layer, cache, cache.positions, -1)
                    for u, bs in groups:
                        summed = self._prompt_chunk_probs(layer, u, t0, stop)               # [Hkv, G, stop]
                        _map_prompt_probs(summed, bs, self.n_kv, slot_pos, probs)
                evicted |= self._policy_step(layer, stop - 1, cache, probs=probs)
            if evicted:
                return stop
        return P

    def _probs_buffer(self, width: int) -> np.ndarray:
        """A zeroed [B*Hkv, G, width] float64 buffer for a fast-forwarded chunk's attention (reused)."""
        buf = self._probs_buf.get(width)
        if buf is None:
            buf = self._probs_buf[width] = np.zeros((len(self.rows) * self.n_kv, self.group, width))
        else:
            buf.fill(0.0)
        return buf

    def _prompt_rows(self, store: dict, layer: int, idx: np.ndarray, t0: int, stop: int) -> torch.Tensor:
        """The captured k or v of every row's prompt at positions t0..stop-1: [B, Hkv, stop - t0, d]."""
        st = store[layer]
        if t0 < st.base:
            raise ValidateError(f"layer {layer}: prompt positions from {t0} were not kept (from {st.base})")
        return st.x[torch.from_numpy(idx), t0 - st.base:stop - st.base].transpose(1, 2)

    def _prompt_chunk_probs(self, layer: int, u: int, t0: int, stop: int) -> np.ndarray:
        """[Hkv, G, stop] float64: the attention of prompt u's tokens t0..stop-1 on every key before stop, summed
        over those queries (causal, and the layer's window), from the captured q/k by
        ``traces.reference.causal_column_sums`` -- the simulator's sums for the same chunk; kept in the prompt memo,
        so the batches of one prompt (prefilled, streamed, each budget tier) compute them once."""
        from traces.reference import causal_column_sums

        memo, key = self.prompt_memo, ("column_sums", layer, u, t0, stop)    # every batch of a prompt needs them
        if memo is not None and key in memo:
            return memo[key]
        sums = causal_column_sums(self._prompt(self.prompt_q, layer, u, 0, stop),
                                  self._prompt(self.prompt_k, layer, u, 0, stop), float(self.layer_scale[layer]),
                                  start=t0, stop=stop, window=self.attn[layer].window or None)
        if memo is not None:
            memo[key] = sums
        return sums

    def _layer_attention(self) -> None:
        """Each layer's attention as its prompt call ran it, and which layers the rows' policies compress."""
        from traces.capture import layer_attention

        self.attn = [layer_attention(self.model.config, l, self.layer_scale[l], self.layer_window[l])
                     for l in range(self.n_layers)]
        self.compressed = [self.sliding == "compress" or not a.sliding for a in self.attn]
        if not any(self.compressed):
            raise ValidateError("every layer of this model slides over a window: with sliding='keep' no layer is "
                                "compressed; use sliding='compress'")

    def _setup_row(self, row: _Row, u: int, n_total: int) -> None:
        """A row's per-layer policies, kernels, parameters and budgets: its policy's allocation over the layers
        it compresses (from prompt u's q/k), the model's window (``window`` at window - 1) on a kept sliding
        layer."""
        from policies.registry import get_policy

        comp = [l for l in range(self.n_layers) if self.compressed[l]]
        memo = self.prompt_memo
        cache = None if memo is None else memo.setdefault(("allocate", u, tuple(comp)), {})
        layers = _PromptLayers(self, u, comp, cache)
        alloc = check_allocation(row.policy, row.policy.allocate(int(row.job.budget), self.n_kv, layers,
                                                                 self.layer_scale[comp[0]]), len(comp), self.n_kv)
        own_window = get_policy("window")
        row.budgets = np.empty((self.n_layers, self.n_kv), np.int64)
        for l, a in enumerate(self.attn):
            if self.compressed[l]:
                policy, row.budgets[l] = row.policy, alloc[comp.index(l)]
            else:
                policy, row.budgets[l] = own_window, max(1, int(a.window) - 1)
            row.layer_policy.append(policy)
            row.kernels.append(policy.kernels())
            try:
                row.params.append(policy.param_vector(a))
            except PolicyError as exc:
                raise ValidateError(str(exc)) from None
        row.scale_params = row.params[comp[0]]

    def _wo(self, layer: int) -> np.ndarray:
        """The model's W_O of ``layer`` (for policies that read it), read once per batch."""
        from traces.recorder import output_projection

        if layer not in self._wo_cache:
            wo = output_projection(self.model, layer)
            if wo is None:
                raise ValidateError(f"{type(self.model).__name__} has no self_attn.o_proj in layer {layer}: a policy "
                                    "that reads W_O cannot run on it")
            self._wo_cache[layer] = wo
        return self._wo_cache[layer]


    def _prefill(self, P: int) -> None:
        """Each row's prefill selector on its prompt's q/k/v (none: keep all), then the kept tokens loaded, one
        layer at a time (a layer's prompt is read as float32 only while that layer is loaded)."""
        H, B = self.n_kv, len(self.rows)
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
                    q, k, v = (self._prompt(a, layer, u) for a in (self.prompt_q, self.prompt_k, self.prompt_v))
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
                    src = self._prompt(self.prompt_k, layer, u, lo), self._prompt(self.prompt_v, layer, u, lo)
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
                    src = self.prompt_k[layer], self.prompt_v[layer]
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


def run_batch(model, jobs: Sequence[BatchJob], *, backend: str = "torch", max_rows: int = 64,
              on_result=None, **kwargs) -> list[RunResult]:
    """Run ``jobs`` closed-loop, batched: jobs that agree on streaming, prompt length, predictions and prompt
    chunk go through the model together (at most ``max_rows`` rows at a time). Results in job order; ``on_result(i,
    result)`` is called as each batch finishes (progress output). kwargs go to `BatchRunner`."""
    jobs = list(jobs)
    groups: dict[tuple, list[int]] = {}
    for i, j in enumerate(jobs):
        groups.setdefault(j.batch_key, []).append(i)
    kwargs.setdefault("prompt_memo", {})      # a prompt's captures serve every batch it appears in
    out: list[RunResult | None] = [None] * len(jobs)
    for idx in groups.values():
        idx.sort(key=lambda i: jobs[i].budget)   # similar budgets together: longer shared fast-forward
        for chunk in _budget_tiers(idx, [jobs[i].budget for i in idx], max_rows):
            res = BatchRunner(model, [jobs[i] for i in chunk], backend=backend, **kwargs).run()
            for i, r in zip(chunk, res):
                out[i] = r
                if on_result is not None:
                    on_result(i, r)
    return out  # type: ignore[return-value]


def _budget_tiers(idx: list[int], budgets: list[int], max_rows: int, spread: float = 2.0) -> list[list[int]]:
    """``idx`` (sorted by budget) cut into batches of at most ``max_rows`` rows whose budgets lie within a factor
    ``spread`` of the batch's smallest: every head of a batch is padded to the batch's largest cache, so budgets 128
    and 2 048 in one batch would make the 128-slot rows attend over 2 048 padded slots at every step."""
    out: list[list[int]] = []
    smallest = 0
    for i, b in zip(idx, budgets):
        if out and len(out[-1]) < max_rows and b <= spread * max(1, smallest):
            out[-1].append(i)
        else:
            out.append([i])
            smallest = b
    return out


class CompressedRunner:
    """Runs one model with ``policy`` at ``budget`` slots per KV head and layer: a batch of one row."""

    def __init__(self, model, policy: Policy, budget: int, *, backend: str = "torch", open_loop: bool = False,
                 record_kept: tuple[int, int] | None = None, cache_dtype: torch.dtype | None = None,
                 keep_logits: bool = False, sliding: str = "keep", chunk: int = 1) -> None:
        check_run_args(policy, budget, backend)
        self.model, self.policy, self.budget, self.backend = model, policy, int(budget), backend
        self.chunk = chunk
        self.kwargs = dict(open_loop=open_loop, record_kept=record_kept, cache_dtype=cache_dtype,
                           keep_logits=keep_logits, sliding=sliding)

    def run(self, prompt_ids: Sequence[int], *, continuation: Sequence[int] | None = None,
            n_generate: int = 0) -> RunResult:
        """Prompt, then teacher-forced decoding of ``continuation`` (NLL of each token) or ``n_generate`` greedy
        tokens. Prediction 0 comes from the prompt's last position, prediction r from decode position P+r-1."""
        job = BatchJob(self.policy, self.budget, list(prompt_ids), continuation, n_generate, chunk=self.chunk)
        return BatchRunner(self.model, [job], backend=self.backend, **self.kwargs).run()[0]


def forward_in_chunks(model, ids: torch.Tensor, chunk: int, keep) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Feed ``ids`` [B, T] through ``model`` ``chunk`` tokens per forward with the model's own KV cache between
    forwards (no layer builds a T x T mask or score matrix: bounded memory at long context), and yield (c0, c1,
    the logits of the chunk's last ``keep(c0, c1)`` positions) for each chunk [c0, c1); the LM head runs on those
    positions alone."""
    from traces.recorder import cache_keyword, returned_cache

    kw_name, past = cache_keyword(model), None
    for c0 in range(0, ids.shape[1], chunk):
        c1 = min(ids.shape[1], c0 + chunk)
        kw = {kw_name: past} if past is not None else {}
        out = model(input_ids=ids[:, c0:c1], use_cache=True, logits_to_keep=keep(c0, c1), **kw)
        past = returned_cache(out)
        yield c0, c1, out.logits


def full_model_logits(model, ids: Sequence[int], *, start: int = 0, chunk: int = PROMPT_CHUNK) -> np.ndarray:
    """Logits [T - start, V] of the unmodified model over ``ids`` at positions start .. T-1 (the full-cache
    reference), ``chunk`` tokens per forward (`forward_in_chunks`): one forward over 32 k tokens would need tens
    of GB (Gemma-3's 262 k-token vocabulary alone makes T x V logits 34 GB)."""
    ids = [int(x) for x in ids]
    if not 0 <= start < len(ids):
        raise ValidateError(f"start must be in [0, {len(ids)}) for {len(ids)} tokens, got {start}")

    x = torch.tensor([ids], device=next(model.parameters()).device)
    parts = []
    model.eval()
    with torch.no_grad():   # keep: the chunk's positions at or after start (at least one: the head needs a row)
        for c0, c1, logits in forward_in_chunks(model, x, chunk, lambda c0, c1: max(1, c1 - max(start, c0))):
            if c1 > start:
                parts.append(logits[0, -(c1 - max(start, c0)):].float().cpu().numpy())
    return np.concatenate(parts)
