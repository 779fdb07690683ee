"""The prepared GPU check: one command, at most 8 minutes on one H100, nothing fetched.

Steps, each recorded with its outcome and time (one failing step does not stop the others; the JSON is rewritten
after each, so a killed run keeps what finished):

1. ``generate``: for a random-weight Llama-3-8B-shaped model (4 layers) and a Gemma-3-270M-shaped one (sliding
   window 512), in bf16 (``--dtype float32`` tells the backends' agreement apart from bf16 rounding), at 8 k and
   32 k prompt tokens, greedy ``generate()`` over kvsim's cache with ``POLICY`` at ``BUDGET`` on the Triton
   backend and on the torch backend (each warmed up at that length first): the same kept sets (every layer, step
   and KV head), logits within tolerance up to the first differing token, the K+V bytes held against the full
   cache's, and decode tokens/s against transformers' own cache (SDPA, ``model.generate`` timed at N and at 1 new
   token).
2. ``recommend``: ``kvsim recommend`` on the shipped tiny model with its closed loop on the GPU (Triton cache) and
   on the CPU (torch cache): the same answer, and the same measured losses where both confirmed a configuration.
3. ``kernel_tests``: the Triton kernel tests (tests/test_kernels_*.py) compiled on the device (TRITON_INTERPRET=0;
   hypothesis's ``dev`` profile, 10 examples a property, since every new shape is a new compile).
4. ``kernel_benchmark``: ``python -m benchmarks.kernels --quick`` (its own JSON, benchmarks/results/kernels.json).

``--dry-run`` runs the same steps on the CPU at toy sizes (one kernel test file under the Triton interpreter,
``kernels.py --interpret-smoke``, toy-sized configs of the same two shapes with 48/96-token prompts) in well
under a minute; tests/test_gpu_check.py runs it, so the script cannot rot.

Run: python -m benchmarks.gpu_check [--dry-run] [--out PATH] [--steps S ...] [--models M ...] [--dtype D]
(default benchmarks/results/gpu_check.json, or gpu_check_dry_run.json for a dry run; a rerun of one step or model
on a short device lease: ``--steps generate --models llama3-8b-shaped-4l [--dtype float32]``)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]

POLICY = "decoding(snapkv, every=8)"
KERNEL_TESTS = ("tests/test_kernels_attention.py", "tests/test_kernels_cache.py", "tests/test_kernels_compaction.py",
                "tests/test_kernels_compile.py", "tests/test_kernels_benchmark.py")
#: |logit(triton) - logit(torch)| allowed, as a share of the largest |logit| (bf16 keeps about 3 digits)
LOGIT_TOLERANCE = 0.05
#: share of (layer, step, KV head) kept sets that must be equal across the backends
KEPT_AGREEMENT = 0.99


@dataclass(frozen=True)
class Sizes:
    """What one run does: prompt lengths, new tokens, budget, kernel test files and kernels.py's mode, per-step
    subprocess time limits (s), and whether the models are toy-sized."""

    prompts: tuple[int, ...]
    new_tokens: int
    budget: int
    kernel_tests: tuple[str, ...]
    kernel_benchmark: tuple[str, ...]
    timeout_s: int
    toy: bool


GPU = Sizes((8192, 32768), 32, 1024, KERNEL_TESTS, ("--quick",), 150, toy=False)
DRY = Sizes((48, 96), 6, 16, ("tests/test_kernels_cache.py",), ("--interpret-smoke",), 120, toy=True)


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
#: the recommend step: ``kvsim recommend`` on the shipped tiny model, small enough to run twice in seconds
RECOMMEND = dict(segments=2, prompt_tokens=96, decode_tokens=16, policies="h2o;snapkv;streaming_llm;buzz;d2o")
RECOMMEND_TARGET = "dnll=0.1"
#: |measured ΔNLL on the device - on the CPU| allowed for a configuration both confirmed, nats/token
RECOMMEND_TOLERANCE = 0.01
#: the generate step's model dtypes, the default first
DTYPES = ("bfloat16", "float32")
#: the steps, in their default order (the end-to-end check first: it matters most)
STEPS = ("generate", "recommend", "kernel_tests", "kernel_benchmark")


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


def _run_generate(model, ids, n: int, backend: str, budget: int, P: int) -> dict[str, Any]:
    """Greedy generate() over kvsim's cache: tokens, per-step logits, kept sets, bytes, decode speed, peak memory."""
    import torch

    from gpu_validate.generation import kvsim_cache
    from traces.hf.forward import cache_keyword

    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with kvsim_cache(model, POLICY, budget, max_new_tokens=n, backend=backend, record_kept=(P, n - 1)) as cache:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **{cache_keyword(model): cache})
    return {"tokens": out.sequences[0, P:].tolist(), "logits": torch.stack(out.logits)[:, 0].float().cpu(),
            "kept": cache.kept(0), "kv_bytes_held": cache.kv_bytes_held()[0],
            "kv_bytes_full_cache": cache.kv_bytes_full_cache()[0], "decode_seconds": cache.decode_seconds,
            "tokens_per_s": cache.steps / cache.decode_seconds if cache.decode_seconds else None,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def _transformers_decode(model, ids, n: int) -> dict[str, Any]:
    """transformers' own cache with SDPA: decode tokens/s from generate() timed at n and at 1 new token."""
    import torch

    def timed(k: int) -> float:
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, do_sample=False)
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    model.set_attn_implementation("sdpa")
    timed(2)                                    # this prompt length's kernels chosen outside the timing
    seconds = timed(n) - timed(1)
    return {"decode_seconds": seconds, "tokens_per_s": (n - 1) / seconds if seconds > 0 else None}


def generate_check(name: str, model, P: int, sizes: Sizes) -> dict[str, Any]:
    """Triton against torch backend on one model and prompt length, and transformers' own decode speed."""
    import torch

    from gpu_validate.evaluate import compare_kept

    dev = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, P), generator=torch.Generator().manual_seed(P)).to(dev)
    n, t0 = sizes.new_tokens, time.perf_counter()
    for backend in ("triton", "torch"):         # kernels specialised on this length compiled outside the timings
        _run_generate(model, ids, 2, backend, sizes.budget, P)
    tri, ref = (_run_generate(model, ids, n, b, sizes.budget, P) for b in ("triton", "torch"))
    same = next((i for i, (a, b) in enumerate(zip(tri["tokens"], ref["tokens"])) if a != b), n)
    diff = float((tri["logits"][:same + 1] - ref["logits"][:same + 1]).abs().max())
    scale = float(ref["logits"].abs().max())
    # decode step r feeds token r: past the first differing token the inputs differ, and so may the kept sets
    steps = max(1, min(same, n - 1))
    kept = compare_kept(tri["kept"], ref["kept"], steps)
    per_layer = [compare_kept(tri["kept"][l:l + 1], ref["kept"][l:l + 1], steps)["kept_agreement"]
                 for l in range(tri["kept"].shape[0])]
    hf = _transformers_decode(model, ids, n)
    row = {"model": name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
           "prompt_tokens": P, "new_tokens": n, "policy": POLICY, "budget": sizes.budget,
           "tokens_equal_prefix": same, "logit_max_abs_diff": diff, "logit_max_abs": scale,
           "kept_steps_compared": steps, "kept_agreement": kept["kept_agreement"], "kept_jaccard": kept["kept_jaccard"],
           "kept_symmetric_difference_max": kept["symmetric_difference_max"], "kept_agreement_per_layer": per_layer,
           "kv_bytes_held": tri["kv_bytes_held"], "kv_bytes_full_cache": tri["kv_bytes_full_cache"],
           "kv_bytes_held_torch_backend": ref["kv_bytes_held"],
           "tokens_per_s_triton": tri["tokens_per_s"], "tokens_per_s_torch": ref["tokens_per_s"],
           "tokens_per_s_transformers_sdpa": hf["tokens_per_s"],
           "peak_gpu_bytes_triton": tri["peak_gpu_bytes"], "seconds": time.perf_counter() - t0}
    row["ok"] = bool(diff <= LOGIT_TOLERANCE * max(scale, 1e-6) and kept["kept_agreement"] >= KEPT_AGREEMENT
                     and tri["kv_bytes_held"] == ref["kv_bytes_held"] < tri["kv_bytes_full_cache"])
    return row


def generate_step(sizes: Sizes, device: str, models: list[str], dtype: str,
                  on_row: Callable[[list], None]) -> dict[str, Any]:
    """`generate_check` for each of ``models`` at every prompt length (each model built once, from its config, in
    ``dtype``; `generate_check` warms each backend up at each length, so compiling stays outside the timings);
    ``on_row(rows)`` after each row, so a killed run keeps what finished."""
    import torch

    rows: list[dict[str, Any]] = []
    for name in models:
        torch.manual_seed(0)
        with torch.device(device):
            model = MODELS[name](sizes.toy)
        model = model.to(getattr(torch, dtype)).eval()
        for P in sizes.prompts:
            try:
                rows.append(generate_check(name, model, P, sizes))
            except Exception as e:  # noqa: BLE001 - recorded, and the other checks still run
                rows.append({"model": name, "prompt_tokens": P, "ok": False, "error": f"{type(e).__name__}: {e}"})
            on_row(rows)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"ok": all(r["ok"] for r in rows), "runs": rows}


def recommend_step(device: str) -> dict[str, Any]:
    """`recommend_texts` on the tiny model with its closed loop on ``device`` (the Triton cache on CUDA) and on the
    CPU (the torch cache): the same answer, and the measured losses of the configurations both confirmed within
    `RECOMMEND_TOLERANCE`. On a CPU-only dry run the two are one run, which checks the plumbing only."""
    import tempfile

    from gpu_validate.recommend import recommend_texts

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at toy sizes")
    ap.add_argument("--out", type=Path, default=None, help="the JSON written (default: benchmarks/results/...)")
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="the steps run, in this order")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                    help="the model shapes of the generate step")
    ap.add_argument("--dtype", choices=DTYPES, default=DTYPES[0],
                    help="the models' dtype in the generate step (float32 separates the backends' agreement from "
                         "bf16 rounding)")
    args = ap.parse_args(argv)
    sizes = DRY if args.dry_run else GPU
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
    report: dict[str, Any] = {
        "benchmark": "gpu_check", "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "machine": machine(),
        "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
        "sizes": asdict(sizes), "tolerances": {"logit_share_of_max": LOGIT_TOLERANCE, "kept_agreement": KEPT_AGREEMENT},
        "steps": {}}
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "--tb=line", "--durations=5"]

    def write() -> None:
        report["ok"] = all(s["ok"] for s in report["steps"].values())
        report["seconds"] = time.perf_counter() - t_all
        atomic_write_text(out, json.dumps(report, indent=1, default=float))

    def generate_progress(rows: list) -> None:
        report["steps"]["generate"] = {"ok": False, "partial": True, "runs": rows}
        write()

    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "generate": lambda: generate_step(sizes, device, args.models, args.dtype, generate_progress),
        "recommend": lambda: recommend_step(device),
        "kernel_tests": lambda: run_subprocess([*pytest, *sizes.kernel_tests], sizes.timeout_s, compiled),
        "kernel_benchmark": lambda: run_subprocess([sys.executable, "-m", "benchmarks.kernels", *sizes.kernel_benchmark],
                                                   sizes.timeout_s, compiled),
    }
    t_all = time.perf_counter()
    for name in args.steps:
        step, t0 = steps[name], time.perf_counter()
        try:
            report["steps"][name] = step()
        except Exception as e:  # noqa: BLE001 - recorded; the next step still runs
            report["steps"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        report["steps"][name]["step_seconds"] = time.perf_counter() - t0
        write()
        print(f"{name}: {'ok' if report['steps'][name]['ok'] else 'FAILED'} "
              f"({report['steps'][name]['step_seconds']:.0f} s)", flush=True)
    print(f"wrote {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
