"""Scorer base: a policy whose author writes only the kernels that fill per-slot scores.

kvpress builds most presses as a ``score()`` method; this is kvsim's equivalent. A scorer module declares

- ``SCHEMA = protection(n_sink=..., n_recent=...) + (its own Params...)`` and ``P = param_indices(SCHEMA)``
  (the protection parameters come first, so the shared eviction code reads them at fixed positions);
- ``score_prompt(params, layer, q, k, v, scale, scores, slot_state, head_state)`` (``SCORE_PROMPT_SIG``):
  fill ``scores[h, i]`` for the P prompt tokens (higher = keep); ``slot_state[h, i, :]`` set here travels with
  the slot into decode;
- ``score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, scores)``
  (``SCORE_STEP_SIG``): fill ``scores[h, i]`` for the ``lengths[h]`` cached slots at decode step ``t``;

and a ``ScorerPolicy`` subclass naming them. The base supplies everything else: sink and recent-window
protection (``n_sink`` first positions and the ``n_recent`` newest are never candidates), per-head budgets,
eviction of the lowest scores (ties evict the older token), and the state layout. The combinators
``ada(scorer)`` and ``decoding(scorer, every, target)`` (policies/combinators.py) reuse the same two kernels.

Why generated wrappers: the engine takes kernels as first-class functions of one fixed signature
(``STEP_SIG``/``PREFILL_SIG``), so the step of each (scorer, mode) pair is its own small function calling the
scorer's kernels and a shared eviction routine as globals. It is built from a template with ``exec`` under
the scorer module's file name and a unique qualified name, which keeps numba's on-disk cache working: a
second process loads it instead of compiling (tests/test_scorers.py checks this). Closures over dispatchers
would not cache (their pickled identity changes per process).
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
from numba import njit, types

from policies._adakv_core import select_prompt, target_size
from policies.base import (PREFILL_SIG, STEP_SIG, Guarantees, Param, Policy, PolicyError, _f4t, _f8m, _f8t, _f8v,
                           _i8m, _i8v)
from policies.kernels import evict_lowest, evict_lowest_sorted

#: score_prompt(params, layer, q[P,Hq,d], k[P,Hkv,d], v[P,Hkv,d], scale, scores[Hkv,P], slot_state[Hkv,P,S],
#:              head_state[Hkv,Hs]) -> None
SCORE_PROMPT_SIG = types.void(_f8v, types.int64, _f4t, _f4t, _f4t, types.float64, _f8m, _f8t, _f8m)
#: score_step(params, layer, t, lengths[Hkv], probs[Hkv,G,cap], keys[Hkv,cap,d], values[Hkv,cap,d],
#:            positions[Hkv,cap], slot_state[Hkv,cap,S], head_state[Hkv,Hs], scores[Hkv,cap]) -> None
SCORE_STEP_SIG = types.void(_f8v, types.int64, types.int64, _i8v, _f8t, _f4t, _f4t, _i8m, _f8t, _f8m, _f8m)

SINK, RECENT = 0, 1   # fixed positions of the protection parameters in every scorer's params vector


def protection(n_sink: int = 0, n_recent: int = 1) -> tuple[Param, Param]:
    """The two protection parameters every scorer schema starts with, with the scorer's defaults."""
    return (Param("n_sink", n_sink, "int", 0, 64, doc="first positions never evicted (attention sinks)",
                  searchable=False),
            Param("n_recent", n_recent, "int", 0, 1024, doc="newest positions never evicted (recent window)",
                  searchable=False))


# ---------------------------------------------------------------- shared eviction (one per mode, compiled once)

@njit(cache=True)
def evict_prompt(params, budget, scores, keep):
    """Per head, drop the lowest-scored prompt tokens among positions [n_sink, P - n_recent) down to the budget."""
    P = scores.shape[1]
    pos = np.arange(P)
    for h in range(scores.shape[0]):
        if P > budget[h]:
            evict_lowest_sorted(scores[h], pos, P, P - budget[h], int(params[SINK]), P - int(params[RECENT]), keep[h])


@njit(cache=True)
def evict_to(params, t, sizes, lengths, positions, scores, keep):
    """Per head, drop the lowest-scored cached slots (sinks and recent window excluded) down to ``sizes[h]``."""
    lo = int(params[SINK])
    hi = t - int(params[RECENT]) + 1
    for h in range(lengths.shape[0]):
        n = lengths[h]
        if n > sizes[h]:
            evict_lowest(scores[h], positions[h], n, n - sizes[h], lo, hi, keep[h])


@njit(cache=True)
def ada_prompt(params, budget, scores, keep, head_state):
    """Ada-KV prompt selection over any scorer's scores: the layer's candidate budget is split across heads by
    Ada-KV's allocation with the safeguard ``floor_alpha`` (the last parameter); sinks rank first (+inf, other
    scores capped at 1e300),
    the recent window is kept by every head. Each head's resulting size is stored in the last two head-state
    columns (the decode-time target)."""
    n_sink = int(params[SINK])
    for h in range(scores.shape[0]):
        for i in range(scores.shape[1]):   # sinks strictly above every other score, +inf ones included
            scores[h, i] = np.inf if i < n_sink else min(scores[h, i], 1e300)
    hs_n = head_state.shape[1]
    alloc = np.ascontiguousarray(head_state[:, hs_n - 2:])
    select_prompt(scores, budget, int(params[RECENT]), params[params.shape[0] - 1], keep, alloc)
    head_state[:, hs_n - 2:] = alloc


@njit(cache=True)
def ada_step(params, t, budget, lengths, positions, scores, head_state, keep):
    """Ada-KV at decode (the authors' fixed allocation): every head keeps its prefill-allocated size."""
    hs_n = head_state.shape[1]
    alloc = np.ascontiguousarray(head_state[:, hs_n - 2:])
    sizes = np.empty(lengths.shape[0], np.int64)
    for h in range(lengths.shape[0]):
        sizes[h] = target_size(budget, alloc, h)
    evict_to(params, t, sizes, lengths, positions, scores, keep)


@njit(cache=True)
def decoding_target(params, budget, h):
    """The size a ``decoding`` wrapper compresses head h to: ``target``, or ``budget - every + 1`` when 0."""
    every = int(params[params.shape[0] - 2])
    target = int(params[params.shape[0] - 1])
    return target if target > 0 else budget[h] - every + 1


@njit(cache=True)
def decoding_prompt(params, budget, scores, keep):
    """The prompt is compressed once to the decoding target (kvpress compresses prefill with its own press)."""
    sizes = np.empty(budget.shape[0], np.int64)
    for h in range(budget.shape[0]):
        sizes[h] = decoding_target(params, budget, h)
    evict_prompt(params, sizes, scores, keep)


@njit(cache=True)
def decoding_step(params, t, budget, lengths, positions, scores, head_state, keep):
    """DecodingPress: count decode steps in the last head-state column; every ``every`` steps compress each
    head back to its target, else keep everything appended."""
    c = head_state.shape[1] - 1
    every = int(params[params.shape[0] - 2])
    head_state[0, c] += 1.0
    if head_state[0, c] < every:
        return
    head_state[0, c] = 0.0
    sizes = np.empty(lengths.shape[0], np.int64)
    for h in range(lengths.shape[0]):
        sizes[h] = decoding_target(params, budget, h)
    evict_to(params, t, sizes, lengths, positions, scores, keep)


@njit(cache=True)
def plain_step(params, t, budget, lengths, positions, scores, head_state, keep):
    """Per-step eviction: each head back to its budget."""
    evict_to(params, t, budget, lengths, positions, scores, keep)


@njit(cache=True)
def plain_prompt(params, budget, scores, keep, head_state):
    evict_prompt(params, budget, scores, keep)


@njit(cache=True)
def decoding_prompt_h(params, budget, scores, keep, head_state):
    decoding_prompt(params, budget, scores, keep)


@njit(cache=True)
def keep_scores_step(params, budget, lengths, values, slot_state, head_state, scores):
    """No rescaling (every mode but ``critical``)."""


@njit(cache=True)
def keep_scores_prompt(params, budget, v, slot_state, head_state, scores):
    """No rescaling (every mode but ``critical``)."""


@njit(cache=True)
def wo_l1(head_state, h, vecs):
    """CriticalKV's projected value norms of KV head h for the rows of ``vecs`` [n, d] (float32): the L1 norm of
    W_O^(j) v averaged over the query heads j of its group. One float32 GEMM against the group's W_O stacked
    as [G * hidden, d] (SGEMM: the products to ~1e-7, half the memory traffic of float64 at a decode step),
    the L1 sums in float64. The head state ends with that block as float32 pairs packed into float64 slots,
    then G*d and hidden (``CriticalScorer.head_state_init``)."""
    hs_n = head_state.shape[1]
    gd = int(head_state[h, hs_n - 2])
    hidden = int(head_state[h, hs_n - 1])
    d = vecs.shape[1]
    g_n = gd // d
    m = g_n * hidden * d
    base = hs_n - 2 - (m + 1) // 2
    block = head_state[h, base:base + (m + 1) // 2].view(np.float32)[:m].reshape((g_n * hidden, d))
    n = vecs.shape[0]
    out = np.zeros(n)
    rows = min(n, 256)                   # GEMM row blocks: no [n, G * hidden] temporary
    prods = np.empty((rows, g_n * hidden), np.float32)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        np.dot(vecs[r0:r1], block.T, prods[:r1 - r0])
        _abs_row_means(prods, r1 - r0, g_n, out[r0:r1])
    return out


@njit(cache=True, fastmath={"reassoc", "contract"})   # SIMD sums (rounding-level differences)
def _abs_row_means(prods, m, g_n, out):
    """out[r] = sum_j |prods[r, j]| / g_n in float64 for the first m rows."""
    for r in range(m):
        acc = 0.0
        for j in range(prods.shape[1]):
            acc += abs(np.float64(prods[r, j]))
        out[r] = acc / g_n


@njit(cache=True)
def critical_stages(params, budget, h, n, scores, norms):
    """CriticalKV's two stages on head h's first n scores: the top ``first_stage_ratio`` x budget by the plain
    score are kept outright (+inf); the others are rescored ``(score + epsilon) * ||W_O v||_1``."""
    eps = params[params.shape[0] - 2]
    n1 = int(budget[h] * params[params.shape[0] - 1])
    first = np.zeros(n, np.bool_)
    if n1 > 0:
        order = np.argsort(-scores[h, :n], kind="mergesort")   # ties: the older token first
        for i in range(min(n1, n)):
            first[order[i]] = True
    for i in range(n):
        scores[h, i] = np.inf if first[i] else (scores[h, i] + eps) * norms[i]


@njit(cache=True)
def critical_step(params, budget, lengths, values, slot_state, head_state, scores):
    """CriticalKV at a decode step: a slot's projected value norm is computed once, when it is new (kept in the
    last slot field; 0 = not yet), then the two stages."""
    last = slot_state.shape[2] - 1
    d = values.shape[2]
    for h in range(lengths.shape[0]):
        n = lengths[h]
        todo = np.flatnonzero(slot_state[h, :n, last] == 0.0)
        if todo.size:
            vecs = np.empty((todo.size, d), np.float32)
            for j in range(todo.size):
                vecs[j] = values[h, todo[j]]
            norms = wo_l1(head_state, h, vecs)
            for j in range(todo.size):
                slot_state[h, todo[j], last] = norms[j]
        critical_stages(params, budget, h, n, scores, slot_state[h, :n, last].copy())


@njit(cache=True)
def critical_prompt(params, budget, v, slot_state, head_state, scores):
    """CriticalKV on the prompt (v [P, Hkv, d]): every token's projected value norm (one GEMM per query head),
    then the two stages."""
    last = slot_state.shape[2] - 1
    for h in range(v.shape[1]):
        norms = wo_l1(head_state, h, np.ascontiguousarray(v[:, h, :]))
        slot_state[h, :, last] = norms
        critical_stages(params, budget, h, v.shape[0], scores, norms)


#: mode -> (prompt eviction, step eviction, prompt rescaling, step rescaling) globals of the generated kernels
MODES: dict[str, tuple[Callable, Callable, Callable, Callable]] = {
    "plain": (plain_prompt, plain_step, keep_scores_prompt, keep_scores_step),
    "ada": (ada_prompt, ada_step, keep_scores_prompt, keep_scores_step),
    "decoding": (decoding_prompt_h, decoding_step, keep_scores_prompt, keep_scores_step),
    "critical": (plain_prompt, plain_step, critical_prompt, critical_step),
}

_TEMPLATE = '''
def {name}_step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep,
                merge_to, merge_w):
    scores = np.zeros((lengths.shape[0], keep.shape[1]), np.float64)
    score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, scores)
    rescale_step(params, budget, lengths, values, slot_state, head_state, scores)
    evict_step(params, t, budget, lengths, positions, scores, head_state, keep)


def {name}_prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    scores = np.zeros((k.shape[1], k.shape[0]), np.float64)
    score_prompt(params, layer, q, k, v, scale, scores, slot_state, head_state)
    rescale_prompt(params, budget, v, slot_state, head_state, scores)
    evict_prompt(params, budget, scores, keep, head_state)
'''


def compose(score_prompt: Any, score_step: Any, mode: str, module: str, name: str) -> tuple[Any, Any]:
    """The (step, prefill) kernels of a scorer under an eviction mode, compiled with the engine's signatures.

    The wrappers are compiled under ``module``'s source file with the unique name ``name`` so numba caches
    them on disk like hand-written kernels (and invalidates them when that file changes).
    """
    evict_prompt_fn, evict_step_fn, rescale_prompt_fn, rescale_step_fn = MODES[mode]
    namespace = {"np": np, "score_prompt": score_prompt, "score_step": score_step, "evict_prompt": evict_prompt_fn,
                 "evict_step": evict_step_fn, "rescale_prompt": rescale_prompt_fn, "rescale_step": rescale_step_fn}
    mod = sys.modules.get(module)
    filename = getattr(mod, "__file__", None)    # exec'd code (a notebook, a README test) has none: no disk cache
    exec(compile(_TEMPLATE.format(name=name), filename or f"<scorer {name}>", "exec"), namespace)
    step, prefill = namespace[f"{name}_step"], namespace[f"{name}_prefill"]
    for fn in (step, prefill):
        fn.__module__ = module
    cache = filename is not None
    return njit(STEP_SIG, cache=cache)(step), njit(PREFILL_SIG, cache=cache)(prefill)


def _source_hash(*modules: str) -> str:
    """Short hash of the shared eviction code's sources. Numba invalidates a cached function only when its own
    file changes, not its callees'; the composed kernels live under the scorer's file, so this hash goes into
    their names and an edit of the shared code compiles them afresh instead of loading stale machine code."""
    h = hashlib.sha256()
    for m in modules:
        h.update(Path(sys.modules[m].__file__).read_bytes())
    return h.hexdigest()[:10]


_BASE_HASH = _source_hash(__name__, "policies._adakv_core", "policies.kernels")


class ScorerPolicy(Policy):
    """Base class of scorers: set ``name``, ``summary``, ``schema`` (starting with ``protection()``), ``P``,
    ``score_prompt`` and ``score_step`` (and ``slot_fields``/``head_fields`` if the kernels keep state); the
    step and prefill kernels are composed when the class is defined."""

    score_prompt: Any = None
    score_step: Any = None
    mode: str = "plain"
    extra_head_fields: int = 0     # head-state columns a combinator appends after the scorer's own
    extra_slot_fields: int = 0     # slot-state fields a combinator appends after the scorer's own

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "score_step" not in cls.__dict__ and "mode" not in cls.__dict__:
            return
        if cls.score_step is None or cls.score_prompt is None:
            raise PolicyError(f"{cls.__name__}: a scorer needs both score_prompt and score_step kernels")
        if [p.name for p in cls.schema[:2]] != ["n_sink", "n_recent"]:
            raise PolicyError(f"{cls.__name__}: a scorer schema must start with protection(...)")
        tag = "".join(c if c.isalnum() else "_" for c in cls.name)
        step, prefill = compose(cls.score_prompt, cls.score_step, cls.mode, cls.score_step.py_func.__module__,
                                f"_{cls.mode}_{tag}_{_BASE_HASH}")
        cls.step_fn, cls.prefill_fn = step, prefill

    def min_budget(self) -> int:
        return self.params["n_sink"] + max(1, self.params["n_recent"])

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(sinks=self.params["n_sink"], recent=self.params["n_recent"])
