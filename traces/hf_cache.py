"""The name transformers gives a model's KV cache argument and output: ``cache`` from transformers 5 on,
``past_key_values`` before (5.x still accepts the old name, with a deprecation warning, until 5.40)."""
from __future__ import annotations

import inspect
from typing import Any


def cache_name(model: Any) -> str:
    """``"cache"`` when the model's forward takes it, else ``"past_key_values"``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """Keyword arguments that hand ``cache`` to ``model(...)`` under the name this transformers uses."""
    return {cache_name(model): cache}


def returned_cache(model: Any, out: Any) -> Any:
    """The cache a forward of ``model`` returned in ``out``."""
    return getattr(out, cache_name(model))
