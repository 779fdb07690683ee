"""Varlen decode attention (with scores) and compaction on a CUDA GPU, vs torch SDPA side by side in one process.

For each (budget, batch) of a Llama-3-8B-like layer (32 query heads, 8 KV heads, d=128, fp16): our kernel
with and without score output (best of a few tile configs), torch SDPA (GQA) and, when installed,
FlashAttention's `flash_attn_with_kvcache` on the same retained lengths (uniform, so padded = retained);
achieved bandwidth = minimum bytes moved / median time, as a fraction of the device's datasheet HBM peak
and of a measured device-to-device copy; what the closed loop runs (probabilities, no statistics) as graph
replays at the default and twice the default split count; plus compaction costs (one eviction + one append per
head, with and without a D2O-style merge). Targets: >= 75% of peak at budget >= 2k, <= 1.1x SDPA's time with scores.
Run: python -m benchmarks.kernels [--quick]   (writes benchmarks/results/kernels.json; needs a CUDA device)
     python -m benchmarks.kernels --interpret-smoke   (tiny CPU correctness pass, writes no numbers)
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any


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
LAYER = dict(n_q=32, n_kv=8, head_dim=128)
BUDGETS = [256, 512, 1024, 2048, 4096, 8192, 16384]
BATCHES = [1, 4, 16, 64]
CONFIGS = [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8)]  # (block_n, num_warps) tried per shape
DEFAULT_CONFIG = (64, 4)


def peak_for(name: str) -> tuple[float | None, str]:
    """Datasheet HBM peak for a device name, with its source."""
    for key, peak, source in PEAK_BANDWIDTH:
        if key in name:
            return peak, source
    return None, "unknown device: no datasheet peak in the table; see copy_bandwidth_Bps"


def measure(device: str, *, bench: Callable[[Callable[[], Any]], float],
            bench_graph: Callable[[Callable[[], Any]], float], budgets: list[int], batches: list[int],
            configs: list[tuple[int, int]], n_q: int, n_kv: int, head_dim: int, copy_bytes: int,
            peak: float | None) -> dict[str, Any]:
    """All timings for one device; `bench(fn)` returns seconds per call. Returns the JSON-ready payload body."""
    import torch
    import torch.nn.functional as F

    from gpu_validate.kvcache.kernels.attention import attention_bytes, choose_splits, varlen_decode_attention

    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None

    torch.manual_seed(0)
    dev = torch.device(device)
    # the device-to-device copy's bandwidth (read + write of copy_bytes): what a memory-bound kernel can reach here;
    # both buffers are freed before the attention shapes are allocated
    big = torch.empty(copy_bytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(big)
    copy_bw = 2 * copy_bytes / bench(lambda dst=dst, big=big: dst.copy_(big))
    del big, dst
    g, d, dt = n_q // n_kv, head_dim, torch.float16
    rows = []
    for budget in budgets:
        for bsz in batches:
            n_heads = bsz * n_kv
            k = torch.randn(n_heads * budget, d, dtype=dt, device=dev)
            v = torch.randn_like(k)
            start = torch.arange(n_heads, device=dev, dtype=torch.int32) * budget
            length = torch.full((n_heads,), budget, dtype=torch.int32, device=dev)
            q = torch.randn(bsz, n_q, d, dtype=dt, device=dev)
            probs = torch.empty(n_heads * budget, g, dtype=torch.float32, device=dev)
            acc = torch.zeros(n_heads * budget, dtype=torch.float32, device=dev)
            ema = torch.zeros_like(acc)

            def ours(cfg, scores, q=q, k=k, v=v, start=start, length=length, probs=probs, acc=acc, ema=ema,
                     budget=budget):
                kw = dict(probs=probs, want_probs=True, acc=acc, ema=ema) if scores else dict(want_probs=False)
                return lambda: varlen_decode_attention(q, k, v, start, length, max_len=budget, block_n=cfg[0],
                                                       num_warps=cfg[1], **kw)

            best = {s: min((bench(ours(cfg, s)), cfg) for cfg in configs) for s in (False, True)}
            t_default = bench(ours(DEFAULT_CONFIG, True))
            kb, vb = k.view(bsz, n_kv, budget, d), v.view(bsz, n_kv, budget, d)
            qb = q.view(bsz, n_q, 1, d)

            def sdpa(qb=qb, kb=kb, vb=vb):
                return F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)

            t_sdpa = bench(sdpa)
            t_ours_graph = bench_graph(ours(best[True][1], True))
            t_sdpa_graph = bench_graph(sdpa)
            # what the closed loop runs: probabilities, no statistics, at the default split count and at twice it
            # (more programs in flight at small batch), as graph replays
            bn, nw = best[True][1]
            splits0 = choose_splits(n_heads, budget, bn, dev)

            def probs_only(splits, q=q, k=k, v=v, start=start, length=length, probs=probs, budget=budget, bn=bn,
                           nw=nw):
                return lambda: varlen_decode_attention(q, k, v, start, length, max_len=budget, block_n=bn,
                                                       num_warps=nw, probs=probs, num_splits=splits)

            t_probs = {sp: bench_graph(probs_only(sp)) for sp in (splits0, 2 * splits0)}
            t_probs_best, splits_best = min((t, sp) for sp, t in t_probs.items())
            max_err = float((ours(DEFAULT_CONFIG, True)().o.float() - sdpa().view(bsz, n_q, d).float()).abs().max())
            t_fa = None
            if flash_attn_with_kvcache is not None:
                kf, vf = kb.transpose(1, 2).contiguous(), vb.transpose(1, 2).contiguous()
                seqlens = torch.full((bsz,), budget, dtype=torch.int32, device=dev)
                qf = q.view(bsz, 1, n_q, d)
                t_fa = bench(lambda: flash_attn_with_kvcache(qf, kf, vf, cache_seqlens=seqlens))
                del kf, vf
            n_slots = n_heads * budget
            b_plain = attention_bytes(n_slots, d, 2, g, scores=False)
            b_scores = attention_bytes(n_slots, d, 2, g, scores=True, n_stats=2)
            (t_plain, cfg_plain), (t_scores, cfg_scores) = best[False], best[True]
            frac = (lambda b, t: None) if peak is None else (lambda b, t: b / t / peak)
            rows.append(dict(
                budget=budget, batch=bsz, n_q_heads=n_q, n_kv_heads=n_kv, head_dim=d, dtype="float16",
                t_ours_no_scores_s=t_plain, cfg_no_scores=list(cfg_plain), t_ours_scores_s=t_scores,
                cfg_scores=list(cfg_scores), t_ours_scores_default_cfg_s=t_default, t_sdpa_s=t_sdpa,
                t_flash_attn_s=t_fa, t_ours_scores_graph_s=t_ours_graph, t_sdpa_graph_s=t_sdpa_graph,
                ratio_scores_vs_sdpa=t_scores / t_sdpa, ratio_no_scores_vs_sdpa=t_plain / t_sdpa,
                ratio_scores_vs_sdpa_graph=t_ours_graph / t_sdpa_graph,
                ratio_scores_vs_flash_attn=None if t_fa is None else t_scores / t_fa,
                bytes_no_scores=b_plain, bytes_scores=b_scores, bw_no_scores_Bps=b_plain / t_plain,
                bw_scores_Bps=b_scores / t_scores, bw_sdpa_Bps=b_plain / t_sdpa,
                frac_peak_no_scores=frac(b_plain, t_plain), frac_peak_scores=frac(b_scores, t_scores),
                frac_peak_scores_graph=frac(b_scores, t_ours_graph), frac_copy_scores=b_scores / t_scores / copy_bw,
                max_abs_err_vs_sdpa=max_err,
                t_ours_probs_graph_s=t_probs_best, probs_splits=splits_best, default_splits=splits0,
                ratio_probs_vs_sdpa_graph=t_probs_best / t_sdpa_graph,
            ))
            print(f"budget {budget:6d} batch {bsz:3d}: graph replay: probs {t_probs_best * 1e6:7.1f} us "
                  f"({splits_best} splits), sdpa {t_sdpa_graph * 1e6:7.1f} us", flush=True)
            print(f"budget {budget:6d} batch {bsz:3d}: ours {t_scores * 1e6:8.1f} us with scores, "
                  f"{t_plain * 1e6:8.1f} us without; sdpa {t_sdpa * 1e6:8.1f} us; ratio {t_scores / t_sdpa:.2f}; "
                  f"{b_scores / t_scores / 1e9:.0f} GB/s", flush=True)
            del k, v, probs, acc, ema
    return dict(copy_bandwidth_Bps=copy_bw, flash_attn_installed=flash_attn_with_kvcache is not None,
                attention=rows, compaction=_compaction(dev, bench, budgets, batches[-1], n_kv, d))


def _compaction(dev, bench, budgets: list[int], bsz: int, n_kv: int, d: int) -> list[dict[str, Any]]:
    """One eviction at a random slot + one append per head, with and without merging the evicted slot."""
    import torch

    from gpu_validate.kvcache.kernels.compaction import slot_heads, varlen_compact

    out = []
    for budget in budgets:
        n_heads = bsz * n_kv
        cap_each = budget + 1
        total = n_heads * cap_each
        k = torch.randn(total, d, dtype=torch.float16, device=dev)
        v = torch.randn_like(k)
        start = torch.arange(n_heads, device=dev, dtype=torch.int32) * cap_each
        cap = torch.full((n_heads,), cap_each, dtype=torch.int32, device=dev)
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
        new = torch.randn(n_heads, 1, d, dtype=torch.float16, device=dev)

        def step(merges, k=k, v=v, start=start, length=length, cap=cap, keep=keep, new=new, pos=pos, acc=acc,
                 merge_to=merge_to, merge_w=merge_w, owner=owner, budget=budget):
            extra = dict(merge_to=merge_to, merge_w=merge_w, slot_owner=owner) if merges else {}

            def fn():
                length.fill_(budget)
                varlen_compact(k, v, start, length, cap, keep=keep, k_new=new, v_new=new, positions=pos, acc=acc,
                               check=False, **extra)
            return fn

        out.append(dict(budget=budget, batch=bsz, n_kv_heads=n_kv, head_dim=d,
                        t_evict1_append1_s=bench(step(False)), t_evict1_merge1_append1_s=bench(step(True))))
        del k, v
    return out


def interpret_smoke() -> int:
    """Tiny correctness pass on CPU under the Triton interpreter; prints, writes nothing."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from gpu_validate.kvcache.kernels.attention import varlen_decode_attention
    from gpu_validate.kvcache.kernel_reference import ref_decode_attention

    torch.manual_seed(0)
    start = torch.tensor([0, 64], dtype=torch.int32)
    length = torch.tensor([40, 17], dtype=torch.int32)
    k, v = torch.randn(128, 64).half(), torch.randn(128, 64).half()
    q = torch.randn(1, 4, 64).half()
    out = varlen_decode_attention(q, k, v, start, length, max_len=64, num_splits=2)
    ref = ref_decode_attention(q, k, v, start, length, softmax_scale=64**-0.5)
    err = float((out.o.float() - ref.o.float()).abs().max())
    print(f"interpret smoke: max |o - ref| = {err:.2e} (no timings: those need a CUDA device)")
    return 0 if err < 2e-3 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="budgets {256, 2048, 16384} x batches {1, 16}")
    ap.add_argument("--interpret-smoke", action="store_true", help="CPU correctness pass only, no numbers")
    args = ap.parse_args(argv)
    if args.interpret_smoke:
        return interpret_smoke()
    import torch

    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("benchmarks/kernels.py needs a CUDA device (and TRITON_INTERPRET unset); refusing to produce numbers. "
              "Use --interpret-smoke for a CPU correctness pass.", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    from benchmarks._util import machine, write_result

    name = torch.cuda.get_device_name()
    peak, peak_source = peak_for(name)
    budgets, batches = ([256, 2048, 16384], [1, 16]) if args.quick else (BUDGETS, BATCHES)
    body = measure(
        "cuda", bench=lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3,
        bench_graph=lambda fn: do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3,
        budgets=budgets, batches=batches, configs=CONFIGS, copy_bytes=1 << 30, peak=peak, **LAYER,
    )
    at_2k = [r["frac_peak_scores"] for r in body["attention"] if r["budget"] >= 2048 and r["frac_peak_scores"]]
    path = write_result("kernels", dict(
        benchmark="kernels", device=name, machine=machine(), torch=torch.__version__, triton=triton.__version__,
        peak_bandwidth_Bps=peak, peak_source=peak_source,
        bytes_model=("no scores: retained K+V once; scores: + 12*G bytes/slot (logits written and read back, "
                     "probs written) + 8 bytes/slot per statistic (acc, ema)"),
        timing=("median of triton.testing.do_bench (eager: includes Python launch overhead) and of "
                "do_bench_cudagraph (graph replay: GPU time only); compaction times include one length-reset "
                "fill_ kernel per call"),
        targets=dict(frac_peak_at_budget_ge_2k=0.75, time_ratio_vs_sdpa_with_scores=1.1,
                     probs_graph_ratio_vs_sdpa_graph_budget_ge_2k=1.3),
        summary=dict(
            min_frac_peak_scores_budget_ge_2k=min(at_2k, default=None),
            max_ratio_scores_vs_sdpa=max(r["ratio_scores_vs_sdpa"] for r in body["attention"]),
            max_ratio_scores_vs_sdpa_graph=max(r["ratio_scores_vs_sdpa_graph"] for r in body["attention"]),
            max_ratio_probs_vs_sdpa_graph_budget_ge_2k=max(
                (r["ratio_probs_vs_sdpa_graph"] for r in body["attention"] if r["budget"] >= 2048), default=None),
        ),
        **body,
    ))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
