"""Any kvsim policy inside a real model's ``generate()``, with the memory really freed.

`kvsim_cache` (a context manager) gives a `KVSimCache`, a transformers ``Cache`` run by a policy spec, for
``model.generate`` or a forward loop; `generate` wraps both for token-id prompts. Modules: `cache` (the cache and
why attention is routed), `hooks` (the block that routes attention and the prompt call), `generate`,
`architectures` (which models, and the error for the others).
"""
from gpu_validate.generation.architectures import SUPPORTED_MODEL_TYPES, check_architecture
from gpu_validate.generation.cache import KVSimCache
from gpu_validate.generation.generate import GenerateResult, Generated, generate
from gpu_validate.generation.hooks import kvsim_cache

__all__ = ["SUPPORTED_MODEL_TYPES", "GenerateResult", "Generated", "KVSimCache", "check_architecture", "generate",
           "kvsim_cache"]
