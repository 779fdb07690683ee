"""What the simulator costs beside the model it stands in for, per (configuration, budget) cell, side by side in one
run, one thread: on the real models, and projected to 8 B geometries.

- ``models``: SmolLM2-135M on one 512 + 128 window and Gemma-3-270M on one 1 024 + 128 window of the shipped `idle`
  text. ``simulate_seconds``: `gpu_validate.studies.fidelity.segments.simulated` for every `kvsim recommend` candidate at every rung
  of its budget ladder, trace recording included, with the losses recommend asks for (the engine's; the error
  after W_O only when it ranks) -- and, beside it, with every loss (``simulate_seconds_all_losses``, what the
  fidelity study asks for). ``closed_per_cell``: `gpu_validate.studies.fidelity.segments.closed_loop` for every candidate at the
  ladder's middle rung, batched as recommend batches them, on the same window. Both sides are timed warm: each
  first runs every candidate on a short window (kernels loaded; ``warmup_seconds``, ``closed_warmup_seconds``).
  ``ratio`` = closed / simulated per cell. ``--recommend`` also times ``kvsim recommend --segments 3 --target dnll=0.1`` end to end.
- ``scale``: Llama-3-8B- and Qwen3-8B-shaped synthetic traces (layers, query / KV heads, head_dim) at 4 k and 32 k
  tokens (+ 256 decoded), replayed here for the recommend families' paper defaults: seconds per layer, times the
  geometry's layers, per cell; the trace-only tables (BUZZ's prompt attention, D2O's allocation statistics...) are
  timed apart (a search computes them once per trace). The model's side comes from the last GPU check
  (``benchmarks/results/gpu_check.json``: bf16 decode tokens/s of the 4-layer Llama-3-8B-shaped model with a policy
  on kvsim's Triton cache, on the GPU that check ran on, scaled to the geometry's layers) and, as a floor, the H100's roofline; the prices are stated assumptions
  (`PRICES`).

Writes benchmarks/results/sim_cost.json (stages merge into it, so ``--only`` reruns one part; ``--only gpu-side``
re-derives the 8 B geometries' closed-loop side and comparison from a newer GPU check, the replays kept).

    python -m benchmarks.sim_cost [--only models|scale|recommend|gpu-side] [--models smollm2-135m,gemma3-270m]
                                  [--geometry llama3-8b,qwen3-8b] [--recommend]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._util import RESULTS, machine, timed, user_env, write_result

#: the real models' windows: prompt + scored tokens, the text and which window of it
MODELS = {"smollm2-135m": {"prompt": 512, "decode": 128}, "gemma3-270m": {"prompt": 1024, "decode": 128}}
TEXT = "idle"
#: per-layer geometry of the 8 B models (Llama-3-8B and Qwen3-8B: 32 query heads, 8 KV heads, head_dim 128)
GEOMETRIES = {"llama3-8b": {"n_layers": 32, "n_q_heads": 32, "n_kv_heads": 8, "head_dim": 128},
              "qwen3-8b": {"n_layers": 36, "n_q_heads": 32, "n_kv_heads": 8, "head_dim": 128}}
#: scale contexts: prompt tokens -> (budget, layers replayed here); 256 tokens decoded after the prompt
CONTEXTS = {4096: (512, 2), 32768: (2048, 1)}
SCALE_DECODE = 256
#: the 4-layer Llama-3-8B-shaped model of the GPU check, and its layers
GPU_MODEL, GPU_MODEL_LAYERS = "llama3-8b-shaped-4l", 4
#: prices assumed for the machine cost (USD per hour), with where the number comes from
PRICES = {
    "h100_gpu_hour": {"usd": 2.99, "source": "assumption: the middle of the $2.49-3.99 per GPU-hour on-demand range of "
                                            "H100 SXM 80GB at specialty clouds (CoreWeave, Lambda, Crusoe, RunPod) "
                                            "quoted by pricegpu.pages.dev, 'H100 vs A100 Cloud Pricing', early 2026"},
    "cpu_core_hour": {"usd": 0.085, "source": "assumption: AWS c5.2xlarge on demand at $0.34 per hour for 8 vCPUs = 4 "
                                              "physical cores (the on-demand column of the AWS Auto Scaling guide's "
                                              "spot-price example, us-east-1)"},
}
#: the H100's roofline (NVIDIA's data sheet figures) for the model-side floor: dense bf16 FLOP/s and HBM bytes/s
H100 = {"bf16_flops": 989e12, "hbm_bytes_per_s": 3.35e12, "mfu": 0.5}
#: parameters of the 8 B models (for the roofline floor)
PARAMS = {"llama3-8b": 8.03e9, "qwen3-8b": 8.19e9}


def load_avg() -> float:
    return float(os.getloadavg()[0])


# ----- the real models -----

def model_costs(name: str, recommend: bool) -> dict[str, Any]:
    """The ``models`` entry of one real model (see the module docstring)."""
    import torch

    from gpu_validate.studies.recommendation.recommend_search import SIM_LOSS
    from gpu_validate.studies.recommendation.candidates import budget_ladder, candidates
    from gpu_validate.studies.fidelity.segments import ENGINE_LOSSES, closed_loop, make_segments, simulated
    from sim.experiments.store import ResultStore
    from traces.model import read_text
    from traces.models import load_model

    cfg = MODELS[name]
    P, D = cfg["prompt"], cfg["decode"]
    torch.set_grad_enabled(False)
    model, tok = load_model(name, device="cpu", progress=False)
    ids = tok(read_text(TEXT)[0], verbose=False)["input_ids"]
    seg = make_segments({TEXT: ids}, 1, P + D)
    cands = candidates()
    ladder = budget_ladder(P)
    configs = [(c.policy, b) for c in cands for b in ladder if c.policy.min_budget() <= b]
    losses = (*ENGINE_LOSSES, SIM_LOSS)
    # every kernel loaded (numba's disk cache) before the timings, on a short window
    short_prompt = max(64, *(c.policy.min_budget() for c in cands))   # room for every candidate's smallest budget
    short = make_segments({TEXT: ids}, 1, short_prompt + 32)
    t0 = time.perf_counter()
    simulated(model, short, _warmup_cells(c.policy for c in cands), n_prompt=short_prompt,
              model_id=name, progress=False, losses=losses)
    warm = time.perf_counter() - t0
    out: dict[str, Any] = {"n_prompt": P, "n_decode": D, "text": f"{TEXT}@{seg[0].start}", "candidates": len(cands),
                           "budgets": ladder, "cells": len(configs), "threads": 1, "warmup_seconds": warm,
                           "load_start": load_avg()}
    t0 = time.perf_counter()
    simulated(model, seg, configs, n_prompt=P, model_id=name, progress=False, losses=losses)
    out["simulate_seconds"] = time.perf_counter() - t0
    out["sim_per_cell"] = out["simulate_seconds"] / len(configs)
    out["simulated_losses"] = list(dict.fromkeys(losses))
    t0 = time.perf_counter()
    simulated(model, seg, configs, n_prompt=P, model_id=name, progress=False)
    out["simulate_seconds_all_losses"] = time.perf_counter() - t0
    out["record_seconds"], out["families"] = _record_and_families(model, seg[0], P, name, cands, configs)
    rung = ladder[len(ladder) // 2]
    closed_cfg = [(c.policy, rung) for c in cands if c.policy.min_budget() <= rung]
    with tempfile.TemporaryDirectory(prefix="kvsim-simcost-") as tmp:
        # the closed loop's kernels loaded too, on the short window (as the simulator's were): both sides timed warm
        t0 = time.perf_counter()
        closed_loop(model, short, _warmup_cells(p for p, _ in closed_cfg), ResultStore(f"{tmp}/warm"),
                    n_prompt=short_prompt, model_id=name, progress=False, log=lambda s: None)
        out["closed_warmup_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        closed_loop(model, seg, closed_cfg, ResultStore(tmp), n_prompt=P, model_id=name, progress=False,
                    log=lambda s: None)
        closed = time.perf_counter() - t0
    out.update(closed_cells=len(closed_cfg), closed_budget=rung, closed_seconds=closed,
               closed_per_cell=closed / len(closed_cfg), closed_batch="recommend's (closed_loop, 48 rows a batch)")
    out["ratio"] = out["closed_per_cell"] / out["sim_per_cell"]
    out["load_end"] = load_avg()
    out["load"] = max(out["load_start"], out["load_end"])
    if recommend:
        out.update(recommend_run(name))
    return out


def _warmup_cells(policies) -> list:
    """The warm-up's cells on the short window: each policy at its smallest budget, at least 16 slots."""
    return [(p, max(16, p.min_budget())) for p in policies]


def _record_and_families(model, seg, P: int, name: str, cands, configs) -> tuple[float, dict[str, Any]]:
    """Seconds to record the window's teacher-forced trace (the part of ``simulate_seconds`` that is the model's),
    and on that trace each family's cells replayed in one pass (`sim.replay.cells`): seconds and cells, where the
    simulate stage's time goes."""
    from gpu_validate.studies.fidelity.segments import record_segment
    from policies.core.base import reconstruction_chunk
    from sim.replay.layer_inputs import load_layers
    from sim.replay.cells import replay_cells
    from traces.format import load_trace

    family = {c.label: c.family for c in cands}
    with tempfile.TemporaryDirectory(prefix="kvsim-simcost-") as tmp:
        t0 = time.perf_counter()
        record_segment(model, seg, Path(tmp) / "t", n_prompt=P, model_id=name,
                       reconstruction_chunk=reconstruction_chunk([p for p, _ in configs]))
        record = time.perf_counter() - t0
        trace = load_trace(Path(tmp) / "t")
        inputs = load_layers(trace)
        fams: dict[str, Any] = {}
        for fam in dict.fromkeys(family.values()):
            cells = [(p, b) for p, b in configs if family[p.label()] == fam]
            t0 = time.perf_counter()
            for _ in replay_cells(trace, cells, inputs=inputs):
                pass
            fams[fam] = {"cells": len(cells), "seconds": time.perf_counter() - t0}
    return record, fams


#: ``--recommend-threads``: the thread settings recommend is timed with (1: one thread; None: the CLI's default)
RECOMMEND_THREADS = {"one": (1,), "default": (None,), "both": (1, None)}


def recommend_run(name: str, threads: int | None = 1, **env: str) -> dict[str, Any]:
    """``kvsim recommend --segments 3 --target dnll=0.1`` end to end as a user runs it (its own process): wall
    seconds, the closed-loop runs it made, its answer and its peak resident memory. ``threads=1``: one thread
    (``recommend_*``, beside the one-thread simulate figures); ``None``: the CLI's default, every core this machine
    has (``recommend_default_threads``). ``env``: variables added to the user's environment."""
    with tempfile.TemporaryDirectory(prefix="kvsim-simcost-rec-") as tmp:
        args = ["recommend", "--model", name, "--segments", "3", "--target", "dnll=0.1",
                *(["--threads", str(threads)] if threads else []), "--out", tmp, "--quiet"]
        load0 = load_avg()
        run = timed(args, user_env(**env))
        rep = json.loads((Path(tmp) / "recommend.json").read_text())
    res = {"recommend_seconds": run["seconds"],
           "recommend_command": "kvsim " + " ".join("OUT" if a == tmp else a for a in args),
           "recommend_model_runs": rep.get("model_runs"), "recommend_answer": rep.get("answer", {}).get("choice"),
           "recommend_load": max(load0, load_avg()), "recommend_stage_seconds": rep.get("stage_seconds"),
           "recommend_peak_rss_gb": run["peak_rss_gb"]}
    if threads:
        return res
    return {"recommend_default_threads": {k.removeprefix("recommend_"): v for k, v in res.items()}
            | {"cores": os.cpu_count()}}


def recommend_first_run(name: str) -> dict[str, Any]:
    """A user's first ``kvsim recommend`` after installing, with the CLI's default threads: an empty numba cache
    (``NUMBA_CACHE_DIR``: every candidate's kernels compiled, by the command and the helper processes it starts on
    the spare cores, `sim.replay.warmup.compiling_meanwhile`), then the same command again on that cache."""
    with tempfile.TemporaryDirectory(prefix="kvsim-simcost-numba-") as cache:
        first, second = (recommend_run(name, None, NUMBA_CACHE_DIR=cache)["recommend_default_threads"]
                         for _ in range(2))
    return {"recommend_first_run": {"seconds": first["seconds"], "stage_seconds": first["stage_seconds"],
                                    "peak_rss_gb": first["peak_rss_gb"], "load": first["load"],
                                    "answer": first["answer"], "model_runs": first["model_runs"],
                                    "then_cached": {k: second[k] for k in ("seconds", "stage_seconds",
                                                                           "peak_rss_gb", "load", "answer")},
                                    "command": first["command"], "cores": first["cores"]}}


# ----- the 8 B geometries -----

def scale_costs(geometry: str, measured: dict[str, Any] | None) -> dict[str, Any]:
    """The ``scale`` entry of one geometry: replay seconds per cell at each context, the GPU closed loop's and the
    machine cost. ``measured``: another geometry's entry with the same per-layer shape, whose per-layer replay
    seconds serve this one (only the layer count differs)."""
    g = GEOMETRIES[geometry]
    out: dict[str, Any] = {**g, "decode": SCALE_DECODE, "contexts": {}}
    for P, (budget, n_meas) in CONTEXTS.items():
        if measured is not None and _same_layer(measured, g):
            per_layer = measured["contexts"][str(P)]["per_layer"]
            ctx = {"budget": budget, "per_layer": per_layer, "layers_replayed": 0,
                   "note": f"per-layer seconds of {measured['name']} (same heads and head_dim; only the layer count "
                           f"differs)"}
        else:
            ctx = {"budget": budget, "layers_replayed": n_meas, "per_layer": replay_geometry(g, P, budget, n_meas),
                   "load": load_avg()}
        ctx["per_cell"] = {pol: {"replay_seconds": v["seconds"] * g["n_layers"],
                                 "trace_only_seconds": v["trace_only_seconds"] * g["n_layers"]}
                           for pol, v in ctx["per_layer"].items()}
        ctx["closed_loop"] = closed_loop_8b(geometry, P)
        ctx["comparison"] = compare(ctx)
        out["contexts"][str(P)] = ctx
    out["name"] = geometry
    return out


def _same_layer(entry: dict[str, Any], g: dict[str, int]) -> bool:
    return all(entry[k] == g[k] for k in ("n_q_heads", "n_kv_heads", "head_dim")) and any(
        c.get("layers_replayed") for c in entry["contexts"].values())


def replay_geometry(g: dict[str, int], P: int, budget: int, n_layers: int) -> dict[str, dict[str, float]]:
    """Seconds per layer of the paper default of each family of the recommend benchmark's fixed subset
    (`benchmarks.recommend.FAMILIES`) replayed at ``budget`` on a synthetic trace of geometry ``g`` with a P-token
    prompt: ``seconds`` the replay once its trace-only tables exist (a search's every
    later cell), ``trace_only_seconds`` what the first replay spends more (its tables). Peak RSS stated apart."""
    from benchmarks.recommend import FAMILIES
    from sim.replay.layer_inputs import load_layers
    from sim.replay.policy_replay import replay
    from sim.experiments.specs import parse_policy
    from traces.synthetic import make_synthetic_trace

    tiny = make_synthetic_trace("mixed", n_layers=1, n_tokens=96, n_prompt=64)
    for name in FAMILIES:                                   # kernels loaded before the timings
        replay(tiny, parse_policy(name), 16, threads=1)
    t0 = time.perf_counter()
    trace = make_synthetic_trace("mixed", n_layers=n_layers, n_q_heads=g["n_q_heads"], n_kv_heads=g["n_kv_heads"],
                                 head_dim=g["head_dim"], n_tokens=P + SCALE_DECODE, n_prompt=P, seed=0,
                                 reference_from=P)
    inputs = load_layers(trace)
    print(f"  synthetic {P} + {SCALE_DECODE} tokens, {n_layers} layer(s): {time.perf_counter() - t0:.0f} s",
          flush=True)
    out = {}
    for name in FAMILIES:
        policy = parse_policy(name)                          # the family's paper default
        t0 = time.perf_counter()
        replay(trace, policy, budget, inputs=inputs, threads=1)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        replay(trace, policy, budget, inputs=inputs, threads=1)
        again = time.perf_counter() - t0
        out[policy.label()] = {"seconds": again / n_layers, "trace_only_seconds": max(0.0, first - again) / n_layers}
        print(f"  {policy.label()}: {again / n_layers:.2f} s a layer (+{max(0.0, first - again) / n_layers:.2f} s "
              f"trace-only)", flush=True)
    del trace, inputs
    return out


def closed_loop_8b(geometry: str, P: int) -> dict[str, Any]:
    """One configuration's closed loop on the GPU for the geometry (seconds per cell: prompt P, 256 decode steps):
    measured = the last GPU check's decode tokens/s of the 4-layer Llama-3-8B-shaped model at the nearest prompt
    length, scaled to the geometry's layers (every layer's attention, policy step and compaction run per token), plus
    the prefill at the roofline; floor = the roofline alone (weights read once per decoded token, prefill FLOPs at
    `H100`'s MFU), what an efficient closed loop could reach."""
    g = GEOMETRIES[geometry]
    path = RESULTS / "gpu_check.json"
    check = json.loads(path.read_text())
    runs = [r for r in check["steps"]["generate"]["runs"] if r["model"] == GPU_MODEL and r["dtype"] == "bfloat16"]
    run = min(runs, key=lambda r: abs(r["prompt_tokens"] - P))
    per_layer_token = 1.0 / run["tokens_per_s_triton"] / GPU_MODEL_LAYERS
    params = PARAMS[geometry]
    prefill = 2 * params * P / (H100["bf16_flops"] * H100["mfu"])
    weights = 2 * params                                         # bf16 bytes
    kv_per_token = 2 * g["n_layers"] * g["n_kv_heads"] * g["head_dim"] * 2 * P   # K and V of the prompt, bf16
    floor_decode = SCALE_DECODE * (weights + kv_per_token) / H100["hbm_bytes_per_s"]
    return {"measured_seconds": prefill + SCALE_DECODE * per_layer_token * g["n_layers"],
            "floor_seconds": prefill + floor_decode,
            "source": f"{path.name} ({check['device']}, kvsim {GPU_MODEL} in bf16 at {run['prompt_tokens']} prompt "
                      f"tokens, {run['policy']} at {run['budget']} slots: "
                      f"{run['tokens_per_s_triton']:.1f} decode tokens/s on the Triton cache, "
                      f"{run['tokens_per_s_transformers_sdpa']:.1f} with transformers' own SDPA cache), scaled from "
                      f"{GPU_MODEL_LAYERS} to {g['n_layers']} layers; prefill and floor at the H100 roofline "
                      f"({H100['bf16_flops'] / 1e12:.0f} TFLOP/s bf16 at {H100['mfu']:.0%} MFU, "
                      f"{H100['hbm_bytes_per_s'] / 1e12:.2f} TB/s)"}


def compare(ctx: dict[str, Any]) -> dict[str, Any]:
    """Per policy: cells the simulator evaluates (one core) for the time and for the machine cost of one closed-loop
    run, against the measured closed loop and against the floor."""
    gpu = PRICES["h100_gpu_hour"]["usd"] / 3600
    cpu = PRICES["cpu_core_hour"]["usd"] / 3600
    out = {}
    for pol, c in ctx["per_cell"].items():
        sim = c["replay_seconds"]
        row = {}
        for side in ("measured", "floor"):
            closed = ctx["closed_loop"][f"{side}_seconds"]
            row[f"cells_per_run_time_{side}"] = closed / sim
            row[f"cells_per_run_cost_{side}"] = closed * gpu / (sim * cpu)
        out[pol] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("models", "scale", "recommend", "recommend-first-run", "gpu-side"),
                    default=None,
                    help="one part (recommend: only the end-to-end recommend runs, merged into the models' entries; "
                         "recommend-first-run: a first run from an empty numba cache and the run after it; "
                         "gpu-side: the scale entries' closed loop and comparison from the current gpu_check.json, "
                         "their replays kept)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--geometry", default=",".join(GEOMETRIES))
    ap.add_argument("--recommend", action="store_true", help="also time kvsim recommend end to end (minutes)")
    ap.add_argument("--recommend-threads", choices=tuple(RECOMMEND_THREADS), default="both",
                    help="with --only recommend: time it on one thread, on the CLI's default threads, or both")
    args = ap.parse_args(argv)
    from sim.replay.threads import limit_threads

    import torch  # noqa: F401  (first, so that limit_threads caps its pool)

    limit_threads(1)
    path = RESULTS / "sim_cost.json"
    out = json.loads(path.read_text()) if path.exists() else {}
    out.setdefault("models", {})
    out.setdefault("scale", {})
    if args.only in (None, "models"):
        for name in filter(None, args.models.split(",")):
            print(f"{name}...", flush=True)
            entry = model_costs(name, args.recommend)
            if not args.recommend:            # keep the end-to-end runs measured before (either thread setting)
                entry.update({k: v for k, v in out["models"].get(name, {}).items() if k.startswith("recommend")})
            out["models"][name] = entry
            print(f"  {entry['cells']} cells: simulate {entry['simulate_seconds']:.1f} s "
                  f"({entry['sim_per_cell'] * 1e3:.0f} ms a cell), closed loop {entry['closed_per_cell']:.2f} s a "
                  f"cell, ratio {entry['ratio']:.1f}", flush=True)
            _save(out, path, argv)
    if args.only == "recommend":
        for name in filter(None, args.models.split(",")):
            print(f"{name}: kvsim recommend...", flush=True)
            for threads in RECOMMEND_THREADS[args.recommend_threads]:
                res = recommend_run(name, threads)
                out["models"].setdefault(name, {}).update(res)
                seconds = res["recommend_seconds"] if threads else res["recommend_default_threads"]["seconds"]
                print(f"  threads {threads or 'default'}: {seconds:.0f} s", flush=True)
            _save(out, path, argv)
    if args.only == "recommend-first-run":
        for name in filter(None, args.models.split(",")):
            print(f"{name}: kvsim recommend from an empty numba cache, then again...", flush=True)
            res = recommend_first_run(name)
            out["models"].setdefault(name, {}).update(res)
            first = res["recommend_first_run"]
            print(f"  {first['seconds']:.0f} s, then {first['then_cached']['seconds']:.0f} s", flush=True)
            _save(out, path, argv)
    if args.only in (None, "scale"):
        for geometry in filter(None, args.geometry.split(",")):
            print(f"{geometry}...", flush=True)
            done = next((e for n, e in out["scale"].items() if n != geometry and _same_layer(e, GEOMETRIES[geometry])),
                        None)
            out["scale"][geometry] = scale_costs(geometry, done)
            _save(out, path, argv)
    if args.only == "gpu-side":
        for geometry, entry in out["scale"].items():
            for P, ctx in entry["contexts"].items():
                ctx["closed_loop"] = closed_loop_8b(geometry, int(P))
                ctx["comparison"] = compare(ctx)
            print(f"{geometry}: closed loop from {ctx['closed_loop']['source'][:60]}...", flush=True)
        _save(out, path, argv, timed_here=False)
    return 0


def _save(out: dict[str, Any], path: Path, argv: list[str] | None, timed_here: bool = True) -> None:
    """Write the JSON; ``machine`` is this machine's only when this run timed something on it (``timed_here``)."""
    from sim.reports.runinfo import kvsim_version, now

    out.update(benchmark="sim_cost", prices=PRICES, h100=H100, kvsim=kvsim_version(), date=now(),
               command="python -m benchmarks.sim_cost " + " ".join(argv if argv is not None else sys.argv[1:]))
    if timed_here or "machine" not in out:
        out["machine"] = machine()
    write_result("sim_cost", out)


if __name__ == "__main__":
    sys.exit(main())
