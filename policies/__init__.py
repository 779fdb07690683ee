"""KV-cache eviction policies: one module per policy, a shared interface and a registry.

Every module of this package is one policy (``_``-prefixed modules are a policy's private helpers); the machinery
they share is ``policies.core``. The names below are imported when first used (PEP 562): ``import
policies.core.errors`` (the CLI's error handling) stays free of numba, and a command imports the policy machinery
only when it runs one.
"""
from __future__ import annotations

from traces.lazy_exports import lazy_exports

_EXPORTS = {**dict.fromkeys(("Guarantees", "Param", "Policy", "param_indices"), "policies.core.base"),
            "PolicyError": "policies.core.errors",
            **dict.fromkeys(("get_policy", "list_policies", "policy_class", "register"), "policies.core.registry")}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
