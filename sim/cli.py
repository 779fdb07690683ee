"""The ``kvsim`` command line: each module in sim/commands adds one subcommand, and so does every entry point of
the ``kvsim.commands`` group (kvsim's own model commands in gpu_validate, and installed plug-ins)."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import warnings
from importlib.metadata import entry_points

warnings.filterwarnings("ignore", message="First-class function type feature is experimental")


#: entry-point group of subcommands: ``name = "package.module"`` (its ``register(subparsers)`` adds the command) or
#: ``name = "package.module:register"``
COMMANDS_GROUP = "kvsim.commands"


def _register_plugin(ep, sub: argparse._SubParsersAction) -> None:
    """Add the subcommand of one ``kvsim.commands`` entry point; a plug-in that fails to load is named in a warning
    and left out, so one broken package does not take the other commands down."""
    where = f"{ep.value}" + (f" (package {ep.dist.name})" if getattr(ep, "dist", None) else "")
    try:
        obj = ep.load()
        register = getattr(obj, "register", obj)
        if not callable(register):
            raise TypeError(f"{ep.value} is neither a register(subparsers) function nor a module with one")
        before = set(sub.choices)
        register(sub)
    except Exception as e:  # noqa: BLE001 - any failure of third-party code is reported the same way
        print(f"kvsim: warning: command plug-in {ep.name!r} from {where} failed to load: {type(e).__name__}: {e}",
              file=sys.stderr)
        return
    if not set(sub.choices) - before:
        print(f"kvsim: warning: command plug-in {ep.name!r} from {where} added no command", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every discovered subcommand."""
    import sim.commands

    parser = argparse.ArgumentParser(
        prog="kvsim",
        description="Simulate KV-cache eviction policies on attention traces, search their hyperparameters, "
                    "and validate them on GPU. Run `kvsim COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    builtin = {m.name.removesuffix("_cmd"): m.name for m in pkgutil.iter_modules(sim.commands.__path__)
               if not m.name.startswith("_")}
    plugins = {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}
    for name in sorted(set(builtin) | set(plugins)):       # one alphabetical list in --help
        if name in builtin:
            importlib.import_module(f"sim.commands.{builtin[name]}").register(sub)
        if name in plugins:
            _register_plugin(plugins[name], sub)
    from sim.commands._common import DefaultsHelpFormatter

    for command in sub.choices.values():
        command.formatter_class = DefaultsHelpFormatter   # every option's help shows its real default
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvsim`` console script; bad input exits with status 2 and a one-line error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from policies.core.errors import PolicyError    # after parsing: `kvsim --help` imports nothing a command runs
    from traces.format import TraceError

    args.argv = argv                                        # the command line, for the header of result pages
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
