"""``kvsim needle``: closed-loop needle-in-a-haystack retrieval on a real model, and the simulator's prediction."""
from __future__ import annotations

import argparse

from sim.commands._common import (add_budgets_option, add_model_option, add_out_option, add_policies_option,
                                  add_quiet_option, add_text_option, add_threads_option, apply_threads, int_list,
                                  positive_int)


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
    from gpu_validate.tasks import TASKS

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


DEFAULT_POLICIES = ("streaming_llm; h2o; tova; cascading; snapkv; pyramidkv; ada_snapkv; bumblebee; buzz; window; "
                    "random; d2o")
#: kept in step with `gpu_validate.needle_report.FIT_OBJECTIVES` (not imported here: the command's module loads light)
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
                                   "balanced accuracy and Matthews correlation.")
    add_model_option(p)
    add_text_option(p, what="filler text")
    p.add_argument("--lengths", type=int_list, default=[256, 512, 1024], help="context lengths in tokens")
    p.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths in [0, 1]")
    p.add_argument("--seeds", type=int_list, default=[1, 2, 3], help="seeds (>= 1): key and filler window")
    p.add_argument("--tasks", type=_tasks, default={"passkey": None},
                   help="comma-separated retrieval tasks (RULER-style, gpu_validate/tasks.py): passkey (one pass "
                        "key), single (one 'special magic number', RULER's wording), multikey (four word->number "
                        "lines, one asked), multivalue (one word, three numbers, all asked), vartrack (a one-hop chain "
                        "of variable assignments, the last one's value asked); NAME:MAXLEN runs a task only at the "
                        "--lengths up to MAXLEN (one the model fails at shorter lengths need not spend the longest "
                        "prompts)")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="write each needle line this many times in a row (a small base model such as "
                        "Gemma-3-270M retrieves a line written twice far more often than once)")
    p.add_argument("--prompt-chunk", type=int, default=1, metavar="C",
                   help="prompt tokens per policy step for policies without a prefill selector (chunked prefill); "
                        "0 = the whole prompt in one step, compressed once after it as a prefill selector does "
                        "(SnapKV's and Ada-KV's needle setting; the prompt then goes through the model once, not "
                        "token by token)")
    add_policies_option(p, default=DEFAULT_POLICIES)
    add_budgets_option(p, default=[32, 64])
    p.add_argument("--store", default="results/needle", help="Parquet results store (resumable)")
    add_out_option(p, "benchmarks/results/needle.json", "summary JSON (the PNG and the HTML page go beside it)")
    p.add_argument("--predict", action="store_true", help="also the simulator's prediction (records one trace per prompt, once: "
                        "the features are stored in --sim-store)")
    p.add_argument("--train-seeds", type=int_list, default=None,
                   help="seeds the prediction threshold is fitted on (none: the first half of --seeds)")
    p.add_argument("--fit-objective", choices=FIT_OBJECTIVES, default="balanced_accuracy",
                   help="what the predictor and its threshold maximise on --train-seeds: balanced_accuracy (most "
                        "cells fail, and agreement rewards predicting the commoner outcome) or agreement (as before)")
    p.add_argument("--sim-store", default=None,
                   help="Parquet store of the simulator's features (resumable; none: the --store path plus '-sim')")
    p.add_argument("--min-full-accuracy", type=float, default=0.0, metavar="A",
                   help="report only the (task, length) cells where the full cache retrieves at least A (the others "
                        "are listed as dropped: a policy cannot be judged on a task the model fails anyway)")
    p.add_argument("--solved-only", action="store_true",
                   help="run and judge the policies only on the prompts the full cache retrieves (each prompt's "
                        "full cache goes first and its prompt forward serves the policies; the full cache's "
                        "accuracy on all prompts stays in the report per cell): every judged cell "
                        "then has a full-cache accuracy of 1, and a policy's accuracy is the share of the model's "
                        "own successes it keeps")
    p.add_argument("--max-rows", type=positive_int, default=48, help="configurations per model batch")
    add_threads_option(p)
    add_quiet_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import os
    from pathlib import Path

    import torch

    from gpu_validate.needle import make_grid, prediction_table, run_needle, stored_features
    from gpu_validate.needle_report import (passing_cells, plot_needle, prediction_report, seed_reliability,
                                            summarize, wrong_calls)
    from gpu_validate.pages import needle_page, needle_tables, run_info
    from sim.commands._common import command_line
    from sim.table import print_tables
    from gpu_validate.jobs import check_run_args
    from policies.registry import get_policy
    from sim.store import ResultStore
    from sim.specs import parse_policy_list
    from traces.models import load_model, model_id as name_of

    torch.set_grad_enabled(False)
    apply_threads(args)
    policies = parse_policy_list(args.policies, exclude=("oracle",))
    configs = []
    for pol in policies:
        for b in args.budgets:
            check_run_args(pol, b, "torch")
            configs.append((pol, int(b)))
    full = get_policy("full")
    model, tok = load_model(args.model, device="cpu")
    model_id = name_of(args.model)
    from traces.model import read_text

    text, text_id = read_text(args.text)
    prompts = [p for p in make_grid(tok, text, args.lengths, args.depths, args.seeds, tasks=list(args.tasks),
                                    repeats=args.repeats)
               if args.tasks[p.task] is None or p.length <= args.tasks[p.task]]
    print(f"{len(prompts)} prompts x {len(configs)} configurations (+ full cache) on {model_id}", flush=True)
    store = ResultStore(args.store)
    ids = {p.prompt_id for p in prompts}

    def run_cells(prompts_, configs_, solved_only=False):
        df = run_needle(model, prompts_, configs_, store, model_id=model_id, max_rows=args.max_rows,
                        decode=tok.decode, chunk=args.prompt_chunk, progress=not args.quiet, solved_only=solved_only,
                        min_full_accuracy=args.min_full_accuracy)
        chunk = df.chunk.fillna(1).astype(int) if "chunk" in df.columns else 1
        df = df[(df.model == model_id) & df.prompt_id.isin(ids) & (chunk == args.prompt_chunk)
                & df.label.isin({pol.label() for pol in policies} | {"full"})
                & (df.budget.isin(args.budgets) | (df.policy == "full"))]
        return df if "task" in df.columns else df.assign(task="passkey")

    gate = args.min_full_accuracy > 0 or args.solved_only
    solved = None
    if args.solved_only:    # one pass: each prompt's full cache first, its policies only where that retrieves
        first = run_cells(prompts, [(full, 1)] + configs, solved_only=True)
        solved = set(first[(first.policy == "full") & first.success.astype(bool)].prompt_id)
    elif gate:              # the full cache first: the policies run only where the model itself can do the task
        first = run_cells(prompts, [(full, 1)])
        _, _, dropped = passing_cells(first, args.min_full_accuracy)
        run_cells([p for p in prompts if (p.task, p.length) not in dropped], configs)
    df, kept_cells, dropped = passing_cells(run_cells(prompts, [] if gate else [(full, 1)] + configs),
                                            args.min_full_accuracy)
    if solved is not None:
        df = df[df.prompt_id.isin(solved)]
        prompts = [p for p in prompts if p.prompt_id in solved and (p.task, p.length) not in dropped]
        print(f"{len(prompts)} prompts of the reported cells the full cache retrieves: the policies are judged on "
              "those", flush=True)
    if dropped:
        print(f"dropped (task, length) cells where the full cache retrieves < {args.min_full_accuracy:g}: "
              + ", ".join(f"{t}@{L} ({a:.2f})" for (t, L), a in dropped.items()), flush=True)
    if df.empty:
        print("no cell left to report: the full cache fails every (task, length) cell", flush=True)
        return 1
    report = {"model": model_id, "backend": "torch", "device": "cpu", "tasks": list(args.tasks),
              "task_max_length": {t: c for t, c in args.tasks.items() if c is not None}, "lengths": args.lengths,
              "depths": args.depths, "seeds": args.seeds, "repeats": args.repeats, "prompt_chunk": args.prompt_chunk,
              "policies": [p.label() for p in policies], "budgets": args.budgets, "n_prompts": len(ids),
              "prompt_ids": sorted(p.prompt_id for p in prompts),
              "text": text_id, "command": command_line(args), **run_info(),
              "min_full_accuracy": args.min_full_accuracy, "solved_only": bool(args.solved_only),
              "n_solved_prompts": None if solved is None else len(prompts),
              "full_accuracy_by_cell": {f"{t}@{L}": a for (t, L), a in {**kept_cells, **dropped}.items()},
              "reported_cells": [f"{t}@{L}" for t, L in kept_cells],
              "dropped_cells": [f"{t}@{L}" for t, L in dropped], **summarize(df),
              "by_task": {t: summarize(part) for t, part in df.groupby("task")}}
    if args.predict:
        sim_store = ResultStore(args.sim_store or str(args.store).rstrip("/") + "-sim")
        prompts = [p for p in prompts if (p.task, p.length) not in dropped]    # (already so with --solved-only)
        feats = stored_features(model, prompts, configs, sim_store, model_id=model_id, chunk=args.prompt_chunk,
                                progress=not args.quiet)
        merged = prediction_table(df, feats)
        train = args.train_seeds if args.train_seeds is not None else args.seeds[:max(1, len(args.seeds) // 2)]
        pred = prediction_report(merged, train, objective=args.fit_objective)
        held_out = merged[~merged.seed.isin(train)]
        report["wrong_calls"] = wrong_calls(held_out, prompts, pred["feature"], pred["threshold"], tok.decode)
        report.update({"sim_agreement": pred["sim_agreement"], "base_rate": pred["base_rate"],
                       "balanced_accuracy": pred["balanced_accuracy"], "mcc": pred["mcc"],
                       "fit_objective": pred["objective"], "sim_store": str(sim_store.root), "prediction": pred,
                       "model_reliability": seed_reliability(report["accuracy_by_seed"], train),
                       "predictor": f"{pred['feature']}: retained share of the full-cache attention on the key's "
                                    f"tokens at the answer steps, {pred['feature_doc']}"})
        print(f"simulator prediction on held-out seeds {pred['test_seeds']}: agreement {pred['sim_agreement']:.3f} "
              f"(base rate {pred['base_rate']:.3f}), balanced accuracy {pred['balanced_accuracy']:.3f}, "
              f"MCC {pred['mcc']:.3f} (predictor {pred['feature']}, threshold {pred['threshold']:.3f}, both chosen "
              f"by {pred['objective'].replace('_', ' ')} on seeds {pred['train_seeds']}); with the full cache's "
              f"outcome per prompt: agreement {pred.get('sim_and_full_agreement', float('nan')):.3f}, balanced "
              f"accuracy {pred.get('sim_and_full_balanced_accuracy', float('nan')):.3f}; "
              f"confusion {pred['confusion']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot_needle(df, out.with_suffix(".png"), title=f"needle retrieval on {model_id} (closed loop, CPU, "
                      f"{len(args.seeds)} seeds per cell)")
    report["plot"] = str(png)
    if len(args.tasks) > 1:
        report["task_plots"] = {t: str(plot_needle(part, out.with_name(f"{out.stem}_{t}.png"),
                                                   title=f"{t} retrieval on {model_id} (closed loop, CPU, "
                                                         f"{len(args.seeds)} seeds per cell)"))
                                for t, part in df.groupby("task")}
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=float))
    os.replace(tmp, out)
    print(f"full-cache accuracy {report['full_accuracy']:.3f}", flush=True)
    print_tables(needle_tables(report), f"kvsim needle — retrieval accuracy on {model_id}")
    page = needle_page(report, out.with_suffix(".html"), plot=png)
    print(f"wrote {out} and {png}\npage: {page}", flush=True)
    return 0
