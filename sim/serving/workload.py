"""Request workloads: arrival times with prompt and output lengths (Poisson, bursty, or replayed from CSV)."""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class WorkloadError(ValueError):
    """A workload is malformed: bad CSV row, negative time, non-positive length."""


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival time (seconds); ``prompt`` and ``output`` are token counts (output >= 1)."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray

    def __post_init__(self) -> None:
        a = np.asarray(self.arrival, dtype=np.float64)
        p = np.asarray(self.prompt, dtype=np.int64)
        o = np.asarray(self.output, dtype=np.int64)
        if not (a.ndim == p.ndim == o.ndim == 1 and len(a) == len(p) == len(o)):
            raise WorkloadError("arrival, prompt and output must be 1-d arrays of the same length")
        if len(a) == 0:
            raise WorkloadError("workload has no requests")
        if not np.all(np.isfinite(a)) or np.any(a < 0):
            raise WorkloadError("arrival times must be finite and >= 0")
        if np.any(p < 1) or np.any(o < 1):
            raise WorkloadError("prompt and output lengths must be >= 1 token")
        order = np.argsort(a, kind="stable")
        object.__setattr__(self, "arrival", a[order])
        object.__setattr__(self, "prompt", p[order])
        object.__setattr__(self, "output", o[order])

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def max_context(self) -> int:
        """Longest cache any request reaches: prompt plus all generated tokens but the last."""
        return int(np.max(self.prompt + self.output - 1))


def _lengths(rng: np.random.Generator, n: int, mean: float, cv: float, what: str) -> np.ndarray:
    """Lognormal token counts with the given mean and coefficient of variation (cv = 0: constant)."""
    if not mean >= 1:
        raise WorkloadError(f"mean {what} length must be >= 1, got {mean}")
    if not cv >= 0:
        raise WorkloadError(f"{what} length cv must be >= 0, got {cv}")
    if cv == 0:
        return np.full(n, int(round(mean)), dtype=np.int64)
    s2 = np.log1p(cv * cv)
    x = rng.lognormal(np.log(mean) - s2 / 2, np.sqrt(s2), n)
    return np.maximum(1, np.round(x)).astype(np.int64)


def poisson_workload(n: int, rate: float, *, prompt_mean: float = 512, prompt_cv: float = 0.0,
                     output_mean: float = 128, output_cv: float = 0.0, seed: int = 0) -> Workload:
    """``n`` requests with exponential inter-arrival times at ``rate`` requests/s."""
    if n < 1 or not rate > 0:
        raise WorkloadError(f"need n >= 1 and rate > 0, got n={n}, rate={rate}")
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1.0 / rate, n))
    return Workload(arrival, _lengths(rng, n, prompt_mean, prompt_cv, "prompt"),
                    _lengths(rng, n, output_mean, output_cv, "output"))


def bursty_workload(n: int, rate: float, *, burstiness: float = 4.0, prompt_mean: float = 512,
                    prompt_cv: float = 0.0, output_mean: float = 128, output_cv: float = 0.0,
                    seed: int = 0) -> Workload:
    """Gamma renewal arrivals with mean rate ``rate`` and squared CV ``burstiness`` (1 = Poisson, >1 = bursty)."""
    if n < 1 or not rate > 0 or not burstiness > 0:
        raise WorkloadError(f"need n >= 1, rate > 0, burstiness > 0; got n={n}, rate={rate}, burstiness={burstiness}")
    rng = np.random.default_rng(seed)
    shape = 1.0 / burstiness
    arrival = np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), n))
    return Workload(arrival, _lengths(rng, n, prompt_mean, prompt_cv, "prompt"),
                    _lengths(rng, n, output_mean, output_cv, "output"))


CSV_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")


def load_csv_workload(path: str | Path) -> Workload:
    """Replay a CSV with header ``arrival_s,prompt_tokens,output_tokens``; errors name the line and column."""
    path = Path(path)
    try:
        fh = path.open(newline="")
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such workload file") from None
    with fh:
        reader = csv.DictReader(fh)
        missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise WorkloadError(f"{path}: missing column(s) {missing}; header must contain {list(CSV_COLUMNS)}")
        rows: list[tuple[float, int, int]] = []
        for row in reader:
            line = reader.line_num
            try:
                t = float(row["arrival_s"])
            except (TypeError, ValueError):
                raise WorkloadError(f"{path}:{line}: arrival_s {row['arrival_s']!r} is not a number") from None
            if not np.isfinite(t) or t < 0:
                raise WorkloadError(f"{path}:{line}: arrival_s {row['arrival_s']!r} must be finite and >= 0")
            lens = []
            for col in ("prompt_tokens", "output_tokens"):
                raw = row[col]
                try:
                    v = int(raw)
                except (TypeError, ValueError):
                    raise WorkloadError(f"{path}:{line}: {col} {raw!r} is not an integer") from None
                if v < 1:
                    raise WorkloadError(f"{path}:{line}: {col} must be >= 1, got {v}")
                lens.append(v)
            rows.append((t, lens[0], lens[1]))
    if not rows:
        raise WorkloadError(f"{path}: no requests")
    a, p, o = (np.array(c) for c in zip(*rows))
    return Workload(a, p, o)
