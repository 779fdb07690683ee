"""What a replay compresses and with what: the checks of its budget, prompt chunk and sliding mode, the layers a
policy compresses, the slots the other layers hold, the policy's allocation over the compressed layers and the
layers replayed side by side. Shared by the step replay (`sim.replay.policy_replay`), the oracle's (`sim.replay.oracle_replay`) and the
layer groups (`sim.replay.layer_groups`), so that all three decide these the same way.

Hybrid models (Gemma-3: sliding-window layers next to global ones). On a sliding layer the model's own cache
*is* its window, and the trace's reference is that windowed attention. By default (``sliding="keep"``) a
policy compresses the global layers only: the sliding layers keep their window, are not replayed (their loss
is zero by definition) and count in the memory held (``kv_bytes_mean``) at min(t + 1, window - 1) slots per KV
head after step t. ``sliding="compress"`` applies the policy to the sliding layers too, on top of their window
(``sim.replay.contract.apply_window``), so budgets below the window save memory there. Metrics are means over the
layers a policy compresses (``ReplayResult.layers``).
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from policies.core.base import Policy, PolicyError
from sim.replay.contract import check_allocation
from sim.replay.layer_inputs import LayerInputs, PromptLayers
from sim.replay.threads import KVSIM_THREADS, available_cores
from traces.format import Trace

#: what a replay does with a hybrid model's sliding-window layers (see the module docstring)
SLIDING_MODES = ("keep", "compress")


class BudgetError(ValueError):
    """A budget that is not a positive integer, or larger than the trace it is replayed on."""


def check_budget(trace: Trace, policy: Policy, budget: int) -> None:
    """Raise `BudgetError` unless ``budget`` is an integer no larger than ``trace``'s tokens; then the policy's own
    ``check_budget``."""
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise BudgetError(f"budget must be an integer, got {budget!r}")
    if budget > trace.meta.n_tokens:
        raise BudgetError(f"budget {budget} is larger than the trace's {trace.meta.n_tokens} tokens "
                          f"({trace.path}); use budget <= {trace.meta.n_tokens} (equal means the full cache)")
    policy.check_budget(int(budget))


def replay_threads(threads: int | None, n_layers: int) -> int:
    """Layers replayed side by side: ``threads``, else this process's share (``KVSIM_THREADS``, which a sweep
    worker's thread budget sets), else every core it may use."""
    return max(1, min(n_layers, threads or int(os.environ.get(KVSIM_THREADS, available_cores()))))


def check_chunk(policy: Policy, chunk: int) -> int:
    """The prompt chunk a replay of ``policy`` uses: ``chunk`` (an integer >= 1) for a policy that streams its
    prompt, 1 for one with a prefill selector (it sees the whole prompt at once anyway). A policy whose step
    assumes one new token per step (``Policy.multi_token_steps`` False) refuses chunk > 1, saying so."""
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
    if policy.has_prefill or chunk == 1:
        return 1
    if not policy.multi_token_steps:
        raise PolicyError(f"{policy.label()} steps one token at a time (its state follows each new token), so it "
                          f"cannot take its prompt in chunks of {chunk}; use chunk 1")
    return int(chunk)


def effective_chunk(policy: Policy, chunk: int) -> int:
    """The prompt chunk ``policy`` runs with when a sweep asks for ``chunk``: 1 for a policy with a prefill
    selector or one that steps token by token, ``chunk`` otherwise (sweep rows record it as ``prefill_chunk``)."""
    return 1 if policy.has_prefill or not policy.multi_token_steps else int(chunk)


def check_sliding(sliding: str) -> str:
    """``sliding`` itself, or a ValueError naming the modes."""
    if sliding not in SLIDING_MODES:
        raise ValueError(f"sliding must be one of {SLIDING_MODES}, got {sliding!r}")
    return sliding


def compressed_layers(trace: Trace, sliding: str = "keep") -> list[int]:
    """Stored-layer indices a policy compresses: every global layer, and the sliding ones with ``compress``."""
    check_sliding(sliding)
    idx = [i for i in range(trace.n_layers) if sliding == "compress" or not trace.meta.attention(i).sliding]
    if not idx:
        raise ValueError(f"trace {trace.path} has only sliding-window layers: with sliding='keep' nothing is "
                         "compressed; replay with sliding='compress' (--sliding compress)")
    return idx


def held_elsewhere(trace: Trace, replayed: Sequence[int]) -> np.ndarray | None:
    """[T - P] slots the layers not in ``replayed`` hold after each measured step: a sliding layer keeps its
    window, min(t + 1, window - 1) per KV head after step t (the newest token joins before the next attention),
    a global one everything. None when every layer is replayed."""
    rest = [i for i in range(trace.n_layers) if i not in set(replayed)]
    if not rest:
        return None
    meta = trace.meta
    t = np.arange(meta.n_prompt, meta.n_tokens) + 1
    out = np.zeros(t.shape, np.int64)
    for i in rest:
        w = meta.attention(i).window
        out += np.minimum(t, w - 1) if w else t
    return out * meta.model.n_kv_heads


def allocation(trace: Trace, policy: Policy, budget: int, inputs: Sequence[LayerInputs],
               layers: Sequence[int]) -> np.ndarray:
    """``policy``'s slots per layer and KV head [len(layers), Hkv] at ``budget`` over the compressed ``layers``:
    ``Policy.allocate`` on their prompts, checked. The one place a replay allocates, so that the policies whose
    budgets couple layers (PyramidKV, D2O) see every compressed layer, whether the replay is split or not."""
    meta = trace.meta
    hkv = meta.model.n_kv_heads
    prompt = PromptLayers(trace, inputs, layers, meta.n_prompt)
    return check_allocation(policy, policy.allocate(int(budget), hkv, prompt, meta.softmax_scale), len(layers), hkv)
