"""``kvsim policies``: list registered policies with their parameters and paper defaults."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from policies.core.base import Param


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policies", help="list policies and their hyperparameters (paper defaults)",
                       description="List every registered policy with its parameters, types, ranges and defaults.")
    p.set_defaults(func=run)


def describe_param(prm: Param) -> str:
    """``name=default (range)`` for the table: every choice listed, booleans as true|false, open bounds shown."""
    if prm.kind == "choice":
        rng = " | ".join(prm.choices)
    elif prm.kind == "bool":
        rng = "true | false"
    else:
        num = (lambda x: str(int(x))) if prm.kind == "int" else (lambda x: f"{x:g}")
        if prm.low is None and prm.high is None:
            rng = f"any {prm.kind}"
        elif prm.high is None:
            rng = f"{prm.kind} >= {num(prm.low)}"
        elif prm.low is None:
            rng = f"{prm.kind} <= {num(prm.high)}"
        else:
            rng = f"{prm.kind} {num(prm.low)}..{num(prm.high)}"
    default = str(prm.default).lower() if prm.kind == "bool" else prm.default
    return f"{prm.name}={default} ({rng})"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from policies import list_policies, policy_class

    table = Table(title="kvsim policies (use NAME:param=value,... wherever a policy is asked for)")
    table.add_column("policy", no_wrap=True)
    table.add_column("what", overflow="fold")
    table.add_column("parameters (default, range)", overflow="fold")
    for name in list_policies():
        cls = policy_class(name)
        table.add_row(name, cls.summary, "\n".join(describe_param(prm) for prm in cls.schema) or "-")
    Console().print(table)
    return 0
