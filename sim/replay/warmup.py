"""Compile kernels ahead of their first use, on spare cores, while the caller does something else.

A cold first run of kvsim spends most of its time in numba compiling the engine and each policy's kernels (about
100 s of one core for every registered policy). ``background_compile`` starts that work in separate processes
while the caller does work that does not need it (``kvsim demo`` converts and records a model meanwhile): each
process replays its share of the policies on a tiny synthetic trace, which compiles exactly the specialisations
a real replay uses and leaves them in numba's disk cache, where the replays that follow load them. The shares are
split so that one process compiles the engine first while the others compile policy kernels that do not need it
(``Policy.kernels``), and only then replay (by then the engine is in the cache).

Run as ``python -m sim.replay.warmup [--engine] POLICY...``.
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Sequence

#: the tiny trace every warm-up replays: the same array types as a recorded trace, a few milliseconds to replay
_TRACE = dict(kind="mixed", n_tokens=96, n_prompt=32)
_BUDGET = 16


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


def wait_all(procs: Sequence[subprocess.Popen]) -> None:
    """Wait for the warm-up processes; one that failed only leaves more to compile later, so failures pass."""
    for p in procs:
        p.wait()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    engine = "--engine" in args
    compile_policies([a for a in args if a != "--engine"], engine=engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
