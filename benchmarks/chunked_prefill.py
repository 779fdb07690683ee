"""How much does chunked prefill move the simulator's ranking? Every policy that streams its prompt, replayed with
the prompt taken 1 (token by token), 64, 512 tokens per step and all at once (C = P: compress once after the
prompt), at three budgets, on a real trace; policies with a prefill selector are unaffected by C and ranked
alongside.

Per budget: each policy's error at every C, and Spearman's rho between the ranking of all policies at C = 1 and at
each other C. Writes benchmarks/results/chunked_prefill.json.

    python -m benchmarks.chunked_prefill [--trace DIR] [--budgets 64,128,256]
"""
from __future__ import annotations

import argparse

from benchmarks._util import machine, write_result

DEFAULT_TRACE = "kvsim-out/smollm2-135m-1024-256"


def main(argv: list[str] | None = None) -> None:
    import time

    from scipy.stats import spearmanr

    from policies import get_policy, list_policies
    from sim.replay.layer_inputs import load_layers
    from sim.replay.policy_replay import replay
    from sim.replay.plan import effective_chunk
    from sim.replay.threads import limit_threads
    from traces.format import load_trace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--budgets", default="64,128,256")
    ap.add_argument("--chunks", default="1,64,512,P", help="prompt chunks; P = the prompt length")
    args = ap.parse_args(argv)
    limit_threads(1)
    t_start = time.perf_counter()
    trace = load_trace(args.trace)
    P = trace.meta.n_prompt
    chunks = [P if c == "P" else int(c) for c in args.chunks.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    inputs = load_layers(trace)
    names = [n for n in list_policies() if not get_policy(n).is_oracle]
    streamed = [n for n in names if effective_chunk(get_policy(n), 2) == 2]
    err: dict[str, dict[int, dict[int, float]]] = {}
    for name in names:
        pol = get_policy(name)
        err[name] = {}
        for b in budgets:
            if b < pol.min_budget():
                continue
            err[name][b] = {}
            for c in (chunks if name in streamed else [1]):
                err[name][b][c] = float(replay(trace, pol, b, inputs=inputs, chunk=c).summary()["err_mean"])
            print(f"{name:34s} b={b:<4d} " + "  ".join(f"C={c}: {e:.4f}" for c, e in err[name][b].items()),
                  flush=True)
    by_budget = {}
    for b in budgets:
        have = [n for n in names if b in err[n]]
        base = [err[n][b][1] for n in have]
        by_budget[b] = {
            "rho_vs_token_by_token": {c: float(spearmanr(base, [err[n][b].get(c, err[n][b][1]) for n in have])[0])
                                      for c in chunks[1:]},
            "largest_rank_moves": {c: _moves(have, base, [err[n][b].get(c, err[n][b][1]) for n in have])
                                   for c in chunks[1:]}}
        print(f"b={b}: rho vs C=1 " + ", ".join(f"C={c}: {r:+.3f}" for c, r in by_budget[b]["rho_vs_token_by_token"]
                                               .items()), flush=True)
    write_result("chunked_prefill", {"trace": args.trace, "n_prompt": P, "chunks": chunks, "budgets": budgets,
                                     "streamed_policies": streamed, "err_mean": err, "by_budget": by_budget,
                                     "seconds": time.perf_counter() - t_start, "machine": machine()})


def _moves(labels, before, after, top: int = 5) -> list[dict]:
    """The policies whose rank moves most between two error vectors."""
    import numpy as np

    r0 = np.argsort(np.argsort(before))
    r1 = np.argsort(np.argsort(after))
    order = np.argsort(-np.abs(r1 - r0))[:top]
    return [{"policy": labels[i], "rank_c1": int(r0[i]) + 1, "rank": int(r1[i]) + 1} for i in order if r1[i] != r0[i]]


if __name__ == "__main__":
    main()
