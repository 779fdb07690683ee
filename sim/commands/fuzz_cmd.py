"""``kvsim fuzz``: drive a policy with hypothesis-generated adversarial traces and check its invariants."""
from __future__ import annotations

import argparse
from pathlib import Path

from sim.commands._common import add_policies_option


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fuzz", help="fuzz a policy (or all) with adversarial generated traces",
                       description="Check interface invariants (budget, promised tokens, finite metrics, mass in "
                                   "[0,1], determinism) on generated traces: random, sinks, Zipf, exact ties, "
                                   "one-hot, logits of 1e-30 and 1e30, length 1, budget 1 and budget >= length. "
                                   "Failing cases are shrunk and saved as trace directories you can replay.")
    p.add_argument("specs", nargs="*", metavar="SPEC",
                   help="policy specs as positionals (the same as --policies, kept for existing scripts)")
    add_policies_option(p, default="all", extra="; positional SPECs, when given, replace it")
    p.add_argument("--profile", choices=("ci", "deep", "quick"), default="ci",
                   help="cases per policy: quick, ci (default) or deep (numbers in sim.experiments.fuzz.PROFILES)")
    p.add_argument("--examples", type=int, default=None, help="cases per policy (overrides --profile)")
    p.add_argument("--save-failures", type=Path, default=Path("kvsim-out/fuzz-failures"),
                   help="directory where shrunk failing traces are written")
    p.add_argument("--plugin", action="append", default=[],
                   help="import this module first (registers policies of code that is not an installed plug-in), "
                        "e.g. mypkg.policies")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import importlib

    from rich.console import Console
    from rich.table import Table

    from policies import list_policies

    try:  # hypothesis is a test extra: the CLI must start without it (README command 1 installs no extras)
        from sim.experiments.fuzz import PROFILES, fuzz_policy
    except ModuleNotFoundError as e:
        raise ValueError(f"kvsim fuzz needs {e.name}: pip install 'kvsim[test]'") from None
    from sim.experiments.specs import parse_policy, split_policy_list

    for mod in args.plugin:
        importlib.import_module(mod)
    text = ";".join(args.specs) if args.specs else args.policies
    specs = [s for item in split_policy_list(text) for s in (list_policies() if item == "all" else [item])]
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
