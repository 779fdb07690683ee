"""BumbleBee at long prompts: peak memory and time of a replay whose prompt selection (Alg. 1) no longer builds the
P x P similarity matrix, against the full-matrix code it replaced, each run in its own process.

Trace: synthetic 'mixed' in Gemma-3-270M's global-layer geometry (1 layer, 4 query heads, 1 KV head, d = 256),
P prompt tokens + 256 decode steps, generated once into --cache (32 k tokens take minutes) and loaded by every run.
Each run is a child process under ``/usr/bin/time``: peak RSS of the whole process (Python, numba, the loaded trace
and the replay's float32 copies of it included) and its wall seconds. Two kinds of run:
  - replay: ``sim.replay.policy_replay.replay`` at one budget (prompt importance + selection + 256 decode steps); the child also
    reports a digest of every recorded kept set and metric, so that before and after can be compared;
  - prefill_ab (up to 8 k): the prefill kernel of both versions in one process, alternated AB_REPEAT times (min and
    median seconds; this machine's load swings single runs by several times, alternation shares it out);
  - select: the prompt selection alone for that budget (similarity + greedy, default parameters, recent window
    forced), from keys and prompt importance saved in --cache: the part this change is about (the replay's time is
    mostly the O(P^2 G d) prompt importance, unchanged).
"before" is policies/bumblebee.py as of --before (a git revision: the last full-matrix version by default), loaded
in place of the current module; "after" is the working tree. Before at 32 k needs ~13 GB (--before-long).

Run: python -m benchmarks.bumblebee_long [--quick] -> benchmarks/results/bumblebee_long.json
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._util import machine, user_env, write_result

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "747a595"      # the last commit whose BumbleBee prefill builds the P x P matrix
DECODE = 256
AB_REPEAT = 5           # alternations of the in-process before/after prefill comparison
GEOMETRY = dict(n_layers=1, n_q_heads=4, n_kv_heads=1, head_dim=256)


def _trace_dir(cache: Path, P: int) -> Path:
    return cache / f"mixed_p{P}_d{GEOMETRY['head_dim']}"


def ensure_trace(cache: Path, P: int) -> Path:
    from traces.synthetic import make_synthetic_trace

    out = _trace_dir(cache, P)
    if not (out / "manifest.json").exists():
        t0 = time.perf_counter()
        make_synthetic_trace("mixed", **GEOMETRY, n_tokens=P + DECODE, n_prompt=P).save(out, overwrite=True)
        print(f"trace {out} written in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def _module(version: str, rev: str):
    """policies.bumblebee now ("after") or as of ``rev`` ("before", from git, as its own module)."""
    if version == "after":
        import policies.bumblebee as mod
        return mod
    src = subprocess.run(["git", "show", f"{rev}:policies/bumblebee.py"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    name = f"kvsim_bumblebee_{rev}"
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{name}.py"
    if not path.exists() or path.read_text() != src:
        path.write_text(src)
    from policies.core.registry import policy_class

    policy_class("bumblebee")           # discover first: the old class must not be replaced by the current one
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def child(kind: str, trace_dir: str, budget: int, version: str, rev: str) -> dict:
    """One measured run (in its own process); returns what it reports on stdout."""
    import numpy as np

    from traces.format import load_trace

    t0 = time.perf_counter()
    mod = _module(version, rev)
    trace = load_trace(trace_dir)
    P, T = trace.meta.n_prompt, trace.meta.n_tokens
    out = {"kind": kind, "tokens": P, "budget": budget, "version": version}
    if kind == "importance":
        la = trace.layer(0)
        q, k = np.array(la.q[:P], np.float32), np.array(la.k[:P], np.float32)
        m = mod.prompt_importance(q, k, float(trace.meta.softmax_scale), 0, 0)
        np.save(Path(trace_dir) / "importance.npy", m)
        return {**out, "seconds": time.perf_counter() - t0}
    if kind == "select":
        from policies.core.scorer import recent_slots

        k = np.ascontiguousarray(np.array(trace.layer(0).k[:P, 0], np.float32))
        m = np.load(Path(trace_dir) / "importance.npy")
        pol = mod.BumbleBee()
        p = pol.params
        args = (p["lam"], mod.CONCAVE.index(p["concave"]), p["alpha"], p["beta"])
        forced = np.zeros(P, np.uint8)
        forced[P - int(recent_slots(budget, p["recent_ratio"])):] = 1
        mode = mod.SIMILARITY.index(p["similarity"])
        t1 = time.perf_counter()
        if version == "before":
            S = np.empty((P, P), np.float64)
            mod.similarity_into(k, mode, S)
            sel, evals = mod.greedy_select(S, m, budget, forced, *args, True)
            cols = P
        else:
            sel, evals, cols = mod.greedy_select_keys(mod.unit_keys_t(k), m, budget, forced, *args, True, mode)
        return {**out, "select_s": time.perf_counter() - t1, "gain_evals": int(evals), "columns": int(cols),
                "picks_sha256": hashlib.sha256(np.asarray(sel, np.int64).tobytes()).hexdigest()[:16]}
    if kind == "prefill_ab":
        # both versions in this process, alternated: the prefill kernel (importance + selection + neighbour stats)
        new = _module("after", rev)
        la = trace.layer(0)
        q, k = np.array(la.q[:P], np.float32), np.array(la.k[:P], np.float32)
        params = new.BumbleBee().param_vector()
        scale = float(trace.meta.softmax_scale)

        def run(m, n):
            keep, st = np.ones((1, n), np.uint8), np.zeros((1, n, 4))
            t = time.perf_counter()
            m._prefill(params, 0, np.array([budget]), q[:n], k[:n], k[:n].copy(), scale, keep, st, np.zeros((1, 0)))
            return time.perf_counter() - t, keep, st

        run(mod, 64), run(new, 64)                   # compile / load both
        times = {"before": [], "after": []}
        same = True
        for _ in range(AB_REPEAT):
            tb, kb, sb = run(mod, P)
            ta, ka, sa = run(new, P)
            times["before"].append(tb)
            times["after"].append(ta)
            same = same and np.array_equal(kb, ka) and np.array_equal(sb, sa)
        return {**out, "before_s": min(times["before"]), "after_s": min(times["after"]),
                "before_median_s": float(np.median(times["before"])),
                "after_median_s": float(np.median(times["after"])), "runs_s": times, "identical": bool(same)}
    from sim.replay.policy_replay import replay

    pol = mod.BumbleBee()
    t1 = time.perf_counter()
    res = replay(trace, pol, budget, record_kept=(P, T - P))
    t2 = time.perf_counter()
    digest = hashlib.sha256(np.ascontiguousarray(res.kept).tobytes() + np.ascontiguousarray(res.metrics).tobytes())
    return {**out, "load_s": t1 - t0, "replay_s": t2 - t1, "kept_and_metrics_sha256": digest.hexdigest()[:16]}


def measure(kind: str, trace_dir: Path, budget: int, version: str, rev: str) -> dict:
    """Run ``child`` in a fresh process under /usr/bin/time: its report plus peak RSS and wall seconds."""
    load0 = os.getloadavg()[0]
    cmd = ["/usr/bin/time", "-f", "TIME %M KB %e s", sys.executable, "-m", "benchmarks.bumblebee_long", "--child",
           kind, str(trace_dir), str(budget), version, rev]
    p = subprocess.run(cmd, capture_output=True, text=True, env=user_env(), cwd=ROOT)
    m = re.search(r"TIME (\d+) KB ([\d.]+) s", p.stderr)
    if p.returncode != 0 or m is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    row = json.loads(p.stdout.strip().splitlines()[-1])
    row.update(peak_rss_mb=int(m.group(1)) / 1024, process_s=float(m.group(2)), load_avg_1min_before=load0,
               load_avg_1min_after=os.getloadavg()[0])
    print(row, flush=True)
    return row


def measure_best(kind: str, trace_dir: Path, budget: int, version: str, rev: str, repeat: int) -> dict:
    """``measure`` ``repeat`` times: the fastest run's report, the largest peak RSS, every run's seconds."""
    runs = [measure(kind, trace_dir, budget, version, rev) for _ in range(repeat)]
    t = "replay_s" if kind == "replay" else "select_s"
    best = dict(min(runs, key=lambda r: r[t]))
    best.update(peak_rss_mb=max(r["peak_rss_mb"] for r in runs), runs_s=[r[t] for r in runs])
    if len({r.get("kept_and_metrics_sha256", r.get("picks_sha256")) for r in runs}) != 1:
        raise RuntimeError(f"{kind} {version} at {budget}: repeated runs disagree")
    return best


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 3 k-token prompt only (smoke run)")
    ap.add_argument("--cache", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "kvsim_bumblebee_long"),
                    help="where the synthetic traces (and their prompt importance) are kept between runs")
    ap.add_argument("--before", default=BEFORE, help="git revision of the full-matrix policies/bumblebee.py")
    ap.add_argument("--before-long", action="store_true", help="also run the full-matrix code at 32 k (~13 GB)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement up to 8 k tokens (32 k: one)")
    ap.add_argument("--child", nargs=5, metavar=("KIND", "TRACE", "BUDGET", "VERSION", "REV"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, trace_dir, budget, version, rev = a.child
        print(json.dumps(child(kind, trace_dir, int(budget), version, rev)), flush=True)
        return
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    sizes = [(3072, [256])] if a.quick else [(8192, [512, 2048]), (32768, [512, 2048])]
    start = _uptime()
    warm = ensure_trace(cache, 3072)      # compile (or load from numba's cache) every kernel before timing
    if not (warm / "importance.npy").exists():
        measure("importance", warm, 0, "after", a.before)
    for kind in ("select", "replay"):
        for v in ("before", "after"):
            measure(kind, warm, 64, v, a.before)
    rows = []
    for P, budgets in sizes:
        td = ensure_trace(cache, P)
        versions = ["before", "after"] if P <= 8192 or a.before_long else ["after"]
        if not (td / "importance.npy").exists():
            measure("importance", td, 0, "after", a.before)
        for b in budgets:
            for kind in ("select", "replay"):
                for v in versions:
                    rows.append(measure_best(kind, td, b, v, a.before, a.repeat if P <= 8192 else 1))
            if "before" in versions:
                rows.append(measure("prefill_ab", td, b, "before", a.before))
    pairs = [{"kind": "prefill_ab", "tokens": r["tokens"], "budget": r["budget"], "before_s": r["before_s"],
              "after_s": r["after_s"], "speedup": r["before_s"] / r["after_s"],
              "speedup_median": r["before_median_s"] / r["after_median_s"], "identical": r["identical"]}
             for r in rows if r["kind"] == "prefill_ab"]
    for r in rows:
        if r["version"] != "after" or r["kind"] == "prefill_ab":
            continue
        o = next((x for x in rows if x["version"] == "before" and (x["kind"], x["tokens"], x["budget"]) ==
                  (r["kind"], r["tokens"], r["budget"])), None)
        if o is None:
            continue
        t = "replay_s" if r["kind"] == "replay" else "select_s"
        same = "kept_and_metrics_sha256" if r["kind"] == "replay" else "picks_sha256"
        pairs.append({"kind": r["kind"], "tokens": r["tokens"], "budget": r["budget"], "before_s": o[t],
                      "after_s": r[t], "speedup": o[t] / r[t], "before_peak_rss_mb": o["peak_rss_mb"],
                      "after_peak_rss_mb": r["peak_rss_mb"], "identical": o[same] == r[same]})
    write_result("bumblebee_long", {
        "machine": machine(), "uptime_start": start, "uptime_end": _uptime(), "before_revision": a.before,
        "trace": {"kind": "mixed", **GEOMETRY, "decode_steps": DECODE, "note": "Gemma-3-270M global-layer geometry"},
        "runs": rows, "before_after": pairs,
        "note": "each run its own process: peak_rss_mb and process_s from /usr/bin/time (whole process, trace "
                "loading included); replay_s / select_s timed inside it, the fastest of runs_s (peak RSS: the "
                "largest). select = similarity + greedy alone (the "
                "nearest-neighbour statistics of the kept keys are left out). identical: same digest of all kept "
                "sets and metrics (replay) or of the picks in order (select). 2-core machine shared with other "
                "jobs: see the load averages per run."})


if __name__ == "__main__":
    main()
