"""Replay speed: numba engine vs the plain-numpy reference, side by side in one process.

Reports head-steps per second (one KV head advanced by one decode step, all its query heads included),
the speed-up over the reference (target >= 50x), and the fraction of this machine's measured copy
bandwidth that the engine's reads of retained keys and values amount to.
Run: python benchmarks/replay.py   (writes benchmarks/results/replay.json)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks._util import best_time, copy_bandwidth, machine, write_result  # noqa: E402
from policies import get_policy  # noqa: E402
from sim.reference_replay import reference_replay_layer  # noqa: E402
from sim.replay import load_layers, replay  # noqa: E402
from traces.synthetic import make_synthetic_trace  # noqa: E402


def main() -> None:
    T, P, layers, hq, hkv, d, budget = 2048, 256, 2, 8, 2, 64, 256
    trace = make_synthetic_trace("mixed", n_tokens=T, n_prompt=P, n_layers=layers, n_q_heads=hq, n_kv_heads=hkv,
                                 head_dim=d, seed=0)
    inputs = load_layers(trace)
    head_steps = layers * hkv * (T - P)
    bw = copy_bandwidth()
    rows = []
    for name in ("window", "h2o", "tova"):
        pol = get_policy(name)
        replay(trace, pol, budget, inputs=inputs, threads=1)                     # compile / load cache
        t_engine = best_time(lambda: replay(trace, pol, budget, inputs=inputs, threads=1))
        t_engine2 = best_time(lambda: replay(trace, pol, budget, inputs=inputs, threads=2))
        budgets = np.full(hkv, budget, np.int64)
        t_ref = best_time(lambda: [reference_replay_layer(pol, l, inputs[l], budgets, P, trace.meta.softmax_scale)
                                   for l in range(layers)], repeat=1)
        # bytes the engine must read per head-step: retained keys and values (float32), ~budget+1 slots
        bytes_read = head_steps * (budget + 1) * d * 4 * 2
        rows.append(dict(policy=name, engine_s=t_engine, engine_2threads_s=t_engine2, reference_s=t_ref,
                         head_steps=head_steps, engine_head_steps_per_s=head_steps / t_engine,
                         engine_2threads_head_steps_per_s=head_steps / t_engine2,
                         reference_head_steps_per_s=head_steps / t_ref, speedup=t_ref / t_engine,
                         kv_read_bytes_per_s=bytes_read / t_engine,
                         fraction_of_copy_bandwidth=bytes_read / t_engine / bw))
        print(f"{name:8s} engine {head_steps / t_engine:10.0f} head-steps/s  reference {head_steps / t_ref:8.0f}"
              f"  speed-up {t_ref / t_engine:6.1f}x  KV reads {bytes_read / t_engine / 1e9:5.2f} GB/s"
              f" = {bytes_read / t_engine / bw:.1%} of copy bandwidth")
    path = write_result("replay", dict(
        benchmark="replay", machine=machine(), copy_bandwidth_bytes_per_s=bw, target_speedup=50,
        config=dict(n_tokens=T, n_prompt=P, n_layers=layers, n_q_heads=hq, n_kv_heads=hkv, head_dim=d,
                    budget=budget), results=rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
