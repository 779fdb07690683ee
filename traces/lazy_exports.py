"""A package's public names imported from their modules when first used (PEP 562), so that importing a light part
of a package (the CLI's help, the error classes) does not import numpy, numba or the engine behind its other names.

It lives in the bottom package and imports nothing but ``importlib``, so that every kvsim package's ``__init__``
(``traces``, ``policies``, ``sim.replay``, ``sim.serving``) exports its names the same way.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping


def lazy_exports(package: str, where: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package named ``package`` (call it from the package's ``__init__`` with
    ``__name__``), whose public names ``where`` maps to the module that defines each (its absolute name). A name is
    imported on its first use and kept in the package's namespace; any other name is an AttributeError."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
