"""``kvsim fidelity``: rank correlation of the simulator's loss with the real model's, over policies × budgets."""
from __future__ import annotations

import argparse
from pathlib import Path

from sim.commands._common import add_budgets_option, add_policies_option
from gpu_validate.model_commands.validate_cmd import add_model_args, load_model_and_ids


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fidelity", help="measure how well the simulator predicts the real model's losses",
                       description="Record a trace of the model on the text, replay every policy x budget in the "
                                   "simulator and run it closed-loop in the model; report Spearman rho between "
                                   "simulated losses and the model's ΔPPL / top-1 disagreement next to the model's "
                                   "own reliability on the text, pair agreement next to its base rate, open-loop "
                                   "kept-set agreement, a scatter plot and an HTML page of it all. The oracle is "
                                   "skipped (it cannot run closed-loop).")
    add_model_args(p)
    p.set_defaults(prompt=128, decode=64)
    add_policies_option(p, default="all", extra=" (the oracle is skipped: it cannot run closed-loop)")
    add_budgets_option(p, default=[16, 32, 64])
    p.add_argument("--open-steps", type=int, default=16, help="decode steps compared in open loop")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default: kvsim-out/fidelity_<device>.json in the working directory, device cpu "
                        "or cuda; the PNG and the HTML page go beside it)")
    p.set_defaults(func=run)


def default_out(device: str) -> Path:
    """Where ``kvsim fidelity`` writes without ``--out``: ``kvsim-out/fidelity_<device>.json`` under the working
    directory (``cuda:1`` counts as ``cuda``), beside the other commands' outputs."""
    return Path("kvsim-out") / f"fidelity_{device.split(':')[0]}.json"


def run(args: argparse.Namespace) -> int:
    import json

    import torch

    from gpu_validate.studies.fidelity.rank_fidelity import pair_agreement, plot_fidelity, run_fidelity, token_reliability
    from gpu_validate.studies.fidelity.fidelity_page import fidelity_page, fidelity_tables
    from gpu_validate.studies.page_parts import run_info
    from sim.commands._common import command_line
    from sim.reports.table import print_tables
    from sim.experiments.specs import parse_policy_list
    from traces.format import atomic_write_text
    from traces.model import read_text
    from traces.models import model_id

    torch.set_grad_enabled(False)
    policies = parse_policy_list(args.policies, exclude=("oracle",))
    if any(b > args.prompt + args.decode for b in args.budgets):
        raise ValueError(f"budgets {args.budgets} must not exceed --prompt + --decode = {args.prompt + args.decode}")
    model, _, ids, device, backend = load_model_and_ids(args)
    report = run_fidelity(model, ids[:args.prompt + args.decode], policies, args.budgets, n_prompt=args.prompt,
                          n_open_steps=args.open_steps, backend=backend, model_id=model_id(args.model),
                          sliding=args.sliding, chunk=args.chunk)
    out = Path(args.out or default_out(device))
    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot_fidelity(report, out.with_suffix(".png"))
    report.update(plot=str(png), text=read_text(args.text)[1], command=command_line(args), **run_info(),
                  model_reliability=token_reliability(report["rows"]), pair_agreement=pair_agreement(report["rows"]))
    atomic_write_text(out, json.dumps(report, indent=1, default=float))
    best = report["best_sim_metric"]
    print(f"Spearman rho (sim err_mean vs ΔPPL): {report['rho_primary']:.3f}  (target >= 0.9)")
    for m, b in best.items():
        print(f"best simulated predictor of {m}: {b['metric']} (rho {b['rho']:.3f})")
    within = report["spearman_within_budget"]["err_mean"]
    print(f"within-budget rho among lossy policies (err_mean): ΔPPL {within['delta_nll']:.3f}, "
          f"top-1 {within['top1_disagreement']:.3f}")
    print(f"open-loop kept-set agreement: {report['kept_agreement']:.4f}  (target >= 0.99)")
    rel, pairs = report["model_reliability"], report["pair_agreement"]
    if rel:
        print(f"the model's own reliability on this text (split-half over {rel['block_tokens']}-token blocks): "
              f"{rel['pooled']:.3f} over all, {rel['within_budget']:.3f} within a budget")
    print(f"pairs of policies ordered as the model orders them: {pairs['agreement']:.3f} (base rate "
          f"{pairs['base_rate']:.3f}, {pairs['n_pairs']} pairs)")
    print_tables(fidelity_tables(report)[0], f"kvsim fidelity — the model's ranking on {report['model']}")
    page = fidelity_page(report, out.with_suffix(".html"), plot=png)
    print(f"wrote {out} and {png}\npage: {page}")
    return 0
