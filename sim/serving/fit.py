"""Least-squares fit of measured attention-kernel timings to ``time_s = intercept + bytes * seconds_per_byte``.

Input, either of:
  - a list of records ``{"device", "budget" or "length", "batch", "time_s", "bytes"}`` (``bytes``: KV bytes one
    kernel call reads, ``time_s``: its measured time), or an object with such a list under ``"records"``;
  - the output of ``benchmarks/kernels.py`` (an object with ``"device"`` and ``"attention"`` rows): ``bytes`` is
    the row's ``bytes_no_scores`` (retained K and V read once) and ``time_s`` the time of the chosen variant, so
    the fitted slope charges any score-output traffic per KV byte, as the serving model counts bytes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np


class KernelTimingError(ValueError):
    """The kernel timing file or its records are malformed, or too few to fit."""


@dataclass(frozen=True)
class KernelFit:
    """Fitted per-call kernel cost: a fixed launch/latency part and an inverse effective bandwidth."""

    intercept_s: float
    seconds_per_byte: float
    n_records: int
    r2: float
    device: str | None = None

    @property
    def bandwidth(self) -> float:
        """Effective bytes per second the kernel reaches on large inputs."""
        return 1.0 / self.seconds_per_byte


#: time column of ``benchmarks/kernels.py`` attention rows per kernel variant
KERNEL_VARIANTS = {"scores": "t_ours_scores_s", "no_scores": "t_ours_no_scores_s", "sdpa": "t_sdpa_s"}


def _from_kernel_benchmark(path: Path, data: dict[str, Any], variant: str) -> list[dict[str, Any]]:
    """Records from the kernel benchmark's attention rows for one kernel variant."""
    if variant not in KERNEL_VARIANTS:
        raise KernelTimingError(f"unknown kernel variant {variant!r}; choose from {sorted(KERNEL_VARIANTS)}")
    rows = data["attention"]
    if not isinstance(rows, list):
        raise KernelTimingError(f"{path}: 'attention' must be a list of rows")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise KernelTimingError(f"{path}: attention row {i} is not an object")
        for key in (KERNEL_VARIANTS[variant], "bytes_no_scores"):
            if key not in row:
                raise KernelTimingError(f"{path}: attention row {i} has no field {key!r}")
        out.append({"device": data.get("device"), "budget": row.get("budget"), "batch": row.get("batch"),
                    "time_s": row[KERNEL_VARIANTS[variant]], "bytes": row["bytes_no_scores"]})
    return out


def load_kernel_timings(path: str | Path, variant: str = "scores") -> list[dict[str, Any]]:
    """Read and validate kernel timings (either format above); errors name the file, record index and field.

    ``variant`` picks the kernel of a ``benchmarks/kernels.py`` file: "scores" (varlen attention that also
    outputs scores, what eviction policies need; default), "no_scores", or "sdpa" (torch reference).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise KernelTimingError(f"{path}: no such kernel timing file") from None
    except json.JSONDecodeError as e:
        raise KernelTimingError(f"{path}: not valid JSON ({e})") from None
    if isinstance(data, dict) and "attention" in data:
        data = _from_kernel_benchmark(path, data, variant)
    elif isinstance(data, dict) and "records" in data:
        data = data["records"]
    if not isinstance(data, list):
        raise KernelTimingError(f"{path}: expected a list of records (or an object with 'records')")
    for i, rec in enumerate(data):
        if not isinstance(rec, dict):
            raise KernelTimingError(f"{path}: record {i} is not an object")
        for key in ("time_s", "bytes"):
            v = rec.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise KernelTimingError(f"{path}: record {i} field {key!r} must be a finite number >= 0, got {v!r}")
        if rec["time_s"] <= 0:
            raise KernelTimingError(f"{path}: record {i} field 'time_s' must be > 0, got {rec['time_s']!r}")
    return data


def fit_kernel_timings(records: Sequence[dict[str, Any]], device: str | None = None) -> KernelFit:
    """Ordinary least squares of time on bytes (records of ``device`` only when given).

    A slightly negative intercept (measurement noise on a tiny launch cost) is clipped to 0.
    """
    rows = [r for r in records if device is None or r.get("device") == device]
    if device is not None and not rows:
        seen = sorted({str(r.get("device")) for r in records})
        raise KernelTimingError(f"no kernel timings for device {device!r}; devices present: {seen}")
    x = np.array([float(r["bytes"]) for r in rows])
    y = np.array([float(r["time_s"]) for r in rows])
    if len(np.unique(x)) < 2:
        raise KernelTimingError(f"need timings at >= 2 distinct byte counts to fit, got {len(np.unique(x))}")
    a = np.column_stack([np.ones_like(x), x])
    (c0, c1), *_ = np.linalg.lstsq(a, y, rcond=None)
    if not c1 > 0:
        raise KernelTimingError(f"fitted seconds per byte is {c1:.3g} <= 0: time does not grow with bytes read")
    resid = y - (c0 + c1 * x)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return KernelFit(intercept_s=max(float(c0), 0.0), seconds_per_byte=float(c1), n_records=len(rows), r2=r2,
                     device=device)
