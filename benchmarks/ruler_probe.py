"""What the full model can do: full-cache accuracy of the RULER-style tasks per prompt format, task and length.

    python benchmarks/ruler_probe.py --model gemma3-270m --tasks passkey,multikey --lengths 1024,4096 \
        --formats x2k0,x2k1 --depths 0,0.5,1 --seeds 1,2

A format ``xRkK`` writes each needle line R times (``--repeats``) and puts K worked examples before the haystack
(``--shots``, `gpu_validate.tasks.with_examples`). Every prompt goes through the model closed loop with the full
cache (`gpu_validate.needle.run_needle`, the same path as `kvsim needle`'s full-cache row), into a resumable store
(results/ruler-probe-<model>); the accuracy per (format, task, length), the wall time per prompt and, for every
failure, what the model wrote go to benchmarks/results/ruler_probe_<model>.json. `benchmarks/ruler.py` takes its
grid (format, lengths) from what this measures: a (task, length) cell is run only where the full cache reaches
the issue's 0.9.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python benchmarks/ruler_probe.py` from the root


def parse_format(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"x(\d+)k(\d+)", text.strip())
    if not m or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"a format is xRkK (R needle repeats >= 1, K worked examples), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def main(argv: list[str]) -> int:
    import torch

    from benchmarks._util import RESULTS, machine, write_result
    from gpu_validate.needle import make_grid, run_needle
    from policies.registry import get_policy
    from sim.commands._common import int_list
    from sim.store import ResultStore
    from traces.model import read_text
    from traces.models import load_model, model_id as name_of

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--text", default="default+idle")
    ap.add_argument("--tasks", default="passkey,multikey,multivalue,vartrack")
    ap.add_argument("--lengths", type=int_list, default=[1024, 4096])
    ap.add_argument("--formats", default="x2k0,x2k1", help="comma-separated xRkK formats")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--seeds", type=int_list, default=[1, 2])
    args = ap.parse_args(argv)
    formats = [parse_format(f) for f in args.formats.split(",") if f.strip()]
    depths = [float(d) for d in args.depths.split(",")]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]

    torch.set_grad_enabled(False)
    model, tok = load_model(args.model, device="cpu")
    model_id = name_of(args.model)
    text, text_id = read_text(args.text)
    store = ResultStore(f"results/ruler-probe-{model_id}")
    out_path = RESULTS / f"ruler_probe_{model_id}.json"
    old = json.loads(out_path.read_text()) if out_path.exists() else {}
    cells: dict[str, dict] = dict(old.get("cells", {}))
    for repeats, shots in formats:
        for L in args.lengths:
            prompts = make_grid(tok, text, [L], depths, args.seeds, tasks=tasks, repeats=repeats, shots=shots)
            t0 = time.perf_counter()
            df = run_needle(model, prompts, [(get_policy("full"), 1)], store, model_id=model_id, decode=tok.decode,
                            chunk=0, progress=False, log=lambda s: None)
            wall = time.perf_counter() - t0
            df = df[df.prompt_id.isin({p.prompt_id for p in prompts}) & (df.policy == "full")]
            for task, part in df.groupby("task"):
                fails = [{"prompt_id": r.prompt_id, "key": r.needle_key,
                          "wrote": tok.decode(json.loads(r.generated))} for r in part.itertuples() if not r.success]
                key = f"x{repeats}k{shots}/{task}@{L}"
                prev = cells.get(key, {})
                cells[key] = {"format": f"x{repeats}k{shots}", "repeats": repeats, "shots": shots, "task": task,
                              "length": L, "n": int(len(part)), "accuracy": float(part.success.mean()),
                              "failures": fails,
                              "seconds_per_prompt": prev.get("seconds_per_prompt") if wall < 1 else
                              round(wall / max(1, len(prompts)), 1)}
                print(f"{key:28s} {cells[key]['accuracy']:.2f} of {len(part)}"
                      + "".join(f"\n    {f['prompt_id']}: {f['key']} -> {f['wrote']!r}" for f in fails[:4]),
                      flush=True)
            write_result(out_path.stem, {"model": model_id, "text": text_id, "machine": machine(),
                                         "depths": depths, "seeds": args.seeds, "cells": cells})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
