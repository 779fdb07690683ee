"""The future-attention oracle's replay: exact, from the full attention rows, every budget of a curve in one pass
per layer (`sim.replay.oracle_kernels.oracle_layer`), and the positions it attends (`oracle_kept`).

It is the ``"oracle"`` replay strategy (`sim.replay.policy_replay.STRATEGIES`, `replay_oracle_policy`): the oracle has no step
kernel and reads no prompt steps, so it shares with the step replay only the plan (`sim.replay.plan`: budgets,
compressed layers, the slots other layers hold) and the result (`sim.replay.result.ReplayResult`).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

import numpy as np

from policies.core.base import Policy
from policies.core.registry import get_policy
from sim.replay.layer_inputs import LayerInputs, layer_inputs
from sim.replay.metrics import N_METRICS
from sim.replay.oracle_kernels import oracle_layer
from sim.replay.plan import check_budget, compressed_layers, held_elsewhere, replay_threads
from sim.replay.result import ReplayResult
from sim.replay.threads import blas_per_layer_thread
from traces.format import Trace

if TYPE_CHECKING:
    from sim.replay.layer_groups import LayerGroup


def replay_oracle_policy(trace: Trace, policy: Policy, budgets: Sequence[int], *,
                          inputs: list[LayerInputs] | None = None, record_kept: tuple[int, int] | None = None,
                          threads: int | None = None, sliding: str = "keep", chunk: int = 1,
                          group: LayerGroup | None = None) -> list[ReplayResult]:
    """The oracle strategy: its ``scope`` parameter is read here, and only here (the oracle reads no prompt
    steps, so ``chunk`` changes nothing)."""
    return replay_oracle(trace, budgets, scope=policy.params["scope"], inputs=inputs, threads=threads,
                         label=policy.label(), record_kept=record_kept, sliding=sliding,
                         layers=None if group is None else group.layers)


def replay_oracle(trace: Trace, budgets: Sequence[int], *, scope: str = "head",
                  inputs: list[LayerInputs] | None = None, threads: int | None = None,
                  label: str = "oracle", record_kept: tuple[int, int] | None = None,
                  sliding: str = "keep", layers: Sequence[int] | None = None) -> list[ReplayResult]:
    """The oracle at several budgets from one pass over the full attention rows (a budget curve).

    ``record_kept=(start, n)`` records, for steps start..start+n-1, the positions the oracle attends at that
    step: the newest token plus the top-``budget`` past tokens of each KV head (``scope='layer'``: the top
    ``budget * Hkv`` across the layer's heads), ranked as ``sim.replay.oracle_kernels.oracle_layer`` ranks them.
    ``layers``: only these of the compressed layers (a ``LayerGroup``'s: the oracle allocates nothing, so a
    group needs no other layer).
    """
    oracle = get_policy("oracle", scope=scope)
    for b in budgets:
        check_budget(trace, oracle, b)
    meta = trace.meta
    inputs = inputs if inputs is not None else layer_inputs(trace)
    layers = compressed_layers(trace, sliding) if layers is None else list(layers)
    T, P = meta.n_tokens, meta.n_prompt
    order = np.argsort(np.asarray(budgets, np.int64), kind="stable")
    sorted_b = np.ascontiguousarray(np.asarray(budgets, np.int64)[order])
    nb, hq, hkv = len(sorted_b), meta.model.n_q_heads, meta.model.n_kv_heads

    def run(layer: int) -> tuple[np.ndarray, np.ndarray]:
        li = inputs[layer]
        metrics = np.zeros((nb, T - P, hq, N_METRICS), np.float64)
        slots = np.zeros((nb, T - P, hkv), np.int32)
        oracle_layer(li.q, li.k, li.v, li.o, li.vmax1, float(li.attention.scale), sorted_b, P,
                     scope == "layer", int(li.attention.window or 0), metrics, slots)
        return metrics, slots

    n_threads = replay_threads(threads, len(layers))
    with blas_per_layer_thread(n_threads), ThreadPoolExecutor(n_threads) as pool:
        outs = list(pool.map(run, layers))
    rec_start, n_rec = record_kept if record_kept else (0, 0)
    n_rec = max(0, min(n_rec, T - rec_start))
    results: list[ReplayResult] = [None] * nb  # type: ignore[list-item]
    for j, b in enumerate(sorted_b):
        kept = None
        if n_rec:
            kept = np.stack([oracle_kept(inputs[i], int(b), rec_start, n_rec, scope == "layer") for i in layers])
        results[int(order[j])] = ReplayResult(
            trace=str(trace.path), policy="oracle", label=label, params={"scope": scope}, budget=int(b),
            budgets=np.full((len(layers), hkv), int(b), np.int64), steps=np.arange(P, T),
            metrics=np.stack([o[0][j] for o in outs]), slots=np.stack([o[1][j] for o in outs]),
            head_dim=meta.model.head_dim, kept=kept,
            kept_steps=np.arange(rec_start, rec_start + n_rec) if n_rec else None,
            layers=np.asarray(layers, np.int64), held_elsewhere=held_elsewhere(trace, layers), sliding=sliding)
    return results


def oracle_kept(li: LayerInputs, budget: int, start: int, n: int, layer_scope: bool) -> np.ndarray:
    """Positions the oracle attends at steps start..start+n-1 of one layer: [n, Hkv, width], -1 padded,
    ascending per head (the layout of ``ReplayResult.kept``); width = min(T, budget [* Hkv]) + 1.

    The ranking is the one ``oracle_layer`` uses: the float64 full-attention probability (of the layer's own,
    possibly windowed, attention) summed over a KV head's query heads, descending, ties to the older token
    (then the lower head, with ``layer_scope``).
    """
    scale, window = float(li.attention.scale), li.attention.window
    T, hq, _ = li.q.shape
    hkv = li.k.shape[1]
    g = hq // hkv
    width = min(T, budget * hkv if layer_scope else budget) + 1
    out = np.full((n, hkv, width), -1, np.int32)
    k64 = li.k.astype(np.float64)
    for r in range(n):
        t = start + r
        if t == 0:
            out[r, :, 0] = 0
            continue
        q = li.q[t].astype(np.float64).reshape(hkv, g, -1)
        logits = np.einsum("hgd,ihd->hgi", q, k64[: t + 1]) * scale
        if window:
            logits[:, :, : max(0, t + 1 - window)] = -np.inf
        p = np.exp(logits - logits.max(axis=2, keepdims=True))
        p /= p.sum(axis=2, keepdims=True)
        mass = p[:, :, :t].sum(axis=1)                                     # [Hkv, t] past tokens
        if layer_scope:
            top = np.argsort(-mass.reshape(-1), kind="stable")[: min(budget * hkv, hkv * t)]
            heads, pos = np.divmod(top, t)
        else:
            top = np.argsort(-mass, axis=1, kind="stable")[:, : min(budget, t)]
            heads, pos = np.repeat(np.arange(hkv), top.shape[1]), top.reshape(-1)
        for h in range(hkv):
            mine = np.sort(np.append(pos[heads == h], t))
            out[r, h, : mine.size] = mine
    return out
