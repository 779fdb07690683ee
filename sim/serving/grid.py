"""Run the serving simulation for several policy/budget cases on one workload and tabulate the results."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pandas as pd

from sim.serving.costs import CostModel
from sim.serving.footprint import memory_tables
from sim.serving.hardware import ModelMemory
from sim.serving.run_summary import latencies, summarize
from sim.serving.scheduler import SchedulerConfig, simulate
from sim.serving.workload import Workload


@dataclass(frozen=True)
class ServingCase:
    """One policy at one budget (``budget=None`` for unbounded policies) with its footprint callable.

    ``policy_label`` is the policy's own label (name plus non-default hyperparameters, no budget), used to
    join quality results; ``label`` names the case in tables and plots.
    """

    policy: str
    budget: int | None
    label: str
    footprint: Callable[[int], int]
    policy_label: str = ""
    params: dict[str, Any] = field(default_factory=dict)


def run_grid(cases: list[ServingCase], workload: Workload, model: ModelMemory, cost: CostModel,
             config: SchedulerConfig, *, accounting: str = "varlen", block_size: int = 16,
             prefill_peak: str = "full", progress: Callable[[int], None] | None = None,
             ) -> tuple[pd.DataFrame, dict[str, dict[str, np.ndarray]]]:
    """One summary row per case (plus its identity columns) and per-case latency samples for CDF plots."""
    rows, curves = [], {}
    for case in cases:
        tables = memory_tables(case.footprint, model, workload.max_context, accounting=accounting,
                               block_size=block_size, prefill_peak=prefill_peak)
        res = simulate(workload, tables, cost, config, progress=progress)
        row = {"policy": case.policy, "budget": np.nan if case.budget is None else case.budget,
               "label": case.label, "policy_label": case.policy_label or case.policy,
               "params": ",".join(f"{k}={v}" for k, v in sorted(case.params.items())),
               "slots_at_max_context": int(tables.slots[-1]), **summarize(res)}
        rows.append(row)
        curves[case.label] = latencies(res)
    return pd.DataFrame(rows), curves
