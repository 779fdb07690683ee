"""Simulator fidelity on the shipped model: `kvsim fidelity` with the settings of the committed results.

Writes benchmarks/results/fidelity_<device>.json and .png (device: cuda when available, else cpu; the CPU run
uses the torch backend, the cuda run the Triton kernels). Extra arguments are passed to `kvsim fidelity`.
"""
from __future__ import annotations

import sys



def main(argv: list[str]) -> int:
    import torch  # noqa: F401  (loaded first, so limit_threads caps its pool too)

    from benchmarks._util import RESULTS
    from gpu_validate.kvcache.backends import pick_device
    from gpu_validate.model_commands.fidelity_cmd import default_out
    from sim.cli import main as kvsim
    from sim.replay.threads import limit_threads

    limit_threads(1)   # one thread, through the API sweep workers use
    device, _ = pick_device(argv[argv.index("--device") + 1] if "--device" in argv[:-1] else None)
    return kvsim(["fidelity", "--model", "default", "--prompt", "128", "--decode", "160", "--budgets", "16,32,64",
                  "--open-steps", "16", "--out", str(RESULTS / default_out(device).name), *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
