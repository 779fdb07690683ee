"""Per-iteration cost model of an LLM server: memory-bound decode steps and FLOP-bound prefills.

Decode iteration (whole batch, one token each)::

    t_decode = step_overhead + weight_bytes / (eff_bw * hbm_bw)            # weights read once per step
               + attn_calls * attn_call_overhead + kv_bytes_read * kv_seconds_per_byte

Prefill iteration (the prompts admitted together)::

    t_prefill = prefill_overhead + sum_i (2 * n_params * c_i + 2 * L * Hq * d * c_i**2) / (eff_flops * peak_flops)

(2 FLOPs per parameter per token; causal attention QK^T and PV cost c^2 * d FLOPs each per head).
The default profile takes bandwidth and FLOP/s from the GPU datasheet times the stated efficiencies of
``GPUProfile``; ``with_kernel_fit`` replaces the attention terms by a least-squares fit to measured
kernel timings (``sim.serving.fit``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from sim.serving.fit import KernelFit
from sim.serving.hardware import GPUProfile, ModelMemory, ServingConfigError


@dataclass(frozen=True)
class CostModel:
    """Deterministic iteration times in seconds; every coefficient is explicit so tests can hand-compute."""

    step_overhead_s: float
    weight_time_s: float
    kv_seconds_per_byte: float
    prefill_overhead_s: float
    flops_per_token: float
    attn_flops_coef: float
    seconds_per_flop: float
    attn_call_overhead_s: float = 0.0
    attn_calls_per_step: int = 0
    source: str = "custom"

    def __post_init__(self) -> None:
        for f in ("step_overhead_s", "weight_time_s", "kv_seconds_per_byte", "prefill_overhead_s",
                  "flops_per_token", "attn_flops_coef", "seconds_per_flop", "attn_call_overhead_s"):
            v = getattr(self, f)
            if not (np.isfinite(v) and v >= 0):
                raise ServingConfigError(f"cost model: {f} must be finite and >= 0, got {v!r}")
        if self.attn_calls_per_step < 0:
            raise ServingConfigError(f"cost model: attn_calls_per_step must be >= 0, got {self.attn_calls_per_step}")

    @property
    def decode_fixed_s(self) -> float:
        """The part of a decode iteration that does not depend on the KV bytes read."""
        return self.step_overhead_s + self.weight_time_s + self.attn_calls_per_step * self.attn_call_overhead_s

    def decode_time(self, kv_bytes_read: float) -> float:
        """Seconds of one decode iteration of the whole batch that reads ``kv_bytes_read`` bytes of KV."""
        return self.decode_fixed_s + kv_bytes_read * self.kv_seconds_per_byte

    def prefill_time(self, contexts: Sequence[int]) -> float:
        """Seconds of one prefill iteration over prompts of the given token counts."""
        s1 = float(sum(contexts))
        s2 = float(sum(c * c for c in contexts))
        return self.prefill_overhead_s + (self.flops_per_token * s1 + self.attn_flops_coef * s2) * self.seconds_per_flop

    @classmethod
    def from_profile(cls, model: ModelMemory, gpu: GPUProfile) -> "CostModel":
        """The documented default: datasheet peaks times the profile's efficiency assumptions."""
        bw = gpu.hbm_bandwidth * gpu.bandwidth_efficiency
        return cls(step_overhead_s=gpu.step_overhead_s, weight_time_s=model.weight_bytes / bw,
                   kv_seconds_per_byte=1.0 / bw, prefill_overhead_s=gpu.prefill_overhead_s,
                   flops_per_token=2.0 * model.n_params,
                   attn_flops_coef=2.0 * model.n_layers * model.n_q_heads * model.head_dim,
                   seconds_per_flop=1.0 / (gpu.peak_flops * gpu.flops_efficiency),
                   source=f"profile:{gpu.name}/{model.name}")

    def with_kernel_fit(self, fit: KernelFit, calls_per_step: int) -> "CostModel":
        """Attention terms from measured kernels: ``calls_per_step`` launches (one per layer) of the fitted kernel."""
        if calls_per_step < 1:
            raise ServingConfigError(f"calls_per_step must be >= 1, got {calls_per_step}")
        return replace(self, kv_seconds_per_byte=fit.seconds_per_byte, attn_call_overhead_s=fit.intercept_s,
                       attn_calls_per_step=int(calls_per_step), source=f"{self.source}+fit:{fit.device or 'all'}")
