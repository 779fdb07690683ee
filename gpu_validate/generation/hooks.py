"""`kvsim_cache`: the block inside which a model generates (or is stepped by hand) over a `KVSimCache`.

Two things make the cache work, both undone when the block ends: the model's attention is routed to the cache
(`traces.hf.routing.routed`), and the model's ``forward`` is wrapped so that a call carrying this cache goes
to it -- the prompt call (the first) to `KVSimCache.prefill`, the runner's own prompt phase, whose logits the
call returns; each later call to the model with the rows' true positions, timed -- while every other call
(the runner's own prompt forwards, other caches) passes through untouched. The prompt is not run by the model's
forward over the padded batch because a streamed policy (H2O, TOVA, ...) compresses while the prompt goes in: the
prompt's last logits are then those of a compressed cache, which only the runner's token-by-token prompt gives.

```python
with kvsim_cache(model, "decoding(snapkv, every=8)", 256, max_new_tokens=64) as cache:
    out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=64)
print(cache.kv_bytes_held())
```
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Iterator

import torch

from gpu_validate.generation.architectures import check_architecture
from gpu_validate.generation.cache import KVSimCache, model_output
from gpu_validate.validate_error import ValidateError
from policies.core.base import Policy
from traces.hf.routing import routed


@contextlib.contextmanager
def kvsim_cache(model, policy: Policy | str, budget: int | None = None, *, max_new_tokens: int,
                **options) -> Iterator[KVSimCache]:
    """A `KVSimCache` of ``model`` running ``policy`` at ``budget`` for one generate() call of up to
    ``max_new_tokens`` tokens (options: `KVSimCache`'s), usable inside the block: pass it as the model's cache
    (``cache=`` or ``past_key_values=``, whichever the installed transformers names it)."""
    check_architecture(model)
    cache = KVSimCache(model, policy, budget, max_new_tokens=max_new_tokens, **options)
    had_own = "forward" in vars(model)
    previous = model.forward
    model.forward = _wrapped_forward(previous, cache)
    model.eval()
    try:
        with routed(model, cache.attention):
            cache.active = True
            yield cache
    finally:
        cache.active = False
        if had_own:
            model.forward = previous
        else:
            del model.forward


def _wrapped_forward(forward, cache: KVSimCache):
    """``forward`` with the calls that carry ``cache`` sent to it (module docstring)."""
    sig = inspect.signature(forward)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        kw = sig.bind(*args, **kwargs).arguments
        kw.update(kw.pop(var_kw, None) or {})
        if kw.get("cache") is not cache and kw.get("past_key_values") is not cache:
            return forward(*args, **kwargs)
        ids = kw.get("input_ids")
        if ids is None:
            raise ValidateError("a KVSimCache needs input_ids (token ids), not inputs_embeds")
        with torch.no_grad():
            if not cache.groups:
                return model_output(cache, cache.prefill(ids, kw.get("attention_mask")))
            return cache.decode(ids, lambda positions: forward(**{**kw, "position_ids": positions}))

    return wrapped
