"""Replay speed on a real model trace: every policy against H2O, the engine against the machine, replay against
running the model. Everything is measured in this one process, one thread (BLAS and torch included), so the
ratios are side by side.

Writes benchmarks/results/replay.json with
  - per-policy replay seconds at one budget (best of ``--repeat``, policies interleaved round by round) and
    the ratio to H2O; the oracle's whole budget curve (one pass) against one H2O replay; every policy's warm
    4-budget replay (64/128/256/512, kernels compiled, prompt statistics cached) against H2O's;
  - the attention inner loop's achieved GMAC/s (the engine's ``_attend_and_measure`` alone on the trace's
    keys, and H2O's whole replay) next to a single-core FMA peak measured here (a numba register-blocked FMA
    kernel and a float32 BLAS GEMM; the larger counts);
  - where the time goes: the engine's parts per (step, KV head) at the budget's slot count (q.k, softmax, p.v
    and metrics, one eviction's compaction) and, per policy, the seconds in its budget allocation, its prefill
    kernel and the streamed steps (the rest);
  - the plain HF model decoding the trace's tokens one by one with its own KV cache (all of them, and the
    cheaper prompt-prefill-then-decode run), and the closed-loop runner
    (``kvsim validate``'s CompressedRunner, h2o, torch backend) over the trace's decode steps; the speed-up of
    each policy's replay over both;
  - ``kvsim sweep`` of all registered policies x 8 budgets on 2 worker processes, run from the CLI in a plain
    user environment as a user runs it (wall seconds).
Run: python -m benchmarks.replay [--trace DIR] [--model DIR] [--quick]
(the trace is recorded from the model with teacher forcing when DIR does not exist yet).
"""
from __future__ import annotations

import argparse
import builtins
import json
import os
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import numpy as np
from numba import njit

from benchmarks._util import RESULTS, cli_seconds, machine, write_result
from policies import get_policy, list_policies
from sim.replay.engine import profile_attention, profile_parts
from sim.replay.metrics import N_METRICS
from sim.replay.layer_inputs import layer_memo, load_layers
from sim.replay.oracle_replay import replay_oracle
from sim.replay.policy_replay import replay, replay_budgets
from sim.replay.threads import limit_threads
from traces.format import load_trace
from traces.hf.forward import CachedForward, forward_in_chunks

#: the SmolLM2-135M trace (recorded on first use) and the registered model (traces/models.py) it comes from
DEFAULT_TRACE = "kvsim-out/smollm2-135m-1024-256"
DEFAULT_MODEL = "smollm2-135m"
BUDGET = 128
ORACLE_BUDGETS = (64, 128, 256)
FOUR_BUDGETS = (64, 128, 256, 512)
SWEEP_BUDGETS = (32, 64, 96, 128, 192, 256, 384, 512)
print = partial(builtins.print, flush=True)   # progress lines appear as they happen, also when redirected
GOALS = {"policy_over_h2o": 2.0, "oracle_curve_over_h2o": 2.0, "fraction_of_peak": 0.40, "speedup_over_hf": 50.0,
         "sweep_seconds": 300.0}


# ----- the machine's single-core FMA peak -----
_LANES = 128   # float32 accumulators: 8 AVX-512 (16 AVX2) registers of independent FMA chains hide the latency


@njit(cache=True, fastmath={"contract"})
def _fma_kernel(acc, n_iter, a, b):
    """acc[j] <- acc[j] * a + b, n_iter times: 2 * 128 independent float32 FMA chains, no memory traffic."""
    for _ in range(n_iter):
        for j in range(_LANES):
            acc[j] = acc[j] * a + b


def fma_peak_gmacs(repeat: int = 5) -> dict:
    """Single-core float32 multiply-add peak: a register-blocked numba FMA loop and a BLAS SGEMM (1 thread)."""
    acc = np.ones(_LANES, np.float32)
    n_iter = 2_000_000
    _fma_kernel(acc, 10, np.float32(0.999), np.float32(1e-3))
    best = min(_timed(lambda: _fma_kernel(acc, n_iter, np.float32(0.999), np.float32(1e-3))) for _ in range(repeat))
    numba_rate = _LANES * n_iter / best / 1e9
    a = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    a @ a
    best = min(_timed(lambda: a @ a) for _ in range(repeat))
    blas_rate = 1024 ** 3 / best / 1e9
    return {"numba_fma_gmacs": numba_rate, "blas_sgemm_gmacs": blas_rate, "peak_gmacs": max(numba_rate, blas_rate)}


# ----- the engine's attention inner loop alone -----
def inner_loop_gmacs(li, scale: float, start: int, n_slots: int, block: int = 16, rounds: int = 3) -> dict:
    """GMAC/s of the attention inner loop (q.k and p.v, 2 * G * n * d MACs per KV head and step) on real data:
    the best rate over short blocks of ``block`` steps (~10 ms each, like the FMA peak's bursts), so that both
    numbers see the core at its least contended."""
    T, hq_n, d = li.q.shape
    hkv = li.k.shape[1]
    probs = np.zeros((hkv, hq_n // hkv, n_slots), np.float64)
    row = np.zeros((hq_n, N_METRICS), np.float64)
    sink = np.zeros(1)
    profile_attention(li.q, li.k, li.v, li.lse, li.o, li.vmax1, scale, start, start + 1, n_slots, probs, row, sink)
    best = np.inf
    for _ in range(rounds):
        for t0 in range(start, T - block + 1, block):     # the hook times its steps (not its cache set-up)
            best = min(best, profile_attention(li.q, li.k, li.v, li.lse, li.o, li.vmax1, scale, t0, t0 + block,
                                               n_slots, probs, row, sink))
    macs = 2 * hq_n * n_slots * d * block
    return {"n_slots": n_slots, "head_dim": d, "steps_per_block": block, "block_seconds": best,
            "gmacs": macs / best / 1e9,
            "includes": "q.k (float32), softmax, metrics incl. p.v (float32 sums over blocks of 256 slots, "
                        "accumulated in float64); the steps alone, not the hook's cache set-up"}


# ----- where the time goes -----
def engine_profile(li, scale: float, start: int, n_slots: int, rounds: int = 2000, repeat: int = 3) -> dict:
    """Microseconds per (step, KV head) of the engine's parts at ``n_slots`` slots (best of ``repeat``)."""
    secs = np.full(4, np.inf)
    for _ in range(repeat + 1):            # the first compiles or loads the cache
        got = np.zeros(4)
        profile_parts(li.q, li.k, li.v, li.lse, li.o, li.vmax1, scale, start, n_slots, rounds, n_slots // 2, got)
        secs = np.minimum(secs, got)
    names = ("qk_dots", "softmax", "pv_and_metrics", "compaction_one_eviction_mid")
    return {"n_slots": n_slots, "us_per_step_and_kv_head": {k: float(s * 1e6) for k, s in zip(names, secs)}}


def policy_profile(trace, policy, inputs, budget: int, repeat: int = 2) -> dict:
    """Seconds of a replay spent in the policy's budget allocation and in its prefill kernel (all layers);
    the rest of ``replay`` is the engine streaming steps (attention, the step kernel, compaction)."""
    from sim.replay.contract import check_allocation
    from sim.replay.layer_inputs import PromptLayers
    from sim.replay.step_plan import initial_head_state

    meta = trace.meta
    P, hkv = meta.n_prompt, meta.model.n_kv_heads
    layers = range(len(inputs))
    bare = PromptLayers(trace, list(inputs), layers, P)     # a plain list, no memo: the allocation's whole work
    shared = PromptLayers(trace, inputs, layers, P)         # a replay's view: what the allocation computed, kept

    def allocate(prompt=bare):
        return check_allocation(policy, policy.allocate(budget, hkv, prompt, meta.softmax_scale), len(inputs), hkv)

    budgets = allocate(shared)

    def prefill():
        kernel = policy.kernels()[1]
        for layer, li in enumerate(inputs):
            params = policy.param_vector(meta.attention(layer))
            head = np.ascontiguousarray(initial_head_state(policy, li, layer_memo(inputs, layer), shared, layer),
                                        np.float64)
            kernel(params, layer, budgets[layer], li.q[:P], li.k[:P], li.v[:P], float(meta.softmax_scale),
                   np.ones((hkv, P), np.uint8), np.zeros((hkv, P, policy.slot_fields)), head)

    out = {"allocate_s": min(_timed(allocate) for _ in range(repeat))}
    out["prefill_s"] = min(_timed(prefill) for _ in range(repeat)) if policy.has_prefill else 0.0
    return out


# ----- running the model -----
def hf_token_by_token(model, ids: list[int]) -> float:
    """Seconds for the plain HF model to process ``ids`` one token per forward with its own KV cache (the model
    adapter's chunked forward, `traces.hf.forward`, at one token per chunk)."""
    import torch

    with torch.no_grad():
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        for _ in forward_in_chunks(model, x, 1):
            pass
        return time.perf_counter() - t0


def hf_prefill_then_decode(model, ids: list[int], n_prompt: int) -> float:
    """Seconds for the plain HF model to prefill ``ids[:n_prompt]`` in one forward, then decode the rest one
    token per forward with its own KV cache: the cheapest model run that yields every decode step's attention."""
    import torch

    with torch.no_grad():
        x = torch.tensor([ids])
        fwd = CachedForward(model)
        t0 = time.perf_counter()
        fwd(x[:, :n_prompt])
        for i in range(n_prompt, len(ids)):
            fwd(x[:, i:i + 1])
        return time.perf_counter() - t0


def closed_loop_runner(model, ids: list[int], n_prompt: int, n_decode: int) -> float:
    """Seconds for ``kvsim validate``'s CompressedRunner (h2o at BUDGET, torch backend) over the decode steps."""
    from gpu_validate.closedloop.runner import CompressedRunner

    runner = CompressedRunner(model, get_policy("h2o"), BUDGET, backend="torch")
    t0 = time.perf_counter()
    runner.run(ids[:n_prompt], continuation=ids[n_prompt:n_prompt + n_decode])
    return time.perf_counter() - t0


def ensure_trace(trace_dir: str, model_dir: str):
    """The trace at ``trace_dir``, recorded first (1024 prompt + 256 teacher-forced tokens, with the rereading pass
    KVzip scores from) when missing or recorded without that pass."""
    from policies.core.base import reconstruction_chunk

    chunk = reconstruction_chunk([get_policy(n) for n in list_policies()])
    if not Path(trace_dir).exists() or (chunk and not load_trace(trace_dir, verify=False).has_reconstruction):
        from traces.models import load_model
        from traces.recorder import record_trace

        model, tok = load_model(model_dir)
        text = (ROOT / "traces" / "model" / "data" / "heldout.txt").read_text()
        ids = tok(text)["input_ids"][:1280]
        record_trace(model, ids, trace_dir, n_prompt=1024, n_decode=len(ids) - 1024, tokenizer=tok,
                     teacher_forced=True, single_pass=True, model_id=model_dir, reconstruction_chunk=chunk,
                     overwrite=True)
    return load_trace(trace_dir, verify=False)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def sweep_seconds(trace_dir: str, workers: int) -> dict:
    """Wall seconds of ``kvsim sweep`` over all registered policies x SWEEP_BUDGETS into a fresh store, run as a
    user runs it: the installed CLI in a plain environment (no thread variable set)."""
    args = ["sweep", trace_dir, "--policies", "all", "--workers", str(workers), "--budgets",
            ",".join(map(str, SWEEP_BUDGETS)), "--quiet"]
    with tempfile.TemporaryDirectory() as tmp:
        wall = cli_seconds([*args, "--out", tmp])
    return {"command": "kvsim " + " ".join(args), "workers": workers, "budgets": list(SWEEP_BUDGETS),
            "policies": list_policies(), "environment": "plain user shell (no thread variables)", "seconds": wall}


def previous_full_run() -> dict:
    """The model runs and the sweep of the last full run in benchmarks/results/replay.json (``--quick`` skips
    them), each marked ``from_run`` as carried over from an earlier run."""
    path = RESULTS / "replay.json"
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    carried = {}
    for key in ("model_runs", "sweep"):
        if old.get(key):
            carried[key] = {**old[key], "from_run": old[key].get("from_run", "the previous full run (--quick skips it)")}
    return carried


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="real model trace directory (recorded when missing)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="local HF folder of the trace's model")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of replays (best of)")
    ap.add_argument("--quick", action="store_true", help="skip the model runs and the sweep (replay numbers only)")
    ap.add_argument("--sweep-workers", type=int, default=2)
    args = ap.parse_args(argv)

    import torch  # noqa: F401  (loaded before the cap, so limit_threads caps its pool too)

    limit_threads(1)     # the replay figures are per thread: the API a sweep worker uses, not environment variables
    load_start = os.getloadavg()[0]
    trace = ensure_trace(args.trace, args.model)
    meta = trace.meta
    t0 = time.perf_counter()
    inputs = load_layers(trace)
    load_s = time.perf_counter() - t0
    names = [n for n in list_policies() if not get_policy(n).is_oracle]

    jobs = {n: (lambda p=get_policy(n): replay(trace, p, BUDGET, inputs=inputs, threads=1)) for n in names}
    jobs["oracle_curve"] = lambda: replay_oracle(trace, list(ORACLE_BUDGETS), inputs=inputs, threads=1)
    first = {n: _timed(f) for n, f in jobs.items()}            # compile or load the numba caches
    times = {n: [] for n in jobs}
    for _ in range(args.repeat):                               # interleaved: load changes hit every policy alike
        for n, f in jobs.items():
            times[n].append(_timed(f))
    best = {n: min(v) for n, v in times.items()}
    h2o = best["h2o"]
    for n in sorted(best, key=best.get):
        print(f"{n:16s} {best[n]:7.3f} s  {best[n] / h2o:5.2f}x h2o   (first call {first[n]:.2f} s)")

    # warm budget curves: kernels compiled, prompt statistics cached on the shared inputs (long-context issue)
    curves = {n: (lambda p=get_policy(n): replay_budgets(trace, p, FOUR_BUDGETS, inputs=inputs, threads=1))
              for n in [*names, "oracle"]}
    for f in curves.values():
        f()
    curve_times: dict[str, list[float]] = {n: [] for n in curves}
    for _ in range(args.repeat):
        for n, f in curves.items():
            curve_times[n].append(_timed(f))
    curve_best = {n: min(v) for n, v in curve_times.items()}
    curve_ratio = {n: v / curve_best["h2o"] for n, v in curve_best.items()}
    print(f"warm {len(FOUR_BUDGETS)}-budget replays over H2O's: " + ", ".join(
        f"{n} {r:.2f}x" for n, r in sorted(curve_ratio.items(), key=lambda x: -x[1])[:10]))

    mid = len(inputs) // 2
    peaks, inners = [], []
    for _ in range(args.repeat):      # alternate, best of each: a busy neighbour core hits both alike
        peaks.append(fma_peak_gmacs(repeat=3))
        inners.append(inner_loop_gmacs(inputs[mid], float(meta.softmax_scale), meta.n_prompt, BUDGET + 1, rounds=1))
    peak = {key: max(p[key] for p in peaks) for key in peaks[0]}
    inner = max(inners, key=lambda r: r["gmacs"])
    T, P = meta.n_tokens, meta.n_prompt
    hq, d = meta.model.n_q_heads, meta.model.head_dim
    # H2O streams all T tokens; attention over min(t + 1, budget + 1) slots, p.v only on measured steps
    h2o_macs = len(inputs) * hq * d * sum(min(t + 1, BUDGET + 1) * (2 if t >= P else 1) for t in range(T))
    engine = {"inner_loop": inner, "h2o_replay_gmacs": h2o_macs / h2o / 1e9, **peak,
              "inner_fraction_of_peak": inner["gmacs"] / peak["peak_gmacs"],
              "h2o_fraction_of_peak": h2o_macs / h2o / 1e9 / peak["peak_gmacs"]}
    print(f"attention inner loop {inner['gmacs']:.1f} GMAC/s, H2O replay {engine['h2o_replay_gmacs']:.1f} GMAC/s; "
          f"peak {peak['peak_gmacs']:.1f} (numba FMA {peak['numba_fma_gmacs']:.1f}, "
          f"SGEMM {peak['blas_sgemm_gmacs']:.1f})"
          f" -> {engine['inner_fraction_of_peak']:.0%} / {engine['h2o_fraction_of_peak']:.0%}")

    profile = {"engine": engine_profile(inputs[mid], float(meta.softmax_scale), meta.n_prompt, BUDGET + 1),
               "policies": {}}
    for n in names:
        part = policy_profile(trace, get_policy(n), inputs, BUDGET)
        part["stream_s"] = max(0.0, best[n] - part["allocate_s"] - part["prefill_s"])
        profile["policies"][n] = part
    print("engine per (step, KV head) at", BUDGET + 1, "slots:",
          ", ".join(f"{k} {v:.2f} us" for k, v in profile["engine"]["us_per_step_and_kv_head"].items()))
    for n in sorted(names, key=best.get, reverse=True)[:8]:
        p = profile["policies"][n]
        print(f"  {n:28s} allocate {p['allocate_s']:.3f} s, prefill {p['prefill_s']:.3f} s, "
              f"streamed steps {p['stream_s']:.3f} s")
    ratios = {n: best[n] / h2o for n in best}
    state: dict = {"model_runs": None, "sweep": None}
    if args.quick:      # keep the last full run's model runs and sweep, labelled as such, rather than drop them
        state.update(previous_full_run())

    def save() -> None:
        """Write what is measured so far (the model runs and the sweep take minutes on a busy machine)."""
        model_runs, sweep = state["model_runs"], state["sweep"]
        met = {"every_policy_within_2x_h2o": all(r <= GOALS["policy_over_h2o"] for n, r in ratios.items()
                                                 if n != "oracle_curve"),
               "oracle_curve_within_2x_h2o": ratios["oracle_curve"] <= GOALS["oracle_curve_over_h2o"],
               "inner_loop_40pct_of_peak": engine["inner_fraction_of_peak"] >= GOALS["fraction_of_peak"],
               "every_warm_budget_curve_within_2x_h2o": max(curve_ratio.values()) <= GOALS["policy_over_h2o"]}
        if model_runs:
            met["replay_50x_over_hf_every_policy"] = min(
                v for n, v in model_runs["speedup_over_hf"].items() if n != "oracle_curve") >= GOALS["speedup_over_hf"]
        if sweep:
            met["sweep_under_5_min"] = sweep["seconds"] < GOALS["sweep_seconds"]
        payload = dict(
            benchmark="replay", machine=machine(), threads=1,
            load_avg_1min_start_now=[load_start, os.getloadavg()[0]],
            conditions="one process, 1 thread (numba, BLAS, torch); policies interleaved, best of repeat; "
                       "the machine's other core may be busy",
            trace=dict(path=str(trace.path), n_layers=len(inputs), n_tokens=T, n_prompt=P, n_q_heads=hq,
                       n_kv_heads=meta.model.n_kv_heads, head_dim=d),
            budget=BUDGET, repeat=args.repeat, load_layers_s=load_s, seconds=best, first_call_s=first,
            ratio_to_h2o=ratios, oracle_budgets=list(ORACLE_BUDGETS), engine=engine, profile=profile,
            warm_budget_curves={"budgets": list(FOUR_BUDGETS), "seconds": curve_best, "ratio_to_h2o": curve_ratio,
                                "over_2x": sorted(n for n, r in curve_ratio.items() if r > 2)},
            model_runs=model_runs,
            sweep=sweep, goals=GOALS, goals_met=met)
        print(f"goals met: {met}")
        print(f"wrote {write_result('replay', payload)}")

    save()
    if args.quick:
        return
    from traces.models import load_model

    model, _ = load_model(args.model)
    model.eval()
    ids = trace.tokens["token_id"].to_numpy().tolist()
    load_before = os.getloadavg()[0]
    t_pd = hf_prefill_then_decode(model, ids[:T], P)
    t_hf = hf_token_by_token(model, ids[:T])
    t_cl = closed_loop_runner(model, ids, P, T - P)
    state["model_runs"] = {
        "hf_token_by_token_s": t_hf, "hf_tokens": T, "hf_tok_per_s": T / t_hf, "closed_loop_h2o_s": t_cl,
        "hf_prefill_then_decode_s": t_pd, "speedup_over_hf_prefill_then_decode": {n: t_pd / best[n] for n in best},
        "closed_loop_decode_steps": T - P,
        "closed_loop_includes": "one prompt forward + per-token decode with the policy step",
        "load_avg_1min_before_after": [load_before, os.getloadavg()[0]],
        "speedup_over_hf": {n: t_hf / best[n] for n in best},
        "speedup_over_closed_loop": {n: t_cl / best[n] for n in best}}
    print(f"HF model prefill + decode one by one: {t_pd:.1f} s -> h2o replay {t_pd / h2o:.0f}x")
    print(f"HF model token by token: {t_hf:.1f} s ({T / t_hf:.1f} tok/s) -> h2o replay {t_hf / h2o:.0f}x, "
          f"slowest {min(state['model_runs']['speedup_over_hf'].values()):.0f}x; closed loop {t_cl:.1f} s -> "
          f"h2o {t_cl / h2o:.0f}x")
    save()
    state["sweep"] = sweep = sweep_seconds(args.trace, args.sweep_workers)
    print(f"kvsim sweep, {len(sweep['policies'])} policies x {len(SWEEP_BUDGETS)} budgets on "
          f"{args.sweep_workers} workers: {sweep['seconds']:.0f} s")
    save()

if __name__ == "__main__":
    main()
