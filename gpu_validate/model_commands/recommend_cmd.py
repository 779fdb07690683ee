"""``kvsim recommend``: the policy, its hyperparameters and the smallest budget that meets a quality target on the
user's model and texts, simulated then confirmed in the model (`gpu_validate.studies.recommendation.recommender`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from sim.commands._common import (add_device_options, add_model_option, add_quiet_option, add_threads_option, int_list,
                                  positive_int)


def register(sub: argparse._SubParsersAction) -> None:
    from gpu_validate.studies.recommendation.candidates import COMBINATORS, TARGETS
    from traces.texts import SHIPPED_TEXTS

    p = sub.add_parser(
        "recommend", help="the policy, parameters and smallest budget meeting a quality target, confirmed in the model",
        description="Record a trace of each text segment, simulate every candidate configuration (every registered "
                    "policy's paper default and the hyperparameter values its module declares) at a ladder of "
                    "budgets on the first segment and the best of them (--race) on the others, calibrate the simulator's losses on a few closed-loop runs of this model, confirm the "
                    "simulator's best configurations near the target in the model, refine the budget between the "
                    "rungs, and answer: the smallest budget whose confirmed best meets the target, that "
                    "configuration, its runner-up, their predicted and measured losses, the memory they hold, a "
                    "confidence, and the budget a distribution-free guarantee certifies (--alpha). Writes "
                    "recommend.json, front.png and recommend.html to --out; closed-loop runs are stored there, so an "
                    "interrupted run resumes.")
    add_model_option(p)
    p.add_argument("--text", nargs="+", default=["default"], metavar="NAME|FILE",
                   help=f"your texts: shipped ({', '.join(SHIPPED_TEXTS)}) or UTF-8 files; --segments windows of "
                        "each are simulated and run")
    p.add_argument("--segments", type=positive_int, default=3,
                   help="segments per text (a retrieval target: pass-key seeds per text, each at 5 depths)")
    p.add_argument("--prompt-tokens", type=positive_int, default=512, help="prompt tokens of a segment")
    p.add_argument("--decode-tokens", type=positive_int, default=128,
                   help="tokens after the prompt, scored teacher-forced")
    p.add_argument("--target", required=True, metavar="NAME=VALUE",
                   help="; ".join(f"{k}=X: {v[1]}" for k, v in TARGETS.items()))
    p.add_argument("--policies", default="all", metavar="LIST",
                   help="';'-separated policy names (each with the hyperparameter values its module declares) or "
                        "specs (one configuration each); 'all' = every registered policy (`kvsim policies`) and the "
                        f"combinators {', '.join(f'{c}(...)' for c in COMBINATORS)} over every scorer they accept")
    p.add_argument("--budgets", type=int_list, default=None, metavar="B,B,...",
                   help="budgets to consider (slots per KV head and layer); none given: a ladder at ratio 1.5 from "
                        "1/16 to 3/4 of the prompt")
    p.add_argument("--validate", type=positive_int, default=3, metavar="K",
                   help="configurations confirmed in the model per budget near the target")
    p.add_argument("--race", type=int, default=None, metavar="N",
                   help="candidates simulated on every segment: those among the N best at some budget on the first "
                        "(default 16: on the recommend benchmark's splits no shortlist changed; 0: every candidate "
                        "on every segment)")
    p.add_argument("--alpha", type=float, default=None, metavar="A",
                   help="level of the distribution-free guarantee: the certified budget meets the target on a new "
                        "window of your text with probability >= 1 - A, assuming only that it is exchangeable with "
                        "the segments measured (default 0.1 where the segments can certify it, i.e. 9 or more, else "
                        "1/(n+1)); a level the segments cannot certify is refused. A retrieval target: the "
                        "Clopper-Pearson level over the pass-key prompts (default 0.05)")
    add_device_options(p, backend=False)
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="confirm in the model on Ray: a cluster address (ray://host:10001, auto) or 'local'; each "
                        "batch of closed-loop runs is one task that loads --model itself (it must exist on every "
                        "node), runs on --threads threads (default 1) and, with --device cuda, declares one GPU (needs "
                        "kvsim[ray])")
    p.add_argument("--out", type=Path, required=True, help="output folder (and the store a rerun resumes from)")
    add_threads_option(p)
    add_quiet_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from gpu_validate.studies.page_parts import run_info
    from gpu_validate.studies.recommendation.recommend_page import (answer_lines, plot_front, print_report,
                                                                    recommend_page)
    from gpu_validate.studies.recommendation.recommender import recommend_texts
    from sim.commands._common import apply_threads, command_line
    from traces.format import atomic_write_text

    apply_threads(args)
    args.out.mkdir(parents=True, exist_ok=True)
    report = recommend_texts(args.model, args.text, args.target, out=args.out, segments=args.segments,
                             prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
                             policies=args.policies, budgets=args.budgets or "auto", validate=args.validate,
                             device=args.device, progress=not args.quiet, ray_address=args.ray,
                             threads=args.threads or 1, alpha=args.alpha, race=args.race)
    report.update(command=command_line(args), **run_info())
    png = plot_front(report, args.out / "front.png")
    atomic_write_text(args.out / "recommend.json", json.dumps(report, indent=1, default=float))
    page = recommend_page(report, args.out / "recommend.html", plot=png)
    print_report(report)
    for line in answer_lines(report):
        print(line)
    print(f"JSON {args.out / 'recommend.json'}, page {page}")
    return 0
