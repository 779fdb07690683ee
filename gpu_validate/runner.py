"""Closed-loop runner: an HF decoder model whose attention runs over a policy-compressed varlen KV cache.

The model's attention modules are routed (transformers' AttentionInterface, as the recorder does) to this
runner. The prompt runs once with the model's own causal attention (its q/k/v are kept for the policy's
allocator and prefill selector); then every token is fed alone: its k/v are appended to each layer's
`VarlenKVCache`, the query attends over the retained slots (Triton kernel or torch reference), the per-slot
probabilities go to the policy's jitted ``step`` -- the very function the simulator replays -- and its keep
mask / merges are applied with the compaction kernel. Policies without a prefill selector get the prompt
streamed token by token through the compressed cache, exactly as the replay engine does.

RoPE: keys are cached *post-RoPE* at their original positions (what the model hands the attention function),
so an eviction never re-rotates the survivors; this is also what the recorder stores and the simulator
replays. The query of step t is rotated at position t, so relative offsets to every kept key are exact.
BUZZ-style log-n scaling: ``logit_scale(params, t + 1)`` multiplies the scaled logits of step t.

``open_loop=True`` is for fidelity checks: the model's output uses the full cache (so every layer's q/k/v
equal a trace recorded from the same model and text), while the compressed cache and the policy run
alongside on the kernel's probabilities; kept sets can then be compared slot for slot with the simulator.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from gpu_validate.backends import BACKENDS, make_cache
from policies.base import Policy, PolicyError
from sim.contract import check_allocation, check_kept, check_scale, check_step, raise_on, slot_capacity

IMPL_NAME = "kvsim_validate"
_ACTIVE: list["CompressedRunner"] = []


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
        raise ValidateError("GPT-2 variants with scale_attn_by_inverse_layer_idx/reorder_and_upcast_attn are not supported")
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


class CompressedRunner:
    """Runs one model with ``policy`` at ``budget`` slots per KV head and layer over varlen caches."""

    def __init__(self, model, policy: Policy, budget: int, *, backend: str = "torch", open_loop: bool = False,
                 record_kept: tuple[int, int] | None = None, cache_dtype: torch.dtype | None = None,
                 keep_logits: bool = False) -> None:
        check_run_args(policy, budget, backend)
        self.model, self.policy, self.budget, self.backend = model, policy, int(budget), backend
        self.open_loop, self.record_kept, self.keep_logits = open_loop, record_kept, keep_logits
        self.n_layers, self.n_q, self.n_kv, self.head_dim = model_geometry(model)
        self.group = self.n_q // self.n_kv
        self.device = next(model.parameters()).device
        self.cache_dtype = cache_dtype or next(model.parameters()).dtype
        self.step_fn, self.prefill_fn, self.scale_fn = policy.kernels()
        self.params = policy.param_vector()
        self.mode = "prompt"
        self.scale: float | None = None

    # ----- attention entry point (called by every attention module) -----
    def attention(self, module, query, key, value, attention_mask, **kwargs):
        layer = _layer_idx(module)
        scaling = kwargs.get("scaling")
        scaling = float(scaling if scaling is not None else getattr(module, "scaling", query.shape[-1] ** -0.5))
        if self.scale is None:
            self.scale = scaling
        elif abs(self.scale - scaling) > 1e-12 * abs(scaling):
            raise ValidateError(f"layer {layer} uses softmax scale {scaling}, another layer {self.scale}")
        if query.shape[0] != 1:
            raise ValidateError(f"the runner supports batch size 1, got {query.shape[0]}")
        if self.mode == "prompt":
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            kwargs.setdefault("dropout", 0.0)
            out, w = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
            self.prompt_q[layer] = query[0].transpose(0, 1).float().cpu().numpy()   # [P, Hq, d]
            self.prompt_k[layer] = key[0].transpose(0, 1).float().cpu().numpy()     # [P, Hkv, d]
            self.prompt_v[layer] = value[0].transpose(0, 1).float().cpu().numpy()
            if self.open_loop:
                self.dense[layer] = [key, value]
            return out, w
        if query.shape[2] != 1 or key.shape[2] != 1:
            raise ValidateError("decode steps feed one token at a time (no HF KV cache)")
        return self._decode_attention(layer, query, key, value), None

    def _decode_attention(self, layer: int, query, key, value) -> torch.Tensor:
        t = self.t
        cache = self.caches[layer]
        cache.append(key.to(self.cache_dtype), value.to(self.cache_dtype),
                     positions=torch.tensor([[t]], device=self.device))
        mult = float(self.scale_fn(self.params, t + 1))
        info = np.zeros(3, np.int64)
        raise_on(self.policy, check_scale(mult, t, info), info, layer)
        o, _ = cache.attend(query[:, :, 0, :].to(self.cache_dtype), logit_scale=mult,
                            update_acc=False, update_ema=False)
        self._policy_step(layer, t, cache)
        if self.open_loop:
            dk, dv = self.dense[layer]
            dk, dv = torch.cat([dk, key], 2), torch.cat([dv, value], 2)
            self.dense[layer] = [dk, dv]
            rep = self.group
            kk = dk.repeat_interleave(rep, dim=1) if rep > 1 else dk
            vv = dv.repeat_interleave(rep, dim=1) if rep > 1 else dv
            o = torch.nn.functional.scaled_dot_product_attention(query, kk, vv, scale=self.scale)[:, :, 0]
        return o.to(query.dtype).reshape(1, 1, self.n_q, self.head_dim)

    # ----- the policy step on host arrays, as sim/engine.py calls it -----
    def _policy_step(self, layer: int, t: int, cache) -> None:
        lengths = cache.length.cpu().numpy().astype(np.int64)
        probs = np.ascontiguousarray(cache.padded(cache.probs).transpose(1, 2).double().cpu().numpy())
        keys = np.ascontiguousarray(cache.padded(cache.k).float().cpu().numpy())
        values = np.ascontiguousarray(cache.padded(cache.v).float().cpu().numpy())
        pos = np.ascontiguousarray(cache.padded(cache.positions, -1).cpu().numpy())
        sst, hst = self.slot_state[layer], self.head_state[layer]
        cap = sst.shape[1]
        sst[np.arange(self.n_kv), lengths - 1] = 0.0   # the new slot starts with zero state
        keep = np.ones((self.n_kv, cap), np.uint8)
        merge_to = np.full((self.n_kv, cap), -1, np.int64)
        merge_w = np.ones((self.n_kv, cap), np.float64)
        budget = self.budgets[layer]
        self.step_fn(self.params, layer, t, budget, lengths, probs, keys, values, pos, sst, hst, keep, merge_to,
                     merge_w)
        valid = np.arange(cap)[None, :] < lengths[:, None]
        keep &= valid.astype(np.uint8)
        kept_n = keep.sum(1).astype(np.int64)
        info = np.zeros(3, np.int64)
        raise_on(self.policy, check_step(lengths, keep, merge_to, budget, self.policy.head_adaptive,
                                         not self.policy.unbounded, t, info), info, layer)
        merging = bool((merge_to[valid] >= 0).any())
        if (kept_n < lengths).any():
            total = cache.total_capacity
            flat_keep = np.zeros(total, np.uint8)
            flat_mt = np.full(total, -1, np.int32)
            flat_mw = np.ones(total, np.float32)
            for h in range(self.n_kv):
                s0, n = self.starts[layer][h], lengths[h]
                flat_keep[s0:s0 + n] = keep[h, :n]
                flat_mt[s0:s0 + n] = merge_to[h, :n]
                flat_mw[s0:s0 + n] = merge_w[h, :n]
            dev = self.device
            cache.compact(torch.from_numpy(flat_keep).to(dev),
                          torch.from_numpy(flat_mt).to(dev) if merging else None,
                          torch.from_numpy(flat_mw).to(dev) if merging else None)
            for h in range(self.n_kv):
                idx = np.flatnonzero(keep[h])
                sst[h, :idx.size] = sst[h, idx]
                sst[h, idx.size:] = 0.0
                pos[h, :idx.size] = pos[h, idx]
                pos[h, idx.size:] = -1
        self.held[layer] = int(kept_n.sum())
        if self.kept is not None:
            r = t - self.record_kept[0]
            if 0 <= r < self.kept.shape[1]:
                self.kept[layer, r, :, :cap] = pos

    # ----- setup -----
    def _forward(self, token: int, t: int):
        self.t = t
        ids = torch.tensor([[token]], device=self.device)
        out = self.model(input_ids=ids, position_ids=torch.tensor([[t]], device=self.device), use_cache=False)
        return out.logits[0, -1].float()

    def run(self, prompt_ids: Sequence[int], *, continuation: Sequence[int] | None = None,
            n_generate: int = 0) -> RunResult:
        """Prompt, then teacher-forced decoding of ``continuation`` (NLL of each token) or ``n_generate`` greedy
        tokens. Prediction 0 comes from the prompt's last position, prediction r from decode position P+r-1."""
        prompt = [int(x) for x in prompt_ids]
        P = len(prompt)
        cont = None if continuation is None else [int(x) for x in continuation]
        n_pred = len(cont) if cont is not None else int(n_generate)
        if P < 1 or n_pred < 1:
            raise ValidateError(f"need a prompt of >= 1 token and >= 1 token to predict, got {P} and {n_pred}")
        max_pos = getattr(self.model.config, "max_position_embeddings", None) or getattr(
            self.model.config, "n_positions", None)
        if max_pos and P + n_pred - 1 > max_pos:
            raise ValidateError(f"{P + n_pred - 1} positions exceed the model's context of {max_pos}")
        n_total = P + n_pred - 1   # tokens the cache will have seen after the last decode step
        self.prompt_q, self.prompt_k, self.prompt_v, self.dense = {}, {}, {}, {}
        self.scale = None
        self.mode = "prompt"
        self.model.eval()
        with torch.no_grad(), routed(self.model, self):
            out = self.model(input_ids=torch.tensor([prompt], device=self.device), use_cache=False)
            last = out.logits[0, -1].float()
            if len(self.prompt_q) != self.n_layers:
                raise ValidateError(f"only {len(self.prompt_q)} of {self.n_layers} layers called the attention "
                                    "interface; this model is not supported")
            layers = [(self.prompt_q[l], self.prompt_k[l]) for l in range(self.n_layers)]
            budgets = check_allocation(self.policy, self.policy.allocate(self.budget, self.n_kv, layers, self.scale),
                                       self.n_layers, self.n_kv)
            self.budgets = budgets
            caps = np.stack([slot_capacity(self.policy, b, n_total) for b in budgets])
            self.caches = [make_cache(self.backend, batch=1, n_kv_heads=self.n_kv, n_q_heads=self.n_q,
                                      head_dim=self.head_dim, capacity=caps[l].tolist(), dtype=self.cache_dtype,
                                      device=self.device, softmax_scale=self.scale, track_acc=False)
                           for l in range(self.n_layers)]
            self.starts = [c.start.cpu().numpy().astype(np.int64) for c in self.caches]
            width = int(caps.max())
            self.slot_state = [np.zeros((self.n_kv, int(caps[l].max()), self.policy.slot_fields))
                               for l in range(self.n_layers)]
            self.head_state = [np.zeros((self.n_kv, self.policy.head_fields)) for _ in range(self.n_layers)]
            self.held = [0] * self.n_layers
            self.kept = None
            if self.record_kept:
                self.kept = np.full((self.n_layers, self.record_kept[1], self.n_kv, width), -1, np.int32)
            self.mode = "decode"
            # an unscaled full cache keeps the prompt as the model computed it: no need to stream it
            if self.policy.has_prefill or (self.policy.unbounded and self.policy.logit_scale_fn is None):
                self._prefill(P)
            else:
                for l, (dk, dv) in self.dense.items():   # the prompt is streamed again: start the dense copy empty
                    self.dense[l] = [dk[:, :, :0], dv[:, :, :0]]
                for t, tok in enumerate(prompt):
                    last = self._forward(tok, t)
            preds, nlls, generated, kv_bytes = [last], [], [], []
            elem = torch.empty((), dtype=self.cache_dtype).element_size()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for r in range(n_pred - 1):
                tok = cont[r] if cont is not None else int(preds[-1].argmax())
                generated.append(tok)
                preds.append(self._forward(tok, P + r))
                kv_bytes.append(sum(self.held) * 2 * self.head_dim * elem)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            if cont is None:
                generated.append(int(preds[-1].argmax()))
            logits = torch.stack(preds)
            if cont is not None:
                logp = torch.log_softmax(logits, -1)
                nlls = (-logp.gather(1, torch.tensor(cont, device=logits.device)[:, None])[:, 0]).cpu().numpy()
        return RunResult(
            positions=np.arange(P - 1, P - 1 + n_pred), top1=logits.argmax(-1).cpu().numpy(),
            nll=None if cont is None else np.asarray(nlls, np.float64), generated=generated,
            kv_bytes=np.asarray(kv_bytes, np.float64), decode_seconds=seconds, n_decode_steps=n_pred - 1,
            budgets=budgets, kept=self.kept,
            kept_steps=None if self.kept is None else np.arange(self.record_kept[0],
                                                                  self.record_kept[0] + self.record_kept[1]),
            logits=logits.cpu().numpy() if self.keep_logits else None, extra={"cache_elem_bytes": elem})

    def _prefill(self, P: int) -> None:
        """The policy's prefill selector on the prompt's q/k/v (none: keep all), then the kept tokens loaded."""
        for layer in range(self.n_layers):
            q = np.ascontiguousarray(self.prompt_q[layer], np.float32)
            k = np.ascontiguousarray(self.prompt_k[layer], np.float32)
            v = np.ascontiguousarray(self.prompt_v[layer], np.float32)
            keep = np.ones((self.n_kv, P), np.uint8)
            pst = np.zeros((self.n_kv, P, self.policy.slot_fields))
            budget = self.budgets[layer]
            if self.policy.has_prefill:
                self.prefill_fn(self.params, layer, budget, q, k, v, float(self.scale), keep, pst, self.head_state[layer])
            kept_n = keep.sum(1).astype(np.int64)
            info = np.zeros(3, np.int64)
            raise_on(self.policy, check_kept(kept_n, budget, self.policy.head_adaptive, not self.policy.unbounded, -1,
                                             info), info, layer)
            dev = self.device
            kt = torch.from_numpy(k).to(dev).transpose(0, 1)[None]
            vt = torch.from_numpy(v).to(dev).transpose(0, 1)[None]
            self.caches[layer].prefill(kt, vt, torch.from_numpy(keep).to(dev).bool()[None])
            sst = self.slot_state[layer]
            for h in range(self.n_kv):
                idx = np.flatnonzero(keep[h])
                sst[h, :idx.size] = pst[h, idx]
            self.held[layer] = int(kept_n.sum())


def full_model_logits(model, ids: Sequence[int]) -> np.ndarray:
    """Logits [T, V] of the unmodified model over ``ids`` in one causal forward (the full-cache reference)."""
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[int(x) for x in ids]], device=device), use_cache=False)
    return out.logits[0].float().cpu().numpy()
