"""What kvsim measures, in one table, and the one jitted measurement behind every number.

``METRICS`` lists the per-(decode step, query head) metrics in the order of the metric columns of every replay
(``ReplayResult.metrics[..., M.<name>]``): each with its name, direction (is lower or higher better), the label
users read, a one-line doc and its value for the full cache. ``measure`` computes all of them for one step and
query head from the few quantities every executor has (retained mass, KL, the cache's attention output, the
running max of the value L1 norms); the numba engine, the oracle and the plain-numpy reference all call it, so
a formula exists once.

``COLUMNS`` names the scalar columns of a replay's summary (``ReplayResult.summary``, one row of a sweep store)
that tables, reports, searches, the fidelity study and serve-sim's quality join show: the mean of every metric,
chosen percentiles, the memory held and the gaps to the oracle. Report pages read labels and directions here.

Adding a metric is one row in ``METRICS`` plus one line in ``measure``; everything downstream (summaries,
``kvsim replay``'s table, search objectives, report legends, the README check) follows from the table.
"""
from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Metric:
    """One per-step metric: ``name`` (column key), ``direction`` ("lower" or "higher" is better), ``label`` (what
    users read), ``doc`` (one line: what it is), ``ideal`` (its value for the full cache), ``percentiles`` (also
    summarised at these percentiles, e.g. 95 -> ``err_p95``) and ``gap`` (sweeps add its distance to the oracle)."""

    name: str
    direction: str
    label: str
    doc: str
    ideal: float = 0.0
    percentiles: tuple[int, ...] = ()
    gap: bool = False

    def __post_init__(self) -> None:
        if self.direction not in ("lower", "higher"):
            raise ValueError(f"metric {self.name}: direction must be 'lower' or 'higher', not {self.direction!r}")

    @property
    def arrow(self) -> str:
        """↓ when lower is better, ↑ when higher is."""
        return "↓" if self.direction == "lower" else "↑"

    def loss(self, value: float) -> float:
        """The distance of ``value`` from the full cache's, oriented so that lower is better (1 - mass, err...)."""
        return value - self.ideal if self.direction == "lower" else self.ideal - value


#: the per-(step, query head) metrics, in column order
METRICS: tuple[Metric, ...] = (
    Metric("mass", "higher", "retained attention mass",
           "share of the full attention probability that falls on tokens the cache holds", ideal=1.0, gap=True),
    Metric("err", "lower", "attention-output error (rel. L2)",
           "‖o_full − o_cache‖₂ / ‖o_full‖₂, the relative error of the attention output", percentiles=(95,),
           gap=True),
    Metric("kl", "lower", "KL(cache ‖ full)",
           "KL divergence of the cache's attention row from the full one (= −log mass when nothing was merged or "
           "rescaled)"),
    Metric("l1", "lower", "L1 output error", "‖o_full − o_cache‖₁ (Ada-KV's eviction loss)"),
    Metric("l1_bound", "lower", "Ada-KV bound on the L1 error",
           "2 (1 − mass) · max_j ‖v_j‖₁ over the tokens seen (Ada-KV Theorem 2, per head)"),
)
NAMES: tuple[str, ...] = tuple(m.name for m in METRICS)
N_METRICS = len(METRICS)
#: named column positions, e.g. ``M.err``: numba freezes the named tuple as constants
M = namedtuple("MetricIndex", NAMES)(*range(N_METRICS))
_BY_NAME = {m.name: m for m in METRICS}


def metric(name: str) -> Metric:
    """The metric called ``name``, or a ValueError listing the known ones."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown metric {name!r}; known: {', '.join(NAMES)}") from None


#: objectives: every metric of ``sim.replay.metrics`` (its mean, as a loss: lower is better) and the gap to the oracle's error
OBJECTIVES = NAMES + ("gap",)


def objectives_help() -> str:
    """One line per objective for ``--help``: the metric's label, as a loss."""
    parts = [f"{m}: {metric(m).label}" + (f" (as {metric(m).ideal:g} - {m})" if metric(m).direction == "higher" else "")
             for m in NAMES]
    return "; ".join(parts + ["gap: error minus the oracle's at the same budget"])

def _measure(mass, kl, o_ref, o_acc, acc_scale, vmax1, out):
    """Every metric of one (step, query head) into ``out[:N_METRICS]``.

    mass: full-attention probability on the held tokens; kl: KL(cache ‖ full) of the attention rows; o_ref [d]:
    the full-cache attention output; ``o_acc * acc_scale`` [d]: the cache's output (the oracle passes its
    unnormalised sum and 1 / mass); vmax1: max_j ‖v_j‖₁ over the tokens seen. The stored float32 lse limits
    mass to ~6e-8 relative precision, so mass is kept in [0, 1] where it cannot resolve.
    """
    num = 0.0
    den = 0.0
    l1 = 0.0
    for x in range(o_ref.shape[0]):
        ref = np.float64(o_ref[x])
        diff = ref - o_acc[x] * acc_scale
        num += diff * diff
        den += ref * ref
        l1 += abs(diff)
    mass = min(1.0, mass)
    out[M.mass] = mass
    out[M.err] = np.sqrt(num / den) if den > 0.0 else np.sqrt(num)     # absolute when o_ref = 0
    out[M.kl] = max(kl, 0.0)
    out[M.l1] = l1
    out[M.l1_bound] = 2.0 * max(0.0, 1.0 - mass) * vmax1


def __getattr__(name: str):
    """``measure``: ``_measure`` jitted with its fixed signature on first use (PEP 562), so that reading the table
    (``kvsim --help`` lists the search objectives) imports no numba. The engine, the oracle and the numpy reference
    import ``measure`` and get the one compiled function."""
    if name != "measure":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from numba import njit, types

    f8v = types.float64[::1]
    fn = njit(types.void(types.float64, types.float64, types.float32[::1], f8v, types.float64, types.float64, f8v),
              cache=True, nogil=True, fastmath={"reassoc", "contract"})(_measure)   # SIMD sums over d
    globals()["measure"] = fn
    return fn


@dataclass(frozen=True)
class Column:
    """One scalar column of a replay summary: ``key`` (e.g. ``err_mean``), ``short`` (a table header), ``label``,
    ``direction`` ("lower"/"higher" is better) and ``doc``."""

    key: str
    short: str
    label: str
    direction: str
    doc: str

    @property
    def arrow(self) -> str:
        return "↓" if self.direction == "lower" else "↑"

    @property
    def title(self) -> str:
        """``label ↓``: a plot title or axis label that says which way is better."""
        return f"{self.label} {self.arrow}"


def _columns() -> dict[str, Column]:
    cols: list[Column] = []
    for m in METRICS:
        cols.append(Column(f"{m.name}_mean", m.name, m.label, m.direction, f"mean over layers, heads and decode "
                                                                           f"steps of {m.doc}"))
        cols += [Column(f"{m.name}_p{p}", f"{m.name} p{p}", f"p{p} {m.label}", m.direction,
                        f"{p}th percentile over layers, heads and steps of {m.doc}") for p in m.percentiles]
    cols += [Column(f"{m.name}_gap", f"{m.name}−oracle", f"{m.label}: gap to the oracle", "lower",
                    f"distance of {m.name}_mean from the future-attention oracle's at the same trace and budget")
             for m in METRICS if m.gap]
    mass = _BY_NAME["mass"]
    cols += [Column("miss_mass", "missed mass", "missed attention mass", "lower",
                    f"1 − {mass.name}_mean: the full attention the cache does not hold"),
             Column("slots_mean", "slots", "slots held per KV head", "lower",
                    "mean slots held per KV head and layer after each decode step"),
             Column("slots_peak", "peak slots", "peak slots held per layer", "lower",
                    "largest number of slots one layer holds after a decode step (all its KV heads)"),
             Column("kv_bytes_mean", "KV bytes", "KV memory held (bytes)", "lower",
                    "mean bytes of keys and values held after each decode step, all layers, at 2 bytes per element")]
    return {c.key: c for c in cols}


#: every scalar summary column by key
COLUMNS: dict[str, Column] = _columns()


def column(key: str) -> Column:
    """The summary column ``key``, or a ValueError listing the known ones."""
    try:
        return COLUMNS[key]
    except KeyError:
        raise ValueError(f"unknown result column {key!r}; known: {', '.join(COLUMNS)}") from None


def summarise(metrics: np.ndarray) -> dict[str, float]:
    """Means and percentiles of a metric array [..., N_METRICS] (NaN when it holds no step)."""
    out: dict[str, float] = {}
    empty = metrics[..., 0].size == 0
    for i, m in enumerate(METRICS):
        vals = metrics[..., i]
        out[f"{m.name}_mean"] = float("nan") if empty else float(vals.mean())
        for p in m.percentiles:
            out[f"{m.name}_p{p}"] = float("nan") if empty else float(np.percentile(vals, p))
    return out
