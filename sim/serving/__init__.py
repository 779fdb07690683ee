"""Serving-level discrete-event simulation: what each policy's KV footprint buys in throughput and latency."""
from sim.serving.costs import CostModel
from sim.serving.fit import KernelFit, KernelTimingError, fit_kernel_timings, load_kernel_timings
from sim.serving.footprint import MemoryTables, memory_tables, policy_footprint, tabulate_footprint
from sim.serving.hardware import GPUS, MODELS, GPUProfile, ModelMemory, ServingConfigError, get_gpu, get_model
from sim.serving.metrics import latencies, summarize
from sim.serving.scheduler import SchedulerConfig, ServingResult, kv_pool_bytes, simulate
from sim.serving.workload import (Workload, WorkloadError, bursty_workload, load_csv_workload,
                                  poisson_workload)

__all__ = ["CostModel", "GPUProfile", "GPUS", "KernelFit", "KernelTimingError", "MODELS", "MemoryTables",
           "ModelMemory", "SchedulerConfig", "ServingConfigError", "ServingResult", "Workload", "WorkloadError",
           "bursty_workload", "fit_kernel_timings", "get_gpu", "get_model", "kv_pool_bytes", "latencies",
           "load_csv_workload", "load_kernel_timings", "memory_tables", "policy_footprint", "poisson_workload",
           "simulate", "summarize", "tabulate_footprint"]
