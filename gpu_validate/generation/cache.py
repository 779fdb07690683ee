"""`KVSimCache`: the cache transformers' ``generate()`` (or a plain forward loop) sees, whose memory is kvsim's
per-head variable-length caches, run by any registered policy spec.

Why the attention is routed and the `transformers.Cache` only counts: a `Cache` is handed a layer's new keys and
values (``update``) and must return the [B, H, T, d] tensors the model then attends over. kvsim's caches hold a
different number of slots per KV head (Ada-KV allocations, per-head evictions), which no [B, H, T, d] tensor
carries without padding and masks, and its policies step on each decode step's attention probabilities over the
retained slots, which the model's attention never returns. So, as in the closed-loop runner, the model's
attention is routed to kvsim (`traces.hf.routing`): ``update`` passes the new token's k/v through, and the
routed attention appends them to the layer's varlen cache, attends over the retained slots and runs the policy's
numba ``step`` -- the very function the simulator replays -- which evicts (and frees) slots. ``get_seq_length``
and ``get_mask_sizes`` report the tokens seen, so ``generate`` computes positions and masks as for its own cache.

The work is the evaluation runner's, not a copy of it: each prompt length's rows are one
`gpu_validate.closedloop.batch_runner.BatchRunner`, whose prompt phase (`BatchRunner.start`: its own prompt forward, the
policy's prefill selector or the streamed prompt, ``prefill_chunk`` tokens per step) gives the first prediction,
and whose routed attention serves every decode step. Greedy decoding through ``generate`` therefore gives the
runner's closed loop token for token, and the `full` policy the model's own ``generate``. Backends as the runner:
the torch one on the CPU, the Triton `VarlenKVCache` on CUDA.

A batch of prompts of different lengths (``generate``'s left padding): each row's prompt is unpadded, rows of one length
share a runner (one batch of its caches, as ``run_batch``) and a decode step's attention call is split among the runners
by row, one slice per runner and layer (never per head). Each row is its run alone. `gpu_validate.generation.hooks`
sends the prompt call here instead of to the model. With one runner (every prompt of one length) a decode step is the
runner's own (`BatchRunner.decode_logits`: the forward as a CUDA graph's replay where one serves, then every layer's
policy step in one host round trip); with several, ``generate``'s forward over all rows, each runner's policy steps
after it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from gpu_validate.closedloop.batch_runner import BatchRunner
from gpu_validate.closedloop.jobs import BatchJob, check_run_args
from gpu_validate.validate_error import ValidateError
from policies.core.base import Policy
from sim.experiments.specs import parse_policy
from traces.hf.geometry import model_shape

UNSUPPORTED = ("beam search, assisted decoding, several sequences per prompt and cache reuse need to copy, "
               "reorder or crop a cache; kvsim's evicts and cannot")


def _elem(group: "_Group") -> int:
    """Bytes of one cached element of the group's caches."""
    return torch.empty((), dtype=group.runner.cache_dtype).element_size()


@dataclass
class _Group:
    """One runner and the ``generate`` batch rows it holds (ascending), all with prompts of ``prompt_len``."""

    runner: BatchRunner
    rows: torch.Tensor
    prompt_len: int


class _CountingLayer(CacheLayerMixin):
    """A layer as transformers sees it: no tensors (the routed attention holds them), the owner's token count."""

    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "KVSimCache") -> None:
        super().__init__()
        self.owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.owner.update(key_states, value_states, -1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise ValidateError(UNSUPPORTED)


class KVSimCache(Cache):
    """A policy-compressed KV cache for one ``generate()`` call (or one forward loop) of ``model``.

    ``policy``: a spec (``"decoding(snapkv, every=8)"``) or a `Policy`; ``budget``: slots per KV head and layer
    (None only for an unbounded policy such as ``full``); ``max_new_tokens``: the tokens the call generates (the
    caches of an unbounded policy are sized for them). ``backend`` None: triton on CUDA, torch elsewhere.
    ``sliding``/``prefill_chunk``/``cache_dtype``/``open_loop``/``record_kept``/``cuda_graphs``/
    ``steps_after_forward``: as `BatchRunner` and `BatchJob`.

    Works only inside `gpu_validate.generation.hooks.kvsim_cache`, which routes the model's attention here.
    """

    def __init__(self, model, policy: Policy | str, budget: int | None = None, *, max_new_tokens: int,
                 backend: str | None = None, sliding: str = "keep", prefill_chunk: int = 1,
                 cache_dtype: torch.dtype | None = None, open_loop: bool = False,
                 record_kept: tuple[int, int] | None = None, cuda_graphs: bool = True,
                 steps_after_forward: bool = True) -> None:
        self.model = model
        self.policy = parse_policy(policy) if isinstance(policy, str) else policy
        shape = model_shape(model)
        self.n_layers, self.n_kv, self.head_dim = shape.n_layers, shape.n_kv_heads, shape.head_dim
        super().__init__(layers=[_CountingLayer(self) for _ in range(self.n_layers)])
        self.device = next(model.parameters()).device
        self.backend = backend or ("triton" if self.device.type == "cuda" else "torch")
        if budget is None and not self.policy.unbounded:
            raise ValidateError(f"policy {self.policy.label()} needs a budget (slots per KV head and layer)")
        if max_new_tokens < 1:
            raise ValidateError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_run_args(self.policy, 1 if budget is None else budget, self.backend)
        self.budget, self.max_new_tokens, self.prefill_chunk = budget, int(max_new_tokens), int(prefill_chunk)
        self.options = dict(backend=self.backend, sliding=sliding, cache_dtype=cache_dtype, open_loop=open_loop,
                            record_kept=record_kept, cuda_graphs=cuda_graphs, steps_after_forward=steps_after_forward)
        self.groups: list[_Group] = []
        self.active = False          # set while `kvsim_cache` routes the model's attention here
        self.seen = 0                # tokens per row transformers counts (left padding included)
        self.steps = 0               # decode steps taken
        self.decode_seconds = 0.0    # wall time of the decode forwards
        self._prompt_lens: torch.Tensor | None = None
        self._t0 = 0.0

    # ----- what transformers calls -----
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The new tokens' k/v, passed through to the routed attention (which caches them)."""
        if not self.active:
            raise ValidateError("a KVSimCache works inside `with kvsim_cache(model, ...)` only: that block routes "
                                "the model's attention to it")
        return key_states, value_states

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValidateError(UNSUPPORTED)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValidateError(UNSUPPORTED)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValidateError(UNSUPPORTED)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValidateError(UNSUPPORTED)

    # ----- the prompt, the decode steps and their attention (called by `hooks`) -----
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Run the (left-padded) prompt batch: each length's rows through their runner's prompt phase. Returns the
        logits [B, V] after each row's prompt, float32."""
        if self.groups:
            raise ValidateError("a KVSimCache takes one prompt batch; make a new one for the next generate() call")
        B, T = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device).long()
        lens = mask.sum(1)
        left_padded = (torch.arange(T, device=mask.device) + 1 - (T - lens)[:, None]).clamp(min=0)  # its cumsum
        if mask.shape != input_ids.shape or not torch.equal(mask.cumsum(1), left_padded):
            raise ValidateError("prompts must be left-padded (attention_mask 0 ... 0 1 ... 1), as generate() pads them")
        by_len: dict[int, list[int]] = {}
        for b, n in enumerate(lens.tolist()):
            by_len.setdefault(int(n), []).append(b)
        logits = None
        for P, rows in sorted(by_len.items()):
            budget = self.budget if self.budget is not None else P + self.max_new_tokens - 1
            jobs = [BatchJob(self.policy, budget, input_ids[b, T - P:].tolist(), n_generate=self.max_new_tokens,
                             chunk=self.prefill_chunk) for b in rows]
            runner = BatchRunner(self.model, jobs, **self.options)
            last = runner.start()
            runner.capture = None        # the prompt's captured q/k/v: read by the prompt phase only, freed here
            if logits is None:
                logits = last.new_empty((B, last.shape[-1]))
            idx = torch.tensor(rows, device=self.device)
            logits[idx] = last
            self.groups.append(_Group(runner, idx, P))
        self._prompt_lens = lens.to(self.device, torch.int64)
        self.seen = T
        return logits

    def decode(self, input_ids: torch.Tensor, hf_forward) -> Any:
        """One decode forward of one token per row, timed: with one runner (every prompt of one length) its own
        decode step (`BatchRunner.decode_logits`: a CUDA graph's replay where one serves, then the policy steps of
        every layer in one host round trip); with several, the model's forward over all rows (``hf_forward(
        position_ids)``: its attention calls split among the runners by row), then each runner's policy steps.
        Returns the model output ``generate`` reads."""
        if not self.groups:
            raise ValidateError("the first forward through a KVSimCache must be the prompt")
        if input_ids.shape[1] != 1:
            raise ValidateError(f"after the prompt a KVSimCache takes one token per row per forward, got "
                                f"{input_ids.shape[1]}")
        if self.steps >= self.max_new_tokens - 1:
            raise ValidateError(f"this KVSimCache was made for max_new_tokens={self.max_new_tokens}")
        self._sync()
        t0 = time.perf_counter()
        if len(self.groups) == 1:
            g = self.groups[0]
            out = model_output(self, g.runner.decode_logits(input_ids, g.prompt_len + self.steps))
        else:
            for g in self.groups:
                g.runner.t = g.prompt_len + self.steps
            out = hf_forward((self._prompt_lens + self.steps)[:, None])
            for g in self.groups:
                g.runner.finish_step()
        self._sync()
        self.decode_seconds += time.perf_counter() - t0
        self.steps += 1
        self.seen += 1
        return out

    def run_info(self) -> dict:
        """How the decode steps ran (the first runner's: CUDA graph or eager and why, round trips, host seconds)."""
        return self.groups[0].runner.run_info() if self.groups else {}

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        """A decode step's routed attention call of one layer ([B, Hq, 1, d]), split among the runners by row."""
        if not self.groups:
            raise ValidateError("the first forward through a KVSimCache must be the prompt")
        if len(self.groups) == 1:
            return self.groups[0].runner.attention(module, query, key, value, None, **kwargs)
        out = query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))
        for g in self.groups:
            out[g.rows] = g.runner.attention(module, query[g.rows], key[g.rows], value[g.rows], None, **kwargs)[0]
        return out, None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ----- what it holds -----
    def _rows(self):
        """(generate row, its group, its runner row) of every row."""
        for g in self.groups:
            for j, b in enumerate(g.rows.tolist()):
                yield b, g, g.runner.rows[j]

    def kv_bytes_held(self) -> list[int]:
        """K+V bytes each row's caches hold now: its retained slots over every layer (a kept sliding layer's
        window included), at the cache's dtype."""
        out = [0] * sum(len(g.rows) for g in self.groups)
        for b, g, row in self._rows():
            out[b] = int(row.held.sum()) * 2 * self.head_dim * _elem(g)
        return out

    def kv_bytes_full_cache(self) -> list[int]:
        """K+V bytes an uncompressed cache would hold for each row's tokens: every token in every layer (as
        `gpu_validate.closedloop.model_metrics.full_cache_bytes`), at the same dtype."""
        out = [0] * sum(len(g.rows) for g in self.groups)
        for b, g, _ in self._rows():
            out[b] = (g.prompt_len + self.steps) * self.n_layers * self.n_kv * 2 * self.head_dim * _elem(g)
        return out

    def budgets(self, b: int):
        """Row b's slots per layer and KV head ([L, Hkv] int64: the policy's allocation, a kept window's size)."""
        return next(row.budgets for r, _, row in self._rows() if r == b)

    def kept(self, b: int):
        """Row b's kept positions after the steps of ``record_kept`` ([L, n, Hkv, W], -1 padded), as
        `gpu_validate.closedloop.jobs.RunResult.kept`."""
        return next(row.kept for r, _, row in self._rows() if r == b)


def model_output(cache: KVSimCache, logits: torch.Tensor):
    """A forward's output as ``generate`` reads it: the logits [B, 1, V] and the cache, under the name the installed
    transformers gives it."""
    name = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    return CausalLMOutputWithPast(logits=logits[:, None, :], **{name: cache})
