"""Simulator fidelity on the shipped model: `kvsim fidelity` with the settings of the committed results.

Writes benchmarks/results/fidelity_<device>.json and .png (device: cuda when available, else cpu; the CPU run
uses the torch backend, the cuda run the Triton kernels). Extra arguments are passed to `kvsim fidelity`.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")


def main(argv: list[str]) -> int:
    import torch

    from sim.cli import main as kvsim

    torch.set_num_threads(1)
    return kvsim(["fidelity", "--model", "default", "--prompt", "128", "--decode", "160", "--budgets", "16,32,64",
                  "--open-steps", "16", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
