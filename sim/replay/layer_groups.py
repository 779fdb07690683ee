"""Layer groups (``--split-layers N``): one configuration's replay cut into groups of consecutive compressed layers,
run as separate jobs (``sim.experiments.executors``), and their results merged back.

A configuration's layers replay independently once each knows its budget, so a long trace's replay can be cut
into groups of consecutive compressed layers. What couples layers is the allocation alone (``Policy.allocate``:
PyramidKV's depth schedule, D2O's variance-based budgets): ``layer_groups`` computes it once over every
compressed layer and hands each ``LayerGroup`` its rows, the replay strategies replay just the group's layers from
them (``group=``), and ``merge_layer_groups`` puts the groups' results back together, identical to the unsplit
replay.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from policies.core.base import Policy
from sim.replay.layer_inputs import LayerInputs, layer_inputs
from sim.replay.plan import allocation, check_budget, compressed_layers, held_elsewhere
from sim.replay.result import ReplayResult, concat_kept
from traces.format import Trace


@dataclass(frozen=True, eq=False)
class LayerGroup:
    """Consecutive compressed layers of one configuration, replayed on their own (``layer_groups``).

    ``layers``: their stored-layer indices; ``alloc[budget]``: their rows [len(layers), Hkv] of the policy's
    allocation over *all* compressed layers, computed where the configuration was split and shipped as plain
    arrays, so a worker replays its group without reading (or allocating from) any other layer.
    """

    layers: tuple[int, ...]
    alloc: dict[int, np.ndarray]

    def budgets(self, budget: int) -> np.ndarray:
        """The group's slots per layer and KV head at ``budget`` (a writable copy: the engine takes no
        read-only array, and Ray hands a task's array arguments over read-only)."""
        try:
            return np.array(self.alloc[int(budget)], np.int64)
        except KeyError:
            raise ValueError(f"layer group {list(self.layers)} carries no allocation for budget {budget} "
                             f"(only {sorted(self.alloc)}); split the configuration at that budget") from None


def layer_groups(trace: Trace, policy: Policy, budgets: Sequence[int], n_groups: int, *,
                 inputs: Sequence[LayerInputs] | None = None, sliding: str = "keep") -> list[LayerGroup]:
    """``policy``'s configuration at ``budgets`` cut into ``n_groups`` groups of consecutive compressed layers
    (sizes differing by at most one), each with its rows of the allocation computed here, once per budget."""
    layers = compressed_layers(trace, sliding)
    if not 1 <= n_groups <= len(layers):
        raise ValueError(f"cannot split the {len(layers)} layers {policy.label()} compresses on {trace.path} "
                         f"(sliding={sliding!r}) into {n_groups!r} groups; use 1 to {len(layers)}")
    for b in budgets:
        check_budget(trace, policy, b)
    inputs = inputs if inputs is not None else layer_inputs(trace)
    full = {int(b): allocation(trace, policy, b, inputs, layers) for b in budgets}
    return [LayerGroup(tuple(layers[j] for j in rows), {b: a[rows] for b, a in full.items()})
            for rows in np.array_split(np.arange(len(layers)), n_groups)]


def merge_layer_groups(trace: Trace, parts: Sequence[ReplayResult]) -> ReplayResult:
    """One configuration's result from its layer groups' results (any order), identical to the unsplit replay:
    layers in trace order, kept sets padded to the widest, and ``held_elsewhere`` recomputed for all of them (a
    group's own counts the other groups' layers as held in full, so summing the groups' would double-count)."""
    parts = sorted(parts, key=lambda r: int(r.layer_index[0]))
    layers = np.concatenate([r.layer_index for r in parts])
    expected = compressed_layers(trace, parts[0].sliding)
    if layers.tolist() != expected:
        raise ValueError(f"layer groups cover layers {layers.tolist()}, the configuration compresses {expected}")
    kept = None if parts[0].kept is None else concat_kept([r.kept for r in parts])
    return replace(parts[0], trace=str(trace.path), layers=layers, kept=kept,
                   budgets=np.concatenate([r.budgets for r in parts]),
                   metrics=np.concatenate([r.metrics for r in parts]), slots=np.concatenate([r.slots for r in parts]),
                   held_elsewhere=held_elsewhere(trace, expected))
