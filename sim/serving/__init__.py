"""Serving-level discrete-event simulation: what each policy's KV footprint buys in throughput and latency.

Names are imported lazily (PEP 562): ``kvsim`` builds its parser on every call and needs only a few constants,
so importing this package must not pull in the scheduler, plots or workload generators.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "CostModel": "costs",
    **dict.fromkeys(("KernelFit", "KernelTimingError", "fit_kernel_timings", "load_kernel_timings"), "fit"),
    **dict.fromkeys(("MemoryTables", "memory_tables", "policy_footprint", "tabulate_footprint"), "footprint"),
    **dict.fromkeys(("GPUS", "MODELS", "GPUProfile", "ModelMemory", "ServingConfigError", "get_gpu", "get_model"),
                    "hardware"),
    **dict.fromkeys(("latencies", "summarize"), "run_summary"),
    **dict.fromkeys(("SchedulerConfig", "ServingResult", "kv_pool_bytes", "simulate"), "scheduler"),
    **dict.fromkeys(("Workload", "WorkloadError", "bursty_workload", "load_csv_workload", "poisson_workload"),
                    "workload"),
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
