"""Stage 2 of benchmarks/recommend.py: recommendations made on some segments, judged on segments they never saw
against the exhaustive closed-loop grid there (see that file's docstring). The splits, the judging of one answer
and the coverage and confidence summaries are the library's (`gpu_validate.studies.recommendation
.recommend_evaluation`); `signal_analysis` (which needs scikit-learn) serves benchmarks/recommend_retrieval.py too.

Three kinds of split. **Random** (the headline): the recommendation sees ``seen`` segments drawn at random from
both texts and is judged on the others -- a user who measured part of their corpus and deploys on the rest, the
units exchangeable by construction, as the guarantee assumes; more than a hundred draws, so that the guarantee's
coverage is a measured share. **Folds**: it sees segment i of each text and is judged on the other segments of the
same texts (two seen segments: what a short run of `kvsim recommend` sees). **Cross-text**: it sees every segment
of one text and is judged on the other -- a distribution shift, which the guarantee does not cover.

The answer is judged on the held-out segments' mean loss of its configuration at its budget (``held_out_met``),
against the smallest budget at which some configuration met the target there. Where refinement tried budgets
between the grid's rungs, the configurations confirmed there are run on every segment afterwards, so that the
answer's held-out loss is measured, and the budget ratio is given two ways: against the grid's rungs (as before
refinement existed, ``budget_ratio``) and against the rungs plus the refined budgets, where "some configuration"
is one of those confirmed there (``budget_ratio_fine``).

**The model's own ceiling.** Beside the simulator's first pick, each cell judges the pick of a perfect simulator:
the model's own closed-loop loss on the segments the recommendation sees (``model_on_seen_first``), and each
recommendation the answer of the model's whole grid there (``model_on_seen``: the smallest grid budget whose best
configuration meets the target). Nothing predicted from those segments knows the held-out ones better than the
model's own losses there.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from gpu_validate.studies.recommendation.recommend_evaluation import (confidence_calibration, coverage, judge,
                                                                      relevel, share_interval, splits,
                                                                      threshold_scan)

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
    from gpu_validate.studies.fidelity.rank_fidelity import spearman

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


def signal_analysis(judged: Sequence[dict]) -> dict[str, Any]:
    """How well each candidate signal of the confidence predicts that an answer fails held out: per signal, its
    AUC for failure (0.5: no information) and the best single threshold's balanced accuracy and MCC, with the base
    rate of failure. Signals: the answer's margin in standard errors over segments, the share of its seen segments
    that met the target, the simulator's pair agreement, the calibration's error, the certificate (0: certified at
    the answer's budget, 1: above it, 2: at no budget tried)."""
    from sklearn.metrics import matthews_corrcoef, roc_auc_score

    fail = np.array([not j["held_out_met"] for j in judged])
    signals = {"margin_t": [-j["confidence"]["margin_t"] for j in judged],
               "units_met_share": [-j["margin"]["units_met_share"] for j in judged],
               "pair_agreement": [-(j["confidence"]["pair_agreement"] if j["confidence"]["pair_agreement"] ==
                                    j["confidence"]["pair_agreement"] else 0.5) for j in judged],
               "calibration_rms_log": [j["calibration_rms_log"] for j in judged],
               "certificate": [0 if j["guarantee"]["budget"] == j["answer"]["budget"] else
                               2 if j["guarantee"]["budget"] is None else 1 for j in judged]}
    out: dict[str, Any] = {"n": len(judged), "failure_base_rate": float(fail.mean()) if len(fail) else float("nan")}
    for name, raw in signals.items():
        x = np.nan_to_num(np.array(raw, float), posinf=1e9, neginf=-1e9)
        if len(set(fail)) < 2:
            out[name] = {"auc_failure": float("nan")}
            continue
        best = max(((float(np.mean([np.mean((x >= t)[fail]), np.mean((x < t)[~fail])])), t)
                    for t in np.unique(x)), default=(float("nan"), float("nan")))
        out[name] = {"auc_failure": float(roc_auc_score(fail, x)), "balanced_accuracy": best[0],
                     "mcc": float(matthews_corrcoef(fail, x >= best[1]))}
    return out


def grid_losses(closed: pd.DataFrame, names: set[str], known: set[tuple[str, int]]
                ) -> tuple[pd.DataFrame, dict[str, pd.Series]]:
    """The closed-loop rows the report judges with (segments ``names``, (label, budget) cells ``known``: the grid's
    and the refined ones confirmed) and, per target column, their losses by label, budget and segment."""
    rows = closed[closed.segment.isin(names)]
    rows = rows[[(lab, int(b)) in known for lab, b in zip(rows.label, rows.budget)]]
    by_cell = rows.set_index(["label", "budget", "segment"])
    return rows, {col: by_cell[col] for col in ("delta_nll", "top1_disagreement")}


def confidence_summary(judged: Sequence[dict]) -> dict[str, Any]:
    """The confidence against the outcome: per level, on the random splits and the folds (`confidence_calibration`),
    the candidate signals (`signal_analysis`) and the margin's threshold scan, over the answers that claim the
    target."""
    rnd = [j for j in judged if j["kind"] == "random"]
    claimed = [j for j in rnd if j["answer"]["met"]]
    return {"confidence_calibration": {**confidence_calibration(rnd),
                                       "fold": confidence_calibration([j for j in judged if j["kind"] == "fold"])},
            "confidence_signals": signal_analysis(claimed), "confidence_threshold_scan": threshold_scan(rnd)}


def complete_tables(loss_of: dict[str, pd.Series]) -> dict[str, pd.DataFrame]:
    """Per target column, the (label, budget) x segment table of the cells run on every segment (what the draw's
    difficulty and the fixed-answer ceiling compare seen and held-out segments on)."""
    return {col: loss.unstack("segment").dropna() for col, loss in loss_of.items()}


def draw_difficulty(judged: Sequence[dict], split_of: dict[str, dict], wide: dict[str, pd.DataFrame]
                    ) -> dict[str, Any]:
    """Whether the answers that failed held out came from draws whose held-out segments were harder than the seen
    ones (something no recommendation can see): per claimed answer of the random splits, the mean over every
    configuration run on all segments at the answer's budget of (held-out mean - seen mean) loss (``wide``:
    `complete_tables`; ``split_of``: split name -> seen and held-out segment names); its AUC for failure and the
    share held per tercile."""
    from sklearn.metrics import roc_auc_score

    from gpu_validate.studies.recommendation.candidates import Target

    claimed = [j for j in judged if j["kind"] == "random" and j["answer"]["met"]]
    shift, held_met = [], []
    for j in claimed:
        sp = split_of[j["split"]]
        at = wide[Target.parse(j["target"]).column].xs(j["answer"]["budget"], level="budget")
        shift.append(float((at[sp["held"]].mean(axis=1) - at[sp["seen"]].mean(axis=1)).mean()))
        held_met.append(j["held_out_met"])
    shift, held_met = np.array(shift), np.array(held_met)
    if len(shift) < 3:
        return {"n": len(shift)}
    edges = np.quantile(shift, [0, 1 / 3, 2 / 3, 1])
    part = np.clip(np.searchsorted(edges, shift, side="right") - 1, 0, 2)
    return {"n": len(shift), "auc_failure": float(roc_auc_score(~held_met, shift)) if 0 < held_met.sum() < len(
                held_met) else float("nan"),
            "by_tercile": [{"shift": [float(edges[t]), float(edges[t + 1])], **share_interval(held_met[part == t])}
                           for t in range(3)],
            "note": "shift: the held-out segments' mean loss minus the seen ones', averaged over every configuration "
                    "at the answer's budget (positive: the held-out text was harder)"}


def fixed_answer_ceiling(judged: Sequence[dict], split_of: dict[str, dict], wide: dict[str, pd.DataFrame],
                         level: float = 0.9) -> dict[str, Any]:
    """What a single answer fixed in advance achieves on the random splits, per target: for every configuration and
    budget run on all segments (``wide``: `complete_tables`), the share of the splits whose held-out mean met the
    target; the smallest budget at which some configuration meets it in at least ``level`` of them, that
    configuration, its share and its median budget ratio to each split's smallest grid budget meeting the target held
    out (the benchmark's ``budget_ratio``). A recommendation can beat it only with what its seen segments say about
    the held-out ones."""
    from gpu_validate.studies.recommendation.candidates import Target

    out = {}
    for tg_name in sorted({j["target"] for j in judged}):
        part = [j for j in judged if j["kind"] == "random" and j["target"] == tg_name]
        tg = Target.parse(tg_name)
        table = wide[tg.column]
        held = np.stack([table[split_of[j["split"]]["held"]].mean(axis=1).to_numpy() for j in part])
        share = np.mean([[tg.met(x) for x in row] for row in held], axis=0)
        ref = np.array([j["smallest_grid_budget_meeting_target"] or np.nan for j in part], float)
        ok = [(b, -sh, lab) for (lab, b), sh in zip(table.index, share) if sh >= level]
        if not ok:
            out[tg_name] = {"budget": None, "level": level}
            continue
        b, sh, lab = min(ok)
        out[tg_name] = {"budget": int(b), "label": lab, "held_out_met_share": -sh, "level": level,
                        "budget_ratio_median": float(np.nanmedian(b / ref))}
    return out


def summarise(cells: Sequence[dict], judged: Sequence[dict], reliable_only: bool) -> dict[str, float]:
    """The summary shares over cells (the choice within a grid budget) and over the judged recommendations."""
    cells = [c for c in cells if c["held_reliability"] >= RELIABLE] if reliable_only else list(cells)

    def share(xs) -> float:
        return float(np.mean(xs)) if len(xs) else float("nan")

    def median(xs) -> float:
        return float(np.nanmedian(xs)) if len(xs) and np.isfinite(xs).any() else float("nan")

    return {"cells": len(cells), "recommendations": len(judged),
            "pick_in_model_top3_share": share([c["simulator_first"]["in_top3"] for c in cells]),
            "median_regret_share": median([c["simulator_first"]["regret_share"] for c in cells]),
            "median_regret_nats": median([c["simulator_first"]["regret_nats"] for c in cells]),
            "recommendation_pick_in_model_top3_share": share([c["recommendation_pick"]["in_top3"] for c in cells]),
            "recommendation_median_regret_share": median([c["recommendation_pick"]["regret_share"] for c in cells]),
            "target_met_share": share([r["held_out_met"] for r in judged]),
            # an answer may say the target is met at no budget tried: the share that claim, and how many of those
            # claims held on the held-out segments
            "claimed_met_share": share([r["answer"]["met"] for r in judged]),
            "target_met_share_of_claimed": share([r["held_out_met"] for r in judged if r["answer"]["met"]]),
            "budget_ratio_median": median([r["budget_ratio"] for r in judged]),
            "budget_ratio_fine_median": median([r["budget_ratio_fine"] for r in judged]),
            "refined_share": share([r["answer"]["refined"] for r in judged]),
            "model_runs_share": share([r["model_runs_share"] for r in judged]),
            "model_on_seen_pick_in_model_top3_share": share([c["model_on_seen_first"]["in_top3"] for c in cells]),
            "model_on_seen_median_regret_share": median([c["model_on_seen_first"]["regret_share"] for c in cells]),
            "model_on_seen_target_met_share": share([r["model_on_seen"]["held_out_met"] for r in judged]),
            "model_on_seen_budget_ratio_median": median([r["model_on_seen"]["budget_ratio"] for r in judged])}


def report(args, load) -> int:
    """The report stage (see the module docstring) with the model and segments ``load(args)`` gives."""
    from benchmarks._util import machine, write_result
    from gpu_validate.studies.fidelity.rank_fidelity import split_half_reliability
    from gpu_validate.studies.recommendation.recommend_search import (REFINE, SIM_LOSS, SIM_LOSSES, ExecutionSettings,
                                                                      GuaranteeSettings, Recommender, SearchSettings)
    from gpu_validate.studies.recommendation.recommend_statistics import MARGIN_Z
    from gpu_validate.studies.recommendation.candidates import Target, budget_ladder, candidates
    from gpu_validate.studies.fidelity.segments import closed_loop, simulated
    from sim.reports.runinfo import kvsim_version, now
    from sim.experiments.store import ResultStore
    from sim.replay.threads import limit_threads
    from traces.texts import SHIPPED_TEXTS

    import torch  # noqa: F401  (first, so limit_threads caps its pool)

    limit_threads(args.threads)
    t0 = time.perf_counter()
    model, _, by_text = load(args)
    cands = candidates(";".join(args.families))
    family_of = {c.label: c.family for c in cands}
    default = {c.family: c.label for c in cands if c.default}
    budgets = budget_ladder(args.prompt, args.budgets)
    configs = [(c.policy, b) for c in cands for b in budgets]
    grid_store, sim_store = ResultStore(args.store), ResultStore(args.store + "-sim")
    closed = grid_store.load()
    done = closed[(closed.model == args.model) & closed.budget.isin(budgets)].groupby("segment").size()
    segs = {t: [s for s in by_text[t] if done.get(s.name, 0) >= len(configs)] for t in by_text}
    every = [s for v in segs.values() for s in v]
    print(f"segments with the whole grid run: {({t: len(v) for t, v in segs.items()})}", flush=True)
    sim = pd.DataFrame(simulated(model, every, configs, n_prompt=args.prompt, model_id=args.model, store=sim_store))
    target = Target.parse(args.target)
    targets = [target] + [Target.parse(f"{target.name}={v}") for v in EXTRA_TARGETS]
    every_split = splits(segs, args.seen, args.splits)
    log = print if args.verbose else (lambda s: None)
    refine = REFINE if args.refine is None else (args.refine or None)
    margin_z = MARGIN_Z if args.margin_z is None else args.margin_z

    # 1. every recommendation on its seen segments (refinement's budgets run closed loop there, stored in the grid)
    made = []
    for i, sp in enumerate(every_split):
        for tg in targets:
            with tempfile.TemporaryDirectory() as tmp:
                rec = Recommender(model, sp["seen"], cands, budgets, tg, n_prompt=args.prompt, model_id=args.model,
                                  out=tmp, search=SearchSettings(validate=VALIDATE, per_family=2, refine=refine),
                                  guarantee=GuaranteeSettings(margin_z=margin_z),
                                  execution=ExecutionSettings(progress=False, log=log, closed_store=grid_store,
                                                              sim_store=sim_store)).run()
            made.append((sp, tg, rec))
        a = rec["answer"]
        print(f"[{i + 1}/{len(every_split)}] {sp['name']}: {tg} -> {a['choice']['label']} @ {a['budget']} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    # 2. the configurations confirmed at refined budgets, run on every segment (their held-out losses)
    fine = sorted({(lab, r["budget"]) for _, _, rec in made for r in rec["per_budget"] if r["budget"] not in budgets
                   for lab in r["confirmed"]})
    by_label = {c.label: c.policy for c in cands}
    print(f"{len(fine)} (configuration, refined budget) cells confirmed: running them on all {len(every)} segments",
          flush=True)
    closed_loop(model, every, [(by_label[lab], b) for lab, b in fine], grid_store, n_prompt=args.prompt,
                model_id=args.model, progress=False, log=log, max_rows=64)
    closed = grid_store.load()
    closed = closed[closed.model == args.model]
    fine_budgets = sorted({b for _, b in fine})
    rows, loss_of = grid_losses(closed, {s.name for s in every},
                                {*((lab, b) for lab in family_of for b in budgets), *fine})

    def held_table(held: Sequence, col: str) -> dict[tuple[str, int], np.ndarray]:
        """(label, budget) -> the loss on each held-out segment, for every cell run on all of them."""
        part = loss_of[col][loss_of[col].index.get_level_values("segment").isin([s.name for s in held])]
        return {(lab, int(b)): v.to_numpy(float) for (lab, b), v in part.groupby(level=["label", "budget"])
                if len(v) == len(held)}

    # 3. the judgements
    cols = ["segment", "label", "budget"]
    merged = rows[rows.budget.isin(budgets)][[*cols, "text", "delta_nll", "top1_disagreement"]].merge(
        sim[[*cols, *SIM_LOSSES]], on=cols)
    per_seg = merged.set_index(cols)[["delta_nll", "top1_disagreement", *SIM_LOSSES]]

    def table(segments: Sequence, col: str) -> pd.DataFrame:
        """label x grid budget: the mean of ``col`` over ``segments``."""
        part = per_seg[per_seg.index.get_level_values("segment").isin([s.name for s in segments])]
        return part[col].groupby(["label", "budget"]).mean().unstack("budget")

    def reliability(segments: Sequence, b: int) -> float:
        """The model's split-half reliability (Spearman-Brown) of its ranking of every configuration at b."""
        if len(segments) < 2:
            return float("nan")
        rows_ = [per_seg.loc[s.name]["delta_nll"].xs(b, level="budget").loc[sorted(family_of)] for s in segments]
        return float(split_half_reliability(np.stack(rows_))["spearman_brown"])

    judged, cells = [], []
    for sp, tg, rec in made:
        held = held_table(sp["held"], tg.column)
        j = judge(rec, held, tg, budgets, fine_budgets, len(configs) * len(sp["held"]))
        seen_t, held_t = table(sp["seen"], tg.column), table(sp["held"], tg.column)
        j.update(split=sp["name"], kind=sp["kind"], n_seen=len(sp["seen"]),
                 model_on_seen=model_on_seen_answer(seen_t, held_t, tg, j["smallest_grid_budget_meeting_target"]))
        judged.append(j)
        if tg is not target:
            continue
        sim_seen = table(sp["seen"], SIM_LOSS)
        for rung in rec["per_budget"]:
            b = rung["budget"]
            if b not in budgets:
                continue
            default_pick = sim_seen.loc[list(default.values()), b].idxmin()
            model_default_pick = seen_t.loc[list(default.values()), b].idxmin()
            cells.append({"split": sp["name"], "kind": sp["kind"], "budget": b,
                          "held_reliability": reliability(sp["held"], b) if sp["kind"] != "random" else 1.0,
                          "simulator_first": rank_stats(sim_seen[b].idxmin(), held_t[b], default_pick),
                          "model_on_seen_first": rank_stats(seen_t[b].idxmin(), held_t[b], model_default_pick),
                          "recommendation_pick": {**rank_stats(rung["pick"]["label"], held_t[b], default_pick),
                                                  "source": rung["source"]}})

    summary: dict[str, Any] = {"sim_loss": SIM_LOSS, "refine": refine, "margin_z": margin_z}
    for kind in ("random", "fold", "cross_text"):
        kc = [c for c in cells if c["kind"] == kind]
        kj = [j for j in judged if j["kind"] == kind]
        summary[kind] = {"all_cells": summarise(kc, kj, False), "reliable_cells": summarise(kc, kj, True),
                         "by_target": {str(tg): summarise([], [j for j in kj if j["target"] == str(tg)], False)
                                       for tg in targets}}
    summary.update(summary["random"]["all_cells"])           # the headline fields at the top level
    rnd = [j for j in judged if j["kind"] == "random"]
    summary["coverage"] = {**coverage(rnd), "by_target": {str(tg): coverage([j for j in rnd if j["target"] == str(tg)])
                                                          for tg in targets},
                           "fold": coverage([j for j in judged if j["kind"] == "fold"]),
                           "cross_text": coverage([j for j in judged if j["kind"] == "cross_text"])}
    summary.update(confidence_summary(judged))
    split_of = {sp["name"]: {"seen": [s.name for s in sp["seen"]], "held": [s.name for s in sp["held"]]}
                for sp in every_split}
    wide = complete_tables(loss_of)
    summary["draw_difficulty"] = draw_difficulty(judged, split_of, wide)
    summary["fixed_answer_ceiling"] = fixed_answer_ceiling(judged, split_of, wide)
    summary["within_family_rho"] = {t: within_family_rho(table(v, SIM_LOSS), table(v, "delta_nll"), family_of)
                                    for t, v in segs.items()}
    texts = list(segs)          # the model on one text against itself on another (symmetric)
    summary["within_family_rho_model_across_texts"] = {
        f"{a} <-> {b}": within_family_rho(table(segs[a], "delta_nll"), table(segs[b], "delta_nll"), family_of)
        for i, a in enumerate(texts) for b in texts[i + 1:]}
    summary["model_split_half_reliability"] = {
        **{t: {b: reliability(v, b) for b in budgets} for t, v in segs.items()},
        "all_segments": {b: reliability(every, b) for b in budgets}}
    summary["goals"] = {"pick_in_model_top3_share": ">= 0.8", "median_regret_share": "<= 0.10",
                        "target_met_share": ">= 0.9", "budget_ratio_median": "<= 1.25", "model_runs_share": "<= 0.10",
                        "coverage": ">= 1 - alpha", "confidence_calibration": "high holds >= 0.95"}
    means = merged.groupby(["text", "label", "budget"])[["delta_nll", "top1_disagreement", *SIM_LOSSES]].mean()
    rows_out = [{"text": t, "label": lab, "family": family_of[lab], "budget": int(b),
                 **{k: float(v) for k, v in r.items()}} for (t, lab, b), r in means.iterrows()]
    fine_rows = [{"label": lab, "budget": b, "delta_nll_mean": float(loss_of["delta_nll"].loc[lab, b].mean())}
                 for lab, b in fine]
    out = {"model": args.model, "texts": {t: SHIPPED_TEXTS[t][1] for t in segs},
           "segments": {t: [s.name for s in v] for t, v in segs.items()},
           "split_note": f"random: {args.splits} draws of {args.seen} of the {len(every)} segments seen, the rest "
                         "held out; fold: segment i of each text seen, the other segments of the same texts held "
                         "out; cross_text: one text seen, the other held out",
           "n_prompt": args.prompt, "n_decode": args.decode, "target": str(target),
           "targets": [str(t) for t in targets], "validate": VALIDATE, "reliable_threshold": RELIABLE,
           "grid": {"families": {f: [c.label for c in cands if c.family == f] for f in default},
                    "subset_note": "a fixed subset of `--policies all` (every registered policy and ada(·)/critical(·)"
                                   "), for the cost of the exhaustive closed-loop grid",
                    "budgets": budgets, "configurations": len(cands), "closed_loop_runs": len(configs) * len(every),
                    "refined_cells": len(fine), "refined_budgets": fine_budgets,
                    "refined_closed_loop_runs": len(fine) * len(every)},
           "summary": summary, "recommendations": judged, "cells": cells, "rows": rows_out, "refined_rows": fine_rows,
           "seconds": time.perf_counter() - t0, "machine": machine(), "kvsim": kvsim_version(), "date": now(),
           "command": "python -m benchmarks.recommend " + " ".join(sys.argv[1:])}
    if args.out:
        from traces.format import atomic_write_text

        path = Path(args.out)
        atomic_write_text(path, json.dumps(out, indent=1, default=float))
    else:
        path = write_result(f"recommend_{args.model}", out)
    for k in ("target_met_share", "budget_ratio_median", "budget_ratio_fine_median", "claimed_met_share",
              "model_runs_share"):
        print(f"{k}: {summary[k]}")
    print("coverage:", {k: v for k, v in summary["coverage"].items() if k not in ("by_target", "fold", "cross_text")})
    print("confidence:", summary["confidence_calibration"])
    print(f"wrote {path}")
    return 0


def resummarise(args) -> int:
    """``--stage summary``: the recorded report (``--out`` or benchmarks/results/recommend_<model>.json) with its
    recommendations' confidence re-levelled by today's rule (`relevel`: from the margin, claim and certificate each
    one recorded) and its confidence summaries, `draw_difficulty` and `fixed_answer_ceiling` recomputed from the
    grid's store; no model or simulator run. The rest of the report is left as measured."""
    from benchmarks._util import RESULTS
    from sim.experiments.store import ResultStore
    from sim.reports.runinfo import now
    from traces.format import atomic_write_text

    path = Path(args.out) if args.out else RESULTS / f"recommend_{args.model}.json"
    out = json.loads(path.read_text())
    judged = out["recommendations"]
    for j in judged:
        j["confidence"]["level"] = relevel(j)
    every_split = splits(out["segments"], args.seen, args.splits)
    split_of = {sp["name"]: {"seen": list(sp["seen"]), "held": list(sp["held"])} for sp in every_split}
    closed = ResultStore(args.store).load()
    labels = [lab for labs in out["grid"]["families"].values() for lab in labs]
    known = {*((lab, b) for lab in labels for b in out["grid"]["budgets"]),
             *((r["label"], r["budget"]) for r in out["refined_rows"])}
    _, loss_of = grid_losses(closed[closed.model == args.model], {n for v in out["segments"].values() for n in v},
                             known)
    summary = out["summary"]
    summary.update(confidence_summary(judged))
    wide = complete_tables(loss_of)
    summary["draw_difficulty"] = draw_difficulty(judged, split_of, wide)
    summary["fixed_answer_ceiling"] = fixed_answer_ceiling(judged, split_of, wide)
    out["resummarised"] = {"date": now(), "command": "python -m benchmarks.recommend " + " ".join(sys.argv[1:]),
                           "note": "confidence levels re-levelled with today's rule from each recommendation's "
                                   "recorded margin, claim and certificate; confidence summaries, draw difficulty "
                                   "and the fixed-answer ceiling recomputed; everything else as measured"}
    atomic_write_text(path, json.dumps(out, indent=1, default=float))
    print("confidence:", summary["confidence_calibration"])
    print("draw difficulty:", summary["draw_difficulty"])
    print("fixed-answer ceiling:", summary["fixed_answer_ceiling"])
    print(f"wrote {path}")
    return 0
