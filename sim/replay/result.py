"""What a replay returns: `ReplayResult`, the metrics of one (trace, policy, budget) replay per replayed layer,
measured step and query head, the slots held, optionally the kept positions, and the scalar summary users read
(means, percentiles, missed mass, memory held).

Its own module so that every way of producing one (the step engine, `sim.replay.policy_replay`; the oracle, `sim.replay.oracle_replay`;
merged layer groups, `sim.replay.layer_groups`) builds the same object without importing the others.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from sim.replay.metrics import NAMES, summarise

if TYPE_CHECKING:
    import pandas as pd     # imported where a table is built: a replay alone (`kvsim replay`) does not load it (0.3 s)

#: bytes per cached element on the GPU the memory figures model (fp16/bf16 caches)
KV_ELEMENT_BYTES = 2


@dataclass
class ReplayResult:
    """Metrics of one (trace, policy, budget) replay.

    ``metrics[l, s, hq, m]`` for replayed layer l (the trace's stored layer ``layer_index[l]``), measured step s
    (absolute position ``steps[s]``), query head hq and metric m in ``sim.replay.metrics.NAMES``; ``slots[l, s, h]`` slots held
    per KV head after the step's eviction; ``kept[l, r, h, :]`` cached positions (-1 padded) for the recorded
    steps, when asked for. ``held_elsewhere[s]`` counts the slots the layers *not* replayed hold after step s
    (a hybrid model's sliding windows, summed over layers and KV heads), so memory covers every layer.
    """

    trace: str
    policy: str
    label: str
    params: dict[str, Any]
    budget: int
    budgets: np.ndarray
    steps: np.ndarray
    metrics: np.ndarray
    slots: np.ndarray
    head_dim: int
    kept: np.ndarray | None = None
    kept_steps: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    layers: np.ndarray | None = None          # stored-layer index of each replayed layer (None: all, in order)
    held_elsewhere: np.ndarray | None = None  # [S] slots held by the layers not replayed
    sliding: str = "keep"

    @property
    def layer_index(self) -> np.ndarray:
        """The trace's stored-layer index of each replayed layer."""
        return np.arange(self.metrics.shape[0]) if self.layers is None else self.layers

    @property
    def kv_bytes_mean(self) -> float:
        """The K/V bytes held (every layer, the ones not replayed included), mean over the measured steps."""
        if not self.metrics.shape[1]:
            return float("nan")
        held = self.slots.sum(axis=(0, 2)) + (0 if self.held_elsewhere is None else self.held_elsewhere)
        return float((held * 2 * self.head_dim * KV_ELEMENT_BYTES).mean())

    def metric(self, name: str) -> np.ndarray:
        """One metric as [L, S, Hq]."""
        return self.metrics[..., NAMES.index(name)]

    def summary(self) -> dict[str, Any]:
        """Scalar aggregates users read: means over layers, heads and measured steps."""
        out: dict[str, Any] = {"trace": self.trace, "policy": self.policy, "label": self.label,
                               "budget": self.budget}
        n = self.metrics.shape[1]
        out.update(summarise(self.metrics))
        out["miss_mass"] = 1.0 - out["mass_mean"]   # `sim.replay.metrics.COLUMNS["miss_mass"]`: the attention not held
        out["slots_mean"] = float(self.slots.mean()) if n else float("nan")
        out["slots_peak"] = int(self.slots.sum(axis=2).max()) if n else 0
        out["kv_bytes_mean"] = self.kv_bytes_mean
        out["n_steps"] = int(n)
        out["n_layers_compressed"] = int(self.metrics.shape[0])
        out["err_by_layer"] = [float(x) for x in self.metric("err").mean(axis=(1, 2))] if n else []
        out["mass_by_layer"] = [float(x) for x in self.metric("mass").mean(axis=(1, 2))] if n else []
        return out

    def per_head(self) -> pd.DataFrame:
        """Metric means per (layer, query head)."""
        import pandas as pd

        L, _, hq, _ = self.metrics.shape
        means = self.metrics.mean(axis=1)
        rows = {"layer": np.repeat(self.layer_index, hq), "head": np.tile(np.arange(hq), L)}
        rows.update({name: means[:, :, i].reshape(-1) for i, name in enumerate(NAMES)})
        return pd.DataFrame(rows)

    def per_step(self) -> pd.DataFrame:
        """Metric means over layers and heads per measured step."""
        import pandas as pd

        means = self.metrics.mean(axis=(0, 2))
        df = pd.DataFrame({name: means[:, i] for i, name in enumerate(NAMES)})
        df.insert(0, "position", self.steps)
        df["slots"] = self.slots.mean(axis=(0, 2))
        return df


def concat_kept(blocks: Sequence[np.ndarray]) -> np.ndarray:
    """Kept-position blocks [n_i, ..., width_i] joined along the first axis, padded with -1 to the widest."""
    width = max(b.shape[-1] for b in blocks)
    out = np.full((sum(len(b) for b in blocks), *blocks[0].shape[1:-1], width), -1, np.int32)
    start = 0
    for b in blocks:
        out[start: start + len(b), ..., : b.shape[-1]] = b
        start += len(b)
    return out
