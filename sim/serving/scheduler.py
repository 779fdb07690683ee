"""Continuous-batching LLM server as a simpy discrete-event simulation.

One scheduler process owns the GPU. At every iteration boundary it (1) moves arrived requests into a FCFS
queue (requests that could never fit the pool alone are rejected), (2) admits queue-head requests while the
batch has room, their prefill peak fits under the admission limit, and the prompt tokens of the iteration stay
within ``max_batched_tokens`` (one request always may go), and runs a prefill iteration for them (it emits
their next token), else (3) runs a decode iteration of the whole batch (one token per request). Before a
decode iteration whose memory would exceed the pool, the most recently admitted requests are preempted
(recompute mode: their KV is dropped and they re-enter the queue head; re-admission re-prefills prompt plus
generated tokens). Prefill and decode iterations do not mix (no chunked prefill).

Token accounting: a request with prompt P and output O emits token 1 at the end of its prefill (TTFT) and one
more per decode iteration; its cache holds P + e - 1 tokens after emitting e tokens; it leaves after O tokens.

Aggregation: ``aggregate_steps > 1`` lets one simpy event cover several decode iterations while the batch
composition is unchanged (the numba kernel stops at the first finish, memory shortfall, or admissible queue
head), so the decisions and clock are identical to ``aggregate_steps == 1`` (one event per iteration).
Arrivals are exogenous: the scheduler process reads them from the sorted workload at each boundary (and sleeps
until the next one when idle) instead of one simpy process per request, so a window can see the next arrival.
An optional sampler process records the number of requests in the system every ``sample_interval`` seconds.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import simpy

from sim.serving._window import decode_window, held_bytes
from sim.serving.costs import CostModel
from sim.serving.footprint import MemoryTables
from sim.serving.hardware import GPUProfile, ModelMemory, ServingConfigError
from sim.serving.workload import Workload

INFINITE_POOL = 1 << 62


def kv_pool_bytes(model: ModelMemory, gpu: GPUProfile, memory_utilization: float = 0.9) -> int:
    """KV pool left on the GPU: ``memory_utilization`` of its memory minus the weights (vLLM's convention)."""
    if not 0 < memory_utilization <= 1:
        raise ServingConfigError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    pool = gpu.memory_bytes * memory_utilization - model.weight_bytes
    if pool <= 0:
        raise ServingConfigError(f"{model.name} weights ({model.weight_bytes / 1e9:.1f} GB) leave no KV memory on "
                                 f"{gpu.name} at utilisation {memory_utilization}")
    return int(pool)


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits. ``pool_bytes=None`` is infinite memory; ``aggregate_steps=1`` is one event per step."""

    pool_bytes: int | None = None
    max_batch: int = 256
    max_batched_tokens: int = 8192
    admit_watermark: float = 0.01
    aggregate_steps: int = 1024
    sample_interval: float | None = None

    def __post_init__(self) -> None:
        if self.pool_bytes is not None and self.pool_bytes <= 0:
            raise ServingConfigError(f"pool_bytes must be > 0 or None (infinite), got {self.pool_bytes}")
        if self.max_batch < 1 or self.max_batched_tokens < 1 or self.aggregate_steps < 1:
            raise ServingConfigError("max_batch, max_batched_tokens and aggregate_steps must be >= 1")
        if not 0 <= self.admit_watermark < 1:
            raise ServingConfigError(f"admit_watermark must be in [0, 1), got {self.admit_watermark}")
        if self.sample_interval is not None and not self.sample_interval > 0:
            raise ServingConfigError(f"sample_interval must be > 0, got {self.sample_interval}")


@dataclass
class ServingResult:
    """Per-request times (NaN where not reached) and run-level accumulators."""

    workload: Workload
    admitted: np.ndarray      # start of the first prefill
    first_token: np.ndarray
    finish: np.ndarray
    preemptions: np.ndarray
    rejected: np.ndarray      # bool: could never fit the pool
    pool_bytes: int | None
    makespan: float           # first arrival to last finish
    byte_seconds: float       # integral of held KV bytes over time
    running_seconds: float    # integral of the running batch size over time
    peak_bytes: int
    max_running: int
    decode_iterations: int
    decode_tokens: int        # tokens emitted by decode iterations (sum of their batch sizes)
    prefill_iterations: int
    events: int               # simpy events the scheduler yielded
    samples: np.ndarray       # [m, 2] (time, requests in system) from the sampler, or empty


def _next_index(mask: np.ndarray) -> np.ndarray:
    """``out[i]`` = smallest j >= i with mask[j], or len(mask)."""
    n = len(mask)
    idx = np.where(mask, np.arange(n), n)
    return np.minimum.accumulate(idx[::-1])[::-1] if n else idx


def simulate(workload: Workload, tables: MemoryTables, cost: CostModel, config: SchedulerConfig = SchedulerConfig(),
             progress: Callable[[int], None] | None = None) -> ServingResult:
    """Run the server on ``workload`` until every request finished or was rejected."""
    if len(tables.held) <= workload.max_context:
        raise ServingConfigError(f"memory tables cover {len(tables.held) - 1} tokens but the workload reaches "
                                 f"{workload.max_context}")
    sim = _Server(workload, tables, cost, config, progress)
    env = simpy.Environment()
    env.process(sim.schedule(env))
    if config.sample_interval is not None:
        env.process(sim.sample(env, config.sample_interval))
    env.run()
    return sim.result()


class _Server:
    """State of one run; ``schedule`` is the simpy process.

    The running batch is the first ``count`` entries of ``n`` (tokens cached), ``rem`` (tokens still to emit) and
    ``rid`` (request index), in admission order (``count``, the clock and ``ptr``, the first arrival not yet seen,
    are ``schedule``'s locals); ``waiting`` is the FCFS queue; ``emitted`` counts the tokens each request emitted,
    kept current for queued requests only."""

    def __init__(self, w: Workload, tables: MemoryTables, cost: CostModel, cfg: SchedulerConfig,
                 progress: Callable[[int], None] | None) -> None:
        self.w, self.t, self.cost, self.cfg, self.progress = w, tables, cost, cfg, progress
        self.pool = INFINITE_POOL if cfg.pool_bytes is None else int(cfg.pool_bytes)
        self.admit_limit = self.pool if cfg.pool_bytes is None else int(self.pool * (1.0 - cfg.admit_watermark))
        n = len(w)
        last = w.prompt + w.output - 1
        # Worst moment alone: re-prefill of the longest context, or holding the largest footprint on the way.
        hmax = np.maximum.accumulate(tables.held)
        peak_max = np.maximum.accumulate(tables.peak)[last]
        self.feasible = (peak_max <= self.admit_limit) & (hmax[last] <= self.pool)
        self.next_feasible = _next_index(self.feasible)
        self.admitted = np.full(n, np.nan)
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.preemptions = np.zeros(n, dtype=np.int64)
        self.done = 0
        self.finished = 0
        self.stats = np.zeros(6)
        self.prefills = 0
        self.events = 0
        self.samples: list[tuple[float, int]] = []
        self.clock = 0.0
        # the scheduler's working state (Python lists: read one item at a time)
        self.arrival, self.prompt, self.output = w.arrival.tolist(), w.prompt.tolist(), w.output.tolist()
        self._feasible, self._next_feasible = self.feasible.tolist(), self.next_feasible.tolist()
        B = cfg.max_batch
        self.n = np.zeros(B, dtype=np.int64)
        self.rem = np.zeros(B, dtype=np.int64)
        self.rid = np.zeros(B, dtype=np.int64)
        self.fin_buf = np.zeros(B, dtype=np.int64)
        self.waiting: deque[int] = deque()
        self.emitted = [0] * n
        self.reported = 0
        self.report_every = max(1, n // 200)
        #: ``decode_window``'s arguments that stay the same through the run (one lookup per event)
        self._window_args = (self.n, self.rem, self.rid, tables.held, tables.read, cost.decode_fixed_s,
                             cost.kv_seconds_per_byte, self.pool, self.admit_limit, cfg.aggregate_steps, self.stats,
                             self.fin_buf)

    def schedule(self, env: simpy.Environment):
        """The GPU's iteration loop (see the module docstring); yields one timeout per event. The clock, the batch
        size and the next arrival are this loop's locals (it runs once per event); the helpers take and return
        them."""
        N, arrival, waiting, held, n, fin_buf = (len(self.w), self.arrival, self.waiting, self.t.held, self.n,
                                                 self.fin_buf)
        admissions, prefill_time, end_prefill, window = (self._admissions, self._prefill_time, self._end_prefill,
                                                         self._decode_window)   # bound once: the loop runs per event
        clock, count, ptr = 0.0, 0, 0
        while True:
            if ptr < N and arrival[ptr] <= clock:
                ptr = self._take_arrivals(ptr, clock)
            if self.progress is not None and self.done - self.reported >= self.report_every:
                self._report_progress()
            if count == 0 and not waiting:
                if ptr >= N:
                    break
                clock = arrival[ptr]                 # idle until the next arrival
                self.events += 1
                yield env.timeout(max(0.0, clock - env.now))
                continue
            mem_now = int(held_bytes(held, n, count))
            joining, contexts, extra = admissions(mem_now, count) if waiting else ((), (), 0)
            if joining:
                start = clock
                clock += prefill_time(joining, contexts, mem_now + extra, count)
                self.events += 1
                yield env.timeout(max(0.0, clock - env.now))
                count = end_prefill(joining, contexts, start, clock, count)
                continue
            if count == 0:
                raise AssertionError("queue head cannot be admitted into an empty server despite feasibility")
            k, new_clock, n_fin = window(count, ptr, clock)
            if k == 0:
                count = self._preempt(count)
                continue
            clock = new_clock
            self.events += 1
            yield env.timeout(max(0.0, clock - env.now))
            if n_fin:
                self.finish[fin_buf[:n_fin]] = clock
                self.done += n_fin
                self.finished += n_fin
                count -= n_fin
        self.clock = clock
        if self.progress is not None and self.done > self.reported:
            self._report_progress()

    def _report_progress(self) -> None:
        self.progress(self.done - self.reported)
        self.reported = self.done

    def _take_arrivals(self, ptr: int, clock: float) -> int:
        """Queue the requests from ``ptr`` on that arrived by ``clock`` (one that could never fit the pool alone is
        rejected: done); returns the first arrival not yet seen."""
        arrival, feasible, N = self.arrival, self._feasible, len(self.arrival)
        while ptr < N and arrival[ptr] <= clock:
            if feasible[ptr]:
                self.waiting.append(ptr)
            else:
                self.done += 1
            ptr += 1
        return ptr

    def _admissions(self, mem_now: int, count: int) -> tuple[list[int], list[int], int]:
        """Take queue-head requests while the batch of ``count`` has room, their prefill peaks fit under the
        admission limit beside the ``mem_now`` bytes held, and the iteration's prompt tokens stay within
        ``max_batched_tokens`` (one request always may go). Returns their indices, their contexts (prompt plus
        tokens emitted before a preemption) and their summed prefill peaks."""
        waiting, B, max_tokens = self.waiting, self.cfg.max_batch, self.cfg.max_batched_tokens
        prompt, emitted, peak, limit = self.prompt, self.emitted, self.t.peak, self.admit_limit
        admitted: list[int] = []
        contexts: list[int] = []
        extra = 0
        tokens = 0
        while waiting and count + len(admitted) < B:
            r = waiting[0]
            c = prompt[r] + emitted[r]
            need = int(peak[c])
            if mem_now + extra + need > limit or (admitted and tokens + c > max_tokens):
                break
            waiting.popleft()
            admitted.append(r)
            contexts.append(c)
            extra += need
            tokens += c
        return admitted, contexts, extra

    def _prefill_time(self, joining: list[int], contexts: list[int], mem: int, count: int) -> float:
        """The seconds of one prefill iteration of the requests ``joining`` the batch of ``count`` (``mem`` bytes
        held at its peak), counted into the run's accumulators."""
        dur = self.cost.prefill_time(contexts)
        batch = count + len(joining)
        self.stats[0] += mem * dur
        self.stats[1] += batch * dur
        self.stats[2] = max(self.stats[2], mem)
        self.stats[5] = max(self.stats[5], batch)
        self.prefills += 1
        return dur

    def _end_prefill(self, joining: list[int], contexts: list[int], start: float, clock: float, count: int) -> int:
        """At ``clock``, the end of a prefill iteration that began at ``start``: each joining request emits its
        next token; the finished leave, the others join the batch. Returns the batch size."""
        emitted, output, n, rem, rid = self.emitted, self.output, self.n, self.rem, self.rid
        admitted, first_token, finish = self.admitted, self.first_token, self.finish
        for r, c in zip(joining, contexts):
            if emitted[r] == 0:
                admitted[r] = start
                first_token[r] = clock
            emitted[r] += 1
            if emitted[r] >= output[r]:
                finish[r] = clock
                self.done += 1
                self.finished += 1
            else:
                n[count], rem[count], rid[count] = c, output[r] - emitted[r], r
                count += 1
        return count

    def _decode_window(self, count: int, ptr: int, clock: float) -> tuple[int, float, int]:
        """Run the batch's decode iterations until its composition would change (``decode_window``), knowing when
        the next request to admit is there: the queue head now, or the next admissible arrival from ``ptr``."""
        n, rem, rid, held, read, fixed_s, spb, pool, limit, steps, stats, fin = self._window_args
        waiting, N = self.waiting, len(self.arrival)
        head_time, head_need, room = np.inf, 0, count < len(n)
        if waiting:
            h = waiting[0]
            head_time, head_need = -np.inf, int(self.t.peak[self.prompt[h] + self.emitted[h]])
        elif ptr < N and self._next_feasible[ptr] < N:
            h = self._next_feasible[ptr]
            head_time, head_need = self.arrival[h], int(self.t.peak[self.prompt[h]])
        return decode_window(n, rem, rid, count, held, read, clock, fixed_s, spb, pool, limit, steps, head_time,
                             head_need, room, stats, fin)

    def _preempt(self, count: int) -> int:
        """Before a decode iteration that would not fit the pool: preempt the most recently admitted requests until
        it fits (recompute mode: their KV is dropped, they return to the queue head with the tokens they emitted).
        Returns the batch size left."""
        need_next = self.t.held[self.n[:count] + 1]
        total = int(need_next.sum())
        while total > self.pool:
            count -= 1
            total -= int(need_next[count])
            r = int(self.rid[count])
            self.emitted[r] = self.output[r] - int(self.rem[count])
            self.preemptions[r] += 1
            self.waiting.appendleft(r)
        return count

    def sample(self, env: simpy.Environment, dt: float):
        """Every ``dt`` record the number of requests in the system (arrived, not rejected, not finished)."""
        cum_feasible = np.cumsum(self.feasible)
        arrival = self.w.arrival
        while self.done < len(self.w):
            yield env.timeout(dt)
            i = int(np.searchsorted(arrival, env.now, side="right"))
            arrived = int(cum_feasible[i - 1]) if i else 0
            self.samples.append((env.now, arrived - self.finished))

    def result(self) -> ServingResult:
        return ServingResult(
            workload=self.w, admitted=self.admitted, first_token=self.first_token, finish=self.finish,
            preemptions=self.preemptions, rejected=~self.feasible,
            pool_bytes=None if self.cfg.pool_bytes is None else self.pool,
            makespan=max(0.0, self.clock - float(self.w.arrival[0])),
            byte_seconds=float(self.stats[0]), running_seconds=float(self.stats[1]), peak_bytes=int(self.stats[2]),
            max_running=int(self.stats[5]), decode_iterations=int(self.stats[3]), decode_tokens=int(self.stats[4]),
            prefill_iterations=self.prefills, events=self.events,
            samples=np.array(self.samples, dtype=np.float64).reshape(-1, 2))
