"""How well the simulator's needle prediction calls the model's retrieval: the scores of a yes/no call
(`binary_scores`, `confusion_scores`: agreement next to its base rate, balanced accuracy, Matthews correlation), the
predictor and its threshold fitted on some seeds and judged on the others (`fit_threshold`, `prediction_report`,
`split_report`), the wrong calls named (`wrong_calls`), accuracy summaries, the result's table columns and the
heatmaps (`plot_needle`). The prompts are `gpu_validate.studies.needle.prompts`', the closed-loop runs
`gpu_validate.studies.needle.runs`'s and the simulator's features `gpu_validate.studies.needle.prediction`'s.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from gpu_validate.studies.fidelity.rank_fidelity import spearman
from gpu_validate.studies.needle.prediction import DIAGNOSTICS, FEATURES
from gpu_validate.studies.needle.prompts import NeedlePrompt
from gpu_validate.validate_error import ValidateError
from sim.replay.metrics import Column
from sim.reports.plotting import agg_pyplot, save_figure

#: the retrieval columns of a needle result (header, label, direction, doc) for the page's tables and legend
ACCURACY = Column("accuracy", "accuracy", "retrieval accuracy", "higher",
                  "share of the prompts whose pass key greedy decoding reproduces exactly, closed loop in the model")
PREDICTED_ACCURACY = Column("predicted_accuracy", "predicted", "the simulator's predicted accuracy", "higher",
                            "share of the held-out prompts the simulator predicts retrieved (the predictor at or above "
                            "its threshold)")
AGREEMENT = Column("agreement", "agreement", "agreement of the prediction with the model", "higher",
                   "share of the held-out prompts where the simulator's call (retrieved or not) is the model's outcome")


# ----- scoring a yes/no prediction -----

#: the objectives `fit_threshold` (and the choice among `FEATURES`) can maximise on the training seeds
FIT_OBJECTIVES = ("balanced_accuracy", "agreement")


def confusion_scores(confusion: Mapping[str, int]) -> dict[str, Any]:
    """The scores of a yes/no prediction from its confusion (the keys ``model_ok_pred_ok``, ``model_ok_pred_fail``,
    ``model_fail_pred_ok``, ``model_fail_pred_fail``; "ok" is the positive class): ``n``; ``agreement``, the share
    called right; ``base_rate``, the share of the commoner true outcome (the agreement of always calling it, which
    an agreement must beat to mean anything); ``balanced_accuracy``, the mean of the share of true successes called
    successes (TPR) and of true failures called failures (TNR), 0.5 for any constant call however unbalanced the
    classes; ``mcc``, the Matthews correlation of the call with the truth (1 perfect, 0 no better than chance, -1
    reversed); and the ``confusion`` itself.

    Edge cases: with no cells every rate is NaN; when the truth holds one class only, the rate of the other class is
    undefined and so is ``balanced_accuracy`` (NaN, never a guess); ``mcc`` is 0 when any marginal (a true class or
    a predicted class) is empty, the usual convention: such a call carries no information about the other side.
    Results stored with only a confusion are scored from it this way (`gpu_validate.studies.needle.needle_page`)."""
    tp, fn = int(confusion["model_ok_pred_ok"]), int(confusion["model_ok_pred_fail"])
    fp, tn = int(confusion["model_fail_pred_ok"]), int(confusion["model_fail_pred_fail"])
    n, pos, neg = tp + fn + fp + tn, tp + fn, fp + tn
    nan = float("nan")
    ba = (tp / pos + tn / neg) / 2 if pos and neg else nan
    denom = float(tp + fp) * pos * neg * (fn + tn)
    mcc = (tp * tn - fp * fn) / np.sqrt(denom) if denom > 0 else (0.0 if n else nan)
    return {"n": n, "agreement": (tp + tn) / n if n else nan, "base_rate": max(pos, neg) / n if n else nan,
            "balanced_accuracy": float(ba), "mcc": float(mcc),
            "confusion": {"model_ok_pred_ok": tp, "model_ok_pred_fail": fn, "model_fail_pred_ok": fp,
                          "model_fail_pred_fail": tn}}


def binary_scores(truth: Sequence[bool] | np.ndarray, pred: Sequence[bool] | np.ndarray) -> dict[str, Any]:
    """`confusion_scores` of the call ``pred`` against the outcome ``truth`` (equal-length booleans, True =
    retrieved): agreement next to its base rate, balanced accuracy, Matthews correlation and the confusion."""
    t, p = np.asarray(truth, bool), np.asarray(pred, bool)
    if t.shape != p.shape:
        raise ValidateError(f"truth and prediction differ in shape: {t.shape} vs {p.shape}")
    return confusion_scores({"model_ok_pred_ok": int((t & p).sum()), "model_ok_pred_fail": int((t & ~p).sum()),
                             "model_fail_pred_ok": int((~t & p).sum()), "model_fail_pred_fail": int((~t & ~p).sum())})


def _objective_scores(feature: np.ndarray, success: np.ndarray, cuts: np.ndarray, objective: str) -> np.ndarray:
    """The ``objective`` of (feature >= cut) against ``success`` for every cut (vectorised `binary_scores`)."""
    if objective not in FIT_OBJECTIVES:
        raise ValidateError(f"unknown fit objective {objective!r} (expected one of {list(FIT_OBJECTIVES)})")
    pred = feature[None, :] >= cuts[:, None]                                  # [cuts, cells]
    if objective == "agreement":
        return (pred == success[None, :]).mean(axis=1)
    pos, neg = success.sum(), (~success).sum()
    if not (pos and neg):                         # one class only: balanced accuracy undefined at every cut
        return np.full(len(cuts), np.nan)
    return ((pred & success).sum(axis=1) / pos + (~pred & ~success).sum(axis=1) / neg) / 2


def fit_threshold(feature: np.ndarray, success: np.ndarray, objective: str = "balanced_accuracy") -> float:
    """The cut t maximising ``objective`` of the call (feature >= t) against ``success`` (candidates: below all
    values, the midpoints between sorted distinct values, above all; ties go to the lowest cut).

    ``objective`` is "balanced_accuracy" (the default) or "agreement". Retrieval outcomes are unbalanced (most
    cells of a small model at a small budget fail), and agreement rewards calling the majority class: with 80 %
    failures a cut above every value ("always fails") already agrees on 0.8, so an agreement-fitted cut drifts
    towards missing the real hits. Balanced accuracy weighs the hits and the misses alike, and a constant call
    scores 0.5 on it. When ``success`` holds one class only, balanced accuracy is undefined and the cut falls back
    to agreement."""
    feature, success = np.asarray(feature, float), np.asarray(success, bool)
    vals = np.unique(feature)
    cands = np.concatenate([[vals[0] - 1e-9], (vals[:-1] + vals[1:]) / 2, [vals[-1] + 1e-9]])
    score = _objective_scores(feature, success, cands, objective)
    if not np.isfinite(score).any():
        score = _objective_scores(feature, success, cands, "agreement")
    return float(cands[int(np.nanargmax(score))])


def _group_scores(part, pred: np.ndarray) -> dict[str, Any]:
    """`binary_scores` of one group of held-out cells, with the model's and the predicted accuracy."""
    truth = part.success.to_numpy().astype(bool)
    return {**binary_scores(truth, pred), "accuracy": float(truth.mean()), "predicted_accuracy": float(pred.mean())}


def prediction_report(df, train_seeds: Sequence[int], features: Sequence[str] | None = None, *,
                      objective: str = "balanced_accuracy") -> dict[str, Any]:
    """Choose the predictor and its threshold on ``train_seeds`` rows of ``df`` (columns seed, success, and one
    column per candidate in ``features``, default the `FEATURES` present; lossy policies only), both by
    ``objective`` (see `fit_threshold`; the same objective picks the threshold of each candidate and the candidate),
    then score the other seeds with `binary_scores`: agreement next to its base rate (the share of the commoner
    outcome, what always predicting it agrees on), balanced accuracy, Matthews correlation and the confusion matrix
    (model outcome × prediction), overall, per policy, per (policy, budget) and per context length; the Spearman
    rho of the predicted accuracy per (policy, budget) with the model's, and every candidate's train / held-out
    scores for reference. With a ``full_success`` column (the full cache's outcome per prompt) also the scores of
    the call "the simulator says retrieved and the full cache retrieves"."""
    train = df[df.seed.isin(train_seeds)]
    test = df[~df.seed.isin(train_seeds)]
    if train.empty or test.empty:
        raise ValidateError(f"need rows on both sides of the seed split (train seeds {list(train_seeds)})")
    return split_report(train, test, features, objective=objective)


def split_report(train, test, features: Sequence[str] | None = None, *,
                 objective: str = "balanced_accuracy") -> dict[str, Any]:
    """`prediction_report` with the split given: the predictor and threshold are fitted on the rows of ``train``
    and judged on ``test`` (another seed set, another task, or another model: the transfer tests)."""
    features = [f for f in (features or FEATURES) if f in train.columns and f in test.columns]
    if not features:
        raise ValidateError(f"no predictor column in the table (expected one of {list(FEATURES)})")
    if objective not in FIT_OBJECTIVES:
        raise ValidateError(f"unknown fit objective {objective!r} (expected one of {list(FIT_OBJECTIVES)})")
    if train.empty or test.empty:
        raise ValidateError("need rows to fit on and rows to judge")
    y_train, truth = train.success.to_numpy().astype(bool), test.success.to_numpy().astype(bool)
    candidates = {}
    for f in features:
        cut = fit_threshold(train[f].to_numpy(), y_train, objective)
        tr = binary_scores(y_train, train[f].to_numpy() >= cut)
        te = binary_scores(truth, test[f].to_numpy() >= cut)
        candidates[f] = {"threshold": cut, "train_agreement": tr["agreement"],
                         "train_balanced_accuracy": tr["balanced_accuracy"], "train_mcc": tr["mcc"],
                         "heldout_agreement": te["agreement"], "heldout_balanced_accuracy": te["balanced_accuracy"],
                         "heldout_mcc": te["mcc"]}

    def train_score(f: str) -> float:
        v = candidates[f][f"train_{objective}"]
        return v if np.isfinite(v) else candidates[f]["train_agreement"]   # one class on the training seeds

    best = max(features, key=train_score)   # first listed wins ties
    cut = candidates[best]["threshold"]
    pred = test[best].to_numpy() >= cut
    overall = binary_scores(truth, pred)

    def per(keys) -> dict[Any, dict[str, Any]]:
        return {k: _group_scores(part, part[best].to_numpy() >= cut) for k, part in test.groupby(keys)}

    per_config = ({f"{label}@{int(b)}": v for (label, b), v in per(["label", "budget"]).items()}
                  if "budget" in test.columns else {})
    per_policy = per("label")
    per_length = {int(L): v for L, v in per("length").items()} if "length" in test.columns else {}
    per_task = {str(t): v for t, v in per("task").items()} if "task" in test.columns else {}

    rho_acc = spearman([v["predicted_accuracy"] for v in per_config.values()],
                       [v["accuracy"] for v in per_config.values()]) if per_config else float("nan")
    gated = {}
    if "full_success" in test.columns:   # one full-cache run per prompt plus the simulator: no retrieval the model
        full_ok = test.full_success.to_numpy().astype(bool)   # cannot do with the full cache is predicted
        g = binary_scores(truth, pred & full_ok)
        where = binary_scores(truth[full_ok], pred[full_ok])
        gated = {"sim_and_full_agreement": g["agreement"], "sim_and_full_balanced_accuracy": g["balanced_accuracy"],
                 "sim_and_full_mcc": g["mcc"], "confusion_sim_and_full": g["confusion"],
                 "sim_agreement_where_full_succeeds": where["agreement"],
                 "sim_balanced_accuracy_where_full_succeeds": where["balanced_accuracy"],
                 "n_test_cells_where_full_succeeds": int(full_ok.sum())}
    return {"feature": best, "feature_doc": FEATURES.get(best, best), "threshold": cut, "objective": objective,
            **gated, "train_seeds": sorted(int(s) for s in train.seed.unique()),
            "test_seeds": sorted(int(s) for s in test.seed.unique()),
            "train_agreement": candidates[best]["train_agreement"],
            "train_balanced_accuracy": candidates[best]["train_balanced_accuracy"],
            "sim_agreement": overall["agreement"], "n_test_cells": overall["n"], "base_rate": overall["base_rate"],
            "balanced_accuracy": overall["balanced_accuracy"], "mcc": overall["mcc"],
            "confusion": overall["confusion"], "per_policy": per_policy, "per_config": per_config,
            "per_length": per_length, "per_task": per_task, "rho_accuracy": rho_acc, "candidates": candidates}


def wrong_calls(df, prompts: Sequence[NeedlePrompt], feature: str, threshold: float,
                decode: Callable[[list[int]], str] | None = None) -> list[dict[str, Any]]:
    """The cells of ``df`` (closed-loop rows with their ``feature``) where the call ``feature >= threshold``
    differs from the model's outcome, each with what the model wrote, the first answer step where its tokens
    leave the canonical answer's (None: it wrote the answer; the step a retrieval goes wrong, or a call that
    missed a success) and, where stored, the layer and answer step where the replay held least of the key's
    attention (`DIAGNOSTICS`). Sorted by how far the feature sits from the threshold, the confident errors first."""
    by_id = {p.prompt_id: p for p in prompts}
    out = []
    for _, row in df.iterrows():
        called = bool(row[feature] >= threshold)
        if called == bool(row.success):
            continue
        gen = json.loads(row.generated)
        p = by_id.get(row.prompt_id)
        step = None
        if p is not None:
            step = next((i for i, (a, b) in enumerate(zip(gen, p.answer)) if a != b), None)
        out.append({"prompt_id": row.prompt_id, "task": row.get("task", "passkey"), "length": int(row.length),
                    "depth": float(row.depth), "label": row.label, "budget": int(row.budget),
                    "model_retrieved": bool(row.success), "simulator_called": called,
                    feature: float(row[feature]), "distance_to_threshold": float(abs(row[feature] - threshold)),
                    "first_wrong_answer_step": step,
                    **{d: int(row[d]) for d in DIAGNOSTICS if d in row and np.isfinite(row[d])},
                    "generated": decode(gen) if decode is not None else gen})
    return sorted(out, key=lambda r: -r["distance_to_threshold"])


def summarize(df) -> dict[str, Any]:
    """Accuracy per (policy label, budget), per (label, budget, length), and the full cache's."""
    full = df[df.policy == "full"]
    lossy = df[df.policy != "full"]
    acc = {f"{lab}@{b}": float(part.success.mean()) for (lab, b), part in lossy.groupby(["label", "budget"])}
    by_len = {f"{lab}@{b}": {int(L): float(p.success.mean()) for L, p in part.groupby("length")}
              for (lab, b), part in lossy.groupby(["label", "budget"])}
    by_seed = {f"{lab}@{b}": {int(s): float(p.success.mean()) for s, p in part.groupby("seed")}
               for (lab, b), part in lossy.groupby(["label", "budget"])}
    return {"full_accuracy": float(full.success.mean()) if len(full) else float("nan"),
            "full_accuracy_by_length": {int(L): float(p.success.mean()) for L, p in full.groupby("length")},
            "accuracy": acc, "accuracy_by_length": by_len, "accuracy_by_seed": by_seed}


def passing_cells(df, min_full: float) -> tuple["Any", dict, dict]:
    """(rows of the (task, length) cells where the full cache's accuracy is at least ``min_full``, {cell: full
    accuracy} kept, {cell: full accuracy} dropped). A cell without full-cache rows is kept."""
    full = df[df.policy == "full"]
    acc = {(str(t), int(L)): float(p.success.mean()) for (t, L), p in full.groupby(["task", "length"])}
    dropped = {c: a for c, a in acc.items() if a < min_full}
    kept = {c: a for c, a in acc.items() if a >= min_full}
    cell = list(zip(df.task.astype(str), df.length.astype(int)))
    return df[[c not in dropped for c in cell]], kept, dropped


def seed_reliability(accuracy_by_seed: dict[str, dict[Any, float]], train_seeds: Sequence[int]) -> dict[str, Any]:
    """The model against itself on other prompts: Spearman rho, over the (policy, budget) configurations, of their
    retrieval accuracy on ``train_seeds`` with their accuracy on the other seeds (other keys and haystacks). A
    predictor of the held-out accuracies can hardly rank them better than the model's own accuracies on the
    training seeds do."""
    train = {int(s) for s in train_seeds}
    a, b = [], []
    for per_seed in accuracy_by_seed.values():
        tr = [v for s, v in per_seed.items() if int(s) in train]
        te = [v for s, v in per_seed.items() if int(s) not in train]
        if tr and te:
            a.append(float(np.mean(tr)))
            b.append(float(np.mean(te)))
    return {"rho": spearman(a, b), "n_configs": len(a), "train_seeds": sorted(train)}


def plot_needle(df, path: str | Path, title: str = "") -> Path:
    """Needle heatmaps in the kvpress / RULER style: one panel per policy (full cache first), context length
    on the y axis, needle depth on the x axis, colour = retrieval accuracy over seeds; one row per budget."""
    plt = agg_pyplot()
    budgets = sorted(df[df.policy != "full"].budget.unique())
    labels = sorted(df[df.policy != "full"].label.unique())
    lengths = sorted(df.length.unique())
    depths = sorted(df.depth.unique())
    cols = ["full"] + labels
    fig, axes = plt.subplots(len(budgets), len(cols), figsize=(1.7 * len(cols) + 1.0, 2.1 * len(budgets) + 0.8),
                             squeeze=False, constrained_layout=True)
    cmap = plt.get_cmap("RdYlGn")
    full = df[df.policy == "full"]
    im = None
    for i, b in enumerate(budgets):
        for j, lab in enumerate(cols):
            ax = axes[i, j]
            part = full if lab == "full" else df[(df.label == lab) & (df.budget == b)]
            grid = np.full((len(lengths), len(depths)), np.nan)
            for (L, d), cell in part.groupby(["length", "depth"]):
                grid[lengths.index(L), depths.index(d)] = cell.success.mean()
            im = ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto", origin="lower")
            ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=6)
            ax.set_yticks(range(len(lengths)), [str(L) for L in lengths], fontsize=6)
            mean = np.nanmean(grid) if np.isfinite(grid).any() else float("nan")
            ax.set_title(f"{'full cache' if lab == 'full' else lab}\n{'' if lab == 'full' else f'b={b} '}"
                         f"acc {mean:.2f}", fontsize=7)
            if i == len(budgets) - 1:
                ax.set_xlabel("needle depth", fontsize=7)
            if j == 0:
                ax.set_ylabel("context tokens", fontsize=7)
    fig.colorbar(im, ax=axes, shrink=0.8, fraction=0.02, pad=0.01, label="retrieval accuracy")
    fig.suptitle(title or "needle retrieval (closed loop)", fontsize=9)
    return save_figure(fig, path, dpi=120)
