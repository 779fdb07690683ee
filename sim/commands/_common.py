"""Options shared by several subcommands: one name, one type, one default and one help text each.

Every command that takes a policy takes ``--policy SPEC`` (one full spec, e.g. ``h2o:recent_ratio=0.3`` or
``ada(snapkv)``); every command that takes several takes ``--policies LIST`` (full specs separated by ``;``
at the top level, see ``sim.experiments.specs.split_policy_list``). ``--layers`` is always a COUNT of layers (of a
generated trace); layer indices are ``--keep-layers``.
"""
from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:                 # this module builds parsers: `kvsim --help` must not import numpy or numba
    from traces.format import Trace


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends each option's real default to its help, so the help cannot disagree with the parser; lines break
    at spaces only, so a path or a spec with a hyphen (``kvsim-out/needle.json``) stays whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "%(default)" in text or default is None or default is False
                or default == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def command_line(args: argparse.Namespace) -> str:
    """The command as typed (``kvsim demo --synthetic mixed``), for the header of a result page."""
    import shlex

    argv = getattr(args, "argv", None)
    return "kvsim " + shlex.join(argv) if argv is not None else f"kvsim {getattr(args, 'command', '')}".strip()


def positive_int(text: str) -> int:
    """An integer >= 1 (budgets, counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """``32,64,128`` -> [32, 64, 128]."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_synthetic_size_args(p: argparse.ArgumentParser) -> None:
    """``--tokens/--prompt/--layers/--seed``: the size and seed of a generated ``synthetic:KIND`` trace."""
    g = p.add_argument_group("synthetic traces (synthetic:KIND)")
    g.add_argument("--tokens", type=positive_int, default=1024, help="tokens of a synthetic trace")
    g.add_argument("--prompt", type=positive_int, default=128, help="prompt tokens of a synthetic trace")
    g.add_argument("--layers", type=positive_int, default=2, help="number of layers of a synthetic trace")
    g.add_argument("--seed", type=int, default=0, help="seed of a synthetic trace")


def add_verify_option(p: argparse.ArgumentParser) -> None:
    """``--no-verify``: skip the checksum/NaN pass over trace files (in every worker too)."""
    p.add_argument("--no-verify", action="store_true",
                   help="skip checksum/NaN verification of trace files (also in worker processes)")


def add_trace_args(p: argparse.ArgumentParser, *, many: bool = False) -> None:
    """TRACE positional(s), the sizes used when a trace is ``synthetic:KIND``, ``--no-verify`` and
    ``--sliding``."""
    p.add_argument("traces" if many else "trace", nargs="+" if many else None, metavar="TRACE",
                   help="trace directory (an existing path always wins), or synthetic:KIND (mixed, sinks, zipf, "
                        "local, recall, topic_shift, adversarial, passkey, random) generated in memory")
    add_synthetic_size_args(p)
    add_verify_option(p)
    add_sliding_option(p)
    add_chunk_option(p)


def add_chunk_option(p: argparse.ArgumentParser) -> None:
    """``--prefill-chunk C``: chunked prefill of streamed prompts."""
    p.add_argument("--prefill-chunk", dest="chunk", type=positive_int, default=1, metavar="C",
                   help="a policy that streams its prompt takes it C tokens per step (chunked prefill: each chunk "
                        "attends over the cache plus itself, the policy steps once on the summed attention); 1 = "
                        "token by token (default), the prompt length = compress once after the prompt. Policies "
                        "with a prefill selector are unaffected")


def add_sliding_option(p: argparse.ArgumentParser) -> None:
    """``--sliding keep|compress``: what a policy does on a hybrid model's sliding-window layers."""
    p.add_argument("--sliding", choices=("keep", "compress"), default="keep",
                   help="hybrid models (Gemma-3): 'keep' compresses the global layers only and leaves each sliding "
                        "layer its window, the model's own cache, counted in the memory held; 'compress' applies "
                        "the policy to the sliding layers too, under their window (no effect on other models)")


def add_policy_option(p: argparse.ArgumentParser, *, required: bool = True, default: str | None = None,
                      extra: str = "") -> None:
    """``--policy SPEC``: one full policy spec."""
    p.add_argument("--policy", required=required, default=default, metavar="SPEC",
                   help="policy spec: NAME, NAME:param=value,..., or WRAPPER(SPEC, k=v); see `kvsim policies`"
                        + extra)


def add_policies_option(p: argparse.ArgumentParser, *, default: str | None, extra: str = "") -> None:
    """``--policies LIST``: full policy specs separated by ``;`` (``all`` = every registered policy)."""
    p.add_argument("--policies", default=default, required=default is None, metavar="LIST",
                   help="';'-separated policy specs, e.g. 'h2o:recent_ratio=0.3,group_reduce=max;tova;"
                        "streaming_llm:n_sinks=8'; 'all' = every registered policy at paper defaults" + extra)


def add_budget_option(p: argparse.ArgumentParser, *, default: int | None = None) -> None:
    """``--budget B``: slots per KV head and layer (required when there is no default)."""
    p.add_argument("--budget", type=positive_int, required=default is None, default=default,
                   help="slots per KV head and layer")


def add_budgets_option(p: argparse.ArgumentParser, *, default: Sequence[int] | None = None,
                       required: bool = False, extra: str = "") -> None:
    """``--budgets B,B,...``: comma-separated slots per KV head and layer."""
    p.add_argument("--budgets", type=int_list, required=required, default=list(default) if default else None,
                   help="comma-separated budgets (slots per KV head and layer)" + extra)


def add_out_option(p: argparse.ArgumentParser, default: Path | str | None, what: str) -> None:
    """``--out PATH``: where the command writes (``what`` says what is written there)."""
    p.add_argument("--out", type=Path, required=default is None, default=None if default is None else Path(default),
                   help=what)


def add_executor_options(p: argparse.ArgumentParser) -> None:
    """``--workers N``, ``--threads N`` and ``--ray ADDRESS``: where the replays run, with how many threads."""
    from sim.replay.threads import available_cores

    p.add_argument("--workers", type=positive_int, default=available_cores(),
                   help="local worker processes (one per core on this machine)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="threads per worker process or Ray task, for numba, BLAS and torch alike (default: the "
                        "cores divided among the workers, so workers x threads <= cores; 1 per Ray task, which "
                        "declares num_cpus=N to Ray's scheduler)")
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run on Ray: a cluster address (ray://host:10001, auto) or 'local' (needs kvsim[ray])")


def add_split_option(p: argparse.ArgumentParser, *, extra: str = "") -> None:
    """``--split-layers N``: each configuration as N jobs of consecutive layers (``Executor.run_split``)."""
    p.add_argument("--split-layers", type=positive_int, default=1, metavar="N",
                   help="run each configuration as N jobs, one per group of consecutive layers (N at most the "
                        "layers a policy compresses), on the local workers or --ray: for one long trace across "
                        "machines. Budgets that couple layers (PyramidKV, D2O) are allocated once over all layers "
                        "here and shipped with each group; results are identical to N = 1" + extra)


def add_threads_option(p: argparse.ArgumentParser) -> None:
    """``--threads N`` for a command that runs a model in this process: caps its numba, BLAS and torch pools."""
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="cap this process's numba, BLAS and torch thread pools at N (default: every core). Set it "
                        "below the core count when other heavy work shares the machine: torch's OpenMP threads "
                        "wait on each other, and one sharing a core with a busy process slows every step")


def apply_threads(args: argparse.Namespace) -> None:
    """Cap this process's pools at ``args.threads`` (`add_threads_option`) when it is given."""
    if getattr(args, "threads", None):
        from sim.replay.threads import limit_threads

        limit_threads(args.threads)


def add_device_options(p: argparse.ArgumentParser, *, backend: bool = True) -> None:
    """``--device`` and (with ``backend``) ``--backend``: where a model command runs the model and its cache
    (``gpu_validate.kvcache.backends.pick_device`` fills in what is not given)."""
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    if backend:
        p.add_argument("--backend", choices=("torch", "triton"), default=None,
                       help="cache kernels: triton (default on cuda) or the torch reference (default on cpu)")


def add_quiet_option(p: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress bar."""
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def trace_ref(args: argparse.Namespace, spec: str):
    """One TRACE argument as a reference every worker process can reopen (with the command's --no-verify)."""
    from sim.experiments.executors import TraceRef

    return TraceRef(spec, args.tokens, args.prompt, args.layers, args.seed, verify=not args.no_verify,
                    sliding=args.sliding, chunk=args.chunk)


def trace_refs(args: argparse.Namespace) -> list:
    """The TRACE arguments as references every worker process can reopen."""
    return [trace_ref(args, spec) for spec in args.traces]


def load(args: argparse.Namespace, spec: str) -> Trace:
    """Open one TRACE argument in this process with the command's synthetic sizes and --no-verify."""
    from sim.experiments.specs import open_trace

    return open_trace(spec, n_tokens=args.tokens, n_prompt=args.prompt, n_layers=args.layers, seed=args.seed,
                      verify=not args.no_verify)


def add_model_option(p: argparse.ArgumentParser, *, default: str | None = "smollm2-135m") -> None:
    """``--model NAME|DIR|FILE.gguf``, resolved by traces.models (the one place that knows models)."""
    p.add_argument("--model", default=default, required=default is None, metavar="NAME|DIR|FILE.gguf",
                   help="a registered model (`kvsim models`: smollm2-135m, gemma3-270m, tiny), a local Hugging Face "
                        "folder, or a .gguf file (Llama, Qwen2, Qwen3, Mistral, Gemma-3)")


def add_text_option(p: argparse.ArgumentParser, *, what: str = "text") -> None:
    """``--text NAME|FILE``: a shipped text (traces.model.SHIPPED_TEXTS) or a UTF-8 file."""
    from traces.texts import SHIPPED_TEXTS

    p.add_argument("--text", default="default", metavar="NAME|FILE",
                   help=f"{what}: a shipped text ({', '.join(SHIPPED_TEXTS)}: 'default' is the held-out pydoc "
                        "chapters, 'idle' the IDLE chapter of the Python docs) or a UTF-8 text file")
