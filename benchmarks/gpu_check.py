"""The prepared GPU check: one command, at most 8 minutes on one H100 or H200, nothing fetched; resumable per step.

Steps, each recorded with its outcome and time (one failing step does not stop the others; the JSON is rewritten
after each, so a killed run keeps what finished, and ``--resume`` skips what a previous run of the same JSON did):

1. ``generate``: for a random-weight Llama-3-8B-shaped model (4 layers) in bf16 and fp32 and a Gemma-3-270M-shaped
   one (sliding window 512) in bf16, at 8 k and 32 k prompt tokens, greedy ``generate()`` over kvsim's cache, side
   by side with transformers' own cache (SDPA; its prompt prefilled in chunks, then ``model.generate`` timed at N
   and at 1 new token): ``full`` on the Triton cache (the goal: >= 0.8x transformers' tokens/s), ``POLICY`` at
   ``BUDGET`` on the Triton cache (>= 1.5x transformers' full cache at 32 k), on the torch backend (the same kept
   sets, logits within tolerance up to the first differing token) and on the Triton cache the way it ran before
   (each layer's policy step inside its attention, no CUDA graph), each warmed up at that length first; the K+V
   bytes held, each run's info (CUDA graph or why not, host seconds of the policy steps).
2. ``closed_loop``: the closed loop's batching on the Llama-shaped model: 16 prefilled configurations in one batch
   against one alone (decode tokens/s per configuration; goal: 16 rows >= 8x one row's).
3. ``kernel_tests``: the Triton kernel tests (`KERNEL_TESTS`) compiled on the device (TRITON_INTERPRET=0;
   hypothesis's ``dev`` profile, 10 examples a property, since every new shape is a new compile).
4. ``kernel_benchmark``: ``python -m benchmarks.kernels --quick`` (its own JSON, benchmarks/results/kernels.json).
5. ``recommend``: ``kvsim recommend`` on the shipped tiny model with its closed loop on the GPU (Triton cache) and
   on the CPU (torch cache): the same answer, and the same measured losses where both confirmed a configuration.

It ends with one side-by-side table (kvsim, transformers, SDPA). ``--dry-run`` runs the same steps on the CPU at
toy sizes (one kernel test file under the Triton interpreter, ``kernels.py --interpret-smoke``, toy-sized configs
of the same shapes with 64-token prompts) in about two minutes; tests/benchmarks/test_gpu_check.py runs it, so the
script cannot rot.

Run: python -m benchmarks.gpu_check [--dry-run] [--out PATH] [--steps S ...] [--models M ...] [--dtypes D ...]
[--resume] (default benchmarks/results/gpu_check.json, or gpu_check_dry_run.json for a dry run)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]

POLICY = "decoding(snapkv, every=8)"
KERNEL_TESTS = ("tests/test_kernels_attention.py", "tests/test_kernels_cache.py", "tests/test_kernels_compaction.py",
                "tests/test_kernels_compile.py", "tests/benchmarks/test_kernels_benchmark.py")
#: |logit(triton) - logit(torch)| allowed, as a share of the largest |logit| (bf16 keeps about 3 digits)
LOGIT_TOLERANCE = 0.05
#: share of (layer, step, KV head) kept sets that must be equal across the backends
KEPT_AGREEMENT = 0.99
#: the issue's speed goals (issue 53), checked in the JSON
GOALS = {"full_vs_transformers": 0.8, "policy_at_32k_vs_transformers_full": 1.5, "closed_loop_16_vs_1_row": 8.0}
#: kvsim's configurations of the generate step: (policy, budget or None for POLICY's, backend, runner options)
CONFIGS = {"full": ("full", None, "triton", {}),
           "policy": (POLICY, "budget", "triton", {}),
           "policy_torch": (POLICY, "budget", "torch", {}),
           "policy_per_layer": (POLICY, "budget", "triton", {"steps_after_forward": False, "cuda_graphs": False})}
#: the (model, dtype) runs that also time the per-layer path before (the comparison needs one; each costs a minute)
PER_LAYER_RUNS = {("llama3-8b-shaped-4l", "bfloat16")}
#: the closed-loop step's configurations: prefilled policies (one batch key) at budgets within one tier
BATCH_POLICIES = ("snapkv", "pyramidkv", "ada_snapkv", POLICY)


@dataclass(frozen=True)
class Sizes:
    """What one run does: prompt lengths, new tokens, budget, the closed-loop step's prompt / decode tokens /
    budgets, kernel test files and kernels.py's mode, per-step subprocess time limits (s), toy-sized models, and the
    new tokens of each configuration's warm-up before its timed run (on a GPU past the CUDA graph's capture and past
    POLICY's first compression, every=8, so that no kernel compiles inside a timed run; the dry run times nothing, so
    two tokens only check that the warm-up runs)."""

    prompts: tuple[int, ...]
    new_tokens: int
    budget: int
    batch_prompt: int
    batch_decode: int
    batch_budgets: tuple[int, ...]
    kernel_tests: tuple[str, ...]
    kernel_benchmark: tuple[str, ...]
    timeout_s: int
    toy: bool
    warmup_tokens: int


GPU = Sizes((8192, 32768), 32, 1024, 2048, 32, (512, 640, 768, 1024), KERNEL_TESTS, ("--quick",), 150, toy=False,
            warmup_tokens=12)
DRY = Sizes((64,), 4, 16, 40, 4, (8, 10, 12, 16), ("tests/test_kernels_cache.py",), ("--interpret-smoke",), 120,
            toy=True, warmup_tokens=2)


def llama3_shaped(toy: bool):
    """Llama-3-8B's attention and MLP shapes (32 q / 8 KV heads, d 128) in 4 layers; toy: 2 small layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = (dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2) if toy else
            dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                 num_attention_heads=32, num_key_value_heads=8))
    cfg = LlamaConfig(**dims, max_position_embeddings=65536, rope_parameters={"rope_type": "default",
                      "rope_theta": 500000.0}, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def gemma3_shaped(toy: bool):
    """Gemma-3-270M's shapes (18 layers, five sliding-window layers of 512 to one global, 4 q / 1 KV head, d 256);
    toy: 4 layers with a window of 8."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    n_layers, window = (4, 8) if toy else (18, 512)
    types = ["full_attention" if (i + 1) % 6 == 0 or (toy and i == 2) else "sliding_attention"
             for i in range(n_layers)]
    dims = (dict(vocab_size=512, hidden_size=64, intermediate_size=128, head_dim=32, query_pre_attn_scalar=32) if toy
            else dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, head_dim=256,
                      query_pre_attn_scalar=256))
    cfg = Gemma3TextConfig(**dims, num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=1,
                           sliding_window=window, layer_types=types, max_position_embeddings=65536,
                           eos_token_id=None, bos_token_id=None, pad_token_id=0)
    return Gemma3ForCausalLM(cfg)


MODELS: dict[str, Callable[[bool], Any]] = {"llama3-8b-shaped-4l": llama3_shaped, "gemma3-270m-shaped": gemma3_shaped}
#: the generate step's (model, dtype) runs, in order (the Llama shape carries the goals, in both dtypes)
RUNS = (("llama3-8b-shaped-4l", "bfloat16"), ("llama3-8b-shaped-4l", "float32"), ("gemma3-270m-shaped", "bfloat16"))
#: the recommend step: ``kvsim recommend`` on the shipped tiny model, small enough to run twice in seconds
RECOMMEND = dict(segments=2, prompt_tokens=96, decode_tokens=16, policies="h2o;snapkv;streaming_llm;buzz;d2o")
RECOMMEND_TARGET = "dnll=0.1"
#: |measured ΔNLL on the device - on the CPU| allowed for a configuration both confirmed, nats/token
RECOMMEND_TOLERANCE = 0.01
#: the steps, in their default order (the end-to-end checks and the goals first: they matter most)
STEPS = ("generate", "closed_loop", "kernel_tests", "kernel_benchmark", "recommend")


def run_subprocess(argv: list[str], timeout_s: int, compiled: bool) -> dict[str, Any]:
    """One command in a child process (Triton compiled on the GPU, or interpreted on the CPU): ok, return code,
    time and the last lines of its output."""
    env = {**os.environ, "TRITON_INTERPRET": "0" if compiled else "1", "HYPOTHESIS_PROFILE": "dev",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:         # its stdout comes back as bytes, whatever text= said
        partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc, out = None, f"{partial}\ntimed out after {timeout_s} s"
    return {"ok": rc == 0, "returncode": rc, "seconds": time.perf_counter() - t0,
            "output_tail": "\n".join(out.strip().splitlines()[-40:])}


def _run_generate(model, ids, n: int, config: str, budget: int, P: int) -> dict[str, Any]:
    """Greedy generate() over kvsim's cache in one of `CONFIGS`: tokens, per-step logits, kept sets, bytes, decode
    speed, peak memory, run info."""
    import torch

    from gpu_validate.generation import kvsim_cache
    from traces.hf.forward import cache_keyword

    policy, b, backend, options = CONFIGS[config]
    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with kvsim_cache(model, policy, budget if b else None, max_new_tokens=n, backend=backend,
                     record_kept=(P, n - 1), **options) as cache:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **{cache_keyword(model): cache})
    return {"tokens": out.sequences[0, P:].tolist(), "logits": torch.stack(out.logits)[:, 0].float().cpu(),
            "kept": cache.kept(0), "kv_bytes_held": cache.kv_bytes_held()[0],
            "kv_bytes_full_cache": cache.kv_bytes_full_cache()[0], "decode_seconds": cache.decode_seconds,
            "tokens_per_s": cache.steps / cache.decode_seconds if cache.decode_seconds else None,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None, "info": cache.run_info()}


def _transformers_decode(model, ids, n: int) -> dict[str, Any]:
    """transformers' own cache with SDPA: the prompt but its last token prefilled in chunks (no T x T scores), then
    decode tokens/s from ``model.generate`` on a copy of that cache, timed at n and at 1 new token."""
    import copy

    import torch

    from traces.hf.forward import DEFAULT_CHUNK, CachedForward, cache_keyword

    model.set_attn_implementation("sdpa")
    fwd = CachedForward(model)
    with torch.no_grad():
        for _ in fwd.chunks(ids[:, :-1], DEFAULT_CHUNK):
            pass
    prefilled = fwd.past

    def timed(k: int) -> tuple[float, list[int]]:
        past = copy.deepcopy(prefilled)
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, do_sample=False,
                             **{cache_keyword(model): past})
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out[0, ids.shape[1]:].tolist()

    timed(2)                                    # this prompt length's kernels chosen outside the timing
    (t_n, tokens), (t_1, _) = timed(n), timed(1)
    seconds = t_n - t_1
    return {"decode_seconds": seconds, "tokens_per_s": (n - 1) / seconds if seconds > 0 else None, "tokens": tokens}


def generate_check(name: str, model, P: int, sizes: Sizes) -> dict[str, Any]:
    """kvsim's configurations against each other and transformers' own cache on one model and prompt length."""
    import torch

    from gpu_validate.closedloop.model_metrics import compare_kept

    dev = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, P), generator=torch.Generator().manual_seed(P)).to(dev)
    n, t0 = sizes.new_tokens, time.perf_counter()
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    configs = [c for c in CONFIGS if c != "policy_per_layer" or (name, dtype) in PER_LAYER_RUNS]
    for config in configs:     # every kernel of this length (graph capture, compaction) compiled outside the timings
        _run_generate(model, ids, sizes.warmup_tokens, config, sizes.budget, P)
    runs = {config: _run_generate(model, ids, n, config, sizes.budget, P) for config in configs}
    tri, ref = runs["policy"], runs["policy_torch"]
    same = next((i for i, (a, b) in enumerate(zip(tri["tokens"], ref["tokens"])) if a != b), n)
    diff = float((tri["logits"][:same + 1] - ref["logits"][:same + 1]).abs().max())
    scale = float(ref["logits"].abs().max())
    # decode step r feeds token r: past the first differing token the inputs differ, and so may the kept sets
    steps = max(1, min(same, n - 1))
    kept = compare_kept(tri["kept"], ref["kept"], steps)
    per_layer = [compare_kept(tri["kept"][l:l + 1], ref["kept"][l:l + 1], steps)["kept_agreement"]
                 for l in range(tri["kept"].shape[0])]
    hf = _transformers_decode(model, ids, n)
    hf_tps = hf["tokens_per_s"]
    row: dict[str, Any] = {"model": name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
           "n_layers": model.config.num_hidden_layers, "prompt_tokens": P, "new_tokens": n, "policy": POLICY,
           "budget": sizes.budget, "tokens_equal_prefix": same, "logit_max_abs_diff": diff, "logit_max_abs": scale,
           "kept_steps_compared": steps, "kept_agreement": kept["kept_agreement"], "kept_jaccard": kept["kept_jaccard"],
           "kept_symmetric_difference_max": kept["symmetric_difference_max"], "kept_agreement_per_layer": per_layer,
           "kv_bytes_held": tri["kv_bytes_held"], "kv_bytes_full_cache": tri["kv_bytes_full_cache"],
           "kv_bytes_held_torch_backend": ref["kv_bytes_held"], "tokens_per_s_transformers_sdpa": hf_tps,
           "full_tokens_equal_prefix_transformers": next(
               (i for i, (a, b) in enumerate(zip(runs["full"]["tokens"], hf["tokens"])) if a != b), n),
           "seconds": None}
    for config in CONFIGS:
        r = runs.get(config, {})
        row[f"tokens_per_s_{config}"] = r.get("tokens_per_s")
        row[f"peak_gpu_bytes_{config}"] = r.get("peak_gpu_bytes")
        row[f"info_{config}"] = r.get("info")
    row["tokens_per_s_triton"], row["tokens_per_s_torch"] = tri["tokens_per_s"], ref["tokens_per_s"]
    ratio = (lambda a: a / hf_tps if a and hf_tps else None)
    row["ratio_full_vs_transformers"] = ratio(runs["full"]["tokens_per_s"])
    row["ratio_policy_vs_transformers_full"] = ratio(tri["tokens_per_s"])
    per_layer = runs.get("policy_per_layer", {}).get("tokens_per_s")
    row["ratio_policy_vs_per_layer_path"] = tri["tokens_per_s"] / per_layer if per_layer else None
    row["decode_ms_per_token_full"] = 1e3 / runs["full"]["tokens_per_s"] if runs["full"]["tokens_per_s"] else None
    row["decode_ms_per_token_transformers"] = 1e3 / hf_tps if hf_tps else None
    row["seconds"] = time.perf_counter() - t0
    row["ok"] = bool(diff <= LOGIT_TOLERANCE * max(scale, 1e-6) and kept["kept_agreement"] >= KEPT_AGREEMENT
                     and tri["kv_bytes_held"] == ref["kv_bytes_held"] < tri["kv_bytes_full_cache"])
    return row


def generate_step(sizes: Sizes, device: str, runs: list[tuple[str, str]], done: list[dict],
                  on_row: Callable[[list], None]) -> dict[str, Any]:
    """`generate_check` for each (model, dtype) of ``runs`` at every prompt length (each model built once, from its
    config; rows in ``done`` -- a resumed run's -- are kept, not rerun); ``on_row(rows)`` after each row, so a killed
    run keeps what finished."""
    import torch

    rows = [r for r in done if r.get("ok") is not None and "error" not in r]
    have = {(r["model"], r.get("dtype"), r["prompt_tokens"]) for r in rows}
    for name, dtype in runs:
        todo = [P for P in sizes.prompts if (name, dtype, P) not in have]
        if not todo:
            continue
        torch.manual_seed(0)
        with torch.device(device):
            model = MODELS[name](sizes.toy)
        model = model.to(getattr(torch, dtype)).eval()
        for P in todo:
            try:
                rows.append(generate_check(name, model, P, sizes))
            except Exception as e:  # noqa: BLE001 - recorded, and the other checks still run
                rows.append({"model": name, "dtype": dtype, "prompt_tokens": P, "ok": False,
                             "error": f"{type(e).__name__}: {e}"[:2000]})
            on_row(rows)
            if device == "cuda":
                torch.cuda.empty_cache()
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"ok": all(r["ok"] for r in rows), "runs": rows}


def closed_loop_step(sizes: Sizes, device: str) -> dict[str, Any]:
    """The closed loop's batching on the Llama-shaped model (bf16 on a GPU): ``BATCH_POLICIES`` x
    ``batch_budgets`` teacher-forced in one batch, against one configuration of each policy (its middle budget)
    run alone; decode tokens/s per configuration (configurations x steps / decode seconds) and the host seconds of
    the policy steps."""
    import torch

    from gpu_validate.closedloop.jobs import BatchJob
    from gpu_validate.closedloop.runner import run_batch
    from sim.experiments.specs import parse_policy

    torch.manual_seed(0)
    with torch.device(device):
        model = MODELS["llama3-8b-shaped-4l"](sizes.toy)
    model = model.to(torch.bfloat16 if device == "cuda" else torch.float32).eval()
    P, n = sizes.batch_prompt, sizes.batch_decode
    ids = torch.randint(0, model.config.vocab_size, (P + n,), generator=torch.Generator().manual_seed(1)).tolist()
    jobs = [BatchJob(parse_policy(p), b, ids[:P], continuation=ids[P:]) for p in BATCH_POLICIES
            for b in sizes.batch_budgets]
    backend = "triton" if device == "cuda" else "torch"
    mid = sizes.batch_budgets[len(sizes.batch_budgets) // 2]

    def timed(batch: list) -> dict[str, Any]:
        run_batch(model, [BatchJob(j.policy, j.budget, j.prompt, continuation=j.continuation[:sizes.warmup_tokens])
                          for j in batch], backend=backend)     # compiled and warmed up outside the timing
        res = run_batch(model, batch, backend=backend)
        seconds = res[0].decode_seconds * len(batch)
        return {"rows": len(batch), "decode_seconds": seconds,
                "tokens_per_s_per_configuration": len(batch) * (n - 1) / seconds,
                "info": {k: res[0].extra.get(k) for k in ("cuda_graph", "cuda_graph_fallback", "host_round_trips",
                                                          "host_step_seconds", "host_phase_seconds")}}

    out: dict[str, Any] = {"model": "llama3-8b-shaped-4l", "prompt_tokens": P, "decode_tokens": n,
                           "configurations": [j.policy.label() + f"@{j.budget}" for j in jobs]}
    alone = {j.policy.label(): timed([j]) for j in jobs if j.budget == mid}
    out["rows_1"] = {"rows": 1, "configurations": list(alone), "tokens_per_s_per_configuration": float(
        np.mean([a["tokens_per_s_per_configuration"] for a in alone.values()])), "each": alone}
    out[f"rows_{len(jobs)}"] = timed(jobs)
    many = out[f"rows_{len(jobs)}"]["tokens_per_s_per_configuration"]
    out["ratio_rows_vs_one"] = many / out["rows_1"]["tokens_per_s_per_configuration"]
    out["ok"] = True
    return out


def recommend_step(device: str) -> dict[str, Any]:
    """`recommend_texts` on the tiny model with its closed loop on ``device`` (the Triton cache on CUDA) and on the
    CPU (the torch cache): the same answer, and the measured losses of the configurations both confirmed within
    `RECOMMEND_TOLERANCE`. On a CPU-only dry run the two are one run, which checks the plumbing only."""
    import tempfile

    from gpu_validate.studies.recommendation.recommender import recommend_texts

    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dev in dict.fromkeys((device, "cpu")):
            t0 = time.perf_counter()
            rep = recommend_texts("tiny", ["default"], RECOMMEND_TARGET, out=Path(tmp) / dev, device=dev,
                                  progress=False, **RECOMMEND)
            measured = {(c["label"], c["budget"]): c["measured"] for c in rep["configurations"]
                        if c["measured"] == c["measured"]}          # NaN: not run in the model
            runs[dev] = {"backend": rep["backend"], "answer": rep["answer"], "model_runs": rep["model_runs"],
                         "measured": measured, "seconds": time.perf_counter() - t0}
    dev, cpu = runs[device], runs["cpu"]
    both = sorted(set(dev["measured"]) & set(cpu["measured"]))
    diff = max((abs(dev["measured"][k] - cpu["measured"][k]) for k in both), default=float("nan"))

    def pick(r: dict[str, Any]) -> tuple[Any, Any]:
        return r["answer"]["budget"], (r["answer"].get("choice") or {}).get("label")

    out = {"model": "tiny", "target": RECOMMEND_TARGET, **RECOMMEND, "device": device,
           "answer_device": pick(dev), "answer_cpu": pick(cpu), "confirmed_both": len(both),
           "measured_max_abs_diff": diff, "tolerance": RECOMMEND_TOLERANCE,
           "runs": {d: {k: v for k, v in r.items() if k != "measured"} for d, r in runs.items()}}
    out["ok"] = bool(pick(dev) == pick(cpu) and both and diff <= RECOMMEND_TOLERANCE)
    return out


def kernel_benchmark_step(sizes: Sizes, compiled: bool) -> dict[str, Any]:
    """``benchmarks/kernels.py`` in a child process; on a GPU its attention rows (kernels.json) come along, for the
    side-by-side table."""
    out = run_subprocess([sys.executable, "-m", "benchmarks.kernels", *sizes.kernel_benchmark], sizes.timeout_s,
                         compiled)
    path = ROOT / "benchmarks" / "results" / "kernels.json"
    if compiled and out["ok"] and path.exists():
        out["attention"] = [{k: r[k] for k in ("budget", "batch", "t_ours_probs_graph_s", "t_sdpa_graph_s",
                                               "ratio_probs_vs_sdpa_graph")}
                            for r in json.loads(path.read_text())["attention"]]
    return out


def goals(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's speed goals against what this run measured (None where the run has no figure)."""
    rows = [r for r in report["steps"].get("generate", {}).get("runs", []) if r.get("model", "").startswith("llama")
            and "error" not in r]
    full = [r["ratio_full_vs_transformers"] for r in rows if r.get("ratio_full_vs_transformers")]
    at32 = [r["ratio_policy_vs_transformers_full"] for r in rows
            if r["prompt_tokens"] >= 32768 and r.get("ratio_policy_vs_transformers_full")]
    loop = report["steps"].get("closed_loop", {}).get("ratio_rows_vs_one")
    got = {"full_vs_transformers": min(full) if full else None,
           "policy_at_32k_vs_transformers_full": min(at32) if at32 else None, "closed_loop_16_vs_1_row": loop}
    return {k: {"goal": GOALS[k], "measured": v, "met": None if v is None else bool(v >= GOALS[k])}
            for k, v in got.items()}


def table(report: dict[str, Any]) -> str:
    """One side-by-side table of the generate step's decode speeds (tokens/s): kvsim's configurations,
    transformers' own cache; then the kernels' time against SDPA, and the goals."""
    head = ("model", "dtype", "prompt", "kvsim full", "kvsim " + POLICY, "torch backend", "per-layer path",
            "transformers", "full/hf", "policy/hf")
    lines = [" | ".join(head)]
    fmt = (lambda x: "-" if x is None else f"{x:.1f}")
    for r in report["steps"].get("generate", {}).get("runs", []):
        if "error" in r:
            lines.append(f"{r['model']} | {r.get('dtype')} | {r['prompt_tokens']} | error: {r['error'][:80]}")
            continue
        lines.append(" | ".join([r["model"], r["dtype"], str(r["prompt_tokens"]), fmt(r["tokens_per_s_full"]),
                                 fmt(r["tokens_per_s_policy"]), fmt(r["tokens_per_s_policy_torch"]),
                                 fmt(r["tokens_per_s_policy_per_layer"]), fmt(r["tokens_per_s_transformers_sdpa"]),
                                 fmt(r["ratio_full_vs_transformers"]), fmt(r["ratio_policy_vs_transformers_full"])]))
    loop = report["steps"].get("closed_loop", {})
    if "rows_1" in loop:
        many = next(v for k, v in loop.items() if k.startswith("rows_") and k != "rows_1")
        lines.append(f"closed loop: 1 row {loop['rows_1']['tokens_per_s_per_configuration']:.1f} tok/s per "
                     f"configuration, {many['rows']} rows {many['tokens_per_s_per_configuration']:.1f} "
                     f"({loop['ratio_rows_vs_one']:.1f}x)")
    kernels = report["steps"].get("kernel_benchmark", {}).get("attention")
    for r in kernels or []:
        lines.append(f"decode attention, {r['budget']} slots x batch {r['batch']}: kvsim "
                     f"{r['t_ours_probs_graph_s'] * 1e6:.1f} us, SDPA {r['t_sdpa_graph_s'] * 1e6:.1f} us "
                     f"({r['ratio_probs_vs_sdpa_graph']:.2f}x, graph replays)")
    for k, g in report.get("goals", {}).items():
        lines.append(f"goal {k}: {fmt(g['measured'])} (>= {g['goal']}) {'met' if g['met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at toy sizes")
    ap.add_argument("--out", type=Path, default=None, help="the JSON written (default: benchmarks/results/...)")
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="the steps run, in this order")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                    help="the model shapes of the generate step")
    ap.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float32"), default=None,
                    help="the generate step's dtypes (default: bf16 and fp32 for the Llama shape, bf16 for Gemma-3)")
    ap.add_argument("--prompts", type=int, nargs="+", default=None,
                    help="the generate step's prompt lengths (default: 8192 32768; a dry run 64)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the steps (and generate rows) the JSON at --out already holds, run the rest")
    args = ap.parse_args(argv)
    sizes = DRY if args.dry_run else GPU
    if args.prompts:
        sizes = replace(sizes, prompts=tuple(args.prompts))
    os.environ.setdefault("TRITON_INTERPRET", "1" if args.dry_run else "0")    # before triton is imported
    import torch
    import triton
    import transformers

    from benchmarks._util import RESULTS, machine
    from traces.format import atomic_write_text

    compiled = os.environ["TRITON_INTERPRET"] == "0" and torch.cuda.is_available()
    if not args.dry_run and not compiled:
        print("benchmarks/gpu_check.py needs a CUDA device (and TRITON_INTERPRET unset or 0); use --dry-run on a "
              "CPU", file=sys.stderr)
        return 2
    device = "cuda" if compiled else "cpu"      # a dry run where a GPU is in use: toy sizes on it
    out = args.out or RESULTS / ("gpu_check_dry_run.json" if args.dry_run else "gpu_check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.read_text()) if args.resume and out.exists() else {}
    report: dict[str, Any] = {
        "benchmark": "gpu_check", "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "machine": machine(),
        "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
        "sizes": asdict(sizes), "tolerances": {"logit_share_of_max": LOGIT_TOLERANCE, "kept_agreement": KEPT_AGREEMENT},
        "steps": dict(previous.get("steps", {}))}
    runs = [(m, d) for m, d in RUNS if m in args.models and (args.dtypes is None or d in args.dtypes)]
    if args.dtypes:
        runs += [(m, d) for m in args.models for d in args.dtypes if (m, d) not in runs]
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "--tb=line", "--durations=5"]

    def write() -> None:
        report["ok"] = all(s["ok"] for s in report["steps"].values())
        report["goals"] = goals(report)
        report["seconds"] = time.perf_counter() - t_all
        atomic_write_text(out, json.dumps(report, indent=1, default=float))

    def generate_progress(rows: list) -> None:
        report["steps"]["generate"] = {"ok": False, "partial": True, "runs": rows}
        write()

    done = previous.get("steps", {}).get("generate", {}).get("runs", [])
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "generate": lambda: generate_step(sizes, device, runs, done, generate_progress),
        "closed_loop": lambda: closed_loop_step(sizes, device),
        "kernel_tests": lambda: run_subprocess([*pytest, *sizes.kernel_tests], sizes.timeout_s, compiled),
        "kernel_benchmark": lambda: kernel_benchmark_step(sizes, compiled),
        "recommend": lambda: recommend_step(device),
    }
    t_all = time.perf_counter()
    for name in args.steps:
        old = previous.get("steps", {}).get(name)
        if old and old.get("ok") and not old.get("partial"):
            print(f"{name}: kept from {out} (--resume)", flush=True)
            continue
        step, t0 = steps[name], time.perf_counter()
        try:
            report["steps"][name] = step()
        except Exception as e:  # noqa: BLE001 - recorded; the next step still runs
            report["steps"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        report["steps"][name]["step_seconds"] = time.perf_counter() - t0
        write()
        print(f"{name}: {'ok' if report['steps'][name]['ok'] else 'FAILED'} "
              f"({report['steps'][name]['step_seconds']:.0f} s)", flush=True)
    write()
    print(table(report))
    print(f"wrote {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
