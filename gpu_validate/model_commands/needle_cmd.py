"""``kvsim needle``: closed-loop needle-in-a-haystack retrieval on a real model, and the simulator's prediction."""
from __future__ import annotations

import argparse

from gpu_validate.studies.needle.experiment import NeedleSpec
from sim.commands._common import (add_budgets_option, add_device_options, add_model_option, add_out_option,
                                  add_policies_option, add_quiet_option, add_text_option, add_threads_option,
                                  apply_threads, int_list, positive_int)


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"depths must lie in [0, 1], got {text!r}")
    return values


def _tasks(text: str) -> dict[str, int | None]:
    """``NAME[:MAXLEN],...`` -> {task: the longest context it runs at, None for every length}."""
    from gpu_validate.studies.needle.tasks import TASKS

    out: dict[str, int | None] = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, _, cap = item.partition(":")
        if name not in TASKS:
            raise argparse.ArgumentTypeError(f"unknown task {name!r} (expected some of {sorted(TASKS)})")
        try:
            out[name] = int(cap) if cap else None
        except ValueError:
            raise argparse.ArgumentTypeError(f"a task's length cap must be an integer, got {item!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"no task in {text!r}")
    return out


#: the experiment's defaults (`gpu_validate.studies.needle.experiment` imports nothing heavy at its top)
DEFAULTS = NeedleSpec()
#: kept in step with `gpu_validate.studies.needle.scores.FIT_OBJECTIVES` (not imported here: the command's module
#: loads light)
FIT_OBJECTIVES = ("balanced_accuracy", "agreement")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("needle", help="needle-in-a-haystack retrieval closed loop, and the simulator's prediction",
                       description="Build a grid of pass-key prompts (context lengths x needle depths x seeds, "
                                   "real filler text), run every policy x budget closed-loop in the model (batched) "
                                   "and score exact-match retrieval into a resumable Parquet store; plot one "
                                   "accuracy heatmap per policy beside the full cache, and an HTML page of the "
                                   "results. With --predict, record each "
                                   "prompt as a teacher-forced trace, replay the policies and predict the outcome "
                                   "from the retained attention on the key (predictor and threshold chosen on "
                                   "--train-seeds by --fit-objective; the features go to a resumable store of their "
                                   "own, --sim-store), scored on the other seeds by agreement next to its base rate, "
                                   "balanced accuracy and Matthews correlation. Runs on CUDA with the Triton cache "
                                   "when a GPU is present (--device, --backend), else on the CPU with the torch one.")
    add_model_option(p, default=DEFAULTS.model)
    add_text_option(p, what="filler text")
    p.add_argument("--lengths", type=int_list, default=DEFAULTS.lengths, help="context lengths in tokens")
    p.add_argument("--depths", type=_floats, default=DEFAULTS.depths, help="needle depths in [0, 1]")
    p.add_argument("--seeds", type=int_list, default=DEFAULTS.seeds, help="seeds (>= 1): key and filler window")
    p.add_argument("--tasks", type=_tasks, default=DEFAULTS.tasks,
                   help="comma-separated retrieval tasks (RULER-style, gpu_validate/studies/needle/tasks.py): "
                        "passkey (one pass key), single (one 'special magic number', RULER's wording), multikey "
                        "(four word->number lines, one asked), multivalue (one word, three numbers, all asked), "
                        "vartrack (a one-hop chain of variable assignments, the last one's value asked); NAME:MAXLEN "
                        "runs a task only at the "
                        "--lengths up to MAXLEN (one the model fails at shorter lengths need not spend the longest "
                        "prompts)")
    p.add_argument("--repeats", type=positive_int, default=DEFAULTS.repeats,
                   help="write each needle line this many times in a row (a small base model such as "
                        "Gemma-3-270M retrieves a line written twice far more often than once)")
    p.add_argument("--prompt-chunk", type=int, default=DEFAULTS.prompt_chunk, metavar="C",
                   help="prompt tokens per policy step for policies without a prefill selector (chunked prefill); "
                        "0 = the whole prompt in one step, compressed once after it as a prefill selector does "
                        "(SnapKV's and Ada-KV's needle setting; the prompt then goes through the model once, not "
                        "token by token)")
    add_policies_option(p, default=DEFAULTS.policies)
    add_budgets_option(p, default=DEFAULTS.budgets)
    p.add_argument("--store", default=DEFAULTS.store, help="Parquet results store (resumable)")
    add_out_option(p, "kvsim-out/needle.json", "summary JSON (the PNG and the HTML page go beside it), relative to the "
                   "working directory")
    p.add_argument("--predict", action="store_true",
                   help="also the simulator's prediction (records one trace per prompt, once: the features are stored "
                        "in --sim-store)")
    p.add_argument("--train-seeds", type=int_list, default=None,
                   help="seeds the prediction threshold is fitted on (none: the first half of --seeds)")
    p.add_argument("--fit-objective", choices=FIT_OBJECTIVES, default=DEFAULTS.fit_objective,
                   help="what the predictor and its threshold maximise on --train-seeds: balanced_accuracy (most "
                        "cells fail, and agreement rewards predicting the commoner outcome) or agreement (as before)")
    p.add_argument("--sim-store", default=None,
                   help="Parquet store of the simulator's features (resumable; none: the --store path plus '-sim')")
    p.add_argument("--min-full-accuracy", type=float, default=DEFAULTS.min_full_accuracy, metavar="A",
                   help="report only the (task, length) cells where the full cache retrieves at least A (the others "
                        "are listed as dropped: a policy cannot be judged on a task the model fails anyway)")
    p.add_argument("--solved-only", action="store_true",
                   help="run and judge the policies only on the prompts the full cache retrieves (each prompt's "
                        "full cache goes first and its prompt forward serves the policies; the full cache's "
                        "accuracy on all prompts stays in the report per cell): every judged cell "
                        "then has a full-cache accuracy of 1, and a policy's accuracy is the share of the model's "
                        "own successes it keeps")
    add_device_options(p)
    p.add_argument("--max-rows", type=positive_int, default=DEFAULTS.max_rows, help="configurations per model batch")
    add_threads_option(p)
    add_quiet_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpu_validate.studies.needle.experiment import NeedleSpec, run_needle_experiment, write_needle_report
    from sim.commands._common import command_line

    apply_threads(args)
    spec = NeedleSpec(model=args.model, text=args.text, lengths=args.lengths, depths=args.depths, seeds=args.seeds,
                      tasks=args.tasks, repeats=args.repeats, prompt_chunk=args.prompt_chunk, policies=args.policies,
                      budgets=args.budgets, store=args.store, predict=args.predict, train_seeds=args.train_seeds,
                      fit_objective=args.fit_objective, sim_store=args.sim_store,
                      min_full_accuracy=args.min_full_accuracy, solved_only=args.solved_only, max_rows=args.max_rows,
                      device=args.device, backend=args.backend)
    result = run_needle_experiment(spec, command=command_line(args), progress=not args.quiet)
    if result.empty:
        return 1
    write_needle_report(result, args.out)
    return 0
