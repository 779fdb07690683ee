"""Needle retrieval on SmolLM2-135M, closed loop on CPU (torch backend), with the simulator's prediction:
`kvsim needle` with the settings of the committed results (benchmarks/results/needle.json and .png).

    python -m benchmarks.needle [--model smollm2-135m] [extra `kvsim needle` arguments]

The grid was sized for a shared 2-core machine (see the JSON for what ran); the store is resumable, so a
larger grid (more --lengths / --seeds) adds only the missing cells.
"""
from __future__ import annotations

import sys


POLICIES = ("streaming_llm;h2o;tova;snapkv;pyramidkv;ada_snapkv;bumblebee;buzz;knorm;"
            "expected_attention:rope_theta=100000")   # SmolLM2's RoPE base


def main(argv: list[str]) -> int:
    import torch  # noqa: F401  (loaded first, so limit_threads caps its pool too)

    from sim.cli import main as kvsim
    from sim.replay.threads import limit_threads

    limit_threads(1)   # one thread, through the API sweep workers use
    model = "smollm2-135m"
    if "--model" in argv:
        i = argv.index("--model")
        model = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    return kvsim(["needle", "--model", model, "--lengths", "256,512,1024", "--depths", "0,0.25,0.5,0.75,1",
                  "--seeds", "1,2,3", "--budgets", "64,128", "--policies", POLICIES, "--predict",
                  "--train-seeds", "1", "--store", "results/needle", "--out", "benchmarks/results/needle.json",
                  *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
