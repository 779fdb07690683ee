"""Grid sweeps: policies x budgets x traces, replayed and stored with stable keys (resumable)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import pandas as pd
from tqdm.auto import tqdm

from policies import Policy
from sim.replay import load_layers, replay, replay_oracle
from sim.specs import trace_id, trace_name
from sim.store import ResultStore, config_key
from traces.format import Trace


@dataclass(frozen=True)
class SweepTask:
    """One configuration to evaluate."""

    trace_index: int
    policy: Policy
    budget: int
    key: str


def plan(traces: Sequence[Trace], policies: Sequence[Policy], budgets: Sequence[int]) -> list[SweepTask]:
    """Every valid (trace, policy, budget) configuration; budgets a policy or trace cannot take are skipped."""
    tasks = []
    for ti, trace in enumerate(traces):
        tid = trace_id(trace)
        for pol in policies:
            for b in budgets:
                if b > trace.meta.n_tokens or b < pol.min_budget():
                    continue
                tasks.append(SweepTask(ti, pol, int(b), config_key(tid, pol.name, pol.params, b)))
    return tasks


def _row(trace: Trace, task: SweepTask, summary: dict, elapsed: float) -> dict:
    row = dict(summary)
    row.update(key=task.key, trace=trace_name(trace), trace_id=trace_id(trace), policy=task.policy.name,
               label=task.policy.label(), params=task.policy.params, budget=task.budget,
               n_tokens=trace.meta.n_tokens, elapsed_s=elapsed)
    return row


def run_sweep(traces: Sequence[Trace], policies: Sequence[Policy], budgets: Sequence[int], store: ResultStore, *,
              progress: bool = True, threads: int | None = None) -> pd.DataFrame:
    """Evaluate every configuration not yet in ``store``; returns the store's full table.

    The oracle (when listed) is replayed once per trace for all its budgets.
    """
    done = store.keys()
    todo = [t for t in plan(traces, policies, budgets) if t.key not in done]
    bar = tqdm(total=len(todo), desc="sweep", unit="cfg", disable=not progress)
    for ti, trace in enumerate(traces):
        mine = [t for t in todo if t.trace_index == ti]
        if not mine:
            continue
        inputs = load_layers(trace)
        oracle_tasks = [t for t in mine if t.policy.is_oracle]
        for scope in sorted({t.policy.params["scope"] for t in oracle_tasks}):
            group = [t for t in oracle_tasks if t.policy.params["scope"] == scope]
            t0 = time.perf_counter()
            results = replay_oracle(trace, [t.budget for t in group], scope=scope, inputs=inputs, threads=threads)
            per = (time.perf_counter() - t0) / len(group)
            store.add([_row(trace, t, r.summary(), per) for t, r in zip(group, results)])
            bar.update(len(group))
        for task in (t for t in mine if not t.policy.is_oracle):
            t0 = time.perf_counter()
            res = replay(trace, task.policy, task.budget, inputs=inputs, threads=threads)
            store.add([_row(trace, task, res.summary(), time.perf_counter() - t0)])
            bar.update(1)
    bar.close()
    return store.load()


def with_oracle_gap(df: pd.DataFrame) -> pd.DataFrame:
    """Add ``err_gap`` and ``mass_gap``: distance to the (per-head) oracle on the same trace and budget."""
    if df.empty or "policy" not in df:
        return df
    orc = df[(df.policy == "oracle") & (df.label == "oracle")][["trace_id", "budget", "err_mean", "mass_mean"]]
    orc = orc.rename(columns={"err_mean": "oracle_err", "mass_mean": "oracle_mass"})
    out = df.merge(orc, on=["trace_id", "budget"], how="left")
    out["err_gap"] = out["err_mean"] - out["oracle_err"]
    out["mass_gap"] = out["oracle_mass"] - out["mass_mean"]
    return out.drop(columns=["oracle_err", "oracle_mass"])
