"""``kvsim demo``: record (or generate) a default trace, replay every policy at several budgets, show the ranking."""
from __future__ import annotations

import argparse
from typing import Callable

from sim.commands._common import add_budgets_option, add_model_option, add_out_option, positive_int

DEMO_LAYERS = 4
"""Layers the demo keeps by default (evenly spaced, first and last included): replaying every policy on all
layers of a real model takes minutes on a small CPU; ``--keep-layers all`` keeps them all."""


def _layers(text: str) -> str | list[int]:
    """``all`` or comma-separated layer indices like ``0,15,29``."""
    if text == "all":
        return text
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected 'all' or layer indices like 0,15,29, got {text!r}")
    return values


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="replay all policies on a real model's trace; print a ranked table, write a page",
                       description="Record a trace of a real model (SmolLM2-135M by default, fetched and converted "
                                   "on first use) on kvsim's shipped held-out text, or generate a synthetic one; "
                                   "replay every registered policy at several budgets, print the ranked table and "
                                   "write OUT/demo.html, a self-contained page: what ran, the table per budget, the "
                                   "legend, loss-vs-budget, loss-vs-memory and occupancy plots (also as PNGs).")
    add_model_option(p)
    p.add_argument("--synthetic", metavar="KIND", default=None,
                   help="use a synthetic trace of this kind instead of a model (e.g. mixed)")
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens in the demo trace")
    p.add_argument("--prompt", type=positive_int, default=512, help="prompt tokens of the demo trace")
    p.add_argument("--keep-layers", dest="layers", type=_layers, default=None, metavar="LIST|all",
                   help=f"model layers to record and replay, e.g. 0,5,29 or all (default: {DEMO_LAYERS} evenly "
                        "spaced layers)")
    add_budgets_option(p, default=[32, 64, 128, 256])
    add_out_option(p, "kvsim-out", "output directory")
    p.set_defaults(func=run)


def demo_layers(n_layers: int, wanted: str | list[int] | None, layer_types: list[str] | None = None) -> tuple[int, ...]:
    """The layers the demo records: all, the given ones, or DEMO_LAYERS of them: evenly spaced, or on a hybrid
    model (``layer_types`` with sliding layers) every global layer first, since those are what a policy
    compresses, then the first sliding one."""
    if wanted == "all" or (wanted is None and n_layers <= DEMO_LAYERS):
        return tuple(range(n_layers))
    if wanted is not None:
        return tuple(wanted)
    if layer_types and "sliding_attention" in layer_types:
        glob = [i for i, t in enumerate(layer_types) if t != "sliding_attention"][:DEMO_LAYERS - 1]
        return tuple(sorted(glob + [layer_types.index("sliding_attention")]))
    import numpy as np

    return tuple(int(x) for x in np.unique(np.round(np.linspace(0, n_layers - 1, DEMO_LAYERS))))


def demo_trace(args: argparse.Namespace, before_slow_work: Callable[[], None] = lambda: None,
               reconstruction_chunk: int | None = None):
    """The demo's trace: the model on the shipped text (recorded once into --out, then reused), or synthetic.
    ``before_slow_work()`` is called before the model is fetched and converted or the trace recorded (not when
    both are already done): the demo compiles its kernels meanwhile. ``reconstruction_chunk``: the trace holds
    KVzip's context-reconstruction pass in chunks of that size (a reused trace without it is recorded again)."""
    import json

    from sim.experiments.executors import TraceRef
    from traces.format import TraceError, load_trace
    from traces.model import record_default_trace
    from traces.models import entry, is_cached, model_id, resolve_model

    if args.synthetic:
        return TraceRef(f"synthetic:{args.synthetic}", args.tokens, args.prompt, 2)
    registered = entry(args.model)
    if registered is not None and not registered.shipped and not is_cached(registered):
        before_slow_work()
    folder = resolve_model(args.model)
    config = json.loads((folder / "config.json").read_text())
    n_layers = config["num_hidden_layers"]
    layers = demo_layers(n_layers, args.layers, config.get("layer_types"))
    name = model_id(args.model)
    tag = "all" if len(layers) == n_layers else "-".join(map(str, layers))
    path = args.out / f"demo-trace-{name}-{args.prompt}-{args.tokens - args.prompt}-L{tag}"
    try:
        plan = load_trace(path).meta.reconstruction
        if reconstruction_chunk and (plan is None or plan.chunk_size != reconstruction_chunk):
            raise TraceError(f"{path} has no reconstruction pass in chunks of {reconstruction_chunk}")
    except TraceError:
        before_slow_work()
        print(f"recording the demo trace of {name} (layers {', '.join(map(str, layers))} of {n_layers}) "
              f"into {path} ...", flush=True)
        record_default_trace(path, n_prompt=args.prompt, n_decode=args.tokens - args.prompt, layers=layers,
                             overwrite=True, model=args.model, reconstruction_chunk=reconstruction_chunk)
    if len(layers) < n_layers:
        print(f"recorded layers {', '.join(map(str, layers))} of {name}'s {n_layers} "
              f"(--keep-layers all for every layer)")
    return TraceRef(str(path))


def describe_replayed(trace) -> str:
    """Which of the trace's layers the policies compress, and what the others keep (hybrid models)."""
    from sim.replay.plan import compressed_layers

    ids = trace.meta.model.layer_ids
    comp = compressed_layers(trace)
    kept = [i for i in range(trace.n_layers) if i not in comp]
    text = f"policies compress layers {', '.join(str(ids[i]) for i in comp)}"
    if kept:
        windows = sorted({trace.meta.attention(i).window for i in kept})
        which = ", ".join(str(ids[i]) for i in kept)
        text += (f" (global); sliding layer{'s' if len(kept) > 1 else ''} {which} keep{'' if len(kept) > 1 else 's'} "
                 f"{'their' if len(kept) > 1 else 'its'} {'/'.join(map(str, windows))}-token window, counted in the "
                 "memory held (--sliding compress in replay/sweep compresses them too)")
    return text


#: policies whose cache occupancy the demo page draws (at the middle budget): a window, sinks + window, two
#: attention-score policies and two paper policies, next to the oracle
OCCUPANCY_POLICIES = ("streaming_llm", "h2o", "snapkv", "buzz", "bumblebee", "oracle")


def _fits(policy, budget: int) -> bool:
    """Whether ``policy`` accepts ``budget`` (BUZZ, for one, needs room for its sinks, window and threshold)."""
    try:
        policy.check_budget(budget)
    except ValueError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    from policies import get_policy, list_policies
    from policies.core.base import reconstruction_chunk
    from sim.commands._common import command_line
    from sim.experiments.executors import default_workers
    from sim.reports.sweep_page import sweep_page
    from sim.reports.report import occupancy_figure, plot_budget_curves, plot_pareto, print_ranked
    from sim.reports.runinfo import save_trace_facts, trace_facts
    from sim.experiments.specs import trace_id
    from sim.experiments.store import ResultStore
    from sim.experiments.sweep import run_sweep, with_oracle_gap
    from sim.replay.threads import available_cores
    from sim.replay.warmup import background_compile, wait_all

    args.out.mkdir(parents=True, exist_ok=True)
    names = list_policies(combinators=False)
    warming: list = []

    def compile_meanwhile() -> None:
        """Compile every policy's kernels on all cores while the model is converted and recorded (a first run's
        cost is mostly numba compiling; later runs load the kernels from its disk cache)."""
        if not warming:
            warming.extend(background_compile(names, available_cores()))

    policies = [get_policy(n) for n in names]
    ref = demo_trace(args, compile_meanwhile, reconstruction_chunk(policies))     # KVzip reads its rereading pass
    if any(p.poll() is None for p in warming):
        print("finishing the policies' numba kernels (first run only; later runs load them from the cache) ...",
              flush=True)
        wait_all(warming)
    trace = ref.open()[0]
    print(repr(trace))
    print(describe_replayed(trace))
    model = f"synthetic:{args.synthetic}" if args.synthetic else trace.meta.model.model_id
    layers = "" if args.synthetic else f", layers {','.join(map(str, trace.meta.model.layer_ids))}"
    title = f"kvsim demo — {model}{layers}"
    store = ResultStore(args.out / "demo-results")
    save_trace_facts(store.root, trace)
    df = run_sweep([ref], policies, args.budgets, store, workers=default_workers())
    tid = trace_id(trace)
    df = with_oracle_gap(df[(df.trace_id == tid) & df.budget.isin(args.budgets)])
    print_ranked(df, title=title)
    figures = {"budget_curves": plot_budget_curves(df, args.out / "demo.png", title=title),
               "pareto": plot_pareto(df, args.out / "demo-pareto.png")}
    budget = sorted(args.budgets)[len(args.budgets) // 2]
    drawn = [pol for pol in map(get_policy, OCCUPANCY_POLICIES) if _fits(pol, budget)]
    if drawn and budget <= trace.meta.n_tokens:
        figures["occupancy"] = occupancy_figure(trace, drawn, budget, args.out / "demo-occupancy.png")
    page = sweep_page(df, args.out / "demo.html", title=title, facts={tid: trace_facts(trace)}, figures=figures,
                      command=command_line(args))
    print(f"page: {page} (open it in a browser: the header says what ran; plots, the table per budget, legend)\n"
          f"plots: {', '.join(str(p) for p in figures.values())}\n"
          f"results store: {store.root} (rerun to resume/extend)")
    return 0
