"""Helpers shared by benchmarks: timing, machine description, JSON output."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def best_time(fn: Callable[[], Any], repeat: int = 3) -> float:
    """Best wall time of ``repeat`` calls (the first call is not special: warm up separately)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def copy_bandwidth(n_bytes: int = 1 << 28) -> float:
    """Measured main-memory bandwidth of this machine (bytes read + written per second by a large copy)."""
    src = np.ones(n_bytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return 2 * n_bytes / best_time(lambda: np.copyto(dst, src), repeat=5)


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version()}


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write benchmarks/results/<name>.json atomically."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=float))
    os.replace(tmp, path)
    return path
