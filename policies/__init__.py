"""KV-cache eviction policies: one module per policy, a shared interface and a registry.

The names below are imported when first used (PEP 562): ``import policies.errors`` (the CLI's error handling) stays
free of numba, and a command imports the policy machinery only when it runs one.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"Guarantees": "policies.base", "Param": "policies.base", "Policy": "policies.base",
            "PolicyError": "policies.errors", "param_indices": "policies.base", "get_policy": "policies.registry",
            "list_policies": "policies.registry", "policy_class": "policies.registry", "register": "policies.registry"}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'policies' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
