"""``kvsim recommend``: which policy, with which hyperparameters, at what budget keeps the quality a user needs on
their model and texts -- decided by the simulator, confirmed in the model.

1. **Simulate** every candidate (`gpu_validate.recommend_grid`: each family's paper default and the hyperparameter
   values around it) at every budget of a ladder on one teacher-forced trace per text segment
   (`gpu_validate.segments.simulated`; the trace is recorded once and serves every configuration).
2. **Calibrate**: the simulator's first choice at every rung runs closed loop in the model on the same segments;
   a power law ``ΔNLL ≈ exp(a) · sim^b`` fitted on those runs turns every simulated loss into a predicted model
   loss (the front, and the rungs nobody confirmed).
3. **Confirm** near the decision: at the smallest rung whose confirmed best meets the target, and at the rung
   below it, the simulator's ``validate`` best configurations run closed loop; while the rung below has a
   configuration that meets the target, the search steps down. The answer is the smallest rung whose *confirmed*
   best meets the target, that configuration, its runner-up and their predicted and measured losses.
   "Meets" is judged on an upper confidence bound of the loss, not on the mean: the best of several noisy
   measurements is an optimistic estimate, and the answer must hold on text the recommendation did not see. The
   bound is the mean plus the larger of two one-sided margins at the level of `MARGIN_Z`: `MARGIN_Z` standard errors
   over blocks of scored tokens (the noise within the segments), and Student's t times the standard error over
   segments, with the variance of the segments' losses about their configuration's mean pooled over the rung's
   confirmed configurations (how much segments differ: on the recommend benchmark's held-out segments the token
   blocks alone understated the deviation 1.4× on SmolLM2 and 2.3× on Gemma-3). ``margin_z=0`` judges the mean.

Every closed-loop run goes into a `sim.store.ResultStore` under the output folder (the simulated cells into a
second one), so an interrupted recommendation resumes without repeating a model run. The recommendation states its
own confidence from the confirmed runs: how often the simulator ordered two confirmed configurations of one rung
as the model did, and how far the calibrated predictions were from the measured losses.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from gpu_validate.fidelity import SIM_LOSSES as FIDELITY_SIM_LOSSES
from gpu_validate.jobs import ValidateError
from gpu_validate.recommend_grid import Candidate, Target
from gpu_validate.segments import ENGINE_LOSSES, RayTarget, Segment, cell_key, closed_loop, simulated

#: the simulated losses of a recommendation's table: `gpu_validate.fidelity`'s and the error after W_O
SIM_LOSSES = (*FIDELITY_SIM_LOSSES, "err_wo_mean")
#: the simulated loss the recommendation ranks by: the L1 distance of the attention distributions. It ranked 31
#: SmolLM2 configurations of a text kvsim had never seen best (Spearman rho 0.81 against the model's ΔNLL; the error
#: after W_O 0.69, the mean error 0.47; issue 38), and again on the shipped `idle` text (mean within-budget rho
#: 0.70, W_O 0.67, mean error 0.62; benchmarks/recommend.py, first two segments)
SIM_LOSS = "l1_mean"
#: a configuration meets the target when its upper bound does: its mean loss plus MARGIN_Z standard errors over
#: token blocks, or plus the one-sided t margin of the same level over segments, whichever is larger (one-sided 95%)
MARGIN_Z = 1.645
#: consecutive scored tokens per block of the standard error (neighbouring tokens' losses are correlated)
SE_BLOCK = 8
#: the smallest model loss the calibration's logarithm sees (a ΔNLL at or below zero is "as good as full")
LOSS_FLOOR = 1e-3


@dataclass(frozen=True)
class Calibration:
    """``model loss ≈ exp(a) · sim^b`` fitted on confirmed runs (least squares in log-log); ``rms_log`` is the
    root-mean-square residual in log units (0.1 ≈ predictions within ±10%)."""

    a: float
    b: float
    n: int
    rms_log: float

    def predict(self, sim: np.ndarray | float) -> np.ndarray:
        return np.exp(self.a) * np.power(np.maximum(np.asarray(sim, float), 1e-12), self.b)


def fit_calibration(sim: Sequence[float], model: Sequence[float]) -> Calibration:
    """The power law through (simulated loss, model loss) points; the exponent is held ≥ 0 (more simulated
    loss never predicts less model loss), and with one point it is 1 (a pure scale)."""
    x = np.log(np.maximum(np.asarray(sim, float), 1e-12))
    y = np.log(np.maximum(np.asarray(model, float), LOSS_FLOOR))
    if len(x) == 0:
        raise ValidateError("calibration needs at least one confirmed run")
    b = 1.0
    if len(x) >= 2 and np.ptp(x) > 0:
        b = max(0.0, float(np.polyfit(x, y, 1)[0]))
    a = float(np.mean(y - b * x))
    rms = float(np.sqrt(np.mean((y - a - b * x) ** 2)))
    return Calibration(a, b, int(len(x)), rms)


def shortlist(ranked: Sequence[str], families: dict[str, str], k: int, per_family: int) -> list[str]:
    """The first ``k`` labels of ``ranked`` (best first) taking at most ``per_family`` from one family, so that
    a confirmation round also tests the simulator's choice *between* families."""
    out, count = [], {}
    for lab in ranked:
        fam = families[lab]
        if count.get(fam, 0) < per_family:
            out.append(lab)
            count[fam] = count.get(fam, 0) + 1
        if len(out) == k:
            break
    return out


class Recommender:
    """One recommendation's state: the simulated table, the confirmed (closed-loop) cells and the search."""

    def __init__(self, model, segments: Sequence[Segment], cands: Sequence[Candidate], budgets: Sequence[int],
                 target: Target, *, n_prompt: int, model_id: str, out: str | Path, validate: int = 3,
                 per_family: int = 2, sim_loss: str = SIM_LOSS, backend: str = "torch", progress: bool = True,
                 log: Callable[[str], None] = print, closed_store=None, sim_store=None,
                 margin_z: float = MARGIN_Z, ray: RayTarget | None = None) -> None:
        from sim.store import ResultStore

        if not segments:
            raise ValidateError("recommend needs at least one text segment")
        if validate < 1:
            raise ValidateError(f"--validate must be >= 1 (configurations confirmed per budget), got {validate}")
        self.model, self.segments, self.target = model, list(segments), target
        self.cands = {c.label: c for c in cands}
        self.family = {c.label: c.family for c in cands}
        self.budgets = sorted(int(b) for b in budgets)
        self.n_prompt, self.model_id, self.backend = n_prompt, model_id, backend
        self.validate, self.per_family, self.sim_loss = validate, per_family, sim_loss
        self.progress, self.log = progress, log
        self.out = Path(out)
        # the stores a rerun resumes from (a benchmark may share them between recommendations)
        self.closed_store = closed_store or ResultStore(self.out / "closed_loop")
        self.sim_store = sim_store or ResultStore(self.out / "simulated")
        self.measured: dict[tuple[str, int], float] = {}     # mean model loss over the segments
        self.bound: dict[tuple[str, int], float] = {}        # its upper confidence bound (what must meet the target)
        self.segment_losses: dict[tuple[str, int], np.ndarray] = {}   # its loss on each segment
        self.block_se: dict[tuple[str, int], float] = {}     # its standard error over token blocks
        self.margin_z = margin_z
        self.ray = ray                                       # closed-loop batches on Ray workers (``closed_loop``)
        self.runs = 0

    # ----- the two sides -----

    def simulate(self) -> pd.DataFrame:
        """Mean over the segments of every simulated loss, per (label, budget); the candidates whose minimum
        budget exceeds a rung are left out of it."""
        if self.sim_loss not in SIM_LOSSES:
            raise ValidateError(f"unknown simulated loss {self.sim_loss!r}; choose from {SIM_LOSSES}")
        configs = [(c.policy, b) for c in self.cands.values() for b in self.budgets if c.policy.min_budget() <= b]
        # the engine's losses come with every replay; the error after W_O only when it ranks (it costs more than
        # the replay itself)
        rows = simulated(self.model, self.segments, configs, n_prompt=self.n_prompt, model_id=self.model_id,
                         store=self.sim_store, progress=self.progress, losses=(*ENGINE_LOSSES, self.sim_loss))
        df = pd.DataFrame(rows)
        cols = [*(c for c in SIM_LOSSES if c in df), "kv_bytes_mean"]
        table = df.groupby(["label", "budget"])[cols].mean().reset_index()
        table["family"] = table.label.map(self.family)
        self.table = table
        return table

    def ranked(self, budget: int) -> list[str]:
        part = self.table[self.table.budget == budget].sort_values([self.sim_loss, "label"])
        return part.label.tolist()

    def confirm(self, cells: Sequence[tuple[str, int]]) -> None:
        """Closed-loop runs of the (label, budget) cells not yet measured, on every segment (`_measure`): their
        losses per segment, their mean (``measured``) and the rungs' upper bounds (`_bound_rung`)."""
        todo = [(lab, int(b)) for lab, b in dict.fromkeys(cells) if (lab, int(b)) not in self.measured]
        if not todo:
            return
        for cell, losses in zip(todo, self._measure(todo)):
            self.segment_losses[cell] = losses
            self.measured[cell] = float(losses.mean())
            self.runs += len(losses)
        for b in {b for _, b in todo}:
            self._bound_rung(b)

    def _measure(self, todo: Sequence[tuple[str, int]]) -> list[np.ndarray]:
        """The (label, budget) cells ``todo`` run closed loop on every segment: each one's loss per segment (and
        its standard error over token blocks, into ``block_se``)."""
        configs = [(self.cands[lab].policy, b) for lab, b in todo]
        df = closed_loop(self.model, self.segments, configs, self.closed_store, n_prompt=self.n_prompt,
                         model_id=self.model_id, progress=self.progress, backend=self.backend, log=self.log,
                         ray=self.ray)
        by_key = df.set_index("key")
        out = []
        for cell, (pol, b) in zip(todo, configs):
            rows = by_key.loc[[cell_key(self.model_id, s, self.n_prompt, pol, b) for s in self.segments]]
            losses = rows[self.target.column].to_numpy(float)
            self.block_se[cell] = self._standard_error(rows, float(losses.mean()))
            out.append(losses)
        return out

    def _bound_rung(self, budget: int) -> None:
        """The upper bounds of a rung's confirmed cells (see the module docstring). The segment margin pools the
        squared deviations of every confirmed cell's segment losses from its mean (degrees of freedom: segments
        minus one per cell), so a rung confirmed on two segments still gets a variance estimate; with one segment
        the token blocks' margin alone remains."""
        from scipy.stats import norm, t

        cells = [k for k in self.segment_losses if k[1] == budget]
        dev = [self.segment_losses[k] - self.measured[k] for k in cells]
        dof = sum(len(d) - 1 for d in dev)
        pooled = sum(float(d @ d) for d in dev) / dof if dof else 0.0
        t_level = float(t.ppf(norm.cdf(self.margin_z), dof)) if dof and self.margin_z > 0 else 0.0
        for k in cells:
            seg_margin = t_level * np.sqrt(pooled / len(self.segment_losses[k]))
            self.bound[k] = self.measured[k] + max(self.margin_z * self.block_se[k], seg_margin)

    def _standard_error(self, rows: pd.DataFrame, mean: float) -> float:
        """The standard error of a confirmed cell's mean loss: for ΔNLL over blocks of `SE_BLOCK` consecutive
        scored tokens of every segment (neighbouring tokens share their errors), for top-1 disagreement the
        binomial one over the scored tokens."""
        import json

        from gpu_validate.fidelity import block_means

        if self.target.column == "delta_nll":
            blocks = np.concatenate([block_means(json.loads(x) if isinstance(x, str) else x, SE_BLOCK)
                                     for x in rows["nll_per_token"]])
            return float(np.std(blocks, ddof=1) / np.sqrt(len(blocks))) if len(blocks) > 1 else float("inf")
        n = len(rows) * max(1, len(self.segments[0].ids) - self.n_prompt - 1)
        p = min(max(mean, 1 / n), 1 - 1 / n)
        return float(np.sqrt(p * (1 - p) / n))

    # ----- the decision -----

    def best_measured(self, budget: int) -> tuple[str, float] | None:
        """The confirmed configuration of a rung with the lowest upper confidence bound, and that bound (None
        before the rung is confirmed)."""
        found = [(v, lab) for (lab, b), v in self.bound.items() if b == budget]
        if not found:
            return None
        v, lab = min(found)
        return lab, v

    def _confirm_rung(self, budget: int) -> None:
        top = shortlist(self.ranked(budget), self.family, self.validate, self.per_family)
        self.confirm([(lab, budget) for lab in top])

    def search(self) -> int | None:
        """Index of the smallest rung whose confirmed best meets the target (None: no rung does)."""
        self.confirm([(self.ranked(b)[0], b) for b in self.budgets])       # calibration: one run per rung
        met = [i for i, b in enumerate(self.budgets) if self.target.met(self.best_measured(b)[1])]
        i = met[0] if met else len(self.budgets) - 1
        while True:
            self._confirm_rung(self.budgets[i])
            if not self.target.met(self.best_measured(self.budgets[i])[1]):
                return None                                               # only when i is the top rung
            if i == 0:
                return 0
            self._confirm_rung(self.budgets[i - 1])
            if not self.target.met(self.best_measured(self.budgets[i - 1])[1]):
                return i
            i -= 1

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.simulate()
        found = self.search()
        cal = fit_calibration([self._sim(lab, b) for lab, b in self.measured], list(self.measured.values()))
        self.table["predicted"] = cal.predict(self.table[self.sim_loss])
        self.table["measured"] = [self.measured.get((lab, int(b)), float("nan"))
                                  for lab, b in zip(self.table.label, self.table.budget)]
        per_budget = [self._rung(b) for b in self.budgets]
        answer = self._answer(found)
        return {"model": self.model_id, "target": str(self.target), "target_column": self.target.column,
                "target_limit": self.target.limit, "budgets": self.budgets, "n_prompt": self.n_prompt,
                "n_decode": len(self.segments[0].ids) - self.n_prompt, "segments": [s.name for s in self.segments],
                "sim_loss": self.sim_loss, "validate": self.validate, "per_family": self.per_family,
                "answer": answer, "per_budget": per_budget,
                "calibration": {"a": cal.a, "b": cal.b, "n": cal.n, "rms_log": cal.rms_log},
                "confidence": self._confidence(cal), "model_runs": self.runs, "front": front(self.table),
                "configurations": self.table.to_dict("records"), "seconds": time.perf_counter() - t0}

    # ----- the report's parts -----

    def _sim(self, label: str, budget: int) -> float:
        row = self.table[(self.table.label == label) & (self.table.budget == budget)]
        return float(row[self.sim_loss].iloc[0])

    def _cell(self, label: str, budget: int) -> dict[str, Any]:
        row = self.table[(self.table.label == label) & (self.table.budget == budget)].iloc[0]
        from sim.specs import policy_spec

        return {"label": label, "spec": policy_spec(self.cands[label].policy), "family": self.cands[label].family,
                "paper_default": self.cands[label].default, "budget": int(budget),
                "simulated": float(row[self.sim_loss]), "predicted": float(row["predicted"]),
                "measured": self.measured.get((label, budget)), "upper_bound": self.bound.get((label, budget)),
                "kv_bytes": float(row["kv_bytes_mean"])}

    def _rung(self, budget: int) -> dict[str, Any]:
        """A rung's choice: the confirmed best where the rung was confirmed, else the simulator's first."""
        best = self.best_measured(budget)
        sim_first = self.ranked(budget)[0]
        pick = best[0] if best else sim_first
        return {"budget": budget, "pick": self._cell(pick, budget), "source": "confirmed" if best else "simulator",
                "simulator_first": sim_first, "confirmed": sorted(lab for lab, b in self.measured if b == budget)}

    def _answer(self, found: int | None) -> dict[str, Any]:
        b = self.budgets[found if found is not None else -1]
        done = sorted((v, lab) for (lab, bb), v in self.bound.items() if bb == b)
        pick = self._cell(done[0][1], b)
        runner = next((self._cell(lab, b) for _, lab in done[1:]
                       if self.cands[lab].family != pick["family"]), None) or (
            self._cell(done[1][1], b) if len(done) > 1 else None)
        from policies.kvpress_press import export_summary

        return {"met": found is not None, "budget": b, "choice": pick, "runner_up": runner,
                "budget_share_of_prompt": b / self.n_prompt,
                "kvpress": export_summary(self.cands[pick["label"]].policy, b, self.n_prompt, pick["spec"])}

    def _confidence(self, cal: Calibration) -> dict[str, Any]:
        """How far to trust the answer: the simulator's order of confirmed pairs within a rung against the
        model's, and the calibration's error on the confirmed runs."""
        agree = total = 0
        for b in self.budgets:
            cells = [(lab, v) for (lab, bb), v in self.measured.items() if bb == b]
            for i, (la, va) in enumerate(cells):
                for lb, vb in cells[i + 1:]:
                    ds, dm = self._sim(la, b) - self._sim(lb, b), va - vb
                    if ds != 0 and dm != 0:
                        total += 1
                        agree += (ds > 0) == (dm > 0)
        share = agree / total if total else float("nan")
        # the answer rests on the measured losses of the confirmed runs, so an order that held is worth more than
        # calibrated values: loose calibration alone (a retrieval target's measured shares are often exactly 0,
        # which a log-scale fit cannot match) caps the level at medium, it does not make it low
        level = ("high" if share >= 0.8 and cal.rms_log <= 0.3 else
                 "medium" if share >= 0.8 or (share >= 0.6 and cal.rms_log <= 0.6) else "low")
        if level == "low":
            advice = ("The simulator is not a reliable guide for this model and text: confirm more configurations "
                      "in the model (--validate) before trusting the choice")
        elif level == "high":
            advice = "The simulator ordered the confirmed configurations as the model did"
        elif share >= 0.8:          # the order held; the calibrated values did not
            advice = ("The simulator ordered the confirmed configurations as the model did, but its calibrated "
                      "losses are loose: the measured ones decided the budget, and the rungs nobody confirmed are "
                      "only estimates")
        else:
            advice = ("The simulator's order was partly wrong among the confirmed configurations; confirming more "
                      "(--validate) may find a better one")
        return {"pair_agreement": share, "pairs": total, "calibration_rms_log": cal.rms_log, "level": level,
                "advice": advice}


def recommend(model, segments: Sequence[Segment], cands: Sequence[Candidate], budgets: Sequence[int],
              target: Target, **kwargs) -> dict[str, Any]:
    """Recommend a policy, its hyperparameters and the smallest budget meeting ``target`` on ``segments``
    (see the module docstring); kwargs go to `Recommender`. Returns the JSON-ready report."""
    return Recommender(model, segments, cands, budgets, target, **kwargs).run()


def recommend_texts(model: str, texts: Sequence[str], target: str, *, out: str | Path, segments: int = 3,
                    prompt_tokens: int = 512, decode_tokens: int = 128, policies: str = "all",
                    budgets: str | Sequence[int] = "auto",
                    validate: int = 3, device: str | None = None, progress: bool = True,
                    ray_address: str | None = None, threads: int = 1) -> dict[str, Any]:
    """`recommend` from names, as ``kvsim recommend`` takes them: a model (registry name, HF folder or .gguf),
    texts (shipped names or UTF-8 files; ``segments`` windows of each), a target (``dnll=0.05``, ``top1=0.95``;
    ``retrieval=0.9`` runs `gpu_validate.recommend_retrieval` on ``segments`` pass-key seeds per text instead),
    families or specs (``all``) and budgets (``auto`` or ``64,128``). On CUDA the closed loop uses the Triton
    cache, else the torch one. With ``ray_address`` the closed-loop batches run as Ray tasks (``threads`` each,
    one GPU each on CUDA) on workers that load ``model`` themselves. The report also names the texts, device
    and backend."""
    import torch

    from gpu_validate.backends import pick_device
    from gpu_validate.recommend_grid import budget_ladder, candidates
    from gpu_validate.segments import make_segments
    from traces.model import read_text
    from traces.models import load_model, model_id

    goal = Target.parse(target)
    cands = candidates(policies)
    ladder = budget_ladder(prompt_tokens, budgets)
    if goal.name == "retrieval" and ray_address is not None:
        raise ValidateError("--ray confirms text segments; a retrieval target runs its needle prompts here")
    torch.set_grad_enabled(False)
    device, backend = pick_device(device)
    hf, tok = load_model(model, device=device, progress=progress)
    if goal.name == "retrieval":
        from gpu_validate.recommend_retrieval import recommend_retrieval

        report = recommend_retrieval(hf, tok, {spec: read_text(spec)[0] for spec in texts}, cands, ladder, goal,
                                     prompt_tokens=prompt_tokens, per_text=segments, model_id=model_id(model),
                                     out=out, backend=backend, validate=validate, progress=progress)
        report.update(texts=list(texts), device=device, backend=backend)
        return report
    ids = {spec: tok(read_text(spec)[0], verbose=False)["input_ids"] for spec in texts}   # a spec names its segments
    segs = make_segments(ids, segments, prompt_tokens + decode_tokens)
    ray = None if ray_address is None else RayTarget(ray_address, model, device, threads)
    report = recommend(hf, segs, cands, ladder, goal, n_prompt=prompt_tokens, model_id=model_id(model), out=out,
                       validate=validate, backend=backend, progress=progress, ray=ray)
    report.update(texts=list(texts), device=device, backend=backend)
    return report


def front(table: pd.DataFrame) -> list[dict[str, Any]]:
    """The memory-vs-loss front of a recommendation's configurations (columns budget, label, kv_bytes_mean,
    predicted, measured): per budget, the one with the lowest measured loss where any was confirmed, else the
    lowest predicted one."""
    out = []
    for b, part in table.groupby("budget"):
        conf = part.dropna(subset=["measured"])
        best = (conf.nsmallest(1, "measured") if len(conf) else part.nsmallest(1, "predicted")).iloc[0]
        out.append({"budget": int(b), "label": best.label, "kv_bytes": float(best.kv_bytes_mean),
                    "loss": float(best.measured if len(conf) else best.predicted), "confirmed": bool(len(conf))})
    return out
