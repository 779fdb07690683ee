"""Benchmark the varlen decode-attention and compaction kernels on a CUDA GPU; writes benchmarks/results/kernels.json.

For each (budget, batch): our kernel with and without score output vs torch SDPA (GQA, same retained lengths,
side by side in this process) and FlashAttention's `flash_attn_with_kvcache` when installed; achieved memory
bandwidth (minimum bytes moved / median time) as a fraction of the device's datasheet HBM peak and of a
measured device-to-device copy; plus compaction costs (one eviction + one append per head, with and without
D2O-style merges). Usage: `python benchmarks/kernels.py [--quick] [--out PATH]`.
Without a CUDA device it refuses (exit 2); `--interpret-smoke` runs a tiny CPU correctness pass instead
(TRITON_INTERPRET=1) and writes no numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

# Datasheet HBM bandwidth (bytes/s), matched by substring of torch.cuda.get_device_name(); first match wins.
PEAK_BANDWIDTH = [
    ("H200", 4.8e12, "NVIDIA H200 datasheet: 4.8 TB/s HBM3e"),
    ("H100 NVL", 3.9e12, "NVIDIA H100 datasheet (NVL): 3.9 TB/s"),
    ("H100 PCIe", 2.0e12, "NVIDIA H100 datasheet (PCIe): 2.0 TB/s"),
    ("H100", 3.35e12, "NVIDIA H100 datasheet (SXM5): 3.35 TB/s HBM3"),
    ("A100-SXM4-80GB", 2.039e12, "NVIDIA A100 datasheet (80GB SXM): 2,039 GB/s"),
    ("A100 80GB PCIe", 1.935e12, "NVIDIA A100 datasheet (80GB PCIe): 1,935 GB/s"),
    ("A100", 1.555e12, "NVIDIA A100 datasheet (40GB): 1,555 GB/s"),
    ("L40S", 0.864e12, "NVIDIA L40S datasheet: 864 GB/s"),
    ("A10G", 0.6e12, "NVIDIA A10G (AWS) spec: 600 GB/s"),
    ("L4", 0.3e12, "NVIDIA L4 datasheet: 300 GB/s"),
    ("RTX 4090", 1.008e12, "NVIDIA RTX 4090 spec: 1,008 GB/s"),
]

# Llama-3-8B-like attention layer: 32 query heads, 8 KV heads, head_dim 128, fp16 cache.
N_Q, N_KV, HEAD_DIM = 32, 8, 128
BUDGETS = [256, 512, 1024, 2048, 4096, 8192, 16384]
BATCHES = [1, 4, 16, 64]
CONFIGS = [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8)]  # (block_n, num_warps) tried per shape


def peak_for(name: str) -> tuple[float | None, str]:
    for key, peak, source in PEAK_BANDWIDTH:
        if key in name:
            return peak, source
    return None, "unknown device: no datasheet peak in the table; see copy_bandwidth"


def atomic_write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def interpret_smoke() -> int:
    """Tiny correctness pass on CPU under the Triton interpreter; prints, writes nothing."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from gpu_validate.kernels.attention import varlen_decode_attention
    from gpu_validate.reference import ref_decode_attention

    torch.manual_seed(0)
    start = torch.tensor([0, 64], dtype=torch.int32)
    length = torch.tensor([40, 17], dtype=torch.int32)
    k, v = torch.randn(128, 64).half(), torch.randn(128, 64).half()
    q = torch.randn(1, 4, 64).half()
    out = varlen_decode_attention(q, k, v, start, length, max_len=64, num_splits=2)
    ref = ref_decode_attention(q, k, v, start, length, softmax_scale=64**-0.5)
    err = float((out.o.float() - ref.o.float()).abs().max())
    print(f"interpret smoke: max |o - ref| = {err:.2e} (no timings: needs a CUDA device)")
    return 0 if err < 2e-3 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kernels.json")
    ap.add_argument("--quick", action="store_true", help="budgets {256, 2048, 16384} x batches {1, 16}")
    ap.add_argument("--interpret-smoke", action="store_true", help="CPU correctness pass only, no numbers")
    args = ap.parse_args(argv)
    if args.interpret_smoke:
        return interpret_smoke()
    import torch

    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("benchmarks/kernels.py needs a CUDA device (and TRITON_INTERPRET unset); refusing to produce "
              "numbers. Use --interpret-smoke for a CPU correctness pass.", file=sys.stderr)
        return 2
    return run_gpu(args)


def run_gpu(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    from gpu_validate.kernels.attention import attention_bytes, varlen_decode_attention
    from gpu_validate.kernels.compaction import slot_heads, varlen_compact

    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None

    torch.manual_seed(0)
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    peak, peak_source = peak_for(name)
    bench = lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # noqa: E731 seconds
    # CUDA-graph replay: GPU time without the Python launch overhead of either side
    bench_graph = lambda fn: do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3  # noqa: E731

    big = torch.empty(1 << 28, dtype=torch.float32, device=dev)  # 1 GiB
    dst = torch.empty_like(big)
    copy_bw = 2 * big.numel() * 4 / bench(lambda: dst.copy_(big))
    del big, dst

    budgets, batches = ([256, 2048, 16384], [1, 16]) if args.quick else (BUDGETS, BATCHES)
    g = N_Q // N_KV
    rows = []
    for budget in budgets:
        for bsz in batches:
            n_heads = bsz * N_KV
            dt = torch.float16
            k = torch.randn(n_heads * budget, HEAD_DIM, dtype=dt, device=dev)
            v = torch.randn_like(k)
            start = (torch.arange(n_heads, device=dev, dtype=torch.int32) * budget)
            length = torch.full((n_heads,), budget, dtype=torch.int32, device=dev)
            q = torch.randn(bsz, N_Q, HEAD_DIM, dtype=dt, device=dev)
            probs = torch.empty(n_heads * budget, g, dtype=torch.float32, device=dev)
            acc = torch.zeros(n_heads * budget, dtype=torch.float32, device=dev)
            ema = torch.zeros_like(acc)

            def ours(block_n, warps, scores):
                kw = dict(probs=probs, want_probs=True, acc=acc, ema=ema) if scores else dict(want_probs=False)
                return lambda: varlen_decode_attention(q, k, v, start, length, max_len=budget, block_n=block_n,
                                                       num_warps=warps, **kw)

            timing = {}
            for scores in (False, True):
                best = min((bench(ours(bn, w, scores)), bn, w) for bn, w in CONFIGS)
                timing[scores] = best
            default_scores = bench(ours(64, 4, True))
            # SDPA on the same lengths (uniform, so padded = retained): [B, H, 1, d] vs [B, Hkv, L, d]
            kb = k.view(bsz, N_KV, budget, HEAD_DIM)
            vb = v.view(bsz, N_KV, budget, HEAD_DIM)
            qb = q.view(bsz, N_Q, 1, HEAD_DIM)
            t_sdpa = bench(lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True))
            t_ours_graph = bench_graph(ours(timing[True][1], timing[True][2], True))
            t_sdpa_graph = bench_graph(lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True))
            o_ref = F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True).view(bsz, N_Q, HEAD_DIM)
            o_ours = ours(64, 4, True)().o
            max_err = float((o_ours.float() - o_ref.float()).abs().max())
            t_fa = None
            if flash_attn_with_kvcache is not None:
                kf = kb.transpose(1, 2).contiguous()
                vf = vb.transpose(1, 2).contiguous()
                seqlens = torch.full((bsz,), budget, dtype=torch.int32, device=dev)
                qf = q.view(bsz, 1, N_Q, HEAD_DIM)
                t_fa = bench(lambda: flash_attn_with_kvcache(qf, kf, vf, cache_seqlens=seqlens))
                del kf, vf
            n_slots = n_heads * budget
            bytes_plain = attention_bytes(n_slots, HEAD_DIM, 2, g, scores=False)
            bytes_scores = attention_bytes(n_slots, HEAD_DIM, 2, g, scores=True, n_stats=2)
            t_plain, bn_p, w_p = timing[False]
            t_scores, bn_s, w_s = timing[True]
            row = dict(
                budget=budget, batch=bsz, n_q_heads=N_Q, n_kv_heads=N_KV, head_dim=HEAD_DIM, dtype="float16",
                t_ours_no_scores_s=t_plain, cfg_no_scores=[bn_p, w_p],
                t_ours_scores_s=t_scores, cfg_scores=[bn_s, w_s], t_ours_scores_default_cfg_s=default_scores,
                t_sdpa_s=t_sdpa, t_flash_attn_s=t_fa,
                ratio_scores_vs_sdpa=t_scores / t_sdpa, ratio_no_scores_vs_sdpa=t_plain / t_sdpa,
                t_ours_scores_graph_s=t_ours_graph, t_sdpa_graph_s=t_sdpa_graph,
                ratio_scores_vs_sdpa_graph=t_ours_graph / t_sdpa_graph,
                frac_peak_scores_graph=None if peak is None else bytes_scores / t_ours_graph / peak,
                ratio_scores_vs_flash_attn=None if t_fa is None else t_scores / t_fa,
                bytes_no_scores=bytes_plain, bytes_scores=bytes_scores,
                bw_no_scores=bytes_plain / t_plain, bw_scores=bytes_scores / t_scores,
                bw_sdpa=bytes_plain / t_sdpa,
                frac_peak_no_scores=None if peak is None else bytes_plain / t_plain / peak,
                frac_peak_scores=None if peak is None else bytes_scores / t_scores / peak,
                frac_copy_scores=bytes_scores / t_scores / copy_bw,
                max_abs_err_vs_sdpa=max_err,
            )
            rows.append(row)
            print(f"budget {budget:6d} batch {bsz:3d}: ours {t_scores * 1e6:8.1f} us (scores) "
                  f"{t_plain * 1e6:8.1f} us (plain), sdpa {t_sdpa * 1e6:8.1f} us, ratio {t_scores / t_sdpa:.2f}, "
                  f"bw {bytes_scores / t_scores / 1e12:.2f} TB/s", flush=True)
            del k, v, probs, acc, ema

    compaction = []
    for budget in budgets:
        bsz = batches[-1]
        n_heads = bsz * N_KV
        total = n_heads * (budget + 1)
        k = torch.randn(total, HEAD_DIM, dtype=torch.float16, device=dev)
        v = torch.randn_like(k)
        start = torch.arange(n_heads, device=dev, dtype=torch.int32) * (budget + 1)
        cap = torch.full((n_heads,), budget + 1, dtype=torch.int32, device=dev)
        length = torch.full((n_heads,), budget, dtype=torch.int32, device=dev)
        pos = torch.arange(total, device=dev)
        acc = torch.rand(total, device=dev)
        owner = slot_heads(start, cap, total)
        evict = start.long() + torch.randint(0, budget, (n_heads,), device=dev)
        keep = torch.ones(total, dtype=torch.bool, device=dev)
        keep[evict] = False
        merge_to = torch.full((total,), -1, dtype=torch.int32, device=dev)
        merge_to[evict] = ((evict - start.long() + 1) % budget).to(torch.int32)
        merge_w = torch.full((total,), 0.5, device=dev)
        kn = torch.randn(n_heads, 1, HEAD_DIM, dtype=torch.float16, device=dev)

        def step(merges):
            def fn():
                length.fill_(budget)
                extra = dict(merge_to=merge_to, merge_w=merge_w, slot_owner=owner) if merges else {}
                varlen_compact(k, v, start, length, cap, keep=keep, k_new=kn, v_new=kn, positions=pos, acc=acc,
                               check=False, **extra)
            return fn

        compaction.append(dict(budget=budget, batch=bsz, t_evict1_append1_s=bench(step(False)),
                               t_evict1_merge1_append1_s=bench(step(True))))
        del k, v

    result = dict(
        benchmark="kernels", device=name, torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), flash_attn_installed=flash_attn_with_kvcache is not None,
        peak_bandwidth_Bps=peak, peak_source=peak_source, copy_bandwidth_Bps=copy_bw,
        bytes_model=("no scores: retained K+V once; scores: + 12*G bytes/slot (logits written, read, probs "
                     "written) + 8 bytes/slot per statistic (acc, ema)"),
        timing=("median of triton.testing.do_bench (eager: includes Python launch overhead) and of "
                "do_bench_cudagraph (graph replay: GPU time only); compaction times include a length reset "
                "(one fill_ kernel) per call"),
        targets=dict(frac_peak_at_budget_ge_2k=0.75, time_ratio_vs_sdpa_with_scores=1.1),
        attention=rows, compaction=compaction,
        summary=dict(
            min_frac_peak_scores_budget_ge_2k=min(
                (r["frac_peak_scores"] for r in rows if r["budget"] >= 2048 and r["frac_peak_scores"] is not None),
                default=None),
            max_ratio_scores_vs_sdpa=max(r["ratio_scores_vs_sdpa"] for r in rows),
            max_ratio_scores_vs_sdpa_graph=max(r["ratio_scores_vs_sdpa_graph"] for r in rows),
        ),
    )
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
