"""The ``kvsim`` command line: each module in sim/commands adds one subcommand."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import warnings

from policies import PolicyError
from traces.format import TraceError

warnings.filterwarnings("ignore", message="First-class function type feature is experimental")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every discovered subcommand."""
    import sim.commands

    parser = argparse.ArgumentParser(
        prog="kvsim",
        description="Simulate KV-cache eviction policies on attention traces, search their hyperparameters, "
                    "and validate them on GPU. Run `kvsim COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(sim.commands.__path__), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"sim.commands.{mod.name}").register(sub)
    from sim.commands._common import DefaultsHelpFormatter

    for command in sub.choices.values():
        command.formatter_class = DefaultsHelpFormatter   # every option's help shows its real default
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvsim`` console script; bad input exits with status 2 and a one-line error."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (TraceError, PolicyError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"kvsim {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvsim {args.command}: interrupted; finished results are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
