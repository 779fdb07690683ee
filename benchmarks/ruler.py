"""RULER-style retrieval at length on the real models, closed loop (on CPU here), with the simulator's prediction.

    python -m benchmarks.ruler --model gemma3-270m        # one model's grid (GRIDS): the needle experiment, 3 tasks
    python -m benchmarks.ruler --transfer                 # the predictor fitted on one model, judged on the other
    python -m benchmarks.ruler --model gemma3-270m --bumblebee   # BumbleBee vs H2O and SnapKV at 5-30 % of the context
    python -m benchmarks.ruler --model smollm2-135m --leaderboard   # KVzip, Q-Filters, ... on the single needle at 4-8 k

Per model this is the needle experiment (`gpu_validate.studies.needle.experiment`, what `kvsim needle` runs) with tasks
single, multikey and vartrack, prompt chunk 0, minimum full-cache accuracy 0.9, solved prompts only and the
prediction, on the grid in `GRIDS` (lengths, depths, seeds, budgets, needle repeats and task formats chosen from
full-cache probes on this machine: gpu_validate/studies/needle/tasks.py), after the multi-value task at 1 024 tokens with the full
cache alone (`SHORT_ONLY`): every prompt goes through the model once, each policy compresses the cache once after
the prompt (a prefill selector, or a policy without one taking the whole prompt as one chunk: SnapKV's and Ada-KV's
needle setting), and greedy decoding is scored by the values it contains. (task, length) cells where the full cache
retrieves < 0.9 are dropped and listed. Results: benchmarks/results/ruler_<model>.json, one heatmap per task beside
it, an HTML page; the stores (results/ruler-<model>, -sim) are resumable. The experiment runs on CUDA with the Triton
cache when a GPU is present (``--device``, ``--backend`` as in `kvsim needle`).

``--transfer`` reads both models' stores and fits the predictor (feature and threshold, by balanced accuracy) on
all cells of one model, then judges it on the other model's held-out seeds, next to that model's own fit on its
training seeds: benchmarks/results/ruler_transfer.json.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_validate.studies.needle.experiment import NeedleSpec

#: where the results go, relative to the repository root (`python -m benchmarks.ruler` runs from there), so the
#: plot paths recorded in the JSON stay relative
OUT = Path("benchmarks") / "results"
DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
#: ten policies; BumbleBee is not among them: its prompt selection costs O(P^2) per layer, head and budget (35 s
#: for one layer of Gemma-3 at 8 k here, five minutes of every 8 k prompt), so it runs in its own, smaller grid
#: (`BUMBLEBEE`)
POLICIES = "streaming_llm;h2o;tova;snapkv;pyramidkv;ada_snapkv;buzz;d2o;expected_attention;knorm"
#: per model: tasks (task -> the longest length it runs at, None: every length), needle repeats, lengths, depths,
#: seeds (the first is the training seed), budgets; lengths up to the model's positions (SmolLM2: 8 192, less the
#: answer) and to what this machine can run (Gemma-3: 16 k, see the README for the wall times)
GRIDS: dict[str, dict[str, Any]] = {
    # variable tracking at 1 k only (the full cache scored 0.67 there) and multi-key to 4 k (0.93 / 0.87 at 1 k / 4 k);
    # the single needle at 8 000 scored 0.73, so its policies stop early (solved prompts, minimum full accuracy)
    "smollm2-135m": {"tasks": {"single": None, "multikey": 4096, "vartrack": 1024}, "repeats": 2,
                     "lengths": [1024, 4096, 8000], "depths": DEPTHS, "seeds": [1, 2, 3], "budgets": [128, 512, 2048]},
    # Gemma-3 stops the multi-key and variable-tracking tasks at 4 k: the full cache scored 0.73 / 0.87 and 0.87 /
    # 0.40 at 1 k / 4 k; the single needle scored 1.00 to 8 k and 0.87 at 16 k (a 16 k prompt costs ~2 min here)
    "gemma3-270m": {"tasks": {"single": None, "multikey": 4096, "vartrack": 4096}, "repeats": 2,
                    "lengths": [1024, 4096, 8192, 16384], "depths": DEPTHS, "seeds": [1, 2, 3],
                    "budgets": [128, 512, 2048]},
}
#: tasks measured with the full cache at the shortest length only: neither model writes three values right
#: (gpu_validate/studies/needle/tasks.py), so the longer lengths would spend an hour of full-cache runs on a dropped cell
SHORT_ONLY = {"tasks": {"multivalue": None}, "lengths": [1024]}
#: BumbleBee against H2O and SnapKV at 5-30 % of the context (its paper's range), the single needle at one length per
#: model: 4 k on Gemma-3 (three global layers: ~1.6 min of BumbleBee selections per prompt here), 1 k on SmolLM2 (its
#: 30 layers x 3 KV heads at 4 k cost ~40 min per prompt)
BUMBLEBEE = {"policies": "bumblebee;h2o;snapkv", "fractions": (0.05, 0.1, 0.2, 0.3), "tasks": {"single": None},
             "lengths": {"gemma3-270m": 4096, "smollm2-135m": 1024}}
#: the methods at the top of kvpress's leaderboard (issue 40) beside the grid's H2O, SnapKV and expected attention
#: (their cells are read back from the model's store), the single needle at 4 k-8 k, the main grid's budgets:
#: kvpress's leaderboard is RULER at 4 k, KVzip first among the methods kvsim can run. SmolLM2 at 4 k only: its
#: full cache retrieves the single needle at 8 000 in 0.73 of the prompts, a dropped cell (`ruler_smollm2-135m.json`)
LEADERBOARD = {"policies": "kvzip;observed_attention;cur;qfilter;duo_attention;h2o;snapkv;expected_attention",
               "tasks": {"single": None},
               "lengths": {"gemma3-270m": [4096, 8192], "smollm2-135m": [4096]}}
TRAIN_SEEDS = [1]
#: (task, length) cells where the full cache retrieves less are dropped (the issue's bar); inside the others the
#: policies are judged on the prompts the full cache retrieves (solved_only)
MIN_FULL = 0.9


def needle_spec(model: str, budgets: list[int], policies: str, args: argparse.Namespace,
                **grid: Any) -> "NeedleSpec":
    """The `NeedleSpec` every grid of ``model`` shares (its `GRIDS` prompts, one pass per prompt into the model's
    store, cells below `MIN_FULL` dropped), run where ``args`` say; tasks and lengths (``grid``) are the caller's."""
    from gpu_validate.studies.needle.experiment import NeedleSpec

    g = GRIDS[model]
    return NeedleSpec(model=model, text="default+idle", repeats=g["repeats"], depths=g["depths"], seeds=g["seeds"],
                      budgets=budgets, policies=policies, prompt_chunk=0, min_full_accuracy=MIN_FULL,
                      solved_only=True, store=f"results/ruler-{model}", max_rows=args.max_rows, device=args.device,
                      backend=args.backend, **grid)


def run_model(model: str, args: argparse.Namespace) -> int:
    """The model's `GRIDS` experiment after its `SHORT_ONLY` cells, whose full-cache accuracies join the report."""
    from gpu_validate.studies.needle.experiment import run_needle_experiment, write_needle_report

    g = GRIDS[model]
    t0 = time.perf_counter()
    short = run_needle_experiment(needle_spec(model, g["budgets"], POLICIES, args, **SHORT_ONLY),
                                  command=args.command, progress=not args.quiet)
    main_ = run_needle_experiment(needle_spec(model, g["budgets"], POLICIES, args, tasks=g["tasks"],
                                              lengths=g["lengths"], predict=True, train_seeds=TRAIN_SEEDS),
                                  command=args.command, progress=not args.quiet)
    wall = time.perf_counter() - t0      # this invocation's (a rerun on a filled store only re-reads and re-scores)
    print(f"{model}: {wall:.0f} s wall", flush=True)
    if main_.empty:
        return 1
    report = main_.report
    report["full_accuracy_by_cell"].update(short.report["full_accuracy_by_cell"])
    report["dropped_cells"] = sorted({*report["dropped_cells"], *(c for c, a in report["full_accuracy_by_cell"].items()
                                                                  if a < MIN_FULL)})
    report["wall_seconds_this_run"] = round(wall, 1)
    write_needle_report(main_, OUT / f"ruler_{model}.json")
    return 0


def run_side_grid(model: str, name: str, budgets: list[int], grid: dict[str, Any], lengths: list[int],
                  args: argparse.Namespace, **report: Any) -> int:
    """A grid beside the main one (`BUMBLEBEE`, `LEADERBOARD`: its policies and tasks): the needle experiment into
    the model's store, its own JSON ``ruler_<name>_<model>.json`` (no prediction), ``report`` added to it."""
    from gpu_validate.studies.needle.experiment import run_needle_experiment, write_needle_report

    t0 = time.perf_counter()
    result = run_needle_experiment(needle_spec(model, budgets, grid["policies"], args, tasks=grid["tasks"],
                                               lengths=lengths), command=args.command, progress=not args.quiet)
    wall = time.perf_counter() - t0
    print(f"{model} {name} grid: {wall:.0f} s wall", flush=True)
    if result.empty:
        return 1
    result.report.update(**report, wall_seconds_this_run=round(wall, 1))
    write_needle_report(result, OUT / f"ruler_{name}_{model}.json")
    return 0


def run_bumblebee(model: str, args: argparse.Namespace) -> int:
    """The `BUMBLEBEE` grid: BumbleBee, H2O and SnapKV at 5-30% of the context, at one length per model."""
    L = BUMBLEBEE["lengths"][model]
    return run_side_grid(model, "bumblebee", [int(round(f * L)) for f in BUMBLEBEE["fractions"]], BUMBLEBEE, [L],
                         args, budget_fractions=list(BUMBLEBEE["fractions"]))


def run_leaderboard(model: str, args: argparse.Namespace) -> int:
    """The `LEADERBOARD` grid: kvpress's leaderboard methods at the main grid's budgets, 4-8 k."""
    return run_side_grid(model, "leaderboard", GRIDS[model]["budgets"], LEADERBOARD, LEADERBOARD["lengths"][model],
                         args)


def transfer() -> int:
    """Fit on one model, judge on the other's held-out seeds, beside each model's own held-out scores; and within a
    model, fit on one task, judge on the others."""
    import json

    from benchmarks._util import RESULTS, machine, write_result
    from gpu_validate.studies.needle.prediction import FEATURES, prediction_table
    from gpu_validate.studies.needle.scores import split_report
    from sim.experiments.store import ResultStore

    tables = {}
    for model in GRIDS:
        report = json.loads((RESULTS / f"ruler_{model}.json").read_text())
        df = ResultStore(f"results/ruler-{model}").load()
        df = df[df.prompt_id.isin(set(report["prompt_ids"])) & (df.chunk.fillna(1).astype(int) == 0)]
        df = df[[f"{t}@{L}" in report["reported_cells"] for t, L in zip(df.task, df.length)]]
        feats = ResultStore(f"results/ruler-{model}-sim").load()
        feats = feats[feats.prompt_id.isin(set(df.prompt_id))][["prompt_id", "label", "budget", *FEATURES]]
        tables[model] = prediction_table(df, feats.drop_duplicates(["prompt_id", "label", "budget"]))
    out = {"machine": machine(), "train_seeds": TRAIN_SEEDS, "directions": {}}
    keys = ("feature", "threshold", "sim_agreement", "base_rate", "balanced_accuracy", "mcc", "confusion",
            "n_test_cells")
    for src in tables:
        for dst in tables:
            test = tables[dst][~tables[dst].seed.isin(TRAIN_SEEDS)]
            train = tables[src] if src != dst else tables[src][tables[src].seed.isin(TRAIN_SEEDS)]
            r = split_report(train, test)
            out["directions"][f"{src}->{dst}"] = {k: r[k] for k in keys}
    for dst in tables:
        own, other = out["directions"][f"{dst}->{dst}"], [v for k, v in out["directions"].items()
                                                          if k.endswith(f"->{dst}") and not k.startswith(dst)]
        for v in other:
            v["balanced_accuracy_minus_own"] = v["balanced_accuracy"] - own["balanced_accuracy"]
            v["mcc_minus_own"] = v["mcc"] - own["mcc"]
    # across tasks, within a model: fitted on one task's training seeds, judged on the other tasks' held-out seeds
    out["tasks"] = {}
    for model, t in tables.items():
        for task in sorted(set(t.task)):
            train = t[(t.task == task) & t.seed.isin(TRAIN_SEEDS)]
            test = t[(t.task != task) & ~t.seed.isin(TRAIN_SEEDS)]
            if len(train) and len(test) and train.success.nunique() == 2:
                r = split_report(train, test)
                out["tasks"][f"{model}: {task}->others"] = {k: r[k] for k in keys}
    path = write_result("ruler_transfer", out)
    for k, v in [*out["directions"].items(), *out["tasks"].items()]:
        print(f"{k:34s} BA {v['balanced_accuracy']:.3f} MCC {v['mcc']:.3f} agreement {v['sim_agreement']:.3f} "
              f"(base rate {v['base_rate']:.3f}, n {v['n_test_cells']}, {v['feature']} >= {v['threshold']:.3f})")
    print(f"wrote {path}")
    return 0


def main(argv: list[str]) -> int:
    import torch  # noqa: F401  (loaded first, so the thread cap covers its pool too)

    from gpu_validate.studies.needle.experiment import NeedleSpec
    from sim.commands._common import add_device_options, add_quiet_option, add_threads_option, apply_threads

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(GRIDS))
    ap.add_argument("--transfer", action="store_true")
    ap.add_argument("--bumblebee", action="store_true", help="the BumbleBee grid of --model (BUMBLEBEE)")
    ap.add_argument("--leaderboard", action="store_true",
                    help="kvpress's leaderboard methods on the single needle at 4-8 k, grid of --model (LEADERBOARD)")
    add_device_options(ap)
    ap.add_argument("--max-rows", type=int, default=NeedleSpec.max_rows,
                    help="configurations per model batch (default: %(default)s)")
    add_threads_option(ap)
    add_quiet_option(ap)
    args = ap.parse_args(argv)
    args.command = shlex.join(["python", "-m", "benchmarks.ruler", *argv])
    apply_threads(args)
    if args.transfer:
        return transfer()
    if not args.model:
        ap.error("--model or --transfer")
    if args.bumblebee:
        return run_bumblebee(args.model, args)
    if args.leaderboard:
        return run_leaderboard(args.model, args)
    return run_model(args.model, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
