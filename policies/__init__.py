"""KV-cache eviction policies: one module per policy, a shared interface and a registry."""
from policies.base import Guarantees, Param, Policy, PolicyError, param_indices
from policies.registry import get_policy, list_policies, policy_class, register

__all__ = ["Guarantees", "Param", "Policy", "PolicyError", "param_indices", "get_policy", "list_policies", "policy_class", "register"]
