"""Grid sweeps: policies x hyperparameter grids x budgets x traces into a resumable results store."""
from __future__ import annotations

import itertools
import sys
from typing import Collection, Sequence

import pandas as pd
from tqdm.auto import tqdm

from policies import Policy, PolicyError, get_policy, list_policies
from sim.experiments.executors import Job, TraceRef, consume, execute
from sim.replay.metrics import METRICS
from sim.replay.plan import effective_chunk
from sim.replay.policy_replay import strategy_of
from sim.experiments.specs import parse_policy, split_policy_list, trace_id
from sim.experiments.store import ResultStore, config_key
from traces.format import Trace


def expand_grid(spec: str) -> list[Policy]:
    """``name:p=a|b,q=c`` -> one policy per combination of alternatives (``all`` = every registered policy).

    A spec without ``|`` is one full policy spec (wrappers such as ``ada(snapkv)`` included); grids are
    written on the parameters of a plain ``NAME:...`` spec.
    """
    spec = spec.strip()
    if spec == "all":
        return [get_policy(n) for n in list_policies()]
    if "|" not in spec:
        return [parse_policy(spec)]
    if "(" in spec:
        raise PolicyError(f"policy spec {spec!r}: '|' alternatives are only read in NAME:param=a|b specs, "
                          f"not inside a wrapper; list the combinations separated by ';'")
    name, _, rest = spec.partition(":")
    axes: list[tuple[str, list[str]]] = []
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, values = item.partition("=")
        if not eq:
            raise PolicyError(f"policy spec {spec!r}: expected param=value[|value...], got {item!r}")
        axes.append((key.strip(), [v.strip() for v in values.split("|") if v.strip()]))
    combos = itertools.product(*[vals for _, vals in axes]) if axes else [()]
    return [get_policy(name.strip(), **{k: v for (k, _), v in zip(axes, combo)}) for combo in combos]


def parse_policy_grid(text: str) -> list[Policy]:
    """A ``;``-separated policy list whose specs may hold ``|`` grids -> policies (duplicates removed, order
    kept). The list is split by ``sim.experiments.specs.split_policy_list``, the one grammar every command shares."""
    seen: dict[str, Policy] = {}
    for part in split_policy_list(text):
        for pol in expand_grid(part):
            seen.setdefault(pol.label(), pol)
    if not seen:
        raise PolicyError(f"no policy in {text!r}")
    return list(seen.values())


def implicit_labels(text: str) -> frozenset[str]:
    """Labels of the policies a ``;``-separated list names only through ``all``: a sweep skips those a trace
    cannot serve (``cannot_serve``), where a policy named explicitly is an error."""
    parts = split_policy_list(text)
    if "all" not in parts:
        return frozenset()
    explicit = {pol.label() for part in parts if part != "all" for pol in expand_grid(part)}
    return frozenset(pol.label() for pol in expand_grid("all")) - explicit


def cannot_serve(trace: Trace, policy: Policy) -> str | None:
    """Why ``trace`` cannot serve ``policy`` (None when it can): the policy scores from a context-reconstruction pass
    (KVzip) the trace was recorded without, or it needs the output projection W_O the trace lacks."""
    if policy.reconstruction_chunk() is not None and not trace.has_reconstruction:
        return "the trace has no context-reconstruction pass; record it with `kvsim record --kvzip`"
    if policy.needs_wo and not trace.has_wo:
        return "the policy needs the output projection W_O, which the trace lacks; record it with `kvsim record`"
    return None


def servable(trace: Trace, policies: Sequence[Policy], optional: Collection[str] = (),
             name: str | None = None) -> list[Policy]:
    """The ``policies`` that ``trace`` (called ``name`` in messages) can serve: one it cannot (``cannot_serve``) is
    a `PolicyError`, unless its label is in ``optional`` (``implicit_labels``: named only through ``all``); then it
    is left out with a notice on stderr."""
    out = []
    where = f" on trace {name}" if name else ""
    for pol in policies:
        why = cannot_serve(trace, pol)
        if why is None:
            out.append(pol)
        elif pol.label() in optional:
            print(f"skipping {pol.label()}{where}: {why}", file=sys.stderr)
        else:
            raise PolicyError(f"{pol.label()}{where}: {why}")
    return out


def plan(traces: Sequence[TraceRef], policies: Sequence[Policy], budgets: Sequence[int],
         done: set[str] = frozenset(), optional: Collection[str] = ()) -> list[Job]:
    """Jobs for every valid configuration not in ``done``; a one-pass strategy (the oracle's) gets one job per
    trace for all its budgets, the others one job per budget. A trace that cannot serve a policy
    (``cannot_serve``) is an error, unless the policy's label is in ``optional`` (``implicit_labels``: named only
    through ``all``): then that pair is skipped with a notice on stderr."""
    jobs: list[Job] = []
    for ref in traces:
        trace, _ = ref.open()
        tid = trace_id(trace)
        for pol in servable(trace, policies, optional, tid):
            valid = [int(b) for b in budgets if pol.min_budget() <= b <= trace.meta.n_tokens]
            chunk = effective_chunk(pol, ref.chunk)
            todo = [(b, config_key(tid, pol.name, pol.params, b, ref.sliding, chunk)) for b in valid]
            todo = [(b, k) for b, k in todo if k not in done]
            if not todo:
                continue
            params = tuple(sorted(pol.params.items()))
            if strategy_of(pol).one_pass:
                jobs.append(Job(ref, pol.name, params, tuple(b for b, _ in todo), tuple(k for _, k in todo)))
            else:
                jobs.extend(Job(ref, pol.name, params, (b,), (k,)) for b, k in todo)
    return jobs


def run_sweep(traces: Sequence[TraceRef], policies: Sequence[Policy], budgets: Sequence[int], store: ResultStore,
              *, workers: int = 1, ray_address: str | None = None, threads: int | None = None,
              split_layers: int = 1, progress: bool = True, optional: Collection[str] = ()) -> pd.DataFrame:
    """Evaluate every configuration not yet in ``store`` and return the store's full table.

    A trace that cannot serve a policy is an error before anything runs, unless the policy's label is in
    ``optional`` (``plan``).

    Each finished job is written at once (atomic part file), so Ctrl-C or kill -9 loses only running jobs
    and a rerun resumes where it stopped. ``threads`` per worker: see ``sim.experiments.executors.Executor``.
    ``split_layers`` > 1 runs each configuration as that many jobs of consecutive layers (``Executor.run_split``);
    its rows are written when its last group is back.
    """
    jobs = plan(traces, policies, budgets, store.keys(), optional)
    total = sum(len(j.budgets) for j in jobs)
    with tqdm(total=total, desc="sweep", unit="cfg", disable=not progress) as bar:
        consume(execute(jobs, workers=workers, ray_address=ray_address, threads=threads, split_layers=split_layers),
                store.add, bar.update)
    return store.load()


def with_oracle_gap(df: pd.DataFrame) -> pd.DataFrame:
    """Add ``<metric>_gap`` for every metric with ``gap`` in sim.replay.metrics (``err_gap``, ``mass_gap``): how much
    worse than the (per-head) oracle on the same trace and budget, oriented so that lower is better."""
    if df.empty or "policy" not in df:
        return df
    gapped = [m for m in METRICS if m.gap and f"{m.name}_mean" in df]
    means = [f"{m.name}_mean" for m in gapped]
    orc = df[(df.policy == "oracle") & (df.label == "oracle")][["trace_id", "budget", *means]]
    orc = orc.rename(columns={c: f"oracle_{c}" for c in means})
    out = df.merge(orc, on=["trace_id", "budget"], how="left")
    for m in gapped:
        out[f"{m.name}_gap"] = m.loss(out[f"{m.name}_mean"]) - m.loss(out[f"oracle_{m.name}_mean"])
    return out.drop(columns=[f"oracle_{c}" for c in means])
