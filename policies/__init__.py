"""KV-cache eviction policies: one module per policy, a shared interface and a registry.

Every module of this package is one policy (``_``-prefixed modules are a policy's private helpers); the machinery
they share is ``policies.core``. The names below are imported when first used (PEP 562): ``import
policies.core.errors`` (the CLI's error handling) stays free of numba, and a command imports the policy machinery
only when it runs one.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {**dict.fromkeys(("Guarantees", "Param", "Policy", "param_indices"), "policies.core.base"),
            "PolicyError": "policies.core.errors",
            **dict.fromkeys(("get_policy", "list_policies", "policy_class", "register"), "policies.core.registry")}

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
