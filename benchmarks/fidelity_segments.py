"""Fidelity at equal budget on SmolLM2-135M, with the model side's own reliability measured first.

Every policy runs closed loop (batched) at one budget on many segments of the shipped held-out text; the
split-half reliability of the policy ranking by mean ΔNLL over segments bounds any simulator-vs-model rho.
Then the within-budget Spearman rho of every simulated loss (mean over segments) against the model's mean
ΔNLL and top-1 disagreement, on the text's first half and, separately, on its second half (no choice in the
simulator's metrics was fitted on either). Writes benchmarks/results/fidelity_smollm2.json.

    python benchmarks/fidelity_segments.py [--segments 8] [--prompt 64] [--decode 32] [--budget 16]   (the committed run, ~5 min)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

POLICIES = ("streaming_llm;h2o;tova;cascading;snapkv:window_size=8;pyramidkv:window_size=8;"
            "ada_snapkv:window_size=8;bumblebee")


def main(argv: list[str]) -> int:
    import numpy as np
    import torch

    from benchmarks._util import machine, write_result
    from gpu_validate.fidelity import MODEL_LOSSES, SIM_LOSSES, segment_study, spearman, split_half_reliability
    from sim.specs import parse_policy
    from traces.model import default_text
    from traces.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--segments", type=int, default=8, help="segments, half from each half of the text")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--policies", default=POLICIES)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    model, tok = load_model(args.model, device="cpu")
    ids = tok(default_text())["input_ids"]
    n = args.prompt + args.decode
    half = len(ids) // 2
    k = args.segments // 2
    starts = [int(x) for x in np.linspace(0, half - n, k)] + [int(x) for x in np.linspace(half, len(ids) - n, k)]
    policies = [parse_policy(s) for s in args.policies.split(";")]
    rows = segment_study(model, ids, starts, policies, args.budget, n_prompt=args.prompt, n_decode=args.decode,
                         model_id="smollm2-135m")
    labels = [p.label() for p in policies]

    def table(key: str, segs) -> np.ndarray:
        return np.array([[next(r[key] for r in rows if r["segment"] == s and r["label"] == lab) for lab in labels]
                         for s in segs])

    all_segs = list(range(len(starts)))
    reliability = {m: split_half_reliability(table(m, all_segs)) for m in MODEL_LOSSES}
    rho = {}
    for name, segs in (("first_half", all_segs[:k]), ("second_half_heldout", all_segs[k:]), ("all", all_segs)):
        rho[name] = {s: {m: spearman(table(s, segs).mean(0), table(m, segs).mean(0)) for m in MODEL_LOSSES}
                     for s in SIM_LOSSES}
    means = {lab: {key: float(table(key, all_segs)[:, i].mean()) for key in (*SIM_LOSSES, *MODEL_LOSSES)}
             for i, lab in enumerate(labels)}
    out = {"model": "smollm2-135m", "model_path": args.model, "policies": labels, "budgets": [args.budget],
           "n_prompt": args.prompt, "n_decode": args.decode, "n_segments": len(starts), "segment_starts": starts,
           "backend": "torch", "device": "cpu", "model_reliability": reliability,
           "spearman_within_budget": rho, "policy_means": means, "rows": rows,
           "seconds": time.perf_counter() - t0, "machine": machine()}
    path = write_result("fidelity_smollm2", out)
    for m, r in reliability.items():
        print(f"model-side split-half reliability of the {m} ranking over {len(starts)} segments: "
              f"{r['split_half_rho']:.3f} (Spearman-Brown {r['spearman_brown']:.3f})")
    for s in SIM_LOSSES:
        print(f"{s:>10s}: rho vs ΔNLL held-out {rho['second_half_heldout'][s]['delta_nll']:+.3f}, "
              f"first half {rho['first_half'][s]['delta_nll']:+.3f}, all {rho['all'][s]['delta_nll']:+.3f}; "
              f"vs top-1 held-out {rho['second_half_heldout'][s]['top1_disagreement']:+.3f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
