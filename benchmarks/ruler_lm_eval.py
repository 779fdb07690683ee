"""lm-evaluation-harness's own RULER tasks, scored through kvsim's model type with each policy, and the simulator's
prediction of the outcomes judged held out.

    python -m benchmarks.ruler_lm_eval --model smollm2-135m [--docs 2] [--length 4096]
    python -m benchmarks.ruler_lm_eval --model gemma3-270m --length 8192 ...

Which RULER tasks lm-eval 0.4.13 generates offline (`OFFLINE_TASKS`, checked by building each on this machine with no
network): the needles in a repeated or synthetic haystack (``niah_single_1``, ``niah_multikey_2``,
``niah_multikey_3``), variable tracking (``ruler_vt``), common and frequent words (``ruler_cwe``, ``ruler_fwe``; the
word lists come from the ``wonderwords`` package). The essay haystacks (``niah_single_2/3``, ``niah_multikey_1``,
``niah_multivalue``, ``niah_multiquery``: Paul Graham's essays from the Hugging Face hub) and the QA tasks (SQuAD,
HotpotQA downloads) cannot run here and are listed in the JSON as such (`DOWNLOADING_TASKS`), not faked.

Closed loop: each task's prompts are lm-eval's own (its generator, the model's tokenizer, at ``--length`` tokens);
the first ``--docs`` of each task are scored by lm-eval's own metric (the share of expected values in the generation)
for the full cache and every policy x budget (`POLICIES`, `BUDGETS`), through ``KVSimLM``
(`gpu_validate.lm_eval_model`): the prompt compressed once after it goes in (a prefill selector, or a streamed
policy taking the whole prompt as one chunk, as benchmarks/ruler.py), then greedy decoding with eviction at every
step. One change to lm-eval's task settings: generation is capped at ``--max-gen`` tokens (lm-eval's defaults are
30-128; every expected answer here fits in 48 of SmolLM2's or Gemma-3's tokens), because decoding dominates the
CPU cost. A doc counts as retrieved when lm-eval's score is 1 (every expected value present).

Prediction: per doc, the prompt (`gpu_validate.studies.needle.lm_eval_docs.needle_prompt_from_doc`: lm-eval's prompt
ids, the evidence positions) and the expected answer recorded as one teacher-forced trace and each (policy,
budget) replayed on it (`gpu_validate.studies.needle.prediction.stored_features`, the needle prediction's features: the
share of the full-cache attention on the evidence tokens -- the positions of the expected values in the prompt --
that the policy still holds while the answer is written). The predictor (feature and threshold) is fitted on the
docs of index 0 of every task and judged on the others (`gpu_validate.studies.needle.scores.prediction_report`): agreement
next to its base rate, balanced accuracy, MCC. Only docs the full cache retrieves are judged (the needle
benchmark's ``solved_only``).

Resumable: the closed-loop outcomes go to ``benchmarks/.ruler-lm-eval/<model>-<length>/closed.jsonl`` one config
at a time, the simulator's features to a ``sim.experiments.store.ResultStore`` beside it. Result:
``benchmarks/results/ruler_lm_eval_<model>.json`` (``_<model>_8k.json`` at ``--length 8192``; rewritten after every
config, so a stopped run leaves what it measured), its page in docs/results/ruler_lm_eval.md
(``python -m benchmarks.docs_tables``). Heavy: run under ``flock /work/heavy.lock``; one thread
(``limit_threads(1)``).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / ".ruler-lm-eval"
#: RULER tasks lm-eval 0.4.13 builds with no network (its sources, and a build on this machine)
OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
#: RULER tasks that download their data (refused offline: "Couldn't reach 'baber/paul_graham_essays'", SQuAD/HotpotQA)
DOWNLOADING_TASKS = {"niah_single_2": "Paul Graham essays (hub)", "niah_single_3": "Paul Graham essays (hub)",
                     "niah_multikey_1": "Paul Graham essays (hub)", "niah_multivalue": "Paul Graham essays (hub)",
                     "niah_multiquery": "Paul Graham essays (hub)", "ruler_qa_squad": "SQuAD v2 (download)",
                     "ruler_qa_hotpot": "HotpotQA (download)"}
#: the seed papers' policies that run here (Ada-KV, BUZZ, D2O) and the issue's (KVzip, SnapKV, StreamingLLM, H2O,
#: TOVA). Not here: BumbleBee (its prompt selection costs ~40 min per 4 k prompt on SmolLM2, benchmarks/ruler.py) and
#: Cascading (its state follows each prompt token in order: a 4 k prompt streamed token by token per config)
POLICIES = ("kvzip", "snapkv", "streaming_llm", "h2o", "tova", "ada_snapkv", "buzz", "d2o")
BUDGETS = (128, 512, 2048)
TRAIN_DOCS = (0,)


#: the seed of Python's global ``random`` when the tasks are built: lm-eval's RULER generator draws every needle
#: (key word, value, depth) from the global ``random`` and never seeds it, so unseeded, each process (a resumed run, the
#: harness check of another) writes other docs under the same ids
DOC_SEED = 42


def build_tasks(folder: Path, length: int, names: tuple[str, ...], max_gen: int) -> dict[str, Any]:
    """lm-eval's task objects for ``names`` at ``length`` tokens with the model's tokenizer (``folder``), their
    generation capped at ``max_gen`` tokens; the docs drawn with ``random`` seeded (`DOC_SEED`), so that a resumed
    run's docs are those of the run it resumes."""
    import random

    from lm_eval.tasks import TaskManager, get_task_dict

    random.seed(DOC_SEED)
    tm = TaskManager(metadata={"tokenizer": str(folder), "max_seq_lengths": [int(length)]})
    tasks = get_task_dict(list(names), tm)
    for task in tasks.values():
        gen = dict(task.config.generation_kwargs or {})
        gen["max_gen_toks"] = int(max_gen)
        task.set_config(key="generation_kwargs", value=gen)
    return tasks


def task_docs(tasks: dict[str, Any], n_docs: int) -> list[dict[str, Any]]:
    """The first ``n_docs`` requests of every task as lm-eval builds them: task name, doc id, the doc, the context
    string and the generation arguments."""
    out = []
    for name, task in tasks.items():
        task.build_all_requests(limit=n_docs, rank=0, world_size=1)
        for inst in task.instances:
            context, gen_kwargs = inst.args
            out.append({"task": name, "doc": int(inst.doc_id), "doc_obj": inst.doc, "context": context,
                        "gen_kwargs": dict(gen_kwargs), "task_obj": task})
    return out


def closed_loop(lm: Any, req: dict[str, Any], configs: list[tuple[str, int | None]]) -> list[dict[str, Any]]:
    """Every (policy, budget) on one lm-eval request in one batched closed loop (`gpu_validate.closedloop.runner.run_batch`: the
    prompt goes through the model once for all of them, then greedy decoding with eviction; the runner ``KVSimLM``
    drives one configuration at a time), each generation cut and scored as lm-eval's ``hf`` model and the task do
    it (``tok_decode``, the stop sequences, ``process_results``)."""
    from lm_eval.models.utils import handle_stop_sequences, postprocess_generated_text

    from gpu_validate.closedloop.jobs import BatchJob
    from gpu_validate.closedloop.runner import run_batch
    from sim.experiments.specs import parse_policy

    gen = dict(req["gen_kwargs"])
    max_gen = int(gen.get("max_gen_toks", lm.max_gen_toks))
    ids = lm.tok_batch_encode([req["context"]], left_truncate_len=lm.max_length - max_gen)[0][0].tolist()
    P = len(ids)
    jobs = [BatchJob(parse_policy(p), int(b) if b is not None else P + max_gen, ids, n_generate=max_gen, chunk=P)
            for p, b in configs]
    t0 = time.perf_counter()
    results = run_batch(lm.model, jobs, backend="torch", max_rows=64)
    seconds = time.perf_counter() - t0
    eos = lm.tok_decode(lm.eot_token_id, skip_special_tokens=False)
    until = handle_stop_sequences(gen.get("until"), eos=eos)
    task = req["task_obj"]
    rows = []
    for (spec, budget), r in zip(configs, results):
        toks = list(r.generated)
        if lm.eot_token_id in toks:
            toks = toks[:toks.index(lm.eot_token_id) + 1]
        text = postprocess_generated_text(generation=lm.tok_decode(toks), stop=until, think_end_token=None)
        metrics = task.process_results(req["doc_obj"], [text])
        score = next(v for v in metrics.values() if v != -1)
        rows.append({"task": req["task"], "doc": req["doc"], "policy": spec, "budget": budget, "score": float(score),
                     "success": bool(float(score) >= 1.0), "prompt_tokens": P, "generation": text,
                     "outputs": list(req["doc_obj"]["outputs"]), "seconds_doc_all_configs": seconds,
                     **({"context": req["context"]} if spec == "full" else {})})
    return rows


def harness_full(lm: Any, tasks: dict[str, Any], n_docs: int) -> dict[tuple[str, int], tuple[str, str]]:
    """The full cache through lm-eval's own evaluation with the ``kvsim`` model (``simple_evaluate``): its
    (prompt, generation) per (task, doc), to check the batched closed loop against the harness path."""
    import lm_eval
    from sim.experiments.specs import parse_policy

    lm.kvsim_policy, lm.kvsim_spec, lm.kvsim_budget = parse_policy("full"), "full", None
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks.values()), limit=n_docs, log_samples=True,
                                  bootstrap_iters=0, verbosity="WARNING")
    return {(t, int(s["doc_id"])): (s["arguments"][0][0], s["filtered_resps"][0])
            for t, samples in out["samples"].items() for s in samples}


def harness_check(via: dict[tuple[str, int], tuple[str, str]], done: list[dict]) -> dict[str, Any]:
    """The harness's full-cache generations against the batched closed loop's, doc by doc where both saw the same
    prompt; a doc whose stored prompt differs (run by a process that drew other docs: `DOC_SEED`) is counted apart,
    not compared."""
    ours = {(r["task"], r["doc"]): (r.get("context"), r["generation"]) for r in done if r["policy"] == "full"}
    same_prompt = [k for k in via if k in ours and ours[k][0] == via[k][0]]
    same = [k for k in same_prompt if via[k][1] == ours[k][1]]
    return {"docs": len(via), "compared": len(same_prompt), "same_generation": len(same),
            "other_prompt": len(via) - len(same_prompt),
            "differing": [{"task": k[0], "doc": k[1], "harness": via[k][1], "batched": ours[k][1]}
                          for k in same_prompt if k not in same][:10]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=4096, help="RULER context length in tokens")
    ap.add_argument("--docs", type=int, default=2, help="docs per task (the first of each trains the predictor)")
    ap.add_argument("--tasks", default=",".join(OFFLINE_TASKS))
    ap.add_argument("--policies", default=";".join(POLICIES))
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--max-gen", type=int, default=24, help="tokens generated per doc at most")
    ap.add_argument("--no-predict", action="store_true", help="skip the simulator's prediction")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: write the JSON (and the prediction, from the docs whose simulator features are "
                         "all stored) from what the stores hold, e.g. while or after a run was stopped")
    ap.add_argument("--no-harness-check", action="store_true",
                    help="skip the full cache's run through lm-eval's own evaluation (the batched loop's check)")
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import pandas as pd

    from benchmarks._util import machine, write_result
    from gpu_validate.lm_eval_model import KVSimLM
    from sim.replay.threads import limit_threads
    from traces.models import resolve_model

    limit_threads(1)
    t_start = time.perf_counter()
    load = os.getloadavg()[0]
    folder = resolve_model(args.model)
    work = WORK / f"{args.model}-{args.length}"
    work.mkdir(parents=True, exist_ok=True)
    closed = work / "closed.jsonl"
    done = [json.loads(line) for line in closed.read_text().splitlines()] if closed.is_file() else []
    names = tuple(t for t in args.tasks.split(",") if t)
    t0 = time.perf_counter()
    tasks = {} if args.report_only else build_tasks(folder, args.length, names, args.max_gen)
    t_build = time.perf_counter() - t0
    lm = KVSimLM(model=args.model, policy="full", prefill_chunk=0, batch_size=1)
    budgets = [int(b) for b in args.budgets.split(",")]
    configs = [("full", None)] + [(p, b) for p in args.policies.split(";") for b in budgets]

    def report(rows: list[dict], prediction: dict | None, check: dict | None) -> None:
        df = pd.DataFrame(rows)
        full = df[df.policy == "full"].set_index(["task", "doc"]).success.to_dict() if len(df) else {}
        cells = {}
        for (pol, b), part in df.groupby(["policy", df.budget.fillna(0).astype(int)]) if len(df) else []:
            per_task = {t: float(g.score.mean()) for t, g in part.groupby("task")}
            solved = part[[full.get((t, d), False) for t, d in zip(part.task, part.doc)]]
            cells[f"{pol}@{b}" if b else pol] = {
                "policy": pol, "budget": int(b) or None, "score_mean": float(part.score.mean()),
                "score_by_task": per_task, "retrieved_share": float(part.success.mean()),
                "retrieved_share_where_full_retrieves": float(solved.success.mean()) if len(solved) else None,
                "n_docs": int(len(part))}
        payload = {
            "model": args.model, "length": args.length, "docs_per_task": args.docs, "tasks": list(names),
            "tasks_offline": list(OFFLINE_TASKS), "tasks_needing_downloads": DOWNLOADING_TASKS,
            "lm_eval_version": _version("lm-eval"), "max_gen_toks": args.max_gen, "policies": args.policies.split(";"),
            "budgets": budgets, "prefill": "the prompt as one chunk (prefill selector or one chunk step)",
            "cells": cells, "full_cache_by_task": {t: float(np.mean([v for (tt, _), v in full.items() if tt == t]))
                                                   for t in names if any(tt == t for tt, _ in full)},
            "docs": [{k: r[k] for k in ("task", "doc", "policy", "budget", "score", "generation")} for r in rows],
            "prediction": prediction, "harness_check": check,
            "seconds": {"build_tasks": round(t_build, 1), "total": round(time.perf_counter() - t_start, 1),
                        "simulate_per_doc_all_configs_this_run": (float(np.mean(sim_seconds)) if sim_seconds
                                                                   else None),
                        "closed_loop_per_doc_all_configs": float(df.drop_duplicates(["task", "doc"])
                                                                 .seconds_doc_all_configs.mean()) if len(df) else None},
            "load_avg_1min_at_start": load, "machine": machine(),
            "command": "python -m benchmarks.ruler_lm_eval " + " ".join(argv if argv is not None else
                                                                           __import__("sys").argv[1:])}
        write_result(result_name(args.model, args.length), payload)

    have = {(r["task"], r["doc"]) for r in done}
    sim_seconds: list[float] = []
    # task by task, its training doc (0) then its held-out ones: a run stopped early still has whole tasks to judge
    reqs = sorted(task_docs(tasks, args.docs), key=lambda r: (names.index(r["task"]), r["doc"]))
    if args.report_only:
        report(done, predict(lm, done, configs, work, args.length, args.model, stored_only=True), None)
        return 0
    for i, req in enumerate(reqs):
        if (req["task"], req["doc"]) in have:
            continue
        rows = closed_loop(lm, req, configs)
        with closed.open("a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        done += rows
        report(done, None, None)
        ok = sum(r["success"] for r in rows)
        print(f"[{i + 1}/{len(reqs)}] {req['task']} doc {req['doc']}: {rows[0]['prompt_tokens']} tokens, full "
              f"{rows[0]['score']:.2f}, {ok}/{len(rows)} configs retrieve ({rows[0]['seconds_doc_all_configs']:.0f} s)",
              flush=True)
        if not args.no_predict and rows[0]["success"]:     # the simulator's features now: a stopped run keeps them
            sim_seconds.append(simulate(lm, rows[:1], configs, work, args.length, args.model)[1])
            print(f"    simulated its {len(configs) - 1} configs: {sim_seconds[-1]:.0f} s", flush=True)
    check = None
    if not args.no_harness_check:
        t0 = time.perf_counter()
        check = harness_check(harness_full(lm, tasks, args.docs), done)
        check["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"harness check: {check['same_generation']}/{check['compared']} full-cache generations equal "
              f"({check['other_prompt']} docs drawn differently, not compared)", flush=True)
    prediction = None if args.no_predict else predict(lm, done, configs, work, args.length, args.model)
    report(done, prediction, check)
    return 0


def simulate(lm: Any, full_rows: list[dict], configs: list, work: Path, length: int, model: str,
             stored_only: bool = False) -> tuple[Any, float]:
    """The simulator's features (`gpu_validate.studies.needle.prediction.stored_features`, resumable) of every lossy config
    on the docs of ``full_rows`` (the full cache's rows), and the seconds it took; ``stored_only``: only the docs
    whose features are all in the store already (nothing is recorded)."""
    from gpu_validate.studies.needle.lm_eval_docs import needle_prompt_from_doc
    from gpu_validate.studies.needle.prediction import feature_key, stored_features
    from gpu_validate.studies.needle.runs import fits
    from sim.experiments.specs import parse_policy
    from sim.experiments.store import ResultStore
    from traces.models import model_id

    prompts = [p for p in (needle_prompt_from_doc(lm, r, length) for r in full_rows) if p.key_positions]
    lossy = [(parse_policy(p), int(b)) for p, b in configs if b is not None]
    if stored_only:
        have = ResultStore(work / "sim").keys()
        prompts = [p for p in prompts if all(feature_key(p, pol, b, model_id(model), 0) in have
                                             for pol, b in lossy if fits(p, pol, b))]
    t0 = time.perf_counter()
    feats = stored_features(lm.model, prompts, lossy, ResultStore(work / "sim"), model_id=model_id(model), chunk=0,
                            progress=False) if prompts else None
    return feats, time.perf_counter() - t0


def predict(lm: Any, rows: list[dict], configs: list, work: Path, length: int, model: str,
            stored_only: bool = False) -> dict[str, Any]:
    """The held-out judgement of the simulator's prediction of each (doc, policy, budget) outcome, on the docs the
    full cache retrieves: predictor and threshold fitted on docs `TRAIN_DOCS`, judged on the others."""
    import pandas as pd

    from gpu_validate.studies.needle.scores import prediction_report
    from sim.experiments.specs import parse_policy

    df = pd.DataFrame(rows)
    solved = [r for r in rows if r["policy"] == "full" and r["success"]]
    if not solved:
        return {"n_docs_full_retrieves": 0, "error": "the full cache retrieves no doc: nothing to predict"}
    feats, t_sim = simulate(lm, solved, configs, work, length, model, stored_only)
    if feats is None:
        return {"n_docs_full_retrieves": len(solved), "error": "no expected value found in any prompt"}
    feats["task"] = [pid.split("-L")[0] for pid in feats.prompt_id]
    feats["seed"] = [int(pid.rsplit("-s", 1)[1]) for pid in feats.prompt_id]
    closed = df[df.policy != "full"].copy()
    closed["label"] = [parse_policy(p).label() for p in closed.policy]
    table = feats.merge(closed[["task", "doc", "label", "budget", "success"]].rename(columns={"doc": "seed"}),
                        on=["task", "seed", "label", "budget"], how="inner")
    table["length"] = length
    out: dict[str, Any] = {"n_docs_full_retrieves": len(solved), "n_docs_simulated": int(feats.prompt_id.nunique()),
                           "n_cells": int(len(table)),
                           "simulate_seconds_reading_back": round(t_sim, 1), "train_docs": list(TRAIN_DOCS),
                           "cells": table[["task", "seed", "label", "budget", "success", "retained_share"]]
                           .to_dict("records")}
    try:
        out.update(prediction_report(table, TRAIN_DOCS))
    except Exception as e:  # noqa: BLE001 -- too few docs on one side: reported, not fatal
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def result_name(model: str, length: int) -> str:
    """The result's name: ``ruler_lm_eval_<model>`` at the default 4 k, ``ruler_lm_eval_<model>_<k>k`` otherwise."""
    return f"ruler_lm_eval_{model}" + ("" if length == 4096 else f"_{length // 1024}k")


def _version(dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
