"""Hyperparameter search with optuna (TPE) over each policy's schema; multi-objective loss vs memory gives a
Pareto front. Every evaluated configuration is also a row of the results store, so searches resume and
never recompute a configuration the store already holds."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from policies import Param, get_policy, policy_class
from sim.experiments.executors import Executor, Job, TraceRef, coalesce
from sim.replay.metrics import OBJECTIVES, metric
from sim.replay.plan import effective_chunk
from sim.experiments.specs import parse_policy, policy_parts, trace_id
from sim.experiments.store import ResultStore, config_key

def row_loss(row: dict[str, Any], objective: str, layer_weights: Sequence[float] | None = None,
             oracle_err: float | None = None) -> float:
    """The loss of one result row: a metric's mean oriented so lower is better (``Metric.loss``: err, 1 - retained
    mass, KL...), or the gap of the mean error to the oracle's."""
    if layer_weights is not None and objective in ("err", "mass"):
        key = "mass_by_layer" if objective == "mass" else "err_by_layer"
        per_layer = np.asarray(row[key], float)
        w = np.asarray(layer_weights, float)
        if w.shape != per_layer.shape:
            raise ValueError(f"--layer-weights has {w.size} weights for a trace with {per_layer.size} layers")
        value = float((w * per_layer).sum() / w.sum())
    else:
        value = float(row["err_mean" if objective == "gap" else f"{objective}_mean"])
    if objective == "gap":
        if oracle_err is None:
            raise ValueError("objective 'gap' needs the oracle's error at the same budget")
        return value - oracle_err
    return metric(objective).loss(value)


def _suggest(trial: Any, p: Param) -> Any:
    if p.kind == "choice":
        return trial.suggest_categorical(p.name, list(p.choices))
    if p.kind == "bool":
        return trial.suggest_categorical(p.name, [False, True])
    if p.kind == "int":
        return trial.suggest_int(p.name, int(p.low), int(p.high), log=p.log and p.low > 0)
    return trial.suggest_float(p.name, float(p.low), float(p.high), log=p.log and p.low > 0)


def search_space(policy: str, fixed: Sequence[str] = ()) -> list[Param]:
    """The searchable parameters of a policy (bounded numeric ones and choices), less those held ``fixed``."""
    return [p for p in policy_class(policy).schema
            if p.searchable and p.name not in fixed
            and (p.kind in ("choice", "bool") or (p.low is not None and p.high is not None))]


def split_search_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME``, ``NAME:param=value,...`` or a wrapper such as ``ada(knorm:n_sink=2)`` -> (registry name, the
    parameters held fixed during the search). The same spec grammar as everywhere; values are validated by the
    policy's schema (a combinator's schema holds its scorer's parameters and its own)."""
    base = parse_policy(spec)              # validates name and values
    name, given = policy_parts(spec)
    return name, {k: base.params[k] for k in given}


@dataclass
class SearchResult:
    trials: pd.DataFrame          # one row per valid trial: params, budget, loss, memory
    pareto: pd.DataFrame          # non-dominated trials (loss vs memory), or the best trial per budget


def run_search(trace: TraceRef, policy: str, budgets: Sequence[int], store: ResultStore, *, objective: str = "err",
               n_trials: int = 40, multi_objective: bool = False, layer_weights: Sequence[float] | None = None,
               workers: int = 1, ray_address: str | None = None, threads: int | None = None, seed: int = 0,
               progress: bool = True) -> SearchResult:
    """TPE search of ``policy``'s hyperparameters on one trace.

    ``policy`` is a spec: ``NAME`` searches every searchable parameter, ``NAME:p=v,...`` holds ``p`` fixed.
    Single objective: minimise the loss averaged over ``budgets``. Multi-objective: the budget is searched
    too (among ``budgets``) and the study minimises (loss, KV bytes held), returning the Pareto front.
    Trials are asked in batches of ``workers`` and run on one executor kept alive for the whole search, so
    its worker processes stay warm (``threads`` per worker: see ``sim.experiments.executors.Executor``).
    """
    import optuna   # deferred: 0.3 s to import, and only the search itself needs it

    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {OBJECTIVES}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    policy, fixed = split_search_spec(policy)
    space = search_space(policy, fixed)
    tr, _ = trace.open()
    tid = trace_id(tr)
    budgets = [b for b in budgets if get_policy(policy, **fixed).min_budget() <= b <= tr.meta.n_tokens]
    if not budgets:
        raise ValueError(f"no budget in {list(budgets)} is valid for {policy} on a {tr.meta.n_tokens}-token trace")
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True)
    study = optuna.create_study(directions=["minimize", "minimize"] if multi_objective else ["minimize"],
                                sampler=sampler)
    cached = {r["key"]: r for r in store.load().to_dict("records")} if store.parts() else {}
    with Executor(workers=workers, ray_address=ray_address, threads=threads) as ex:
        oracle_err: dict[int, float] = {}
        if objective == "gap":
            oracle_err = _oracle_errors(ex, trace, tid, budgets, store, cached)
        records = []
        bar = tqdm(total=n_trials, desc=f"search {policy}", unit="trial", disable=not progress)
        while len(records) < n_trials:
            batch = [study.ask() for _ in range(min(max(1, workers), n_trials - len(records)))]
            plans = []
            for trial in batch:
                params = {**fixed, **{p.name: _suggest(trial, p) for p in space}}
                pol = get_policy(policy, **params)
                bset = [trial.suggest_categorical("budget", budgets)] if multi_objective else budgets
                if pol.min_budget() > min(bset):
                    # e.g. more sinks than the budget holds: not a configuration, so the trial is pruned
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    records.append({**pol.params, "label": pol.label(), "budget": min(bset), "loss": np.nan,
                                    "kv_bytes_mean": np.nan, "trial": trial.number})
                    bar.update(1)
                    continue
                chunk = effective_chunk(pol, trace.chunk)
                keys = [config_key(tid, pol.name, pol.params, b, trace.sliding, chunk) for b in bset]
                plans.append((trial, pol, bset, keys))
            missing = [Job(trace, pol.name, tuple(sorted(pol.params.items())), (b,), (k,))
                       for _, pol, bset, keys in plans for b, k in zip(bset, keys) if k not in cached]
            for rows in ex.run(coalesce(missing) if ex.in_process else missing):
                store.add(rows)
                cached.update({r["key"]: r for r in rows})
            for trial, pol, bset, keys in plans:
                rows = [cached[k] for k in keys]
                loss = float(np.mean([row_loss(_decoded(r), objective, layer_weights, oracle_err.get(b))
                                      for r, b in zip(rows, bset)]))
                memory = float(np.mean([r["kv_bytes_mean"] for r in rows]))
                study.tell(trial, [loss, memory] if multi_objective else loss)
                records.append({**pol.params, "label": pol.label(), "budget": bset[0] if multi_objective else "mean",
                                "loss": loss, "kv_bytes_mean": memory, "trial": trial.number})
                bar.update(1)
        bar.close()
    trials = pd.DataFrame(records).dropna(subset=["loss"]).reset_index(drop=True)
    if trials.empty:
        raise ValueError(f"every sampled configuration of {policy} was invalid for budgets {list(budgets)}")
    if multi_objective:
        front = {t.number for t in study.best_trials}
        pareto = trials[trials.trial.isin(front)].sort_values("kv_bytes_mean")
    else:
        pareto = trials.nsmallest(1, "loss")
    return SearchResult(trials, pareto.reset_index(drop=True))


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    """Rows read back from Parquet hold arrays for list columns; normalise them."""
    return {k: (list(v) if isinstance(v, np.ndarray) else v) for k, v in row.items()}


def _oracle_errors(ex: Executor, trace: TraceRef, tid: str, budgets: Sequence[int], store: ResultStore,
                   cached: dict[str, Any]) -> dict[int, float]:
    oracle = get_policy("oracle")
    keys = {b: config_key(tid, "oracle", oracle.params, b, trace.sliding) for b in budgets}
    todo = [b for b, k in keys.items() if k not in cached]
    if todo:
        job = Job(trace, "oracle", tuple(sorted(oracle.params.items())), tuple(todo), tuple(keys[b] for b in todo))
        for rows in ex.run([job]):
            store.add(rows)
            cached.update({r["key"]: r for r in rows})
    return {b: float(cached[k]["err_mean"]) for b, k in keys.items()}


def describe(result: SearchResult) -> str:
    """One JSON line per Pareto/best configuration, for logs and notes."""
    return "\n".join(json.dumps(r, default=str) for r in result.pareto.to_dict("records"))
