"""Registry of policies: every module in this package registers its classes; users register their own."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from policies.base import Policy, PolicyError

_REGISTRY: dict[str, type[Policy]] = {}
_NOT_POLICY_MODULES = {"base", "registry", "kernels", "scorer", "combinators"}
_discovered = False


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its ``name`` to the CLI, sweeps and tests."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)) or not cls.name:
        raise PolicyError(f"{cls!r} must be a Policy subclass with a non-empty name")
    index = getattr(cls, "P", None)
    if index is not None and tuple(index._fields if index else ()) != tuple(p.name for p in cls.schema):
        raise PolicyError(f"{cls.name}: its parameter index P names {list(index._fields if index else ())} but its "
                          f"schema is {[p.name for p in cls.schema]}; build P with param_indices(schema)")
    other = _REGISTRY.get(cls.name)
    if other is not None and other is not cls and other.__qualname__ != cls.__qualname__:
        raise PolicyError(f"policy name {cls.name!r} is already registered by {other.__module__}.{other.__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    import policies

    for mod in pkgutil.iter_modules(policies.__path__):
        if mod.name not in _NOT_POLICY_MODULES and not mod.name.startswith("_"):
            importlib.import_module(f"policies.{mod.name}")
    _discovered = True


def list_policies(combinators: bool = True) -> list[str]:
    """Names of all registered policies, sorted, then (``combinators``) every combinator over every scorer."""
    _discover()
    names = sorted(_REGISTRY)
    if combinators:
        from policies.combinators import WRAPPERS
        from policies.scorer import ScorerPolicy
        scorers = [n for n in names if issubclass(_REGISTRY[n], ScorerPolicy)]
        names += [f"{w}({n})" for w in WRAPPERS for n in scorers]
    return names


def policy_class(name: str) -> type[Policy]:
    """The class registered under ``name``, or the combinator class ``wrapper(scorer)``."""
    _discover()
    if "(" in name:
        from policies.combinators import combined_class, split_name
        wrapper, inner = split_name(name)
        return combined_class(wrapper, policy_class(inner))
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; available: {', '.join(sorted(_REGISTRY))}") from None


def get_policy(name: str, **params: Any) -> Policy:
    """Instantiate a registered policy with validated parameters (paper defaults for the rest)."""
    return policy_class(name)(**params)
