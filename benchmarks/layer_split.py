"""One long trace across machines: the per-layer replay rate measured here, and the arithmetic for splitting a
Llama-3-8B trace of 128 k tokens by layer (``--split-layers``), extrapolated from it.

One measured run: the first layer group of a 30-way split of the SmolLM2-135M 8 192-token trace (layer 0), H2O
at budget 2 048, token by token, as a split worker replays it: its layer loaded from the memory-mapped float16
files (timed apart) and replayed on one thread. The replay time is scaled by the engine's work per step, which
is proportional to the slots held times query heads times head dimension (every held slot is scored by each
query head of its KV head and read back for the output, d multiply-adds each); the load time by the bytes of
a layer's float32 inputs. Every policy is assumed to cost what H2O costs (the engine's attention dominates; BUZZ,
D2O and expected attention cost more per step). The trace's size is the format's (README, Traces).

    python -m benchmarks.layer_split [--trace kvsim-out/long/smollm2-8k]   ->  benchmarks/results/layer_split.json
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from benchmarks._util import machine, write_result
from traces.format import ModelInfo

#: the extrapolation's target: Llama-3-8B's attention geometry, 128 k tokens
LLAMA = dict(model_id="Llama-3-8B", n_layers=32, n_q_heads=32, n_kv_heads=8, head_dim=128, hidden_size=4096)
TOKENS = 131_072
#: the sweep to finish in an hour: the long-context benchmark's policies at its budgets
SWEEP_POLICIES = 14
SWEEP_BUDGETS = (512, 2048)


def slot_steps(n_tokens: int, budget: int) -> int:
    """Slots attended over a replay of ``n_tokens`` tokens at ``budget``: sum over steps t of min(t + 1, budget)."""
    ramp = min(n_tokens, budget)
    return ramp * (ramp + 1) // 2 + (n_tokens - ramp) * budget


def stored_bytes_per_token(model, value_bytes: int = 2) -> int:
    """Bytes one layer of a trace stores per token: q, k, v at ``value_bytes`` plus the float32 lse and o."""
    hq, hkv, d = model.n_q_heads, model.n_kv_heads, model.head_dim
    return value_bytes * (hq + 2 * hkv) * d + 4 * (hq + hq * d)


def measure(trace_dir: str, budget: int) -> tuple[dict, ModelInfo]:
    """Time the load and the replay of layer 0 as the first group of a split into single layers (after loading
    the kernels); the record and the trace's geometry."""
    from policies import get_policy
    from sim.replay.layer_groups import layer_groups
    from sim.replay.layer_inputs import LayerLoader, load_layers
    from sim.replay.policy_replay import replay, replay_budgets
    from traces.format import load_trace
    from traces.synthetic import make_synthetic_trace

    policy = get_policy("h2o")
    replay(make_synthetic_trace("mixed", n_layers=1, n_tokens=64, n_prompt=16), policy, 8, threads=1)   # kernels
    trace = load_trace(trace_dir, verify=False)
    [first, *_] = layer_groups(trace, policy, [budget], trace.n_layers, inputs=LayerLoader(trace))
    load_avg = os.getloadavg()
    t0 = time.perf_counter()
    inputs = load_layers(trace, first.layers)          # layer 0: its index in this list is its layer index
    t1 = time.perf_counter()
    replay_budgets(trace, policy, [budget], inputs=inputs, group=first, threads=1)
    t2 = time.perf_counter()
    return {"trace": trace_dir, "model": trace.meta.model.model_id, "policy": "h2o", "budget": budget,
            "layers": list(first.layers), "n_tokens": trace.meta.n_tokens, "n_prompt": trace.meta.n_prompt,
            "load_s": t1 - t0, "replay_s": t2 - t1, "load_avg_before": load_avg, "load_avg_after": os.getloadavg(),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
            "stored_bytes_on_disk": sum(f.stat().st_size for f in Path(trace_dir).glob("layers/*/*.npy")
                                        if f.stem != "wo"),
            "stored_bytes_by_format": stored_bytes_per_token(trace.meta.model) * trace.meta.n_tokens * trace.n_layers
            }, trace.meta.model


def extrapolate(m: dict, small: ModelInfo) -> dict:
    """The 128 k-token Llama-3-8B figures from the measurement ``m`` on a trace of geometry ``small``."""
    from sim.replay.layer_inputs import layer_input_bytes

    big = ModelInfo(**LLAMA)
    slots = slot_steps(m["n_tokens"], m["budget"])
    per_unit = m["replay_s"] / (small.n_q_heads * small.head_dim * slots)        # per query head . dim . slot . step
    load_per_byte = m["load_s"] / layer_input_bytes(small, m["n_tokens"])

    def layer_seconds(budget: int) -> float:
        return (per_unit * big.n_q_heads * big.head_dim * slot_steps(TOKENS, budget)
                + load_per_byte * layer_input_bytes(big, TOKENS))

    per_layer = {b: layer_seconds(b) for b in SWEEP_BUDGETS}
    core_s = SWEEP_POLICIES * big.n_layers * sum(per_layer.values())
    return {
        "measured": m,
        "rate": {"ns_per_kv_head_slot_step": 1e9 * m["replay_s"] / (small.n_kv_heads * slots),
                 "ns_per_query_head_dim_slot_step": 1e9 * per_unit, "load_ns_per_input_byte": 1e9 * load_per_byte},
        "target": {**LLAMA, "n_tokens": TOKENS},
        "trace_gb": {"per_layer": stored_bytes_per_token(big) * TOKENS / 1e9,
                     "all_layers": stored_bytes_per_token(big) * TOKENS * big.n_layers / 1e9,
                     "wo_all_layers": 4 * big.hidden_size * big.n_q_heads * big.head_dim * big.n_layers / 1e9},
        "worker_memory_gb_per_layer": layer_input_bytes(big, TOKENS) / 1e9,
        "replay_s_per_layer": per_layer,
        "replay_h_per_configuration": {b: big.n_layers * s / 3600 for b, s in per_layer.items()},
        "sweep": {"policies": SWEEP_POLICIES, "budgets": list(SWEEP_BUDGETS),
                  "layer_jobs": SWEEP_POLICIES * len(SWEEP_BUDGETS) * big.n_layers, "core_hours": core_s / 3600,
                  "workers_for_one_hour": math.ceil(core_s / 3600)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(ROOT / "kvsim-out/long/smollm2-8k"))
    ap.add_argument("--budget", type=int, default=2048)
    args = ap.parse_args()
    out = extrapolate(*measure(args.trace, args.budget))
    out["machine"] = machine()
    print(write_result("layer_split", out))


if __name__ == "__main__":
    main()
