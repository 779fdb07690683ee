"""Replay: a policy walked over a recorded trace by the numba engine, and the metrics of what it kept.

``from sim.replay import replay`` (and ``replay_budgets``) is the public entry point; the names are imported when
first used (PEP 562), so that importing a submodule such as ``sim.replay.threads`` does not compile the engine.
"""

from __future__ import annotations

from traces.lazy_exports import lazy_exports

_EXPORTS = {"replay": "sim.replay.policy_replay", "replay_budgets": "sim.replay.policy_replay",
            "ReplayResult": "sim.replay.result"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
