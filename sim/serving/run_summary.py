"""Operator-facing summary of a serving run: throughput, latency percentiles, concurrency, memory, preemptions."""
from __future__ import annotations

from typing import Any

import numpy as np

from sim.serving.scheduler import ServingResult

PERCENTILES = (50, 90, 95, 99)


def latencies(res: ServingResult) -> dict[str, np.ndarray]:
    """Per completed request: TTFT, TPOT (requests with >= 2 output tokens), end-to-end and queueing delay."""
    done = np.isfinite(res.finish)
    w = res.workload
    ttft = res.first_token[done] - w.arrival[done]
    e2e = res.finish[done] - w.arrival[done]
    multi = done & (w.output > 1)
    tpot = (res.finish[multi] - res.first_token[multi]) / (w.output[multi] - 1)
    queue = res.admitted[done] - w.arrival[done]
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e, "queue": queue}


def summarize(res: ServingResult) -> dict[str, Any]:
    """Flat dict of the run's metrics (seconds, requests/s, tokens/s, bytes, fractions)."""
    w = res.workload
    done = np.isfinite(res.finish)
    n_done = int(done.sum())
    span = res.makespan if res.makespan > 0 else float("nan")
    out: dict[str, Any] = {
        "requests": len(w),
        "completed": n_done,
        "rejected": int(res.rejected.sum()),
        "makespan_s": res.makespan,
        "throughput_rps": n_done / span,
        "output_tokens_per_s": float(w.output[done].sum()) / span,
        "mean_running": res.running_seconds / span,
        "max_running": res.max_running,
        "mean_in_system": float(np.sum(res.finish[done] - w.arrival[done])) / span,
        "preemptions": int(res.preemptions.sum()),
        "preempted_requests": int(np.count_nonzero(res.preemptions)),
        "peak_kv_bytes": res.peak_bytes,
        "pool_bytes": res.pool_bytes,
        "mean_kv_bytes": res.byte_seconds / span,
        "memory_utilization": (res.byte_seconds / span / res.pool_bytes) if res.pool_bytes else float("nan"),
        "decode_iterations": res.decode_iterations,
        "mean_decode_batch": res.decode_tokens / res.decode_iterations if res.decode_iterations else float("nan"),
        "prefill_iterations": res.prefill_iterations,
        "events": res.events,
    }
    for name, x in latencies(res).items():
        out[f"{name}_mean_s"] = float(np.mean(x)) if len(x) else float("nan")
        for p in PERCENTILES:
            out[f"{name}_p{p}_s"] = float(np.percentile(x, p)) if len(x) else float("nan")
    return out
