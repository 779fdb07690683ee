"""The policy interface: a parameter schema with paper defaults plus numba kernels with fixed signatures.

A policy decides, once per decode step and per layer, which cached slots of each KV head to keep.
Its jitted ``step`` sees only what a GPU kernel can give it: the attention probabilities of the
step's query heads over the *currently cached* slots (never over tokens it already evicted), the
cached keys/values and their original positions, and its own state arrays. It writes a keep mask
and, for merging policies, a merge target and weight per slot. Every kernel is compiled with an
explicit signature so the replay engine is compiled once and cached for all policies, and only when it
first runs (``@kernel(SIG)``): importing a policy, listing or describing it compiles nothing.

Step contract (per layer, called after the new token ``t`` was appended at slot ``lengths[h] - 1``):
  - ``keep[h, i]`` is 1 on entry for ``i < lengths[h]``; set it to 0 to evict slot ``i``;
  - ``merge_to[h, i] = j`` (with ``keep[h, i] == 0`` and ``keep[h, j] == 1``) folds slot ``i`` into
    slot ``j``: ``x_j <- merge_w[h, j] * x_j + sum_i merge_w[h, i] * x_i`` for keys and values;
  - after the step each head holds at most ``budget[h]`` slots, or, for ``head_adaptive`` policies,
    the layer holds at most ``sum(budget)`` slots;
  - ``slot_state[h, i, :]`` moves with its slot on compaction (zeroed for a new slot);
    ``head_state[h, :]`` persists across steps.
"""
from __future__ import annotations

import itertools
import os
from collections import namedtuple
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import numpy as np
from numba import njit, types

from policies.core.errors import PolicyError
from policies.core.kvpress_press import NoKvpressPress

_f8v = types.float64[::1]
_i8v = types.int64[::1]
_f8m = types.float64[:, ::1]
_i8m = types.int64[:, ::1]
_u1m = types.uint8[:, ::1]
_f8t = types.float64[:, :, ::1]
_f4t = types.float32[:, :, ::1]

#: step(params, layer, t, budget[Hkv], lengths[Hkv], probs[Hkv,G,cap], keys[Hkv,cap,d], values[Hkv,cap,d],
#:      positions[Hkv,cap], slot_state[Hkv,cap,S], head_state[Hkv,Hs], keep[Hkv,cap], merge_to[Hkv,cap],
#:      merge_w[Hkv,cap]) -> None
STEP_SIG = types.void(_f8v, types.int64, types.int64, _i8v, _i8v, _f8t, _f4t, _f4t, _i8m, _f8t, _f8m, _u1m, _i8m,
                      _f8m)
#: prefill(params, layer, budget[Hkv], q[P,Hq,d], k[P,Hkv,d], v[P,Hkv,d], scale, keep[Hkv,P],
#:         slot_state[Hkv,P,S], head_state[Hkv,Hs]) -> None ; keep is 1 on entry, set 0 to drop a prompt token.
PREFILL_SIG = types.void(_f8v, types.int64, _i8v, _f4t, _f4t, _f4t, types.float64, _u1m, _f8t, _f8m)
#: logit_scale(params, n) -> multiplier applied to the scaled attention logits when n tokens have been seen.
LOGIT_SCALE_SIG = types.float64(_f8v, types.int64)


class Kernel:
    """A policy kernel compiled for one fixed signature when it first runs, not when its module is imported.

    Why: importing every policy used to compile (or load from numba's disk cache) every kernel of every policy,
    which made ``kvsim policies`` and every command that lists policies wait for all of them, and a cold first run
    compile kernels nothing would call. A ``Kernel`` is what ``@kernel(SIG)`` makes of a function (or what a
    composed scorer makes of its generated source, ``build``): ``dispatcher`` compiles it with ``njit(SIG,
    cache=True)`` the first time it is asked for, so numba types it as a first-class function of that signature
    and the engine stays compiled once for all policies. Calling it runs the compiled kernel; ``py_func`` is the
    Python source, as on a numba dispatcher.
    """

    __slots__ = ("signature", "py_func", "_build", "_dispatcher")

    def __init__(self, signature: Any, py_func: Callable | None = None,
                 build: Callable[[], Any] | None = None) -> None:
        if (py_func is None) == (build is None):
            raise TypeError("Kernel takes either py_func or build")
        self.signature = signature
        self.py_func = py_func
        self._build = build
        self._dispatcher = None

    @property
    def dispatcher(self) -> Any:
        """The numba dispatcher compiled for ``signature`` (compiled or loaded from the disk cache on first use)."""
        if self._dispatcher is None:
            if self._build is not None:
                self._dispatcher = self._build()
            else:     # code exec'd from a string (a notebook, a README example) has no file to cache beside
                source = self.py_func.__code__.co_filename
                cache = source.endswith(".py") and os.path.isfile(source)
                self._dispatcher = njit(self.signature, cache=cache)(self.py_func)
        return self._dispatcher

    def __call__(self, *args: Any) -> Any:
        return self.dispatcher(*args)

    def __repr__(self) -> str:
        state = "compiled" if self._dispatcher is not None else "not compiled yet"
        name = getattr(self.py_func, "__qualname__", "composed")
        return f"<kernel {name} ({state})>"


def kernel(signature: Any) -> Callable[[Callable], Kernel]:
    """Decorator: ``@kernel(STEP_SIG)`` makes ``fn`` a ``Kernel`` compiled for ``signature`` on first use.

    Equivalent to ``@njit(STEP_SIG, cache=True)`` in what runs; it only moves the compilation from import time
    to the first replay that needs it. A plain ``@njit(SIG, cache=True)`` function is accepted wherever a kernel
    is (plug-ins written that way keep working), it is just compiled at import."""
    def wrap(fn: Callable) -> Kernel:
        return Kernel(signature, py_func=fn)
    return wrap


def compiled(fn: Any) -> Any:
    """The numba dispatcher behind ``fn``: a ``Kernel``'s (compiling it now), or ``fn`` itself (already jitted)."""
    return fn.dispatcher if isinstance(fn, Kernel) else fn


@kernel(LOGIT_SCALE_SIG)
def unit_logit_scale(params, n):
    """Default attention-logit multiplier: attention is left unchanged."""
    return 1.0


@kernel(PREFILL_SIG)
def stream_prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    """Placeholder prefill for streaming policies; the engine streams the prompt through ``step`` instead."""
    return


def prompt_memo(prompt_layers: Any, key: tuple, compute: Callable[[], Any]) -> Any:
    """Work in ``allocate()`` that depends only on the trace's prompt (D2O's attention variances), done once per
    set of prepared inputs: the replays of several budgets, and a sweep worker's jobs on the same trace, share
    it through the ``cache`` the replay's prompt view carries (``sim.replay.layer_inputs.PromptLayers``). ``key`` names the
    work and every parameter it depends on; a plain list of layers (no cache) just computes."""
    cache = getattr(prompt_layers, "cache", None)
    if cache is None:
        return compute()
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def reconstruction_chunk(policies: Sequence["Policy"]) -> int | None:
    """The chunk size of the reconstruction pass a trace recorded for ``policies`` must hold (the first that needs
    one, ``Policy.reconstruction_chunk``), or None when none does."""
    return next((c for c in (p.reconstruction_chunk() for p in policies) if c is not None), None)


#: the value of a ``from_layer`` parameter that means "the layer's own" (read from the trace or the model)
FROM_MODEL = -1.0


@dataclass(frozen=True)
class Param:
    """One hyperparameter: its type, range and the paper's default."""

    name: str
    default: Any
    kind: str = "float"          # "int" | "float" | "bool" | "choice"
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    log: bool = False            # sample on a log scale in searches
    doc: str = ""
    searchable: bool = True      # part of the hyperparameter search space
    #: a field of the layer's attention (``traces.format.LayerAttention``, e.g. ``rope_theta``) that this
    #: parameter takes when its value is ``FROM_MODEL``: the trace's (or, closed loop, the model's) own value
    from_layer: str | None = None

    def coerce(self, value: Any, policy: str) -> Any:
        """Validate and convert a user-supplied value, naming policy and parameter in errors."""
        where = f"{policy}.{self.name}"
        try:
            if self.kind == "choice":
                value = str(value)
                if value not in self.choices:
                    raise PolicyError(f"{where}: {value!r} is not one of {self.choices}")
                return value
            if self.kind == "bool":
                if isinstance(value, str):
                    if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                        raise PolicyError(f"{where}: {value!r} is not a boolean")
                    return value.lower() in ("1", "true", "yes")
                return bool(value)
            if self.kind == "int":
                f = float(value)
                if not f.is_integer():
                    raise PolicyError(f"{where}: {value!r} is not an integer")
                value = int(f)
            else:
                value = float(value)
                if not np.isfinite(value):
                    raise PolicyError(f"{where}: {value!r} is not finite")
        except (TypeError, ValueError) as e:
            if isinstance(e, PolicyError):
                raise
            raise PolicyError(f"{where}: cannot read {value!r} as {self.kind}") from None
        if self.low is not None and value < self.low:
            raise PolicyError(f"{where}: {value} is below the minimum {self.low}")
        if self.high is not None and value > self.high:
            raise PolicyError(f"{where}: {value} is above the maximum {self.high}")
        return value

    def encode(self, value: Any) -> float:
        """The float a jitted kernel reads for this parameter (choices by index)."""
        return float(self.choices.index(value)) if self.kind == "choice" else float(value)


def param_indices(schema: Sequence[Param]) -> tuple:
    """Named positions of a schema's parameters in the kernels' ``params`` vector, e.g. ``P.recent_ratio``.

    Build it once per module from the same schema the policy class declares (``P = param_indices(SCHEMA)``)
    and read parameters in kernels as ``params[P.recent_ratio]``: numba freezes the named tuple as a
    constant, so reordering the schema re-indexes every kernel and cannot feed one the wrong value.
    ``@register`` checks that a class's ``P`` matches its ``schema``.
    """
    names = [p.name for p in schema]
    if len(set(names)) != len(names):
        raise PolicyError(f"duplicate parameter names in schema: {names}")
    return namedtuple("ParamIndex", names, rename=False)(*range(len(names))) if names else ()


class Guarantees(NamedTuple):
    """Positions a policy promises to hold after every step: the first ``sinks`` and the last ``recent``."""

    sinks: int = 0
    recent: int = 0


class Policy:
    """Base class of every policy: subclass, set the class attributes, decorate with ``@register``.

    Subclasses provide ``step_fn`` (compiled with ``STEP_SIG``) and optionally ``prefill_fn``
    (``PREFILL_SIG``; without one the prompt is streamed through ``step``), ``logit_scale_fn``
    (``LOGIT_SCALE_SIG``) and an ``allocate`` override for layer- or head-level budgets.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    schema: ClassVar[tuple[Param, ...]] = ()
    slot_fields: ClassVar[int] = 0
    head_fields: ClassVar[int] = 0
    head_adaptive: ClassVar[bool] = False   # budget is shared by the heads of a layer
    unbounded: ClassVar[bool] = False       # keeps everything (the full cache)
    is_oracle: ClassVar[bool] = False       # needs future attention: cannot run closed-loop in a model
    replay_strategy: ClassVar[str] = "step"  # how sim.replay.policy_replay replays it (sim.replay.policy_replay.STRATEGIES)
    compresses_below_budget: ClassVar[bool] = False   # evicts even when everything fits (decoding())
    needs_wo: ClassVar[bool] = False        # reads the layer's output projection W_O (head_state_init)
    #: the step reads the step's attention ``probs``; False lets the engine skip the attention of unmeasured
    #: (prompt) steps, the bulk of a streamed prompt's cost
    reads_attention: ClassVar[bool] = True
    #: the step reads the cached ``keys`` / ``values`` (True unless declared otherwise): the GPU closed loop copies a
    #: layer's keys / values to the host for its steps only when some row's policy reads them
    #: (tests/test_policy_reads.py checks every registered policy that declares False against random keys / values)
    reads_keys: ClassVar[bool] = True
    reads_values: ClassVar[bool] = True
    #: the step handles several new slots at once (a chunked prefill appends a prompt chunk before one step);
    #: False for policies whose state follows each new token in order (BUZZ's counters, Cascading's offers...)
    multi_token_steps: ClassVar[bool] = True
    step_fn: ClassVar[Any] = None
    prefill_fn: ClassVar[Any] = None
    logit_scale_fn: ClassVar[Any] = None
    #: named bundles of parameter values selected by a ``preset`` parameter (e.g. a released code's behaviour);
    #: values the user gives explicitly win over the preset's
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    #: the hyperparameter grid a configuration search tries (``kvsim recommend``'s candidates): parameter name ->
    #: the values to try, the paper default first. Only ``searchable`` parameters of the schema; empty: the paper
    #: default alone. ``search_configs`` expands it.
    search_grid: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @classmethod
    def search_configs(cls) -> list[dict[str, Any]]:
        """The parameter sets of ``search_grid``, the paper default first: every combination of the declared values
        (a grid over two booleans is four configurations; over one parameter, its values). Each value is checked
        against the schema's type and range, and each axis must start at the paper default, so a changed default
        or a typo fails here, naming the policy, rather than searching a grid that lost its anchor."""
        known = {p.name: p for p in cls.schema}
        axes = []
        for name, values in cls.search_grid.items():
            p = known.get(name)
            if p is None or not p.searchable:
                raise PolicyError(f"{cls.name}.search_grid: {name!r} is not a searchable parameter of its schema "
                                  f"({sorted(q.name for q in cls.schema if q.searchable)})")
            coerced = tuple(p.coerce(v, cls.name) for v in values)
            if not coerced or coerced[0] != p.default:
                raise PolicyError(f"{cls.name}.search_grid[{name!r}] must start at the paper default {p.default!r}, "
                                  f"got {values!r}")
            if len(set(coerced)) != len(coerced):
                raise PolicyError(f"{cls.name}.search_grid[{name!r}] lists a value twice: {values!r}")
            axes.append([(name, v) for v in coerced])
        return [dict(combo) for combo in itertools.product(*axes)]

    def __init__(self, **params: Any) -> None:
        preset = self.presets.get(str(params.get("preset", "")))
        if preset:
            params = {**preset, **params}
        known = {p.name: p for p in self.schema}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise PolicyError(f"{self.name}: unknown parameter(s) {unknown}; known: {sorted(known)}")
        self.params: dict[str, Any] = {
            p.name: p.coerce(params.get(p.name, p.default), self.name) for p in self.schema
        }
        self.validate()

    def validate(self) -> None:
        """Cross-parameter checks; override to reject inconsistent combinations."""

    def param_vector(self, attention: Any = None) -> np.ndarray:
        """Parameters in schema order as the float64 vector the kernels read. A ``from_layer`` parameter left at
        ``FROM_MODEL`` takes the value ``attention`` (the layer's ``LayerAttention``) records, e.g. the layer's
        own RoPE base, so one policy reads each layer's geometry (Gemma-3: 1e6 global, 1e4 sliding)."""
        out = np.array([p.encode(self.params[p.name]) for p in self.schema], dtype=np.float64)
        for i, p in enumerate(self.schema):
            if p.from_layer and self.params[p.name] == FROM_MODEL:
                value = getattr(attention, p.from_layer, None) if attention is not None else None
                if value is None:
                    raise PolicyError(f"{self.label()}: {p.name}={FROM_MODEL:g} means the layer's own "
                                      f"{p.from_layer}, which this trace or model does not record (a version-1 "
                                      f"trace, or a scaled RoPE); pass {p.name}=VALUE explicitly")
                out[i] = float(value)
        return out

    @property
    def reads_layer_attention(self) -> bool:
        """True when a parameter comes from the layer's attention (``param_vector`` needs it per layer)."""
        return any(p.from_layer and self.params[p.name] == FROM_MODEL for p in self.schema)

    def guarantees(self, budget: int) -> Guarantees:
        """What the policy promises to keep at this budget (checked by the property tests)."""
        return Guarantees()

    def footprint(self, budget: int, n_tokens: int) -> int:
        """Slots per KV head and layer held after ``n_tokens`` tokens (for memory and serving models)."""
        return n_tokens if self.unbounded else min(n_tokens, budget)

    def min_budget(self) -> int:
        """Smallest per-head budget the policy can honour (e.g. its sinks plus one recent slot)."""
        return 1

    def check_budget(self, budget: int) -> None:
        """Reject a budget this policy cannot honour, saying why."""
        if not isinstance(budget, (int, np.integer)) or budget < self.min_budget():
            raise PolicyError(f"{self.label()}: budget {budget!r} is below its minimum {self.min_budget()} "
                              f"(it must hold its protected tokens plus the newest one)")

    def allocate(self, budget: int, n_kv_heads: int, prompt_layers: Sequence[tuple[np.ndarray, np.ndarray]],
                 scale: float) -> np.ndarray:
        """Per-layer, per-KV-head slot budgets [L, Hkv]; default: ``budget`` everywhere.

        ``prompt_layers[l]`` is (q[:P], k[:P]) of layer l as float32; allocators (PyramidKV, D2O,
        Ada-KV) may read them. The total should stay ``budget * L * Hkv``.
        """
        return np.full((len(prompt_layers), n_kv_heads), budget, dtype=np.int64)

    def head_state_init(self, n_kv_heads: int, head_dim: int, wo: np.ndarray | None = None) -> np.ndarray:
        """One layer's initial head state [Hkv, width >= head_fields]: zeros, unless the policy keeps per-layer
        constants there (``needs_wo`` policies get the layer's W_O [hidden, Hq*d], e.g. CriticalKV)."""
        return np.zeros((n_kv_heads, self.head_fields))

    def replay_head_state(self, n_kv_heads: int, head_dim: int, layer: Any, memo: dict | None = None,
                          n_prompt: int = 0) -> np.ndarray:
        """The initial head state of a replay of a recorded layer (``sim.replay.layer_inputs.LayerInputs``: its q, k, v and W_O
        are all known in advance; its first ``n_prompt`` tokens are the prompt): ``head_state_init`` unless a
        policy adds tables that depend on the trace only (CriticalKV: every position's projected value norm;
        BumbleBee: every prompt key's importance), kept in ``memo`` (a dict shared by the replays of the same
        prepared layer, ``sim.replay.layer_inputs.layer_memo``) so that they are computed once, not per budget. The array
        returned is the replay's own (the engine writes into it)."""
        return self.head_state_init(n_kv_heads, head_dim, layer.wo)

    @classmethod
    def shares_prompt_scores(cls) -> bool:
        """Whether the replays of several budgets of one configuration can start from one head state with the
        prompt already scored (``policies.core.scorer.ScorerPolicy.with_prompt_scores``); no, unless a scorer
        says so."""
        return False

    def prompt_head_state(self, head_state: np.ndarray, prompt_layers: Any, j: int) -> np.ndarray:
        """The head state of compressed layer j once its prompt is known (``prompt_layers``: the view ``allocate``
        reads, the simulator's or the closed loop's): ``head_state`` itself, unless the policy scores the prompt
        from a pass of its own (KVzip appends its prompt-score table). Called after ``replay_head_state`` /
        ``head_state_init`` by every replay and closed-loop run, before the prefill."""
        return head_state

    def reconstruction_chunk(self) -> int | None:
        """The chunk size of the context-reconstruction pass this policy scores from (KVzip's ``chunk_size``; a
        trace for it is recorded with ``kvsim record --kvzip``), or None: it needs none."""
        return None

    def kvpress_press(self, prompt_at_once: bool = False) -> Any:
        """This policy's counterpart in kvpress (``policies.core.kvpress_press.KvpressPress``): the press whose kept
        sets of a prompt compressed once after its prefill equal this policy's at the same per-head count, or
        ``NoKvpressPress`` saying why there is none. ``prompt_at_once``: the prompt is selected at once by the
        policy's prompt score (``ada(x, floor_alpha=1)``) rather than streamed through its step. Declared by each
        policy next to its rule; read by ``kvsim export --kvpress``, ``kvsim recommend`` and the parity benchmark."""
        raise NoKvpressPress(f"{self.name}: kvpress has no press with its rule")

    def kernels(self) -> tuple[Callable, Callable, Callable]:
        """The (step, prefill, logit_scale) numba dispatchers handed to the replay engine, compiled (or loaded from
        numba's disk cache) here, on first use, not when the policy's module was imported."""
        cls = type(self)   # via the class: a numba dispatcher read off an instance becomes a bound method
        if cls.step_fn is None:
            raise PolicyError(f"{self.name}: no step kernel")
        return (compiled(cls.step_fn), compiled(cls.prefill_fn or stream_prefill),
                compiled(cls.logit_scale_fn or unit_logit_scale))

    @property
    def has_prefill(self) -> bool:
        return self.prefill_fn is not None

    def label(self) -> str:
        """Short human label: name plus non-default parameters."""
        diff = [f"{p.name}={self.params[p.name]}" for p in self.schema if self.params[p.name] != p.default]
        return f"{self.name}({', '.join(diff)})" if diff else self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params.items())})"
