"""BumbleBee cost: per-step time of the streaming selector (Alg. 2) vs budget, against a reference step that
recomputes every nearest neighbour (O(budget^2 d), what Alg. 2 costs without cached statistics), and the lazy
vs naive greedy of the prompt selector (Alg. 1), each pair measured side by side in this process.

Run: python -m benchmarks.bumblebee_step  -> benchmarks/results/bumblebee_step.json
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from numba import njit

from benchmarks._util import machine, write_result
from policies import get_policy
from policies._bumblebee_greedy import greedy_select
from policies._bumblebee_similarity import _cos_from, _dots_to, kernel_sim, similarity_matrix
from policies.bumblebee import F_ACC, F_NN, F_NNPOS, F_NORM, P, _step, prompt_importance


@njit(cache=True)
def _recompute_neighbours(params, lengths, keys, positions, slot_state):
    """Reference: every slot's nearest neighbour from scratch over the whole cache, O(n^2 d)."""
    mode = int(params[P.similarity])
    for h in range(lengths.shape[0]):
        n = lengths[h]
        for i in range(n):
            nrm = 0.0
            for x in range(keys.shape[2]):
                nrm += np.float64(keys[h, i, x]) ** 2
            slot_state[h, i, F_NORM] = np.sqrt(nrm)
        dots = np.empty(n, np.float32)
        for i in range(n):
            best, best_pos = 0.0, -1
            _dots_to(keys, h, i, n, dots)
            for j in range(n):
                if j != i:
                    s = kernel_sim(_cos_from(dots[j], slot_state[h, i, F_NORM], slot_state[h, j, F_NORM]), mode)
                    if best_pos < 0 or s > best:
                        best, best_pos = s, positions[h, j]
            slot_state[h, i, F_NN] = best
            slot_state[h, i, F_NNPOS] = best_pos


@njit(cache=True)
def _drive(params, keys, budget, n_steps, variant, seed):
    """Stream ``n_steps`` keys of one head through the step at ``budget`` (cache pre-filled to the budget).

    variant 0: the policy's incremental step; 1: neighbours recomputed each step, then the same step;
    2: driver only (random attention row, append, compaction; evict the oldest). Returns the kept positions
    and how many nearest-neighbour repairs (slots whose neighbour was evicted) the steps needed.
    """
    np.random.seed(seed)
    d = keys.shape[1]
    cap = budget + 1
    ck = np.zeros((1, cap, d), np.float32)
    cv = np.zeros((1, cap, d), np.float32)
    pos = np.full((1, cap), -1, np.int64)
    sst = np.zeros((1, cap, 4), np.float64)
    hst = np.zeros((1, 0), np.float64)
    probs = np.zeros((1, 1, cap), np.float64)
    keep = np.ones((1, cap), np.uint8)
    merge_to = np.full((1, cap), -1, np.int64)
    merge_w = np.ones((1, cap), np.float64)
    bud = np.array([budget], np.int64)
    lengths = np.zeros(1, np.int64)
    before = np.zeros(cap, np.float64)
    repairs = 0
    for t in range(n_steps + budget):
        n = lengths[0]
        ck[0, n] = keys[t % keys.shape[0]]
        pos[0, n] = t
        for f in range(4):
            sst[0, n, f] = 0.0
        n += 1
        lengths[0] = n
        tot = 0.0
        for i in range(n):
            probs[0, 0, i] = np.random.exponential()
            tot += probs[0, 0, i]
        for i in range(n):
            probs[0, 0, i] /= tot
        if t < budget:
            # fill the cache without steps; neighbours from scratch once it is full (not timed: subtracted)
            sst[0, n - 1, F_ACC] = np.random.exponential()
            if t == budget - 1:
                _recompute_neighbours(params, lengths, ck, pos, sst)
            continue
        if variant == 2:
            if n > budget:
                keep[0, 0] = 0
        else:
            if variant == 1:
                _recompute_neighbours(params, lengths, ck, pos, sst)
            before[:n] = sst[0, :n, F_NNPOS]
            _step(params, 0, t, bud, lengths, probs, ck, cv, pos, sst, hst, keep, merge_to, merge_w)
            for i in range(n - 1):
                if keep[0, i] != 0 and sst[0, i, F_NNPOS] != before[i] and sst[0, i, F_NNPOS] != t:
                    repairs += 1
        w = 0
        for i in range(n):
            if keep[0, i] != 0:
                if w != i:
                    ck[0, w] = ck[0, i]
                    pos[0, w] = pos[0, i]
                    sst[0, w] = sst[0, i]
                w += 1
            keep[0, i] = 1
        lengths[0] = w
    return pos[0, :lengths[0]].copy(), repairs


def _clustered_keys(rng: np.random.Generator, n: int, d: int, n_clusters: int = 32) -> np.ndarray:
    """Keys around a few directions with jitter (redundant keys, as in real heads)."""
    centers = rng.normal(size=(n_clusters, d))
    return (centers[rng.integers(0, n_clusters, n)] + 0.5 * rng.normal(size=(n, d))).astype(np.float32)


def _per_step(params, keys, budget, steps, variant) -> float:
    """Steady-state seconds per step: a run of ``steps`` steps minus the cache fill alone."""
    t0 = time.perf_counter()
    _drive(params, keys, budget, 0, variant, 0)
    t1 = time.perf_counter()
    _drive(params, keys, budget, steps, variant, 0)
    t2 = time.perf_counter()
    return max(0.0, (t2 - t1) - (t1 - t0)) / steps


def bench_step(budgets, d, steps, ref_steps) -> list[dict]:
    rng = np.random.default_rng(0)
    params = get_policy("bumblebee").param_vector()
    keys = _clustered_keys(rng, 4096, d)
    _drive(params, keys, 8, 8, 0, 0), _drive(params, keys, 8, 8, 1, 0), _drive(params, keys, 8, 8, 2, 0)
    rows = []
    for b in budgets:
        kept_inc, _ = _drive(params, keys, b, ref_steps, 0, 1)
        same = np.array_equal(kept_inc, _drive(params, keys, b, ref_steps, 1, 1)[0])
        repairs = _drive(params, keys, b, steps, 0, 0)[1] / steps
        inc = min(_per_step(params, keys, b, steps, 0) for _ in range(2))
        drv = min(_per_step(params, keys, b, steps, 2) for _ in range(2))
        ref = _per_step(params, keys, b, ref_steps, 1)
        rows.append({"budget": b, "head_dim": d, "step_us": 1e6 * inc, "driver_us": 1e6 * drv,
                     "recompute_step_us": 1e6 * ref, "speedup_vs_recompute": ref / inc, "nn_repairs_per_step": repairs,
                     "same_selection_as_recompute": bool(same)})
        print(rows[-1])
    return rows


def bench_greedy(prompts, ratios, d) -> list[dict]:
    rng = np.random.default_rng(1)
    pol = get_policy("bumblebee")
    p = pol.params
    rows = []
    for P in prompts:
        k = _clustered_keys(rng, P, d)
        q = _clustered_keys(rng, P, d)[:, None, :]
        t0 = time.perf_counter()
        m = prompt_importance(q, np.ascontiguousarray(k[:, None, :]), d ** -0.5, 0, 0)
        t_imp = time.perf_counter() - t0
        t0 = time.perf_counter()
        S = similarity_matrix(k.astype(np.float64), 0)
        t_sim = time.perf_counter() - t0
        forced = np.zeros(P, np.uint8)
        for r in ratios:
            b = max(1, int(P * r))
            args = (S, m, b, forced, p["lam"], 0, p["alpha"], p["beta"])
            greedy_select(*args[:2], 2, *args[3:], True)      # compile
            t0 = time.perf_counter()
            lazy, ev_l = greedy_select(*args, True)
            t_l = time.perf_counter() - t0
            t0 = time.perf_counter()
            naive, ev_n = greedy_select(*args, False)
            t_n = time.perf_counter() - t0
            rows.append({"prompt": P, "budget": b, "lazy_s": t_l, "naive_s": t_n, "speedup": t_n / t_l,
                         "lazy_evals": int(ev_l), "naive_evals": int(ev_n),
                         "same_selection": bool(np.array_equal(lazy, naive)),
                         "importance_s": t_imp, "similarity_matrix_s": t_sim})
            print(rows[-1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    a = ap.parse_args()
    if a.quick:
        step = bench_step([32, 64], 64, 200, 20)
        greedy = bench_greedy([128], [0.1], 64)
    else:
        step = bench_step([64, 128, 256, 512, 1024], 128, 2000, 40)
        greedy = bench_greedy([256, 512, 1024, 2048], [0.1, 0.2], 128)
    write_result("bumblebee_step", {"machine": machine(), "step": step, "greedy": greedy,
                                    "note": "one KV head, clustered random keys, float32 keys; step_us includes the "
                                            "driver (random attention row, append, compaction) given as driver_us"})


if __name__ == "__main__":
    main()
