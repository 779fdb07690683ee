"""The model side: policies run inside real models, and the studies that put the simulator beside them.

- ``gpu_validate.kvcache``: the per-head variable-length K/V cache, its Triton kernels and their torch references.
- ``gpu_validate.closedloop``: a model decoding many (policy, budget, prompt) rows over compressed caches.
- ``gpu_validate.generation``: any policy inside transformers' ``generate()``.
- ``gpu_validate.studies``: fidelity, needle / RULER retrieval and ``kvsim recommend``.
- ``gpu_validate.model_commands``: the kvsim subcommands that run a model; ``gpu_validate.lm_eval_model``:
  lm-evaluation-harness's model type.
"""
