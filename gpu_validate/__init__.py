"""GPU validation: Triton kernels over per-head variable-length caches, a closed-loop model runner, fidelity."""
