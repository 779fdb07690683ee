"""The needle / RULER experiment as one library call: `run_needle_experiment` builds the prompt grid, runs every
policy x budget closed loop in the model (into a resumable store), optionally predicts each outcome with the
simulator, and returns the report; `write_needle_report` writes its JSON, heatmaps and page.

`kvsim needle` (`gpu_validate.model_commands.needle_cmd`) and the benchmarks (`benchmarks/ruler.py`) both call these, so
the experiment has one implementation: a benchmark gets the report as a dict and adds its own fields before it is
written, instead of running the command by argv and patching its JSON afterwards. The experiment runs where the
model is put: on CUDA with the Triton cache when a GPU is present, else on the CPU with the torch cache
(`gpu_validate.kvcache.backends.pick_device`), unless ``device`` / ``backend`` say otherwise.

This module imports nothing heavy at the top: the command's module imports `NeedleSpec` for its defaults, and
``kvsim --help`` must stay fast.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_POLICIES = ("streaming_llm; h2o; tova; cascading; snapkv; pyramidkv; ada_snapkv; bumblebee; buzz; window; "
                    "random; d2o")


def _say(text: str) -> None:
    print(text, flush=True)


@dataclass
class NeedleSpec:
    """One experiment: the prompt grid, the policies and budgets, the stores, the prediction's settings and where
    it runs. Each field is the `kvsim needle` option of the same name (its help says what it does); the defaults
    are the command's."""

    model: str = "smollm2-135m"
    text: str = "default"
    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    #: task -> the longest context length it runs at (None: every length)
    tasks: dict[str, int | None] = field(default_factory=lambda: {"passkey": None})
    repeats: int = 1
    prompt_chunk: int = 1
    policies: str = DEFAULT_POLICIES
    budgets: list[int] = field(default_factory=lambda: [32, 64])
    store: str = "results/needle"
    predict: bool = False
    train_seeds: list[int] | None = None
    fit_objective: str = "balanced_accuracy"
    sim_store: str | None = None
    min_full_accuracy: float = 0.0
    solved_only: bool = False
    max_rows: int = 48
    device: str | None = None
    backend: str | None = None


@dataclass
class NeedleResult:
    """What `run_needle_experiment` returns: ``report`` (the JSON-ready summary; a caller may add fields before
    `write_needle_report`) and ``table``, the closed-loop rows of the reported (task, length) cells (what the
    heatmaps draw). ``empty``: the full cache fails every cell, nothing is reported (``report`` then holds the
    grid and the full cache's accuracy per cell only)."""

    report: dict[str, Any]
    table: "pd.DataFrame"

    @property
    def empty(self) -> bool:
        return bool(self.table.empty)


def run_needle_experiment(spec: NeedleSpec, *, command: str | None = None, progress: bool = True,
                          log: Callable[[str], None] = _say) -> NeedleResult:
    """Run ``spec``: every prompt of its grid x (policy, budget), plus the full cache, closed loop in the model
    (cells already in ``spec.store`` are read back), cells the full cache retrieves less than
    ``spec.min_full_accuracy`` dropped, and with ``spec.predict`` the simulator's features (``spec.sim_store``) and
    the predictor fitted on ``spec.train_seeds`` and judged on the other seeds. ``command`` is recorded in the
    report (the page shows it)."""
    import torch

    from gpu_validate.kvcache.backends import pick_device
    from gpu_validate.studies.needle.prompts import make_grid
    from gpu_validate.studies.needle.runs import run_needle
    from gpu_validate.studies.needle.scores import summarize
    from gpu_validate.studies.page_parts import run_info
    from sim.experiments.store import ResultStore
    from traces.model import read_text
    from traces.models import load_model, model_id as name_of

    device, backend = pick_device(spec.device, spec.backend)
    policies, configs = _configurations(spec, backend)
    with torch.no_grad():
        model, tok = load_model(spec.model, device=device)
        model_id = name_of(spec.model)
        text, text_id = read_text(spec.text)
        prompts = [p for p in make_grid(tok, text, spec.lengths, spec.depths, spec.seeds, tasks=list(spec.tasks),
                                        repeats=spec.repeats)
                   if spec.tasks[p.task] is None or p.length <= spec.tasks[p.task]]
        log(f"{len(prompts)} prompts x {len(configs)} configurations (+ full cache) on {model_id} ({device}, "
            f"{backend})")
        store = ResultStore(spec.store)
        ids = {p.prompt_id for p in prompts}

        def run_cells(prompts_, configs_, solved_only=False):
            """The closed-loop rows of ``prompts_`` x ``configs_`` (run where the store lacks them) of this
            experiment's grid: its model, prompts, prompt chunk, policies and budgets."""
            df = run_needle(model, prompts_, configs_, store, model_id=model_id, backend=backend,
                            max_rows=spec.max_rows, decode=tok.decode, chunk=spec.prompt_chunk, progress=progress,
                            solved_only=solved_only, min_full_accuracy=spec.min_full_accuracy)
            chunk = df.chunk.fillna(1).astype(int) if "chunk" in df.columns else 1
            df = df[(df.model == model_id) & df.prompt_id.isin(ids) & (chunk == spec.prompt_chunk)
                    & df.label.isin({pol.label() for pol in policies} | {"full"})
                    & (df.budget.isin(spec.budgets) | (df.policy == "full"))]
            return df if "task" in df.columns else df.assign(task="passkey")

        df, prompts, solved, kept_cells, dropped = _gated_cells(run_cells, spec, prompts, configs, log)
        report = {"model": model_id, "backend": backend, "device": device, "tasks": list(spec.tasks),
                  "task_max_length": {t: c for t, c in spec.tasks.items() if c is not None}, "lengths": spec.lengths,
                  "depths": spec.depths, "seeds": spec.seeds, "repeats": spec.repeats,
                  "prompt_chunk": spec.prompt_chunk, "policies": [p.label() for p in policies],
                  "budgets": spec.budgets, "n_prompts": len(ids), "prompt_ids": sorted(p.prompt_id for p in prompts),
                  "text": text_id, "command": command, **run_info(),
                  "min_full_accuracy": spec.min_full_accuracy, "solved_only": bool(spec.solved_only),
                  "n_solved_prompts": None if solved is None else len(prompts),
                  "full_accuracy_by_cell": {f"{t}@{L}": a for (t, L), a in {**kept_cells, **dropped}.items()},
                  "reported_cells": [f"{t}@{L}" for t, L in kept_cells],
                  "dropped_cells": [f"{t}@{L}" for t, L in dropped]}
        if df.empty:
            log("no cell left to report: the full cache fails every (task, length) cell")
            return NeedleResult(report, df)
        report.update({**summarize(df), "by_task": {t: summarize(part) for t, part in df.groupby("task")}})
        if spec.predict:
            prompts = [p for p in prompts if (p.task, p.length) not in dropped]    # (already so when solved_only)
            report.update(_prediction(spec, model, tok, prompts, configs, df, report["accuracy_by_seed"],
                                      model_id=model_id, progress=progress, log=log))
    return NeedleResult(report, df)


def _configurations(spec: NeedleSpec, backend: str) -> tuple[list, list]:
    """The spec's policies (the oracle left out) and their (policy, budget) configurations, each checked to run on
    ``backend``."""
    from gpu_validate.closedloop.jobs import check_run_args
    from sim.experiments.specs import parse_policy_list

    policies = parse_policy_list(spec.policies, exclude=("oracle",))
    configs = []
    for pol in policies:
        for b in spec.budgets:
            check_run_args(pol, b, backend)
            configs.append((pol, int(b)))
    return policies, configs


def _gated_cells(run_cells: Callable, spec: NeedleSpec, prompts: list, configs: list,
                 log: Callable[[str], None]) -> tuple["pd.DataFrame", list, set | None, dict, dict]:
    """Every cell run, the full cache first where the spec gates on it (``min_full_accuracy``, ``solved_only``), so
    that the policies run only where the model itself can do the task. Returns the reported rows, the prompts
    judged, the prompts the full cache solves (None: not ``solved_only``), and the (task, length) cells kept and
    dropped with the full cache's accuracy in each."""
    from gpu_validate.studies.needle.scores import passing_cells
    from policies.core.registry import get_policy

    full = get_policy("full")
    gate = spec.min_full_accuracy > 0 or spec.solved_only
    solved = None
    if spec.solved_only:    # one pass: each prompt's full cache first, its policies only where that retrieves
        first = run_cells(prompts, [(full, 1)] + configs, solved_only=True)
        solved = set(first[(first.policy == "full") & first.success.astype(bool)].prompt_id)
    elif gate:              # the full cache first: the policies run only where the model itself can do the task
        first = run_cells(prompts, [(full, 1)])
        _, _, dropped = passing_cells(first, spec.min_full_accuracy)
        run_cells([p for p in prompts if (p.task, p.length) not in dropped], configs)
    df, kept_cells, dropped = passing_cells(run_cells(prompts, [] if gate else [(full, 1)] + configs),
                                            spec.min_full_accuracy)
    if solved is not None:
        df = df[df.prompt_id.isin(solved)]
        prompts = [p for p in prompts if p.prompt_id in solved and (p.task, p.length) not in dropped]
        log(f"{len(prompts)} prompts of the reported cells the full cache retrieves: the policies are judged on "
            "those")
    if dropped:
        log(f"dropped (task, length) cells where the full cache retrieves < {spec.min_full_accuracy:g}: "
            + ", ".join(f"{t}@{L} ({a:.2f})" for (t, L), a in dropped.items()))
    return df, prompts, solved, kept_cells, dropped


def _prediction(spec: NeedleSpec, model, tok, prompts: list, configs: list, df: "pd.DataFrame",
                accuracy_by_seed: dict, *, model_id: str, progress: bool,
                log: Callable[[str], None]) -> dict[str, Any]:
    """The report's prediction fields: the simulator's features of every reported cell (``spec.sim_store``), the
    predictor fitted on the training seeds and judged on the others, its wrong calls and the model's own
    reliability across seeds."""
    from gpu_validate.studies.needle.prediction import prediction_table, stored_features
    from gpu_validate.studies.needle.scores import prediction_report, seed_reliability, wrong_calls
    from sim.experiments.store import ResultStore

    sim_store = ResultStore(spec.sim_store or str(spec.store).rstrip("/") + "-sim")
    feats = stored_features(model, prompts, configs, sim_store, model_id=model_id, chunk=spec.prompt_chunk,
                            progress=progress)
    merged = prediction_table(df, feats)
    train = spec.train_seeds if spec.train_seeds is not None else spec.seeds[:max(1, len(spec.seeds) // 2)]
    pred = prediction_report(merged, train, objective=spec.fit_objective)
    held_out = merged[~merged.seed.isin(train)]
    out = {"wrong_calls": wrong_calls(held_out, prompts, pred["feature"], pred["threshold"], tok.decode),
           "sim_agreement": pred["sim_agreement"], "base_rate": pred["base_rate"],
           "balanced_accuracy": pred["balanced_accuracy"], "mcc": pred["mcc"],
           "fit_objective": pred["objective"], "sim_store": str(sim_store.root), "prediction": pred,
           "model_reliability": seed_reliability(accuracy_by_seed, train),
           "predictor": f"{pred['feature']}: retained share of the full-cache attention on the "
                        f"key's tokens at the answer steps, {pred['feature_doc']}"}
    log(f"simulator prediction on held-out seeds {pred['test_seeds']}: agreement {pred['sim_agreement']:.3f} "
        f"(base rate {pred['base_rate']:.3f}), balanced accuracy {pred['balanced_accuracy']:.3f}, "
        f"MCC {pred['mcc']:.3f} (predictor {pred['feature']}, threshold {pred['threshold']:.3f}, both "
        f"chosen by {pred['objective'].replace('_', ' ')} on seeds {pred['train_seeds']}); with the full "
        f"cache's outcome per prompt: agreement {pred.get('sim_and_full_agreement', float('nan')):.3f}, "
        f"balanced accuracy {pred.get('sim_and_full_balanced_accuracy', float('nan')):.3f}; "
        f"confusion {pred['confusion']}")
    return out


def write_needle_report(result: NeedleResult, out: str | Path, *, log: Callable[[str], None] = _say) -> Path:
    """Write a non-empty ``result``: one accuracy heatmap per policy beside the full cache at ``out`` with a .png
    suffix (and one per task, ``<stem>_<task>.png``, when there are several), the report as JSON at ``out``
    (atomically, with the plots' paths added to ``result.report``) and its page at ``out`` with an .html suffix;
    the ranked tables go to the terminal. Returns ``out``."""
    import json

    from gpu_validate.studies.needle.scores import plot_needle
    from gpu_validate.studies.needle.needle_page import needle_page, needle_tables
    from sim.reports.table import print_tables
    from traces.format import atomic_write_text

    if result.empty:
        raise ValueError("the needle result reports no cell (the full cache fails every one): nothing to write")
    report, df = result.report, result.table
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    where = f"closed loop, {str(report['device']).upper()}, {len(report['seeds'])} seeds per cell"
    png = plot_needle(df, out.with_suffix(".png"), title=f"needle retrieval on {report['model']} ({where})")
    report["plot"] = str(png)
    if len(report["tasks"]) > 1:
        report["task_plots"] = {t: str(plot_needle(part, out.with_name(f"{out.stem}_{t}.png"),
                                                   title=f"{t} retrieval on {report['model']} ({where})"))
                                for t, part in df.groupby("task")}
    atomic_write_text(out, json.dumps(report, indent=1, default=float))
    log(f"full-cache accuracy {report['full_accuracy']:.3f}")
    print_tables(needle_tables(report), f"kvsim needle — retrieval accuracy on {report['model']}")
    page = needle_page(report, out.with_suffix(".html"), plot=png)
    log(f"wrote {out} and {png}\npage: {page}")
    return out
