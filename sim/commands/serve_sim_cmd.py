"""`kvsim serve-sim`: throughput and latency a policy's KV footprint buys on a GPU, joined with its quality loss."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sim.commands._common import (DefaultsHelpFormatter, add_budgets_option, add_out_option, add_policies_option,
                                  add_quiet_option)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``serve-sim`` subcommand; its handler is ``args.func(args) -> int``."""
    from sim.serving.fit import KERNEL_VARIANTS      # small constant tables only: the simulator loads in main()
    from sim.serving.footprint import ACCOUNTING, PREFILL_PEAK
    from sim.serving.hardware import GPUS, MODELS

    p = subparsers.add_parser("serve-sim", help="serving DES: throughput/latency per policy and budget",
                              description=__doc__, formatter_class=DefaultsHelpFormatter)
    add_policies_option(p, default="full;streaming_llm")
    add_budgets_option(p, default=[256, 1024])
    p.add_argument("--model", default="llama-2-7b", choices=sorted(MODELS), help="model memory preset")
    p.add_argument("--gpu", default="h100-sxm", choices=sorted(GPUS), help="GPU profile preset")
    p.add_argument("--arrivals", default="poisson", choices=("poisson", "bursty", "csv"),
                   help="arrival process, or csv replay")
    p.add_argument("--trace-csv", type=Path, help="CSV with arrival_s,prompt_tokens,output_tokens (--arrivals csv)")
    p.add_argument("--rate", type=float, default=10.0, help="mean arrivals per second")
    p.add_argument("--requests", type=int, default=2000, help="requests to generate")
    p.add_argument("--burstiness", type=float, default=4.0, help="squared CV of inter-arrival times (bursty)")
    p.add_argument("--prompt-mean", type=float, default=1024, help="mean prompt tokens (lognormal)")
    p.add_argument("--prompt-cv", type=float, default=0.5, help="coefficient of variation of prompt tokens")
    p.add_argument("--output-mean", type=float, default=256, help="mean output tokens (lognormal)")
    p.add_argument("--output-cv", type=float, default=0.5, help="coefficient of variation of output tokens")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--accounting", default="varlen", choices=ACCOUNTING,
                   help="varlen: exact slots per head; block: paged blocks of --block-size slots")
    p.add_argument("--block-size", type=int, default=16, help="slots per block (block accounting)")
    p.add_argument("--prefill-peak", default="full", choices=PREFILL_PEAK,
                   help="full: prompt KV fully materialised before compression")
    p.add_argument("--max-batch", type=int, default=256, help="max requests running at once")
    p.add_argument("--max-batched-tokens", type=int, default=8192, help="max prompt tokens per prefill iteration")
    p.add_argument("--memory-utilization", type=float, default=0.9,
                   help="share of GPU memory for weights + KV pool (vLLM convention)")
    p.add_argument("--pool-gb", type=float, help="KV pool in GB (overrides memory-utilization)")
    p.add_argument("--kernel-timings", type=Path, default=None, metavar="FILE",
                   help="fit the attention costs to measured kernel timings: a JSON of records (device, bytes, "
                        "time_s) or the output of `python -m benchmarks.kernels` on your GPU (in a kvsim checkout: "
                        "benchmarks/results/kernels.json, measured on an H200). Without it the costs are the "
                        "--gpu preset's datasheet bandwidth and peak")
    p.add_argument("--kernel-device", default=None, help="use only timings of this device")
    p.add_argument("--kernel-variant", default="scores", choices=sorted(KERNEL_VARIANTS),
                   help="which kernel of a benchmarks/kernels.py file to fit")
    p.add_argument("--kernel-calls-per-step", type=int, default=None,
                   help="attention kernel launches per decode iteration (default: one per model layer)")
    p.add_argument("--aggregate-steps", type=int, default=1024,
                   help="max decode iterations per event while the batch is unchanged (1 = one per iteration)")
    p.add_argument("--quality", type=Path, help="sweep results store (directory) or Parquet to join on policy+budget")
    add_out_option(p, "kvsim-out/serve-sim", "output directory")
    add_quiet_option(p)
    p.set_defaults(func=main)
    return p


def build_cases(policies: str, budgets: list[int]) -> list:
    """Cross ';'-separated policy specs with budgets; an unbounded policy appears once."""
    from sim.serving.footprint import policy_footprint
    from sim.serving.grid import ServingCase
    from sim.serving.hardware import ServingConfigError
    from sim.experiments.specs import parse_policy, split_policy_list

    cases = []
    for spec in split_policy_list(policies):
        policy = parse_policy(spec)
        for b in budgets:
            fp, label, used = policy_footprint(policy, b)
            cases.append(ServingCase(policy.name, used, label, fp, policy.label(), dict(policy.params)))
            if used is None:
                break
    if not cases:
        raise ServingConfigError(f"no policies in {policies!r}")
    return cases


def _kernel_costs(args: argparse.Namespace, cost, n_layers: int) -> tuple[Any, dict | None]:
    """The cost model with its attention terms fitted to ``--kernel-timings`` (a missing or unusable file is a
    `KernelTimingError` naming it), or unchanged without that option."""
    from sim.serving.fit import KernelTimingError, fit_kernel_timings, load_kernel_timings

    if args.kernel_timings is None:
        return cost, None
    timings = args.kernel_timings
    records = load_kernel_timings(timings, args.kernel_variant)      # its errors name the file
    try:
        fit = fit_kernel_timings(records, device=args.kernel_device)
    except KernelTimingError as e:
        raise KernelTimingError(f"{timings}: {e}") from None
    cost = cost.with_kernel_fit(fit, calls_per_step=args.kernel_calls_per_step or n_layers)
    return cost, {"file": str(timings), "variant": args.kernel_variant, "intercept_s": fit.intercept_s,
                  "bandwidth_Bps": fit.bandwidth, "r2": fit.r2, "records": fit.n_records}


def main(args: argparse.Namespace) -> int:
    """Run the grid, print a table, write CSV/JSON and PNG plots under ``--out``."""
    from sim.serving.costs import CostModel
    from sim.serving.grid import run_grid
    from sim.serving.hardware import ServingConfigError, get_gpu, get_model
    from sim.serving.plots import latency_cdf, throughput_vs_budget
    from sim.serving.quality import QUALITY_COLUMNS, join_quality, load_quality
    from sim.serving.scheduler import SchedulerConfig, kv_pool_bytes
    from sim.serving.workload import bursty_workload, load_csv_workload, poisson_workload
    from traces.format import atomic_write_text

    model, gpu = get_model(args.model), get_gpu(args.gpu)
    if args.arrivals == "csv":
        if args.trace_csv is None:
            raise ServingConfigError("--arrivals csv needs --trace-csv FILE")
        workload = load_csv_workload(args.trace_csv)
    else:
        make = poisson_workload if args.arrivals == "poisson" else bursty_workload
        extra: dict[str, Any] = {"burstiness": args.burstiness} if args.arrivals == "bursty" else {}
        workload = make(args.requests, args.rate, prompt_mean=args.prompt_mean, prompt_cv=args.prompt_cv,
                        output_mean=args.output_mean, output_cv=args.output_cv, seed=args.seed, **extra)
    quality = load_quality(args.quality) if args.quality is not None else None
    cost = CostModel.from_profile(model, gpu)
    cost, fit_info = _kernel_costs(args, cost, model.n_layers)
    pool = int(args.pool_gb * 1e9) if args.pool_gb else kv_pool_bytes(model, gpu, args.memory_utilization)
    config = SchedulerConfig(pool_bytes=pool, max_batch=args.max_batch, max_batched_tokens=args.max_batched_tokens,
                             aggregate_steps=args.aggregate_steps)
    cases = build_cases(args.policies, args.budgets)
    bar = None
    if not args.quiet:
        from tqdm import tqdm
        bar = tqdm(total=len(cases) * len(workload), unit="req", desc="serve-sim")
    try:
        df, curves = run_grid(cases, workload, model, cost, config, accounting=args.accounting,
                              block_size=args.block_size, prefill_peak=args.prefill_peak,
                              progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    quality_col = None
    if quality is not None:
        df = join_quality(df, quality)
        quality_col = next((c for c in QUALITY_COLUMNS if c in df.columns and df[c].notna().any()), None)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "serving.csv", df.to_csv(index=False))
    meta = {"model": model.name, "gpu": gpu.name, "cost_model": cost.source, "kernel_fit": fit_info,
            "pool_bytes": pool, "requests": len(workload), "arrivals": args.arrivals,
            "rows": json.loads(df.to_json(orient="records"))}
    atomic_write_text(args.out / "serving.json", json.dumps(meta, indent=2))
    latency_cdf(curves, args.out / "latency_cdf.png")
    throughput_vs_budget(df, args.out / "throughput_vs_budget.png", quality_col=quality_col)
    _print_table(df, quality_col)
    print(f"wrote {args.out}/serving.csv, serving.json, latency_cdf.png, throughput_vs_budget.png")
    return 0


def _print_table(df, quality_col: str | None) -> None:
    import numpy as np
    import pandas as pd
    from rich.console import Console
    from rich.table import Table

    cols = [("label", "policy@budget", str), ("throughput_rps", "req/s", "{:.2f}".format),
            ("output_tokens_per_s", "tok/s", "{:.0f}".format), ("mean_running", "concurrent", "{:.1f}".format),
            ("ttft_p50_s", "TTFT p50 ms", lambda v: f"{v * 1e3:.0f}"),
            ("tpot_p50_s", "TPOT p50 ms", lambda v: f"{v * 1e3:.1f}"),
            ("e2e_p99_s", "E2E p99 s", "{:.2f}".format), ("memory_utilization", "mem util", "{:.0%}".format),
            ("preemptions", "preempt", str), ("rejected", "rejected", str)]
    if quality_col:
        cols.append((quality_col, quality_col, lambda v: "n/a" if pd.isna(v) else f"{v:.4f}"))
    table = Table(title="serve-sim")
    for _, head, _ in cols:
        table.add_column(head, justify="right")
    for _, row in df.iterrows():
        table.add_row(*[fmt(row[c]) if not (isinstance(row[c], float) and np.isnan(row[c]) and c != quality_col)
                        else "n/a" for c, _, fmt in cols])
    console = Console()
    if not console.is_terminal:
        console = Console(width=170)
    console.print(table)
