"""The ``decoding`` stage: kvpress's DecodingPress, its class and its kernels.

The cache grows during decoding and every ``every`` steps each head is
compressed back to ``target`` by the chain inside it. ``target=0`` (default) means ``budget - every + 1``, the
largest target whose peak (target + every - 1 slots after a step) stays within the budget. A prompt the chain
selects from is compressed once to the target (kvpress leaves prefill to the wrapped press; here the budget
must hold from the first step); a streamed prompt is compressed every ``every`` steps like the decode. kvpress
defaults to ``compression_interval=512, target_size=2048``; kvsim budgets are smaller, so the default interval
is 16. With ``every=1`` this is the chain's per-step eviction. It must be the outermost stage: it schedules the
whole chain (kvpress's DecodingPress wraps a press; nothing wraps it).

Decoding state (1 column, head 0's): decode steps since the last compression.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from policies.core.base import Param, Policy, PolicyError
from policies.core.kvpress_press import KvpressPress, NoKvpressPress
from policies.core.scorer import ScorerPolicy, StageCode
from policies.core.stage_base import Stage

EVERY = Param("every", 16, "int", 1, 1024, log=True, doc="decode steps between compressions (kvpress compression_interval)")
TARGET = Param("target", 0, "int", 0, 1 << 20,
               doc="slots per head after a compression; 0: budget - every + 1 (peak = budget)", searchable=False)


@njit(cache=True)
def decoding_target(budget, every, target):
    """The size a ``decoding`` stage compresses a head to: ``target``, or ``budget - every + 1`` when 0."""
    return np.int64(target) if target > 0 else budget - every + 1


@njit(cache=True)
def decoding_tick(head_state, off, every):
    """Count a step in head 0's slice; True (and restart the count) every ``every`` steps: a compression."""
    head_state[0, off] += 1.0
    if head_state[0, off] < every:
        return False
    head_state[0, off] = 0.0
    return True


class DecodingStage(Stage):
    name = "decoding"
    summary = "DecodingPress: compress every N decode steps"
    params = (EVERY, TARGET)
    head_fields = 1
    # its schedule counts one token per step, so a prompt chunk would overrun the target
    policy_attrs = {"compresses_below_budget": True, "multi_token_steps": False}

    @classmethod
    def code(cls, pol: type[ScorerPolicy]) -> StageCode:
        off = pol.head_offsets[cls.name]
        every, target = (cls.index(pol, p.name) for p in cls.params)
        return StageCode(base=(f"    for h in range(hkv):\n"
                               f"        base[h] = decoding_target(budget[h], np.int64(params[{every}]), "
                               f"np.int64(params[{target}]))\n"),
                         step=f"    evict = decoding_tick(head_state, {off}, np.int64(params[{every}]))\n",
                         globals=(("decoding_target", decoding_target),
                                  ("decoding_tick", decoding_tick)))

    @classmethod
    def base_size(cls, params: dict[str, Any], budget: int) -> int:
        return params["target"] or budget - params["every"] + 1

    @classmethod
    def min_budget(cls, params: dict[str, Any], inner: int) -> int:
        every, target = params["every"], params["target"]
        return max(inner, target + every - 1) if target else inner + every - 1

    @classmethod
    def validate(cls, policy: Policy, scorer_min: int) -> None:
        if policy.params["target"] and policy.params["target"] < scorer_min:
            raise PolicyError(f"{policy.name}.target: {policy.params['target']} is below the scorer's minimum "
                              f"{scorer_min} (its protected tokens plus one)")

    @classmethod
    def kvpress(cls, policy: Policy, inner: KvpressPress) -> KvpressPress:
        """None checked: kvpress's DecodingPress acts while generating, which the parity benchmark does not
        compare."""
        raise NoKvpressPress(f"{policy.label()}: kvpress's DecodingPress compresses while generating, which "
                             "kvsim has not compared with kvpress (the parity benchmark compresses a prompt "
                             "once); export the inner policy for the prompt")
