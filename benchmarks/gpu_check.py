"""The prepared GPU check: one command, at most 8 minutes on one H100, nothing fetched.

Steps, each recorded with its outcome and time (one failing step does not stop the others; the JSON is rewritten
after each, so a killed run keeps what finished):

1. ``kernel_tests``: the Triton kernel tests (tests/test_kernels_*.py) compiled on the device (TRITON_INTERPRET=0).
2. ``kernel_benchmark``: ``benchmarks/kernels.py --quick`` (its own JSON, benchmarks/results/kernels.json).
3. ``generate``: for a random-weight Llama-3-8B-shaped model (4 layers) and a Gemma-3-270M-shaped one (sliding
   window 512), at 8 k and 32 k prompt tokens, greedy ``generate()`` over kvsim's cache with ``POLICY`` at
   ``BUDGET`` on the Triton backend and on the torch backend: the same kept sets (every layer, step and KV head),
   logits within tolerance up to the first differing token, the K+V bytes held against the full cache's, and
   decode tokens/s against transformers' own cache (SDPA, ``model.generate`` timed at N and at 1 new token).

``--dry-run`` runs the same steps on the CPU at toy sizes (one kernel test file under the Triton interpreter,
``kernels.py --interpret-smoke``, toy-sized configs of the same two shapes with 48/96-token prompts) in well
under a minute; tests/test_gpu_check.py runs it, so the script cannot rot.

Run: python benchmarks/gpu_check.py [--dry-run] [--out PATH]   (default benchmarks/results/gpu_check.json, or
gpu_check_dry_run.json for a dry run)
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
sys.path.insert(0, str(ROOT))

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


def run_subprocess(argv: list[str], timeout_s: int, compiled: bool) -> dict[str, Any]:
    """One command in a child process (Triton compiled on the GPU, or interpreted on the CPU): ok, return code,
    time and the last lines of its output."""
    env = {**os.environ, "TRITON_INTERPRET": "0" if compiled else "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = None, f"timed out after {timeout_s} s\n{e.stdout or ''}"
    return {"ok": rc == 0, "returncode": rc, "seconds": time.perf_counter() - t0,
            "output_tail": "\n".join(str(out).strip().splitlines()[-15:])}


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
    seconds = timed(n) - timed(1)
    return {"decode_seconds": seconds, "tokens_per_s": (n - 1) / seconds if seconds > 0 else None}


def generate_check(name: str, model, P: int, sizes: Sizes) -> dict[str, Any]:
    """Triton against torch backend on one model and prompt length, and transformers' own decode speed."""
    import torch

    from gpu_validate.evaluate import compare_kept

    dev = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, P), generator=torch.Generator().manual_seed(P)).to(dev)
    n, t0 = sizes.new_tokens, time.perf_counter()
    tri, ref = (_run_generate(model, ids, n, b, sizes.budget, P) for b in ("triton", "torch"))
    same = next((i for i, (a, b) in enumerate(zip(tri["tokens"], ref["tokens"])) if a != b), n)
    diff = float((tri["logits"][:same + 1] - ref["logits"][:same + 1]).abs().max())
    scale = float(ref["logits"].abs().max())
    kept = compare_kept(tri["kept"], ref["kept"], n - 1)
    hf = _transformers_decode(model, ids, n)
    row = {"model": name, "prompt_tokens": P, "new_tokens": n, "policy": POLICY, "budget": sizes.budget,
           "tokens_equal_prefix": same, "logit_max_abs_diff": diff, "logit_max_abs": scale,
           "kept_agreement": kept["kept_agreement"], "kept_jaccard": kept["kept_jaccard"],
           "kv_bytes_held": tri["kv_bytes_held"], "kv_bytes_full_cache": tri["kv_bytes_full_cache"],
           "kv_bytes_held_torch_backend": ref["kv_bytes_held"],
           "tokens_per_s_triton": tri["tokens_per_s"], "tokens_per_s_torch": ref["tokens_per_s"],
           "tokens_per_s_transformers_sdpa": hf["tokens_per_s"],
           "peak_gpu_bytes_triton": tri["peak_gpu_bytes"], "seconds": time.perf_counter() - t0}
    row["ok"] = bool(diff <= LOGIT_TOLERANCE * max(scale, 1e-6) and kept["kept_agreement"] >= KEPT_AGREEMENT
                     and tri["kv_bytes_held"] == ref["kv_bytes_held"] < tri["kv_bytes_full_cache"])
    return row


def generate_step(sizes: Sizes, device: str) -> dict[str, Any]:
    """`generate_check` for every model shape and prompt length (each model built once, from its config)."""
    import torch

    rows = []
    for name, make in MODELS.items():
        torch.manual_seed(0)
        with torch.device(device):
            model = make(sizes.toy)
        model = model.to(torch.bfloat16 if device == "cuda" else torch.float32).eval()
        for P in sizes.prompts:
            try:
                rows.append(generate_check(name, model, P, sizes))
            except Exception as e:  # noqa: BLE001 - recorded, and the other checks still run
                rows.append({"model": name, "prompt_tokens": P, "ok": False, "error": f"{type(e).__name__}: {e}"})
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"ok": all(r["ok"] for r in rows), "runs": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at toy sizes")
    ap.add_argument("--out", type=Path, default=None, help="the JSON written (default: benchmarks/results/...)")
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
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "kernel_tests": lambda: run_subprocess([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                *sizes.kernel_tests], sizes.timeout_s, compiled),
        "kernel_benchmark": lambda: run_subprocess([sys.executable, "benchmarks/kernels.py", *sizes.kernel_benchmark],
                                                   sizes.timeout_s, compiled),
        "generate": lambda: generate_step(sizes, device),
    }
    t_all = time.perf_counter()
    for name, step in steps.items():
        t0 = time.perf_counter()
        try:
            report["steps"][name] = step()
        except Exception as e:  # noqa: BLE001 - recorded; the next step still runs
            report["steps"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        report["steps"][name]["step_seconds"] = time.perf_counter() - t0
        report["ok"] = all(s["ok"] for s in report["steps"].values())
        report["seconds"] = time.perf_counter() - t_all
        atomic_write_text(out, json.dumps(report, indent=1, default=float))
        print(f"{name}: {'ok' if report['steps'][name]['ok'] else 'FAILED'} "
              f"({report['steps'][name]['step_seconds']:.0f} s)", flush=True)
    print(f"wrote {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
