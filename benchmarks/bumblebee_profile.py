"""Where BumbleBee's prompt selection spends its time at length, on a recorded trace: the profile behind its replay
against its closed loop (benchmarks/long_context.py), which both run this selection.

For one KV head of the chosen layers (default: Gemma-3-270M's 32 k-token trace, its first global layer), with the
layer's real prompt importance (``prompt_attention``, the paper's default group reduction) and the forced recent
window of each budget:

- ``greedy``: the exact lazy greedy beyond FULL_MATRIX_MAX (``greedy_select_keys``) at the default column cache and
  at 2x and 4x it: seconds, gain evaluations, and similarity columns computed, in units of P (round 0 computes
  every candidate's column once: 1 P; the rest are later rounds' cache misses);
- ``cosines``: the column kernel's throughput (``cosines_into``, the per-element FMA chain that keeps the bounded
  path's cosines bitwise equal to the full matrix's) against the BLAS SGEMM of the same rows, in GFLOP/s, and
  whether their results were bitwise equal here.

So the closed loop's share of this work, and what a faster column kernel or a larger cache could buy, are measured
rather than guessed. Run alone on a quiet machine:

    python -m benchmarks.bumblebee_profile [--trace DIR] [--layers 5] [--budgets 512,2048]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks._util import machine, model_name, write_result

DEFAULT_TRACE = "kvsim-out/long/gemma3-32k"     # benchmarks/long_context.py's recording


def _greedy(uT, m, budget, recent, cache_cols) -> dict:
    from policies._bumblebee_greedy import greedy_select_keys

    n = uT.shape[1]
    forced = np.zeros(n, np.uint8)
    forced[n - recent:] = 1
    t0 = time.perf_counter()
    sel, evals, computed = greedy_select_keys(uT, m, budget, forced, 0.3, 0, 0.04, 1.0, True, 0, cache_cols)
    return {"seconds": time.perf_counter() - t0, "gain_evaluations": int(evals), "columns": int(computed),
            "columns_per_prompt_key": computed / n, "picks": int(len(sel))}


def _cosines(uT, rows: int = 16, repeat: int = 2048) -> dict:
    """GFLOP/s of the FMA-chain column kernel and of SGEMM on the same ``repeat`` rows, ``rows`` at a time."""
    from policies._bumblebee_similarity import COL_W, cosines_into

    d, n = uT.shape
    u = np.ascontiguousarray(uT.T)
    items = np.arange(rows)
    blk, acc = np.empty((rows, n), np.float32), np.empty((rows, COL_W), np.float32)
    cosines_into(uT, items, rows, blk, np.arange(rows), acc)             # compiled before timing
    t0 = time.perf_counter()
    for s in range(0, repeat, rows):
        items[:] = np.arange(s, s + rows)
        cosines_into(uT, items, rows, blk, np.arange(rows), acc)
    fma = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s in range(0, repeat, rows):
        gemm = u[s:s + rows] @ uT
    sgemm = time.perf_counter() - t0
    flops = 2.0 * repeat * n * d
    return {"rows_per_call": rows, "fma_chain_gflops": flops / fma / 1e9, "sgemm_gflops": flops / sgemm / 1e9,
            "bitwise_equal": bool(np.array_equal(gemm, blk))}


def main(argv: list[str] | None = None) -> int:
    from policies.core.shared_kernels import GROUP_REDUCE, prompt_attention
    from policies._bumblebee_greedy import default_cache_columns
    from policies._bumblebee_similarity import unit_keys_t
    from policies.core.scorer import recent_slots
    from traces.format import load_trace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--layers", default="5", help="comma-separated layer indices (default: Gemma-3's first global)")
    ap.add_argument("--budgets", default="512,2048")
    ap.add_argument("--cache-factors", default="1,2,4", help="column caches as multiples of the default")
    args = ap.parse_args(argv)
    trace = load_trace(args.trace, verify=False)
    P = trace.meta.n_prompt
    rows = []
    for li in (int(x) for x in args.layers.split(",")):
        la = trace.layer(li)
        q = np.ascontiguousarray(la.q[:P], np.float32)
        k = np.ascontiguousarray(la.k[:P], np.float32)
        scale = float(trace.meta.attention(li).scale)
        t0 = time.perf_counter()
        m = prompt_attention(q, k, scale, GROUP_REDUCE.index("mean"))[0]
        importance_s = time.perf_counter() - t0
        uT = unit_keys_t(k[:, 0, :])
        default_cols = default_cache_columns(P)
        row = {"layer": li, "n_prompt": P, "head_dim": int(k.shape[2]), "importance_seconds": importance_s,
               "cosines": _cosines(uT), "greedy": []}
        for b in (int(x) for x in args.budgets.split(",")):
            recent = int(recent_slots(b, 0.5))
            for f in (int(x) for x in args.cache_factors.split(",")):
                g = _greedy(uT, m, b, recent, default_cols * f)
                row["greedy"].append({"budget": b, "cache_columns": default_cols * f,
                                      "cache_mib": default_cols * f * 4 * P / 2**20, **g})
                print(f"layer {li} budget {b} cache x{f}: {g['seconds']:.1f} s, {g['columns_per_prompt_key']:.2f} P "
                      f"columns, {g['gain_evaluations']} gains", flush=True)
        rows.append(row)
        print(f"layer {li}: importance {importance_s:.1f} s; cosines {row['cosines']}", flush=True)
    path = write_result("bumblebee_profile", {"trace": args.trace, "model": model_name(trace), "layers": rows,
                                              "machine": machine(), "load_avg_1min": os.getloadavg()[0]})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
