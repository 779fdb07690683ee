"""The compressed K/V cache on the GPU: the per-head variable-length cache, its Triton kernels, their torch references
and the backends the runner picks from."""
