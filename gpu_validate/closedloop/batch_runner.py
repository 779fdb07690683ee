"""`BatchRunner`: many closed-loop configurations decoded as one batch through the model.

The model's attention modules are routed to the runner (`traces.hf.routing`). The prompt runs once with the model's own
causal attention (`gpu_validate.closedloop.prompt_store`), then enters each row's compressed cache, prefilled or
streamed (`gpu_validate.closedloop.prompt_loading`). Then every token is fed alone: its k/v are appended to each layer's
cache and the query attends over the retained slots; after the forward the per-slot probabilities of every layer go to
the policies' jitted ``step`` -- the very function the simulator replays -- and their keep masks / merges are applied,
all layers in one host round trip (`gpu_validate.closedloop.decode_steps`). On a GPU the cache is the Triton
`VarlenKVCache` (every layer a view of one set of buffers, one compaction per step) and the decode forward a CUDA
graph's replay (`gpu_validate.closedloop.decode_graph`); on the CPU it is `HostKVCache`, padded numpy arrays that the
steps read as views and compact in place (numba), with torch's attention arithmetic. The module docstring of
`gpu_validate.closedloop.runner` tells the semantics (RoPE, logit scaling, open loop, hybrid models). What is read of
the model and done to it (geometry, each layer's attention, W_O, routing, forwards) is the model adapter's, `traces.hf`.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from gpu_validate.closedloop.decode_graph import DecodeGraph, GraphCaptureFailed
from gpu_validate.closedloop.decode_steps import DecodeSteps
from gpu_validate.closedloop.jobs import BatchJob, RunResult, check_run_args
from gpu_validate.closedloop.prompt_loading import PromptLoading
from gpu_validate.closedloop.prompt_store import PromptCapture, PromptLayers
from gpu_validate.kvcache.backends import HostKVCache, TorchVarlenKVCache, make_cache
from gpu_validate.kvcache.varlen_cache import layer_views
from gpu_validate.validate_error import ValidateError
from policies.core.base import Policy, PolicyError, compiled, unit_logit_scale
from policies.core.registry import get_policy
from sim.replay.contract import check_allocation, check_scale, raise_on, slot_capacity
from traces.hf.forward import forward_at, skinny_linears
from traces.hf.geometry import layer_attention, model_shape, output_projection
from traces.hf.routing import attention_call, routed


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


class BatchRunner(PromptLoading):
    """Runs many closed-loop configurations as one batch through the model.

    Every batch row is a (policy, budget, prompt) configuration with its own per-head varlen cache: one cache per layer
    holds all rows (``batch = rows``, capacities per row and KV head; `HostKVCache` on the CPU, `VarlenKVCache` on a
    device), so attention is one call per layer and the model's weight matmuls are shared by the rows. The policy step
    runs per row on that row's slice of the layer (all rows of a layer in one jitted call,
    `gpu_validate.closedloop.host_steps.step_layer`), exactly as a one-row run does, so a batch gives the results of
    running each configuration alone (tested). Work every row does identically is shared: each distinct prompt goes
    through the model once, and streamed prompts skip the model until the first eviction in any row (`_fast_forward`).
    Rows must agree on whether the prompt is streamed, on the prompt length, on the number of predictions and on the
    prompt chunk (`BatchJob.batch_key`; `run_batch` groups jobs that way).

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
                 keep_logits: bool = False, sliding: str = "keep", prompt_memo: dict | None = None,
                 steps_after_forward: bool = True, cuda_graphs: bool = True) -> None:
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
        self.shape = model_shape(model)
        self.n_layers, self.n_q, self.n_kv = self.shape.n_layers, self.shape.n_q_heads, self.shape.n_kv_heads
        self.head_dim, self.group = self.shape.head_dim, self.shape.group
        self.device = next(model.parameters()).device
        self.cache_dtype = cache_dtype or next(model.parameters()).dtype
        self.mode = "prompt"
        self.layer_scale: dict[int, float] = {}
        self.layer_window: dict[int, int | None] = {}
        self._wo_cache: dict[int, np.ndarray] = {}
        self.prompt_memo = prompt_memo
        #: True: every layer's policy step runs after the model's forward (one host round trip per decode step,
        #: `gpu_validate.closedloop.decode_steps`); False: each layer's right after its attention (the path before, kept
        #: to show the two agree and to time them side by side)
        self.steps_after_forward = steps_after_forward
        self.cuda_graphs = cuda_graphs
        self._pending: dict[int, np.ndarray | None] = {}
        self.graph: DecodeGraph | None = None

    # ----- attention entry point (called by every attention module) -----
    def attention(self, module, query, key, value, attention_mask, **kwargs):
        """The routed attention of one layer's call (`traces.hf.routing.routed`): the model's own during the prompt
        forward (captured), then attention over the rows' compressed caches."""
        call = attention_call(module, query, kwargs)
        layer = call.layer
        if self.mode == "prompt":
            return self.capture.attention(call, module, query, key, value, attention_mask, **kwargs)
        C = query.shape[2]
        if query.shape[0] != len(self.rows) or key.shape[2] != C or not 1 <= C <= self.chunk:
            raise ValidateError(f"decode steps feed one token (or a prompt chunk of {self.chunk}) per batch row at a "
                                "time (no HF KV cache)")
        return self._decode_attention(layer, query, key, value), None

    def _decode_attention(self, layer: int, query, key, value, *, extend_dense: bool = True) -> torch.Tensor:
        """Append the C new tokens one by one, each attending over the cache; the layer's policy step after the last
        is due (`finish_step`, or at once when ``steps_after_forward`` is off). Open loop, the output is the full
        cache's (a dense copy, extended by the new tokens)."""
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
                self.steps.check_append(layer, 1, t)
                pos = self._new_pos if C == 1 else torch.full((B, 1), t, device=self.device, dtype=torch.int64)
                cache.append(key[:, :, j:j + 1].to(self.cache_dtype), value[:, :, j:j + 1].to(self.cache_dtype),
                             positions=pos, check=False)
            mults = self._mults(t) if self.compressed[layer] else None   # a kept window is the model's own
            visible_from = t - window + 1 if window and C > 1 else None       # older chunk-mates' windows moved
            outs.append(self._attend(cache, query[:, :, j, :].to(self.cache_dtype), mults, visible_from))
            if C > 1:
                if self.host:
                    p = cache.p.numpy().astype(np.float64)
                else:
                    p = self._host_padded(layer, cache, cache.probs, 0.0).transpose(0, 2, 1).astype(np.float64)
                summed = p if summed is None else summed + p
        self._pending[layer] = summed
        self._due = (t0 + C - 1, C)
        if not self.steps_after_forward:
            self.finish_step()
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

    def finish_step(self) -> bool:
        """The policy steps due since the last call (every layer's, after a forward) at the step of the tokens
        appended last (`DecodeSteps.step`); True when some row evicted or merged a slot of a compressed layer."""
        if not self._pending:
            return False
        pending, self._pending = self._pending, {}
        t, n_new = self._due
        summed = {layer: p for layer, p in pending.items() if p is not None}
        return self.steps.step(sorted(pending), t, n_new, summed)

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
        x = x.detach()
        if x.dtype == torch.bfloat16:           # numpy has no bfloat16; every float reader upcasts anyway
            x = x.float()
        out = x.cpu().numpy()[self.slot_index[layer]]
        out[~(np.arange(cache.max_capacity)[None, :] < lengths[:, None])] = fill
        return out

    def _prompt_forward(self, prompts: list[tuple[int, ...]]) -> torch.Tensor:
        """The distinct prompts through the model, their q/k/v captured (`PromptCapture.forward`; every token's k/v
        when the prompt is streamed or the loop open); open loop, each row's dense copy of its prompt's k/v. Returns
        the logits after each distinct prompt's last token."""
        cap = self.capture
        last = cap.forward(prompts, self.device, bool(self.jobs[0].streams or self.open_loop))
        if self.open_loop:
            dev, dtype = self.device, next(self.model.parameters()).dtype
            self.dense = {layer: [a[layer].x.to(dev, dtype).transpose(1, 2)[self.prompt_of] for a in (cap.k, cap.v)]
                          for layer in cap.k}
        return last

    def _forward(self, tokens: Sequence[Sequence[int]], t: int, *, logits: bool = True):
        """Feed each row's tokens (one, or a prompt chunk) at positions t, t+1, ...; the logits after the last,
        or None with ``logits=False`` (streamed prompt tokens: their predictions are never read, so the LM head
        -- a fifth of SmolLM2's decode FLOPs -- is skipped by running only the decoder stack)."""
        ids = torch.tensor([[int(x) for x in row] for row in tokens], device=self.device)
        if logits and ids.shape[1] == 1:
            return self.decode_logits(ids, t)
        self.t = t
        if not self.host:
            self._new_pos.fill_(t)
        pos = (t + torch.arange(ids.shape[1], device=self.device, dtype=torch.int64))[None, :].expand(len(tokens), -1)
        out = forward_at(self.model, ids, pos, logits=logits)
        self.finish_step()
        return out

    def decode_logits(self, ids: torch.Tensor, t: int) -> torch.Tensor:
        """One decode step of every row: token ids [B, 1] at position t through the model (a CUDA graph's replay where
        one serves, `gpu_validate.closedloop.decode_graph`), then every layer's policy steps; the logits [B, V]
        float32."""
        self.t = t
        if self.graph is None:
            self.graph = DecodeGraph(lambda i, p: forward_at(self.model, i, p), self._graph_reason())
        if not self.host:
            self._new_pos.fill_(t)
        pos = torch.full((len(self.rows), 1), t, device=self.device, dtype=torch.int64)
        snap = self.steps.snapshot() if self.graph.capturing_next else None
        try:
            out = self.graph.logits(ids, pos, lambda: self.graph_bookkeeping(t))
        except GraphCaptureFailed:
            self.steps.restore(snap)
            self._pending = {}
            out = forward_at(self.model, ids, pos)
        self.finish_step()
        return out

    def graph_bookkeeping(self, t: int) -> None:
        """What a decode forward's Python does on the host per layer (a graph's replay runs none): each device
        layer's mirror gets the new slot, and every layer's step is due."""
        for layer in range(self.n_layers):
            self.steps.check_append(layer, 1, t)
            self._pending[layer] = None
        self._due = (t, 1)

    def _graph_reason(self) -> str | None:
        """Why the decode forward cannot be a CUDA graph, or None."""
        if not self.cuda_graphs:
            return "turned off (cuda_graphs=False)"
        if self.device.type != "cuda":
            return f"no CUDA device ({self.device.type})"
        if self.backend != "triton":
            return "the torch backend's attention gathers by masks (host syncs); the Triton cache replays"
        if self.open_loop:
            return "open loop: the dense reference copy grows every step"
        if self._scaled_rows:
            return "a row's attention-logit scale changes every step (BUZZ log n)"
        if not self.steps_after_forward:
            return "policy steps inside the forward (steps_after_forward=False)"
        return None

    def run_info(self) -> dict:
        """How the decode steps ran: CUDA graph or eager (and why), one host round trip per step or per layer,
        host seconds of the policy steps and where they went (`DecodeSteps.phase_seconds`)."""
        graph = self.graph.info() if self.graph else {"cuda_graph": False, "cuda_graph_fallback": "no decode step"}
        return {**graph, "host_round_trips": "per step" if self.steps_after_forward else "per layer",
                "host_step_seconds": self.steps.host_seconds, "host_phase_seconds": dict(self.steps.phase_seconds)}

    def _record(self, rows: list[_Row], logits: torch.Tensor, r: int) -> None:
        """Store prediction r of every row (argmax, NLL of the teacher-forced token, logits if asked)."""
        top1 = logits.argmax(-1).tolist()
        nll = None
        if rows[0].cont is not None:
            logp = torch.log_softmax(logits.float(), -1)     # bf16/fp16 logits: the NLL in fp32
            tgt = torch.tensor([row.cont[r] for row in rows], device=logits.device)
            nll = (-logp.gather(1, tgt[:, None])[:, 0]).double().cpu().numpy()
        for b, row in enumerate(rows):
            row.preds_top1.append(int(top1[b]))
            if nll is not None:
                row.nlls.append(float(nll[b]))
            if self.keep_logits:
                row.logits.append(logits[b].float().cpu())

    def start(self) -> torch.Tensor:
        """The prompt phase of every job: the prompt forward, the rows' caches set up, and the prompt prefilled or
        streamed into them; returns the logits [rows, V] after each row's prompt (its prediction 0). Afterwards the
        runner is in decode mode: a model forward routed to it (`traces.hf.routing.routed`) with one token per
        row at position ``self.t`` appends, attends and steps the policies (`run` feeds them; so does
        `gpu_validate.generation` for transformers' ``generate``)."""
        jobs = self.jobs
        P, n_pred, streams = len(jobs[0].prompt), jobs[0].n_pred, jobs[0].streams
        if P < 1 or n_pred < 1:
            raise ValidateError(f"need a prompt of >= 1 token and >= 1 token to predict, got {P} and {n_pred}")
        max_pos = self.shape.max_positions
        if max_pos and P + n_pred - 1 > max_pos:
            raise ValidateError(f"{P + n_pred - 1} positions exceed the model's context of {max_pos}")
        n_total = P + n_pred - 1   # tokens the cache will have seen after the last decode step
        rows = self.rows = [_Row(j, self.n_layers, self.n_kv) for j in jobs]
        prompts: dict[tuple[int, ...], int] = {}
        for row in rows:
            prompts.setdefault(tuple(row.prompt), len(prompts))
        self.prompt_of = torch.tensor([prompts[tuple(row.prompt)] for row in rows], device=self.device)
        self.dense = {}
        self.capture = PromptCapture(self.model, P, self.sliding, self.prompt_memo)
        self.layer_scale, self.layer_window = self.capture.scale, self.capture.window   # set by the prompt forward
        self.mode = "prompt"
        self.model.eval()
        with torch.no_grad(), routed(self.model, self.attention):
            last = self._prompt_forward(list(prompts))[self.prompt_of]
            if len(self.capture.k) != self.n_layers:
                raise ValidateError(f"only {len(self.capture.k)} of {self.n_layers} layers called the attention "
                                    "interface; this model is not supported")
            self._layer_attention()
            caps_all = self._setup_rows(n_total)
            self._make_caches(caps_all)
            self.mode = "decode"
            if not streams:
                self._prefill(P)
                if not self.host:
                    self.steps.sync_mirrors()
            else:
                t_model = self._fast_forward(P)
                for l, (dk, dv) in self.dense.items():   # the dense copy holds the tokens the cache has seen
                    self.dense[l] = [dk[:, :, :t_model], dv[:, :, :t_model]]
                for t in range(t_model, P, self.chunk):
                    stop = min(P, t + self.chunk)
                    last = self._forward([row.prompt[t:stop] for row in rows], t, logits=stop == P)
        return last

    def _setup_rows(self, n_total: int) -> np.ndarray:
        """Each row's policies, budgets and per-slot and per-head state sized for ``n_total`` tokens; returns the
        slot capacities [layers, rows, KV heads]."""
        caps = []
        for b, row in enumerate(self.rows):
            self._setup_row(row, int(self.prompt_of[b]), n_total)
            cap = np.stack([slot_capacity(p, b, n_total, self.chunk)
                            for p, b in zip(row.layer_policy, row.budgets)])
            caps.append(cap)
            row.slot_state = [np.zeros((self.n_kv, int(cap[l].max()), row.layer_policy[l].slot_fields))
                              for l in range(self.n_layers)]
            row.head_state = [self._head_state(row, l) for l in range(self.n_layers)]
            if self.record_kept:
                row.kept = np.full((self.n_layers, self.record_kept[1], self.n_kv, int(cap.max())), -1, np.int32)
        return np.stack(caps, 1)   # [L, B, Hkv]

    def _make_caches(self, caps_all: np.ndarray) -> None:
        """The varlen caches of every layer at capacities ``caps_all`` (host arrays for a float32 torch run on the
        CPU, else one device cache whose layers are views), and the decode steps that drive them."""
        rows = self.rows
        B = len(rows)
        self.host = (self._host_cache and self.backend == "torch" and self.device.type == "cpu"
                     and self.cache_dtype == torch.float32)
        layer_caps = [caps_all[l].reshape(-1).tolist() for l in range(self.n_layers)]
        common = dict(n_kv_heads=self.n_kv, n_q_heads=self.n_q, head_dim=self.head_dim, dtype=self.cache_dtype,
                      device=self.device, track_acc=False)
        if self.host:
            self.kv_group = None
            self.caches = [HostKVCache(batch=B, capacity=layer_caps[l], softmax_scale=self.layer_scale[l],
                                       **common) for l in range(self.n_layers)]
        else:                  # every layer's cache a view of one (`layer_views`): one compaction per step
            self.kv_group = make_cache(self.backend, batch=self.n_layers * B,
                                       capacity=[c for caps_l in layer_caps for c in caps_l], **common)
            self.caches = layer_views(self.kv_group, self.n_layers,
                                      [self.layer_scale[l] for l in range(self.n_layers)])
        self.slot_index = None if self.host else [c.slot_rows.cpu().numpy() for c in self.caches]
        self._probs_buf, self._mults_memo = {}, {}
        unit = compiled(unit_logit_scale)
        self._scaled_rows = [b for b, row in enumerate(rows) if row.scale_fn is not unit]
        self.reads_attention = any(row.policy.reads_attention for row in rows)
        self.layer_reads = [any(row.layer_policy[l].reads_attention for row in rows) for l in range(self.n_layers)]
        self.steps = DecodeSteps(self, caps_all)
        self._new_pos = None if self.host else torch.zeros((B, 1), dtype=torch.int64, device=self.device)

    def run(self) -> list[RunResult]:
        """Run every job of the batch; results in job order. On the CPU a batch of 2-4 rows multiplies by the
        weights the way the CPU's BLAS does fast for that shape (`traces.hf.forward.skinny_linears`)."""
        with skinny_linears(self.model):
            return self._run()

    def _run(self) -> list[RunResult]:
        last = self.start()
        rows, P, n_pred = self.rows, len(self.jobs[0].prompt), self.jobs[0].n_pred
        with torch.no_grad(), routed(self.model, self.attention):
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
                    row.kv_bytes.append(int(row.held.sum()) * 2 * self.head_dim * elem)
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
                extra={"cache_elem_bytes": elem, "batch_rows": len(rows), **self.run_info()}))
        return results

    def _layer_attention(self) -> None:
        """Each layer's attention as its prompt call ran it, and which layers the rows' policies compress."""
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
        comp = [l for l in range(self.n_layers) if self.compressed[l]]
        memo = self.prompt_memo
        cache = {} if memo is None else memo.setdefault(("allocate", u, tuple(comp)), {})
        layers = PromptLayers(self.capture, u, comp, cache)
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
        row.prompt_layers = layers

    def _head_state(self, row: _Row, layer: int) -> np.ndarray:
        """A row's initial head state of ``layer``: its policy's ``head_state_init`` (with W_O where it reads it),
        then, on a compressed layer, what the policy adds once the prompt is known (``prompt_head_state``)."""
        policy = row.layer_policy[layer]
        head = policy.head_state_init(self.n_kv, self.head_dim, self._wo(layer) if policy.needs_wo else None)
        if not self.compressed[layer]:
            return head
        try:
            return policy.prompt_head_state(head, row.prompt_layers, row.prompt_layers.layers.index(layer))
        except PolicyError as exc:
            raise ValidateError(str(exc)) from None

    def _wo(self, layer: int) -> np.ndarray:
        """The model's W_O of ``layer`` (for policies that read it), read once per batch."""
        if layer not in self._wo_cache:
            wo = output_projection(self.model, layer)
            if wo is None:
                raise ValidateError(f"{type(self.model).__name__} has no self_attn.o_proj in layer {layer}: a policy "
                                    "that reads W_O cannot run on it")
            self._wo_cache[layer] = wo
        return self._wo_cache[layer]
