"""Serving-level discrete-event simulation: what each policy's KV footprint buys in throughput and latency.

Names are imported lazily (PEP 562): ``kvsim`` builds its parser on every call and needs only a few constants,
so importing this package must not pull in the scheduler, plots or workload generators.
"""
from __future__ import annotations

from traces.lazy_exports import lazy_exports

_WHERE = {name: f"sim.serving.{module}" for name, module in {
    "CostModel": "costs",
    **dict.fromkeys(("KernelFit", "KernelTimingError", "fit_kernel_timings", "load_kernel_timings"), "fit"),
    **dict.fromkeys(("MemoryTables", "memory_tables", "policy_footprint", "tabulate_footprint"), "footprint"),
    **dict.fromkeys(("GPUS", "MODELS", "GPUProfile", "ModelMemory", "ServingConfigError", "get_gpu", "get_model"),
                    "hardware"),
    **dict.fromkeys(("latencies", "summarize"), "run_summary"),
    **dict.fromkeys(("SchedulerConfig", "ServingResult", "kv_pool_bytes", "simulate"), "scheduler"),
    **dict.fromkeys(("Workload", "WorkloadError", "bursty_workload", "load_csv_workload", "poisson_workload"),
                    "workload"),
}.items()}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
