"""Registry of policies: every module in this package registers its classes, installed plug-ins register theirs
through the ``kvsim.policies`` entry-point group, and users register their own with ``@register``.

Combinators (``ada(...)``, ``decoding(...)``, ``critical(...)``) are registered here as *wrappers*: a name and a
function that builds the class ``wrapper(inner)`` from the inner policy's class. ``policies/core/combinators.py``
registers kvsim's own when it is imported (discovery imports it after the policy modules), so this module imports
nothing above ``policies.core.base``.
"""
from __future__ import annotations

import importlib
import pkgutil
import warnings
from importlib.metadata import entry_points
from typing import Any, Callable, NamedTuple

import policies
from policies.core.base import Policy, PolicyError

#: entry-point group of policy plug-ins: ``name = "package.module"``; importing the module registers its policies
POLICIES_GROUP = "kvsim.policies"

_REGISTRY: dict[str, type[Policy]] = {}
_discovered = False


class Wrapper(NamedTuple):
    """A combinator: ``build(inner_class)`` returns the class ``name(inner)`` or raises PolicyError saying why the
    pair makes no sense; ``listed(inner_class)`` says whether ``list_policies`` enumerates ``name(inner)``."""

    build: Callable[[type[Policy]], type[Policy]]
    listed: Callable[[type[Policy]], bool]


_WRAPPERS: dict[str, Wrapper] = {}


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


def register_wrapper(name: str, build: Callable[[type[Policy]], type[Policy]],
                     listed: Callable[[type[Policy]], bool] = lambda cls: False) -> None:
    """Make ``name(INNER)`` resolvable: ``build`` turns the inner policy's class into the combined class."""
    if not name.isidentifier():
        raise PolicyError(f"combinator name {name!r} must be an identifier")
    _WRAPPERS[name] = Wrapper(build, listed)


def _load_plugins() -> None:
    """Import every module named in the ``kvsim.policies`` entry-point group (installed plug-in packages)."""
    for ep in entry_points(group=POLICIES_GROUP):
        try:
            ep.load()
        except Exception as e:  # noqa: BLE001 - any failure of third-party code is reported the same way
            dist = f" (package {ep.dist.name})" if getattr(ep, "dist", None) else ""
            warnings.warn(f"kvsim policy plug-in {ep.name!r} = {ep.value!r}{dist} failed to load and is left out: "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    for mod in pkgutil.iter_modules(policies.__path__):  # every module outside core/ but a policy's private helpers
        if not mod.ispkg and not mod.name.startswith("_"):
            importlib.import_module(f"policies.{mod.name}")
    importlib.import_module("policies.core.combinators")
    _load_plugins()


def split_name(name: str) -> tuple[str, str] | None:
    """``'ada(knorm)'`` -> ``('ada', 'knorm')``, ``'ada(critical(knorm))'`` -> ``('ada', 'critical(knorm)')``;
    None for a plain name."""
    head, paren, rest = name.partition("(")
    if not paren:
        return None
    if not rest.endswith(")") or rest.count("(") != rest.count(")") - 1:
        raise PolicyError(f"policy name {name!r}: unbalanced parentheses")
    return head.strip(), rest[:-1].strip()


def list_policies(combinators: bool = True) -> list[str]:
    """Names of all registered policies, sorted, then (``combinators``) every combinator over every policy it
    lists (one level: ``ada(knorm)``, not ``ada(critical(knorm))``)."""
    _discover()
    names = sorted(_REGISTRY)
    if combinators:
        names += [f"{w}({n})" for w, wrapper in _WRAPPERS.items() for n in sorted(_REGISTRY)
                  if wrapper.listed(_REGISTRY[n])]
    return names


def policy_class(name: str) -> type[Policy]:
    """The class registered under ``name``, or the combined class of ``wrapper(inner)`` (nested to any depth)."""
    _discover()
    split = split_name(name)
    if split is not None:
        wrapper, inner = split
        if wrapper not in _WRAPPERS:
            raise PolicyError(f"unknown combinator {wrapper!r} in {name!r}; available: {', '.join(sorted(_WRAPPERS))}")
        return _WRAPPERS[wrapper].build(policy_class(inner))
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; available: {', '.join(sorted(_REGISTRY))}") from None


def get_policy(name: str, **params: Any) -> Policy:
    """Instantiate a registered policy with validated parameters (paper defaults for the rest)."""
    return policy_class(name)(**params)
