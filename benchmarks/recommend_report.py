"""Stage 2 of benchmarks/recommend.py: recommendations made on some segments, judged on segments they never saw
against the exhaustive closed-loop grid there (see that file's docstring).

Three kinds of split. **Folds** (the headline): the recommendation sees segment i of each text and is judged on the
other segments of the same texts -- a user samples their corpus and deploys on the rest of it. **Halves** (from 4
segments a text): it sees half of each text's segments, every choice of them, and is judged on the other half -- the
same user with more of their text sampled, which says what more seen text buys. **Cross-text**: it sees every
segment of one text and is judged on the other text -- a distribution shift, reported beside the folds.
A cell is one (split, budget); the model's own split-half reliability on the held-out segments of the cell says
which cells can judge a ranking at all, and the summary gives the shares over every cell and over the reliable ones.

**The model's own ceiling.** Beside the simulator's first pick, each cell judges the pick of a perfect simulator:
the model's own closed-loop loss on the segments the recommendation sees (``model_on_seen_first``), and each
recommendation the answer of the model's whole grid there (``model_on_seen``: the smallest budget whose best
configuration meets the target). Nothing predicted from those segments knows the held-out ones better than the
model's own losses there, so these shares (``model_on_seen_*`` in the summary) are what the goals can be measured
against: where the model's own ranking does not carry from seen to held-out segments, no simulator's can.
"""
from __future__ import annotations

import itertools
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np
import pandas as pd

#: targets whose recommendations are judged besides the model's headline one (``dnll=`` values)
EXTRA_TARGETS = (0.1, 0.2)
VALIDATE = 3
#: a held-out cell judges a ranking when the model agrees with itself at least this well there
RELIABLE = 0.8


def rank_stats(first: str, model: pd.Series, default_pick: str) -> dict[str, Any]:
    """Where configuration ``first`` sits in the model's order (``model``: loss per label) and its regret: its loss
    above the model's best, in nats and as a share of the regret of ``default_pick``, the configuration chosen
    without any hyperparameter search (the simulator's first among the paper defaults): 0 is the model's best, 1 no
    better than ranking paper defaults, inf: the default pick is the model's best and ``first`` is worse."""
    order = model.sort_values().index.tolist()
    best = model.min()
    denom, regret = model[default_pick] - best, model[first] - best
    share = 0.0 if regret <= 0 else (regret / denom if denom > 0 else float("inf"))
    return {"pick": first, "pick_model_rank": order.index(first) + 1, "in_top3": order.index(first) < 3,
            "regret_nats": float(regret), "regret_share": float(share), "model_best": order[0],
            "default_pick": default_pick, "default_pick_model_rank": order.index(default_pick) + 1}


def within_family_rho(sim: pd.DataFrame, model: pd.DataFrame, family_of: dict[str, str]) -> dict[str, float]:
    """Per family of >= 3 configurations: Spearman rho of the simulated and the model's means over the family's
    hyperparameter values, averaged over budgets (``sim`` and ``model``: index label, columns budgets)."""
    from gpu_validate.fidelity import spearman

    out = {}
    for fam in sorted(set(family_of.values())):
        labs = [lab for lab in sim.index if family_of[lab] == fam]
        if len(labs) >= 3:
            vals = [spearman(sim.loc[labs, b], model.loc[labs, b]) for b in sim.columns]
            out[fam] = round(float(np.nanmean(vals)), 6) if np.isfinite(vals).any() else float("nan")
    return out


def model_on_seen_answer(seen: pd.DataFrame, held: pd.DataFrame, tg, smallest_held: int | None) -> dict[str, Any]:
    """The recommendation a perfect simulator would make, the model's exhaustive grid on the seen segments
    (``seen``, ``held``: label x budget losses): the smallest budget where its best configuration meets the target,
    judged on the held-out segments as the recommendation is."""
    meet = [b for b in seen.columns if tg.met(seen[b].min())]
    if not meet:
        return {"met_on_seen": False, "held_out_met": False, "budget_ratio": float("nan")}
    b = meet[0]
    label = seen[b].idxmin()
    loss = float(held.loc[label, b])
    return {"met_on_seen": True, "budget": int(b), "label": label, "held_out_loss": loss,
            "held_out_met": tg.met(loss), "budget_ratio": b / smallest_held if smallest_held else float("nan")}


def splits(segs: dict[str, list]) -> list[dict[str, Any]]:
    """The folds (segment i of each text seen, the rest held out), the halves (every way of seeing half of each
    text's segments, the same indices in every text, the other half held out; from 4 segments a text) and the two
    cross-text splits."""
    n = min(len(v) for v in segs.values())
    out = [{"name": f"fold {i}", "kind": "fold", "seen": [v[i] for v in segs.values()],
            "held": [s for v in segs.values() for j, s in enumerate(v) if j != i]} for i in range(n)]
    if n >= 4:
        for seen in itertools.combinations(range(n), n // 2):
            out.append({"name": "half " + ",".join(map(str, seen)), "kind": "halves",
                        "seen": [v[i] for v in segs.values() for i in seen],
                        "held": [s for v in segs.values() for j, s in enumerate(v) if j not in seen]})
    texts = list(segs)
    out += [{"name": f"{a} -> {b}", "kind": "cross_text", "seen": segs[a], "held": segs[b]}
            for a in texts for b in texts if a != b]
    return out


def summarise(cells: Sequence[dict], recs: Sequence[dict], reliable_only: bool) -> dict[str, float]:
    """The issue's summary shares over cells (and over the recommendations of the headline target)."""
    cells = [c for c in cells if c["held_reliability"] >= RELIABLE] if reliable_only else list(cells)

    def share(xs) -> float:
        return float(np.mean(xs)) if len(xs) else float("nan")

    def median(xs) -> float:
        return float(np.median(xs)) if len(xs) else float("nan")

    return {"cells": len(cells),
            "pick_in_model_top3_share": share([c["simulator_first"]["in_top3"] for c in cells]),
            "median_regret_share": median([c["simulator_first"]["regret_share"] for c in cells]),
            "median_regret_nats": median([c["simulator_first"]["regret_nats"] for c in cells]),
            "recommendation_pick_in_model_top3_share": share([c["recommendation_pick"]["in_top3"] for c in cells]),
            "recommendation_median_regret_share": median([c["recommendation_pick"]["regret_share"] for c in cells]),
            "recommendation_median_regret_nats": median([c["recommendation_pick"]["regret_nats"] for c in cells]),
            "target_met_share": share([r["held_out_met"] for r in recs]),
            # an answer may say the target is met at no budget tried: the share that claim, and how many of those
            # claims held on the held-out segments
            "claimed_met_share": share([r["answer"]["met"] for r in recs]),
            "target_met_share_of_claimed": share([r["held_out_met"] for r in recs if r["answer"]["met"]]),
            "budget_ratio_median": float(np.nanmedian([r["budget_ratio"] for r in recs])) if recs else float("nan"),
            "model_runs_share": share([r["model_runs_share"] for r in recs]),
            "model_on_seen_pick_in_model_top3_share": share([c["model_on_seen_first"]["in_top3"] for c in cells]),
            "model_on_seen_median_regret_share": median([c["model_on_seen_first"]["regret_share"] for c in cells]),
            "model_on_seen_median_regret_nats": median([c["model_on_seen_first"]["regret_nats"] for c in cells]),
            "model_on_seen_target_met_share": share([r["model_on_seen"]["held_out_met"] for r in recs]),
            "model_on_seen_claimed_met_share": share([r["model_on_seen"]["met_on_seen"] for r in recs]),
            "model_on_seen_target_met_share_of_claimed": share([r["model_on_seen"]["held_out_met"] for r in recs
                                                                if r["model_on_seen"]["met_on_seen"]]),
            "model_on_seen_budget_ratio_median": (float(np.nanmedian([r["model_on_seen"]["budget_ratio"] for r in recs]))
                                                  if recs else float("nan"))}


def report(args, load) -> int:
    from benchmarks._util import machine, write_result
    from gpu_validate.fidelity import split_half_reliability
    from gpu_validate.recommend import SIM_LOSS, SIM_LOSSES, Recommender
    from gpu_validate.recommend_grid import Target, budget_ladder, candidates
    from gpu_validate.segments import simulated
    from sim.runinfo import kvsim_version, now
    from sim.store import ResultStore
    from traces.texts import SHIPPED_TEXTS

    t0 = time.perf_counter()
    model, _, by_text = load(args)
    cands = candidates()
    family_of = {c.label: c.family for c in cands}
    default = {c.family: c.label for c in cands if c.default}
    budgets = budget_ladder(args.prompt, args.budgets)
    configs = [(c.policy, b) for c in cands for b in budgets]
    grid_store, sim_store = ResultStore(args.store), ResultStore(args.store + "-sim")
    closed = grid_store.load()
    closed = closed[closed.model == args.model]
    done = closed.groupby("segment").size()
    segs = {t: [s for s in by_text[t] if done.get(s.name, 0) >= len(configs)] for t in by_text}
    print(f"segments with the whole grid run: {({t: len(v) for t, v in segs.items()})}", flush=True)
    sim = pd.DataFrame(simulated(model, [s for v in segs.values() for s in v], configs, n_prompt=args.prompt,
                                 model_id=args.model, store=sim_store))
    cols = ["segment", "label", "budget"]
    merged = closed[[*cols, "text", "delta_nll", "top1_disagreement"]].merge(sim[[*cols, *SIM_LOSSES]], on=cols)
    values = ["delta_nll", "top1_disagreement", *SIM_LOSSES]
    per_seg = merged.set_index(["segment", "label", "budget"])[values]

    def table(segments: Sequence, col: str) -> pd.DataFrame:
        """label x budget: the mean of ``col`` over ``segments``."""
        names = [s.name for s in segments]
        part = per_seg[per_seg.index.get_level_values("segment").isin(names)]
        return part[col].groupby(["label", "budget"]).mean().unstack("budget")

    def reliability(segments: Sequence, b: int) -> float:
        """The model's split-half reliability (Spearman-Brown) of its ranking of every configuration at b."""
        if len(segments) < 2:
            return float("nan")
        rows = [per_seg.loc[s.name]["delta_nll"].xs(b, level="budget").loc[sorted(family_of)] for s in segments]
        return float(split_half_reliability(np.stack(rows))["spearman_brown"])

    target = Target.parse(args.target)
    targets = [target] + [Target.parse(f"{target.name}={v}") for v in EXTRA_TARGETS]
    def judge(sp: dict, tg, validate: int, per_family: int, recs: list, cells: list | None) -> None:
        """One recommendation on the split's seen segments, judged on its held-out ones; its per-budget cells
        (``cells``) for the headline target."""
        with tempfile.TemporaryDirectory() as tmp:
            rec = Recommender(model, sp["seen"], cands, budgets, tg, n_prompt=args.prompt, model_id=args.model,
                              out=tmp, validate=validate, per_family=per_family, closed_store=grid_store,
                              sim_store=sim_store, progress=False, log=lambda s: None).run()
        a = rec["answer"]
        held = table(sp["held"], tg.column)
        held_loss = float(held.loc[a["choice"]["label"], a["budget"]])
        meets = [b for b in budgets if (held[b] <= tg.limit).any()]
        seen = table(sp["seen"], tg.column)
        recs.append({"split": sp["name"], "kind": sp["kind"], "target": str(tg), "answer": a,
                     "held_out_loss": held_loss, "held_out_met": tg.met(held_loss),
                     "smallest_grid_budget_meeting_target": meets[0] if meets else None,
                     "budget_ratio": a["budget"] / meets[0] if meets else float("nan"), "model_runs": rec["model_runs"],
                     "model_runs_share": rec["model_runs"] / (len(configs) * len(sp["held"])),
                     "confidence": rec["confidence"], "calibration": rec["calibration"],
                     "model_on_seen": model_on_seen_answer(seen, held, tg, meets[0] if meets else None)})
        print(f"{sp['name']} {tg} (validate {validate}, {per_family}/family): {a['choice']['label']} @ {a['budget']}, "
              f"held-out {held_loss:.4f} ({'meets' if tg.met(held_loss) else 'MISSES'}), smallest meeting "
              f"{meets[:1]}", flush=True)
        if cells is None:
            return
        sim_seen, model_seen = table(sp["seen"], SIM_LOSS), table(sp["seen"], tg.column)
        for rung in rec["per_budget"]:
            b = rung["budget"]
            default_pick = sim_seen.loc[list(default.values()), b].idxmin()
            model_default_pick = model_seen.loc[list(default.values()), b].idxmin()
            cells.append({"split": sp["name"], "kind": sp["kind"], "budget": b,
                          "held_reliability": reliability(sp["held"], b),
                          "simulator_first": rank_stats(sim_seen[b].idxmin(), held[b], default_pick),
                          "model_on_seen_first": rank_stats(model_seen[b].idxmin(), held[b], model_default_pick),
                          "recommendation_pick": {**rank_stats(rung["pick"]["label"], held[b], default_pick),
                                                  "source": rung["source"]}})

    recs: list = []
    cells: list = []
    more_recs: list = []
    more_cells: list = []
    every_split = splits(segs)
    for sp in every_split:
        for tg in targets:
            judge(sp, tg, VALIDATE, 2, recs, cells if tg is target else None)
            if sp["kind"] == "fold":      # what confirming one configuration of every family buys
                judge(sp, tg, len(default), 1, more_recs, more_cells if tg is target else None)

    summary: dict[str, Any] = {"sim_loss": SIM_LOSS}
    for kind in sorted({sp["kind"] for sp in every_split}):
        kc = [c for c in cells if c["kind"] == kind]
        kr = [r for r in recs if r["kind"] == kind]
        summary[kind] = {"all_cells": summarise(kc, kr, False), "reliable_cells": summarise(kc, kr, True)}
    summary.update(summary["fold"]["all_cells"])             # the headline fields at the top level, as the issue asks
    summary["fold_validate_every_family"] = {"validate": len(default), "per_family": 1,
                                             "all_cells": summarise(more_cells, more_recs, False),
                                             "reliable_cells": summarise(more_cells, more_recs, True)}
    every = [s for v in segs.values() for s in v]
    summary["within_family_rho"] = {t: within_family_rho(table(v, SIM_LOSS), table(v, "delta_nll"), family_of)
                                    for t, v in segs.items()}
    texts = list(segs)          # the model on one text against itself on another (symmetric)
    summary["within_family_rho_model_across_texts"] = {
        f"{a} <-> {b}": within_family_rho(table(segs[a], "delta_nll"), table(segs[b], "delta_nll"), family_of)
        for i, a in enumerate(texts) for b in texts[i + 1:]}
    summary["within_family_rho_by_sim_loss"] = {s: within_family_rho(table(every, s), table(every, "delta_nll"),
                                                                     family_of) for s in SIM_LOSSES}
    summary["model_split_half_reliability"] = {
        **{t: {b: reliability(v, b) for b in budgets} for t, v in segs.items()},
        "all_segments": {b: reliability(every, b) for b in budgets}}
    summary["goals"] = {"pick_in_model_top3_share": ">= 0.8", "median_regret_share": "<= 0.10",
                        "target_met_share": ">= 0.9", "budget_ratio_median": "<= 1.25", "model_runs_share": "<= 0.10"}
    means = merged.groupby(["text", "label", "budget"])[values].mean()
    rows = [{"text": t, "label": lab, "family": family_of[lab], "budget": int(b), **{k: float(v) for k, v in r.items()}}
            for (t, lab, b), r in means.iterrows()]
    out = {"model": args.model, "texts_seen": list(segs), "texts_held_out": list(segs),
           "split_note": "folds: segment i of each text seen, the other segments of the same texts held out; "
                         "halves: half of each text's segments seen (every choice of indices), the other half held "
                         "out; cross_text: one text seen, the other held out",
           "texts": {t: SHIPPED_TEXTS[t][1] for t in segs}, "segments": {t: [s.name for s in v] for t, v in segs.items()},
           "n_prompt": args.prompt, "n_decode": args.decode, "target": str(target),
           "targets": [str(t) for t in targets], "validate": VALIDATE, "reliable_threshold": RELIABLE,
           "grid": {"families": {f: [c.label for c in cands if c.family == f] for f in default},
                    "budgets": budgets, "configurations": len(cands), "closed_loop_runs": len(configs) * len(every)},
           "summary": summary, "recommendations": recs, "cells": cells,
           "recommendations_validate_every_family": more_recs, "rows": rows,
           "seconds": time.perf_counter() - t0, "machine": machine(), "kvsim": kvsim_version(), "date": now(),
           "command": "python -m benchmarks.recommend " + " ".join(sys.argv[1:])}
    path = write_result(f"recommend_{args.model}", out)
    for k, v in summary.items():
        print(f"{k}: {v}")
    print(f"wrote {path}")
    return 0
