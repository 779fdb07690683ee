"""``kvsim fuzz``: drive a policy with hypothesis-generated adversarial traces and check its invariants."""
from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from sim.fuzz import PROFILES

    p = sub.add_parser("fuzz", help="fuzz a policy (or all) with adversarial generated traces",
                       description="Check interface invariants (budget, promised tokens, finite metrics, mass in "
                                   "[0,1], determinism) on generated traces: random, sinks, Zipf, exact ties, "
                                   "one-hot, logits of 1e-30 and 1e30, length 1, budget 1 and budget >= length. "
                                   "Failing cases are shrunk and saved as trace directories you can replay.")
    p.add_argument("policies", nargs="+", help="policy specs (name or name:param=value,...), or 'all'")
    p.add_argument("--profile", choices=sorted(PROFILES), default="ci",
                   help=f"cases per policy: {', '.join(f'{k}={v}' for k, v in PROFILES.items())}")
    p.add_argument("--examples", type=int, default=None, help="cases per policy (overrides --profile)")
    p.add_argument("--save-failures", type=Path, default=Path("kvsim-out/fuzz-failures"),
                   help="where shrunk failing traces are written")
    p.add_argument("--plugin", action="append", default=[],
                   help="import this module first (registers your own policies), e.g. mypkg.policies")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import importlib

    from rich.console import Console
    from rich.table import Table

    from policies import list_policies
    from sim.fuzz import PROFILES, fuzz_policy
    from sim.specs import parse_policy

    for mod in args.plugin:
        importlib.import_module(mod)
    specs = list_policies() if args.policies == ["all"] else args.policies
    n = args.examples or PROFILES[args.profile]
    table = Table(title=f"kvsim fuzz ({n} cases per policy)")
    for col in ("policy", "cases", "ran", "clean rejections", "result"):
        table.add_column(col)
    failed = 0
    for spec in specs:
        parse_policy(spec)   # validate before fuzzing
        report = fuzz_policy(lambda spec=spec: parse_policy(spec), max_examples=n, save_failures=args.save_failures)
        ok = report.failure is None
        failed += not ok
        ran = f"{report.effective} ({report.effective / max(report.cases, 1):.0%})"
        table.add_row(report.policy, str(report.cases), ran, str(report.rejected),
                      "ok" if ok else f"FAILED: {report.failure}\nsaved: {report.saved}")
    Console(width=140).print(table)
    return 1 if failed else 0
