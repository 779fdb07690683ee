"""Closed-loop runner: an HF decoder model whose attention runs over a policy-compressed varlen KV cache.

The model's attention modules are routed (transformers' AttentionInterface, the same mechanism the recorder uses:
`traces.hf.routing`) to this runner. The prompt runs once with the model's own causal attention, in chunks; of its q/k/v
each layer keeps, at the model's dtype and preallocated, only what the runs read (q on the layers the policies compress,
for their allocator and prefill selector; a kept sliding layer's k/v over its last window, unless a streamed prompt
needs them all: `gpu_validate.closedloop.prompt_store`): on Gemma-3 18 KB per prompt token (its 3 global layers), not
every layer's fp32 q/k/v twice over (parts, then concatenated). Then every token is fed alone: its k/v are appended to
each layer's cache, the query attends over the retained slots, the per-slot probabilities go to the policy's jitted
``step`` -- the very function the simulator replays -- and its keep mask / merges are applied. On a GPU the cache is the
Triton `VarlenKVCache` (compaction kernel); on the CPU it is `HostKVCache`, padded numpy arrays that the steps read as
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
``sliding="keep"`` (default, as in ``sim.replay.plan``) a sliding layer holds the model's own window (the
``window`` policy at budget window - 1, which is exactly it) and the row's policy compresses the global layers;
with ``sliding="compress"`` the policy runs on the sliding layers too, under their window
(``sim.replay.contract.apply_window``). Parameters that come from the layer (expected attention's RoPE base) are read
from the model's config per layer.

This module holds the entry points: `run_batch` (jobs grouped into batches) and `CompressedRunner` (one configuration).
Under them: `gpu_validate.closedloop.batch_runner` (the batched decode loop), `gpu_validate.closedloop.prompt_store`
(the prompt forward and its captures), `gpu_validate.closedloop.prompt_loading` (prefill and fast-forward),
`gpu_validate.closedloop.host_steps` (the jitted per-row work around a policy step),
`gpu_validate.closedloop.chunked_forward` (the full-cache reference logits) and `gpu_validate.closedloop.jobs` (jobs,
results, argument checks, `ValidateError`). Everything read of or done to the transformers model -- its geometry, each
layer's attention, W_O, attention routing, chunked and positioned forwards -- is the model adapter's, `traces.hf`
(shared with the recorder).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from gpu_validate.closedloop.batch_runner import BatchRunner
from gpu_validate.closedloop.jobs import BatchJob, RunResult, check_run_args
from policies.core.base import Policy
from traces.hf.geometry import model_shape


def run_batch(model, jobs: Sequence[BatchJob], *, backend: str = "torch", max_rows: int = 64,
              on_result=None, **kwargs) -> list[RunResult]:
    """Run ``jobs`` closed-loop, batched: jobs that agree on streaming, prompt length, predictions and prompt
    chunk go through the model together, cut by budget into batches of at most ``max_rows`` rows where a separate
    batch costs less than padding (`budget_batches`). Results in job order; ``on_result(i, result)`` is called as
    each batch finishes (progress output). kwargs go to `BatchRunner`."""
    jobs = list(jobs)
    groups: dict[tuple, list[int]] = {}
    for i, j in enumerate(jobs):
        groups.setdefault(j.batch_key, []).append(i)
    kwargs.setdefault("prompt_memo", {})      # a prompt's captures serve every batch it appears in
    batch_slots = batch_cost_in_slots(model) if len(jobs) > 1 else 0.0
    out: list[RunResult | None] = [None] * len(jobs)
    for idx in groups.values():
        idx.sort(key=lambda i: jobs[i].budget)   # similar budgets together: longer shared fast-forward
        for chunk in budget_batches(idx, [jobs[i].budget for i in idx], max_rows, batch_slots):
            res = BatchRunner(model, [jobs[i] for i in chunk], backend=backend, **kwargs).run()
            for i, r in zip(chunk, res):
                out[i] = r
                if on_result is not None:
                    on_result(i, r)
    return out  # type: ignore[return-value]


def batch_cost_in_slots(model) -> float:
    """How many cache slots of one row cost, per decode step, what starting one more batch costs: a decode step
    reads every weight of the model once per batch whatever its rows, and each row's attention reads the K and V
    of every slot it is padded to in every layer. Both are memory traffic, so the ratio of the weights' bytes to
    one slot's K/V bytes prices padding against batches on any device, to first order. On SmolLM2-135M (fp32) it
    is about 11 700 slots. On the CPU the fixed part dominates: 128 teacher-forced steps after a 512-token prompt
    took 18.7 s for 3 rows, 17.9 s for 12 and 23.6 s for 24 (observed attention at 112, two threads), so a
    recommendation's budgets 32-368 belong in one batch, not the four that a factor-2 rule cut them into."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shape = model_shape(model)
    item = next(model.parameters()).element_size()
    return weight_bytes / (2 * shape.n_layers * shape.n_kv_heads * shape.head_dim * item)


def budget_batches(idx: list[int], budgets: list[int], max_rows: int, batch_slots: float) -> list[list[int]]:
    """``idx`` (sorted by budget) cut into consecutive batches of at most ``max_rows`` rows at the least cost,
    where a batch costs ``batch_slots`` (`batch_cost_in_slots`) plus its rows times its largest budget (every row
    is padded to the batch's largest cache): so budgets 128 and 2 048 share a batch only when a batch's own cost
    outweighs padding the small rows to 2 048. Exact (dynamic programming over the cut points)."""
    n = len(idx)
    best = [0.0] + [np.inf] * n          # best[k]: the least cost of the first k rows
    cut = [0] * (n + 1)
    for k in range(1, n + 1):
        for j in range(max(0, k - max_rows), k):
            cost = best[j] + batch_slots + (k - j) * budgets[k - 1]
            if cost < best[k]:
                best[k], cut[k] = cost, j
    out, k = [], n
    while k:
        out.append(idx[cut[k]:k])
        k = cut[k]
    return out[::-1]


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
