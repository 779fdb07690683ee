"""Replay: a policy walked over a recorded trace by the numba engine, and the metrics of what it kept.

``from sim.replay import replay`` (and ``replay_budgets``) is the public entry point; the names are imported when
first used (PEP 562), so that importing a submodule such as ``sim.replay.threads`` does not compile the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"replay": "sim.replay.policy_replay", "replay_budgets": "sim.replay.policy_replay",
            "ReplayResult": "sim.replay.result"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sim.replay' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
