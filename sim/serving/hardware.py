"""Model memory configurations and GPU profiles: what a KV slot costs in bytes and what the GPU can move.

Peak numbers are vendor datasheet values (sources in each preset's ``source``); efficiencies are
stated assumptions, meant to be replaced by a fit to measured kernel timings (``sim.serving.fit``).
"""
from __future__ import annotations

from dataclasses import dataclass


class ServingConfigError(ValueError):
    """A serving configuration value is missing, unknown or out of range."""


@dataclass(frozen=True)
class ModelMemory:
    """The parts of a decoder model's shape that set KV memory, weight traffic and prefill FLOPs."""

    name: str
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    n_params: float          # parameter count (weights read once per decode step, 2 FLOPs/param/token)
    dtype_bytes: int = 2     # KV cache and weights in fp16/bf16
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("n_layers", "n_q_heads", "n_kv_heads", "head_dim", "dtype_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ServingConfigError(f"model {self.name!r}: {f} must be a positive integer, got {v!r}")
        if not self.n_params > 0:
            raise ServingConfigError(f"model {self.name!r}: n_params must be positive, got {self.n_params!r}")
        if self.n_q_heads % self.n_kv_heads:
            raise ServingConfigError(f"model {self.name!r}: n_q_heads {self.n_q_heads} is not a multiple of "
                                     f"n_kv_heads {self.n_kv_heads}")

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one cached token in every layer and KV head: K and V, ``head_dim`` values each."""
        return self.n_layers * self.n_kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.n_params * self.dtype_bytes


@dataclass(frozen=True)
class GPUProfile:
    """Peak capabilities of one GPU plus the efficiencies assumed for the default cost model."""

    name: str
    memory_bytes: float
    hbm_bandwidth: float            # bytes/s, datasheet peak
    peak_flops: float               # dense fp16/bf16 tensor FLOP/s, datasheet peak
    bandwidth_efficiency: float = 0.8   # assumption: memory-bound GEMV / attention reach ~80 % of peak
    flops_efficiency: float = 0.5       # assumption: prefill model-FLOPs utilisation ~50 %
    step_overhead_s: float = 1.0e-3     # assumption: launch + scheduling cost per decode iteration
    prefill_overhead_s: float = 2.0e-3  # assumption: same for a prefill iteration
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("memory_bytes", "hbm_bandwidth", "peak_flops"):
            if not getattr(self, f) > 0:
                raise ServingConfigError(f"gpu {self.name!r}: {f} must be positive, got {getattr(self, f)!r}")
        for f in ("bandwidth_efficiency", "flops_efficiency"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise ServingConfigError(f"gpu {self.name!r}: {f} must be in (0, 1], got {v!r}")
        for f in ("step_overhead_s", "prefill_overhead_s"):
            if not getattr(self, f) >= 0:
                raise ServingConfigError(f"gpu {self.name!r}: {f} must be >= 0, got {getattr(self, f)!r}")


MODELS: dict[str, ModelMemory] = {
    "llama-2-7b": ModelMemory("llama-2-7b", n_layers=32, n_q_heads=32, n_kv_heads=32, head_dim=128,
                              n_params=6.74e9, source="meta-llama/Llama-2-7b-hf config.json; 6.74B params "
                              "(Touvron et al. 2023, Table 1)"),
    "llama-3-8b": ModelMemory("llama-3-8b", n_layers=32, n_q_heads=32, n_kv_heads=8, head_dim=128,
                              n_params=8.03e9, source="meta-llama/Meta-Llama-3-8B config.json (GQA, 8 KV heads); "
                              "8.03B params"),
    "mistral-7b": ModelMemory("mistral-7b", n_layers=32, n_q_heads=32, n_kv_heads=8, head_dim=128,
                              n_params=7.24e9, source="mistralai/Mistral-7B-v0.1 config.json; 7.24B params"),
}

GPUS: dict[str, GPUProfile] = {
    "a100-80gb": GPUProfile("a100-80gb", memory_bytes=80e9, hbm_bandwidth=2.039e12, peak_flops=312e12,
                            source="NVIDIA A100 datasheet (SXM4 80GB): 2,039 GB/s HBM2e, 312 TFLOPS BF16 dense"),
    "h100-sxm": GPUProfile("h100-sxm", memory_bytes=80e9, hbm_bandwidth=3.35e12, peak_flops=989e12,
                           source="NVIDIA H100 datasheet (SXM5 80GB): 3.35 TB/s HBM3, 989 TFLOPS BF16 dense"),
    "h200": GPUProfile("h200", memory_bytes=141e9, hbm_bandwidth=4.8e12, peak_flops=989e12,
                       source="NVIDIA H200 datasheet (SXM 141GB): 4.8 TB/s HBM3e, 989 TFLOPS BF16 dense"),
}


def get_model(name: str) -> ModelMemory:
    """A model memory preset by name."""
    try:
        return MODELS[name]
    except KeyError:
        raise ServingConfigError(f"unknown model {name!r}; presets: {', '.join(sorted(MODELS))} "
                                 f"(or build a ModelMemory yourself)") from None


def get_gpu(name: str) -> GPUProfile:
    """A GPU profile preset by name."""
    try:
        return GPUS[name]
    except KeyError:
        raise ServingConfigError(f"unknown gpu {name!r}; presets: {', '.join(sorted(GPUS))}") from None
