"""``kvsim policies``: list registered policies with their parameters and paper defaults."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policies", help="list policies and their hyperparameters (paper defaults)",
                       description="List every registered policy with its parameters, types, ranges and defaults.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from policies import list_policies, policy_class

    table = Table(title="kvsim policies (use NAME:param=value,... wherever a policy is asked for)")
    for col in ("policy", "what", "parameters (default, range)"):
        table.add_column(col)
    for name in list_policies():
        cls = policy_class(name)
        params = []
        for prm in cls.schema:
            rng = "|".join(prm.choices) if prm.kind == "choice" else f"{prm.low}..{prm.high}"
            params.append(f"{prm.name}={prm.default} ({rng})")
        table.add_row(name, cls.summary, "\n".join(params) or "-")
    Console().print(table)
    return 0
