"""On-GPU validation: Triton kernels, the varlen KV cache and the closed-loop model runner."""
