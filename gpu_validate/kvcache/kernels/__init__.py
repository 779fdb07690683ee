"""Triton kernels over a per-head variable-length KV cache (Ada-KV flat layout)."""

from gpu_validate.kvcache.kernels.kernel_errors import CacheCapacityError, KernelInputError

__all__ = ["CacheCapacityError", "KernelInputError"]
