"""Long context on this machine: recording 8 k / 32 k-token traces in bounded memory, and replaying them.

Every run is a separate ``kvsim`` process started as a user starts it (plain environment, its own thread budget),
timed and measured for peak resident memory (``/usr/bin/time``):

- ``recordings``: SmolLM2-135M at 8 192 tokens (all 30 layers) and Gemma-3-270M at 32 768 tokens (all 18), teacher
  forced on the shipped text (repeated when shorter than the context), float16 storage, prefill in chunks of 512;
- ``replay``: one configuration per policy x budget (512, 2 048) x prompt chunk (1, 512) on each trace, with
  ``kvsim replay --json``; the oracle's whole curve once per trace. Each runs with an empty trace-table folder
  (``$KVSIM_TABLES``: a user's first replay of the trace), and where it stored tables (BUZZ's and BumbleBee's
  prompt attention) once more reading them (``seconds_tables_reused``: every later replay, sweep job or trial);
- ``closed_loop``: the same configuration run inside the model (``kvsim validate``, teacher forced, torch backend
  on CPU) for a few configurations, and for the rest an estimate from the measured per-token cost of the model
  (labelled ``closed_loop_estimated``), so that ``speedup`` = closed loop / replay is stated for every row.

Writes benchmarks/results/long_context.json after every run (resumable: finished rows are kept).

    python -m benchmarks.long_context [--only recordings|replay|closed_loop] [--models ...] [--policies ...]
                                      [--rerun ...]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from benchmarks._util import RESULTS, machine, timed, user_env, write_result

TRACES = {
    "smollm2-135m": {"dir": "kvsim-out/long/smollm2-8k", "prompt": 7936, "decode": 256, "text": "long-default"},
    "gemma3-270m": {"dir": "kvsim-out/long/gemma3-32k", "prompt": 32512, "decode": 256, "text": "long-default"},
}
POLICIES = "full;streaming_llm;h2o;tova;snapkv;pyramidkv;expected_attention;knorm;bumblebee;d2o;buzz;cascading"
BUDGETS = (512, 2048)
CHUNKS = (1, 512)
#: configurations run closed loop for real (the others are estimated from their measured per-token cost): every
#: prefill selector whose estimated ratio was under the goal, and a chunked stream, where the run takes < 20 min
CLOSED_LOOP = (("gemma3-270m", "snapkv", 2048, 1), ("smollm2-135m", "snapkv", 2048, 1),
               ("smollm2-135m", "h2o", 2048, 512), ("smollm2-135m", "bumblebee", 2048, 1),
               ("smollm2-135m", "buzz", 2048, 1), ("smollm2-135m", "expected_attention", 2048, 1),
               ("smollm2-135m", "knorm", 2048, 1), ("smollm2-135m", "d2o", 2048, 512),
               ("gemma3-270m", "bumblebee", 2048, 1), ("gemma3-270m", "buzz", 2048, 1))


def long_text(n_tokens: int, model: str) -> Path:
    """The shipped held-out texts, concatenated and repeated until the model's tokenizer gives ``n_tokens``
    (a long context of real prose; repetition is marked by the text id)."""
    from traces.model import read_text
    from traces.models import resolve_model
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model(model), local_files_only=True)
    parts = [read_text(name)[0] for name in ("default", "idle")]
    text, n = "", 0
    while n < n_tokens + 64:
        text += "\n\n".join(parts) + "\n\n"
        n = len(tok(text, verbose=False)["input_ids"])
    path = Path(tempfile.gettempdir()) / f"kvsim-long-{model}.txt"
    path.write_text(text)
    return path


def recordings(out: dict, models: list[str]) -> None:
    for model in models:
        t = TRACES[model]
        if any(r["model"] == model for r in out["recordings"]) and Path(t["dir"], "manifest.json").exists():
            continue
        text = long_text(t["prompt"] + t["decode"], model)
        args = ["record", "--model", model, "--text", str(text), "--prompt-tokens", str(t["prompt"]),
                "--decode-tokens", str(t["decode"]), "--teacher-forced", "--single-pass", "--dtype", "float16",
                "--out", t["dir"], "--overwrite", "--no-progress"]
        r = timed(args)
        out["recordings"] = [x for x in out["recordings"] if x["model"] != model]   # a re-recording replaces it
        out["recordings"].append({"model": model, "n_tokens": t["prompt"] + t["decode"], "n_prompt": t["prompt"],
                                  "seconds": r["seconds"], "peak_rss_gb": r["peak_rss_gb"],
                                  "command": "kvsim " + " ".join(args), "result": r["stdout"].strip()})
        print(f"recorded {model} {t['prompt'] + t['decode']} tokens: {r['seconds']:.0f} s, "
              f"{r['peak_rss_gb']:.2f} GB peak", flush=True)
        save(out)


def replays(out: dict, policies: list[str], models: list[str]) -> None:
    """Each policy x budget, and x prompt chunk for a policy that streams its prompt in chunks (for the others a
    chunk changes nothing: ``sim.replay.plan.effective_chunk``)."""
    from policies import get_policy
    from sim.replay.plan import effective_chunk

    done = {(r["model"], r["policy"], r["budget"], r["chunk"]) for r in out["replay"]}
    for model in models:
        t = TRACES[model]
        if not Path(t["dir"], "manifest.json").exists():
            continue
        for name in policies:
            for budget in BUDGETS:
                chunked = name != "oracle" and effective_chunk(get_policy(name), 2) == 2
                for chunk in (CHUNKS if chunked else (1,)):
                    if (model, name, budget, chunk) in done:
                        continue
                    args = ["replay", t["dir"], "--policy", name, "--budget", str(budget), "--prefill-chunk",
                            str(chunk), "--no-verify", "--json"]
                    tables = Path(tempfile.mkdtemp(prefix="kvsim-long-tables-"))
                    env = user_env(KVSIM_TABLES=str(tables))
                    try:
                        r = timed(args, env)
                        reused = timed(args, env) if any(tables.rglob("*.npy")) else None
                    except RuntimeError as exc:
                        out["replay"].append({"model": model, "policy": name, "budget": budget, "chunk": chunk,
                                              "error": str(exc)[-400:]})
                        save(out)
                        continue
                    summary = json.loads(r["stdout"])
                    out["replay"].append({"model": model, "n_tokens": t["prompt"] + t["decode"], "policy": name,
                                          "budget": budget, "chunk": chunk, "seconds": r["seconds"],
                                          "peak_rss_gb": r["peak_rss_gb"], "err_mean": summary["err_mean"],
                                          "n_layers_compressed": summary.get("n_layers_compressed")})
                    if reused is not None:
                        out["replay"][-1].update(seconds_tables_reused=reused["seconds"],
                                                 peak_rss_gb_tables_reused=reused["peak_rss_gb"])
                    shutil.rmtree(tables, ignore_errors=True)
                    print(f"{model} {name} b={budget} C={chunk}: {r['seconds']:.1f} s"
                          + (f" ({reused['seconds']:.1f} s reading its tables)" if reused else "")
                          + f", {r['peak_rss_gb']:.2f} GB, err {summary['err_mean']:.3f}", flush=True)
                    save(out)


def closed_loop(out: dict, models: list[str]) -> None:
    """Measured closed-loop runs, then per-token estimates for every replay row."""
    done = {(r["model"], r["policy"], r["budget"], r["chunk"]) for r in out["closed_loop"]}
    for model, name, budget, chunk in CLOSED_LOOP:
        if (model, name, budget, chunk) in done or model not in models:
            continue
        t = TRACES[model]
        text = long_text(t["prompt"] + t["decode"], model)
        args = ["validate", "--model", model, "--text", str(text), "--policy", name, "--budget", str(budget),
                "--prompt", str(t["prompt"]), "--decode", str(t["decode"]), "--prefill-chunk", str(chunk),
                "--passkey-depths", "", "--json"]
        r = timed(args, timeout=6 * 3600)
        res = json.loads(r["stdout"])
        out["closed_loop"].append({"model": model, "policy": name, "budget": budget, "chunk": chunk,
                                   "seconds": r["seconds"], "peak_rss_gb": r["peak_rss_gb"],
                                   "delta_nll": res.get("delta_nll"), "tokens_per_s": res.get("tokens_per_s")})
        print(f"closed loop {model} {name} b={budget} C={chunk}: {r['seconds']:.0f} s", flush=True)
        save(out)


def speedups(out: dict) -> None:
    """closed_loop_seconds for every replay row: measured where that configuration ran, else estimated (labelled
    ``closed_loop_estimated``). A CPU closed loop's time is the model's forward passes, not the policy's work, so
    a row is estimated from the fastest measured run of the same model that feeds the prompt the same way (the
    model's forwards with the least policy work beside them: a lower bound): a prefill selector's (and the
    oracle's) from the prefill-selector runs (prompt in 512-token forwards); a policy streaming its prompt in chunks
    of C > 1 from runs streaming at that C (or, where none ran, from the prefill-selector runs: a lower bound, as
    the streamed chunks cost more); a policy streaming token by token from the prefill-selector runs plus the
    single-token forwards it does instead of 512-token ones, P - P/512 more forwards at the measured decode cost
    per token (``1 / tokens_per_s``)."""
    from policies import get_policy

    def kind(policy_name: str, chunk: int) -> str:
        if policy_name == "oracle" or get_policy(policy_name).has_prefill:
            return "prefill"
        return f"stream{chunk}"

    runs = {}
    for r in out["closed_loop"]:
        runs.setdefault((r["model"], kind(r["policy"], r["chunk"])), []).append(r)
    measured = {(r["model"], r["policy"], r["budget"], r["chunk"]): r for r in out["closed_loop"]}
    for row in out["replay"]:
        if "seconds" not in row:
            continue
        key = (row["model"], row["policy"], row["budget"], row["chunk"])
        if key in measured:
            row["closed_loop_seconds"], row["closed_loop_estimated"] = measured[key]["seconds"], False
        else:
            k = kind(row["policy"], row["chunk"])
            same, note = runs.get((row["model"], k)), "from measured runs"
            if not same:                                  # from the prefill selectors' runs
                same = runs.get((row["model"], "prefill"))
                if not same:
                    continue
                if k not in ("prefill", "stream1"):
                    note = f"lower bound: no measured run streams its prompt in chunks of {row['chunk']}"
            # the fastest measured run feeding the prompt the same way: the model's forwards with the least policy
            # work beside them, so a lower bound on this policy's closed loop (and on its speed-up)
            fastest = min(same, key=lambda r: r["seconds"])
            seconds = fastest["seconds"]
            if k == "stream1" and kind(fastest["policy"], fastest["chunk"]) == "prefill":
                n_prompt = TRACES[row["model"]]["prompt"]   # plus single-token forwards instead of 512-token ones
                seconds += (n_prompt - n_prompt // 512) / fastest["tokens_per_s"]
            row["closed_loop_seconds"], row["closed_loop_estimated"] = seconds, True
            row["closed_loop_estimate"] = note
        row["speedup"] = row["closed_loop_seconds"] / row["seconds"]
        if "seconds_tables_reused" in row:
            row["speedup_tables_reused"] = row["closed_loop_seconds"] / row["seconds_tables_reused"]


def save(out: dict) -> None:
    speedups(out)
    out["machine"] = machine()
    write_result("long_context", out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("recordings", "replay", "closed_loop"), default=None)
    ap.add_argument("--models", default=";".join(TRACES), metavar="LIST",
                    help=f"';'-separated models to record, replay and run (default: {';'.join(TRACES)}); the rows "
                         "of the others are kept as they are")
    ap.add_argument("--policies", default=POLICIES + ";oracle")
    ap.add_argument("--rerun", default="", metavar="LIST",
                    help="';'-separated policies whose replay rows are measured again (their old rows dropped)")
    args = ap.parse_args(argv)
    path = RESULTS / "long_context.json"
    out = json.loads(path.read_text()) if path.exists() else {}
    for key in ("recordings", "replay", "closed_loop"):
        out.setdefault(key, [])
    out["goals"] = {"recording_peak_rss_gb": 6.0, "replay_peak_rss_gb": 2.0, "speedup": 20.0}
    models = [m for m in args.models.split(";") if m]
    unknown = sorted(set(models) - set(TRACES))
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {sorted(TRACES)}")
    rerun = {p for p in args.rerun.split(";") if p}
    out["replay"] = [r for r in out["replay"] if r["policy"] not in rerun or r["model"] not in models]
    os.chdir(ROOT)
    if args.only in (None, "recordings"):
        recordings(out, models)
    if args.only in (None, "replay"):
        replays(out, [p for p in args.policies.split(";") if p], models)
    if args.only in (None, "closed_loop"):
        closed_loop(out, models)
    save(out)


if __name__ == "__main__":
    main()
