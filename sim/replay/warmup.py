"""Compile kernels ahead of their first use, on spare cores, while the caller does something else.

A cold first run of kvsim spends most of its time in numba compiling the engine and each policy's kernels (measured
on a 2-core VM, 2026-11-30: about 215 s of one core for the engine and the 28 registered policies, 190 s more for
the 52 combinations ``ada(·)``, ``critical(·)``, ``decoding(·)``, ``threshold(·)`` over them; loading them all from
the cache afterwards: 4 s). ``background_compile`` starts that work in separate processes
while the caller does work that does not need it (``kvsim demo`` converts and records a model meanwhile): each
process replays its share of the policies on a tiny synthetic trace, which compiles exactly the specialisations
a real replay uses and leaves them in numba's disk cache, where the replays that follow load them. The shares are
split so that one process compiles the engine first while the others compile policy kernels that do not need it
(``Policy.kernels``), and only then replay (by then the engine is in the cache).

``compiling_meanwhile`` is the same for a caller that compiles too (``kvsim recommend``'s simulate stage compiles
its candidates' kernels one after another in its own process): the helpers take the names in the reverse order,
so that the caller and they meet in the middle, and they are stopped when the caller's block ends.

Run as ``python -m sim.replay.warmup [--engine] POLICY...``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from contextlib import contextmanager
from typing import Iterator, Sequence

#: the tiny trace every warm-up replays: the same array types as a recorded trace, a few milliseconds to replay
_TRACE = dict(kind="mixed", n_tokens=96, n_prompt=32)
_BUDGET = 16
#: helpers run at this niceness: they take the cores the caller leaves idle, not the caller's
HELPER_NICENESS = 10


def compile_policies(names: Sequence[str], *, engine: bool = False) -> None:
    """Compile (or load from numba's disk cache) what replaying ``names`` needs: with ``engine``, the engine first;
    then every policy's kernels, then one replay of each (its allocation and prompt-statistics helpers). A policy
    that cannot replay the tiny trace is skipped: the real replay reports its error."""
    warnings.filterwarnings("ignore")      # numba's experimental first-class-function notice, once per process
    # imported in the compiling process only: the caller of ``background_compile`` goes on without the engine
    from policies import get_policy
    from sim.replay.policy_replay import replay
    from traces.synthetic import make_synthetic_trace

    trace = make_synthetic_trace(**_TRACE)
    if engine:
        replay(trace, get_policy("full"), _BUDGET)
    policies = []
    for name in names:
        try:
            policy = get_policy(name)
            if not policy.is_oracle:
                policy.kernels()
            policies.append(policy)
        except Exception:  # noqa: BLE001 - the real replay names the problem
            continue
    for policy in policies:
        try:
            replay(trace, policy, max(_BUDGET, policy.min_budget()))
        except Exception:  # noqa: BLE001
            continue


def background_compile(names: Sequence[str], processes: int) -> list[subprocess.Popen]:
    """Start ``processes`` processes that compile ``names`` (``compile_policies``), the first one the engine too;
    returns them (``wait_all`` waits). Policies are dealt round-robin in the given order."""
    processes = max(1, min(processes, len(names) or 1))
    shares = [list(names[i::processes]) for i in range(processes)]
    return [subprocess.Popen([sys.executable, "-m", "sim.replay.warmup", *(["--engine"] if i == 0 else []), *share],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for i, share in enumerate(shares)]


@contextmanager
def compiling_meanwhile(names: Sequence[str], processes: int) -> Iterator[list[subprocess.Popen]]:
    """Run the block while ``processes`` helpers compile ``names`` (repeated names once), the engine first, the
    names from last to first: a block that needs them in the given order finds the later ones in numba's disk cache
    by the time it gets there, instead of compiling every one itself (a first ``kvsim recommend``: 126 candidates,
    about 400 s of one core). With the kernels already cached the helpers only load them (about 4 s of one core). On
    exit, helpers still running are stopped: what they finished stays cached (numba writes a cache entry whole),
    the rest the caller compiles when it needs it. ``processes`` < 1 starts none."""
    order = list(dict.fromkeys(names))[::-1]
    procs = background_compile(order, processes) if processes >= 1 and order else []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        wait_all(procs)


def wait_all(procs: Sequence[subprocess.Popen]) -> None:
    """Wait for the warm-up processes; one that failed only leaves more to compile later, so failures pass."""
    for p in procs:
        p.wait()


def main(argv: Sequence[str] | None = None) -> int:
    if hasattr(os, "nice"):
        os.nice(HELPER_NICENESS)
    args = list(sys.argv[1:] if argv is None else argv)
    engine = "--engine" in args
    compile_policies([a for a in args if a != "--engine"], engine=engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
