"""``kvsim recommend``: which policy, with which hyperparameters, at what budget keeps the quality a user needs on
their model and texts -- decided by the simulator, confirmed in the model.

1. **Simulate** every candidate (`gpu_validate.studies.recommendation.candidates`: each policy's paper default and
   the hyperparameter values its module declares) at every budget of a ladder on one teacher-forced trace per text
   segment
   (`gpu_validate.studies.fidelity.segments.simulated`; the trace is recorded once and serves every configuration).
2. **Calibrate**: the simulator's first choice at every rung runs closed loop in the model on the same segments;
   a power law ``ΔNLL ≈ exp(a) · sim^b`` fitted on those runs turns every simulated loss into a predicted model
   loss (the front, and the rungs nobody confirmed).
3. **Confirm** near the decision: at the smallest rung whose confirmed best meets the target, and at the rung
   below it, the simulator's ``validate`` best configurations run closed loop; while the rung below has a
   configuration that meets the target, the search steps down. A round that runs the model also runs, ahead, what
   the next rounds would confirm: with a rung that meets the target, the rung below and the first budget refined
   between the two (`next_cells`); with the rung below, the budget refined above it, needed if it misses
   (`refine_cells`). Ahead runs only ride along, never as a batch of their own: on the CPU a 3-row batch costs
   nearly what a 12-row one does (the model's weights are read once a step), so the typical search's three rounds
   cost one batch; the decisions are those of the round-by-round search.
4. **Refine**: between that rung and the one below it, budgets spaced at most `REFINE` apart (`refine_points`) are
   bisected the same way (simulated, then the simulator's best confirmed), so that the answer is within `REFINE` of
   the smallest budget whose confirmed best meets the target rather than a whole rung (1.33-2x) above it.
   The answer is the smallest budget whose *confirmed* best meets the target, that configuration, its runner-up and
   their predicted and measured losses.
   "Meets" is judged on an upper confidence bound of the loss, not on the mean: the best of several noisy
   measurements is an optimistic estimate, and the answer must hold on text the recommendation did not see. The
   bound is the mean plus the larger of two one-sided margins at the level of `MARGIN_Z`: `MARGIN_Z` standard errors
   over blocks of scored tokens (the noise within the segments), and Student's t times the standard error over
   segments, with the variance of the segments' losses about their configuration's mean pooled over the rung's
   confirmed configurations (how much segments differ: on the recommend benchmark's held-out segments the token
   blocks alone understated the deviation 1.4× on SmolLM2 and 2.3× on Gemma-3). ``margin_z=0`` judges the mean.
5. **Certify** (`Recommender.certify`): a distribution-free guarantee beside the bound, which assumes nothing of
   the losses' distribution -- only that a future window of the user's text is exchangeable with the segments
   measured (the calibration units). The chosen configuration runs at every rung from the answer's budget up; each
   segment's loss is made non-increasing in the budget (its worst at that budget or any larger one), and the
   certified budget is the smallest at which at least ``k = ceil((n + 1)(1 - alpha))`` of the ``n`` segments meet
   the target. Then a new window meets it there with probability at least ``1 - alpha`` (the conformal rank
   argument: the new window's loss is equally likely to fall at any of the n + 1 ranks). ``n`` segments certify no
   level below ``1 / (n + 1)`` (k would exceed n), and such a level is refused (`conformal_rank`). The
   configuration and the answer's budget are chosen on the same segments, a selection the argument does not
   cover: `benchmarks/recommend.py` measures the coverage over repeated seen/held-out splits.

Every closed-loop run goes into a `sim.experiments.store.ResultStore` under the output folder (the simulated cells
into a second one), so an interrupted recommendation resumes without repeating a model run. The recommendation states
its own confidence (`confidence`): a prediction of whether the answer holds on text it has not seen, from the margin
by which the answer's measured loss met the target in units of the segments' spread (calibrated against held-out
outcomes in `benchmarks/recommend.py`), besides how often the simulator ordered two confirmed configurations as the
model did and how far the calibrated predictions were from the measured losses.

The statistics behind the bound, the guarantee, the confidence and the calibration are in
`gpu_validate.studies.recommendation.recommend_statistics`; the entry points that take names (``recommend_texts``)
in `gpu_validate.studies.recommendation.recommender`; the retrieval target's subclass in
`gpu_validate.studies.recommendation.retrieval`; how answers are judged on held-out units in
`gpu_validate.studies.recommendation.recommend_evaluation`.
"""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from gpu_validate.studies.fidelity.rank_fidelity import SIM_LOSSES as FIDELITY_SIM_LOSSES
from gpu_validate.studies.fidelity.rank_fidelity import block_means
from gpu_validate.studies.fidelity.segments import ENGINE_LOSSES, RayTarget, Segment, cell_key, closed_loop, simulated
from gpu_validate.studies.recommendation.candidates import Candidate, Target
from gpu_validate.studies.recommendation.recommend_statistics import (CONFIDENCE_ADVICE, MARGIN_Z, SE_BLOCK,
                                                                      Calibration, confidence_level, conformal_rank,
                                                                      default_alpha, fit_calibration)
from gpu_validate.validate_error import ValidateError
from policies.core.kvpress_press import export_summary
from sim.experiments.specs import policy_spec
from sim.experiments.store import ResultStore

#: the simulated losses of a recommendation's table: `gpu_validate.studies.fidelity.rank_fidelity`'s and the error
#: after W_O
SIM_LOSSES = (*FIDELITY_SIM_LOSSES, "err_wo_mean")
#: the simulated loss the recommendation ranks by: the L1 distance of the attention distributions. It ranked 31
#: SmolLM2 configurations of a text kvsim had never seen best (Spearman rho 0.81 against the model's ΔNLL; the error
#: after W_O 0.69, the mean error 0.47; issue 38), and again on the shipped `idle` text (mean within-budget rho
#: 0.70, W_O 0.67, mean error 0.62; benchmarks/recommend.py, first two segments)
SIM_LOSS = "l1_mean"
#: the largest ratio between two budgets the search leaves untried near its answer (`refine_points`)
REFINE = 1.25
#: the candidates that go on from the first segment to the others (`race_survivors`): those among the RACE best at
#: some budget on it. Racing changes a recommendation only where a label of some budget's shortlist was raced out;
#: over the recommend benchmark's stored simulations (29 candidates of 8 families on 25 / 28 segments, all 127 / 128
#: splits, every grid budget: `benchmarks/race_check.py`) that happened to 0 shortlists at 16 on both models (1 of
#: 768 at 12 on Gemma-3, 38 of 635 at 8 on SmolLM2); a shortlisted label ranked at worst 11th (SmolLM2) and 13th
#: (Gemma-3) on the raced segment. With all 126 candidates, 16 keeps 25-33 of them, so the other segments simulate
#: about a quarter of the cells; on a 126-candidate recommendation of three segments, a shortlisted label ranked at
#: worst 3rd on whichever of them was raced
RACE = 16


@dataclass(frozen=True)
class SearchSettings:
    """How the search confirms its answer: ``validate`` configurations confirmed in the model per budget near the
    target, at most ``per_family`` of one family (so that a round also tests the simulator's choice between
    families), ranked by the simulated loss ``sim_loss``; ``refine``: the largest ratio between two budgets left
    untried near the answer (`refine_points`; None: the ladder's rungs only); ``race``: the candidates simulated on
    every segment are those among the ``race`` best at some budget on the first (`race_survivors`; None: every
    candidate on every segment); ``lookahead``: a rung's confirmations run in one batch with the ones the search
    would ask for next if the rung meets the target (`Recommender.next_cells`), since a model batch costs little
    more for more rows."""

    validate: int = 3
    per_family: int = 2
    sim_loss: str = SIM_LOSS
    refine: float | None = REFINE
    race: int | None = RACE
    lookahead: bool = True


@dataclass(frozen=True)
class GuaranteeSettings:
    """How the answer is judged and guaranteed: ``margin_z``, the level of the upper confidence bound that must meet
    the target (`MARGIN_Z`; 0 judges the mean); ``alpha``, the level of the distribution-free guarantee (None:
    `default_alpha` of the units)."""

    margin_z: float = MARGIN_Z
    alpha: float | None = None


@dataclass(frozen=True)
class ExecutionSettings:
    """Where and how the model runs: the closed-loop cache's ``backend``, ``ray`` workers for the closed-loop
    batches (None: this process; `gpu_validate.studies.fidelity.segments.closed_loop`), progress lines to ``log``,
    and the stores a rerun resumes from (None: ``closed_loop`` and ``simulated`` under the output folder; a benchmark
    shares them between recommendations)."""

    backend: str = "torch"
    progress: bool = True
    log: Callable[[str], None] = print
    ray: RayTarget | None = None
    closed_store: ResultStore | None = None
    sim_store: ResultStore | None = None


def refine_points(lo: int, hi: int, ratio: float = REFINE) -> list[int]:
    """The budgets strictly between ``lo`` and ``hi`` that split their ratio into equal steps of at most ``ratio``
    (geometrically, rounded to multiples of 8 as the automatic ladder is): 256 -> 384 gives [312], 128 -> 256 gives
    [152, 184, 216]. Empty when ``hi / lo`` is within ``ratio`` already, or the two are 8 apart; a step the rounding
    widened past ``ratio`` is split again."""
    if hi / lo <= ratio * (1 + 1e-9) or hi - lo <= 8:
        return []
    steps = int(np.ceil(np.log(hi / lo) / np.log(ratio) - 1e-9))
    out = sorted({b for k in range(1, steps) if lo < (b := int(round(lo * (hi / lo) ** (k / steps) / 8) * 8)) < hi})
    if not out:                     # every point rounded onto an end: the multiple of 8 nearest the middle
        mid = int(round(np.sqrt(lo * hi) / 8) * 8)
        out = [mid if lo < mid < hi else (lo // 8 + 1) * 8]
    chain = [lo, *out, hi]
    return sorted({*out, *(b for a, c in zip(chain, chain[1:]) for b in refine_points(a, c, ratio))})


def race_survivors(rows: pd.DataFrame, sim_loss: str, keep: int) -> set[str]:
    """The labels among the ``keep`` best by ``sim_loss`` at some budget of ``rows`` (one segment's simulated
    cells; ties broken by label): the candidates worth simulating on the other segments. A candidate outside every
    budget's ``keep`` best on one segment is far from any shortlist the search confirms (`RACE`)."""
    ranked = rows.sort_values([sim_loss, "label"]).groupby("budget", sort=False).head(keep)
    return set(ranked.label)


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
                 target: Target, *, n_prompt: int, model_id: str, out: str | Path,
                 search: SearchSettings = SearchSettings(), guarantee: GuaranteeSettings = GuaranteeSettings(),
                 execution: ExecutionSettings = ExecutionSettings()) -> None:
        """A recommendation of a policy among ``cands`` at one of ``budgets`` meeting ``target`` on ``segments``
        (the calibration units) of ``model`` (``model_id``; ``n_prompt`` prompt tokens a segment), its stores
        under ``out``; the ``search``, ``guarantee`` and ``execution`` settings as their classes say."""
        if not segments:
            raise ValidateError("recommend needs at least one text segment")
        if search.validate < 1:
            raise ValidateError(f"--validate must be >= 1 (configurations confirmed per budget), got {search.validate}")
        self.model, self.segments, self.target = model, list(segments), target
        self.cands = {c.label: c for c in cands}
        self.family = {c.label: c.family for c in cands}
        self.budgets = sorted(int(b) for b in budgets)
        self.n_prompt, self.model_id, self.backend = n_prompt, model_id, execution.backend
        self.validate, self.per_family, self.sim_loss = search.validate, search.per_family, search.sim_loss
        self.race, self.lookahead = search.race, search.lookahead
        self.survivors: set[str] | None = None      # the candidates simulated on every segment (None: all)
        self.progress, self.log = execution.progress, execution.log
        self.out = Path(out)
        # the stores a rerun resumes from (a benchmark may share them between recommendations)
        self.closed_store = execution.closed_store or ResultStore(self.out / "closed_loop")
        self.sim_store = execution.sim_store or ResultStore(self.out / "simulated")
        self.measured: dict[tuple[str, int], float] = {}     # mean model loss over the segments
        self.bound: dict[tuple[str, int], float] = {}        # its upper confidence bound (what must meet the target)
        self.segment_losses: dict[tuple[str, int], np.ndarray] = {}   # its loss on each segment
        self.block_se: dict[tuple[str, int], float] = {}     # its standard error over token blocks
        self.margin_z = guarantee.margin_z
        self.ray = execution.ray                             # closed-loop batches on Ray workers (``closed_loop``)
        self.runs = 0                                        # model runs made (cells sent x units)
        self.sent: set[tuple[str, int]] = set()              # the cells sent to the model, confirmed or run ahead
        self.refine = search.refine                          # None: the ladder's rungs only
        self.rungs = list(self.budgets)                      # the ladder and the budgets refinement added
        # the guarantee's level, checked before anything runs: the units must be able to certify it
        self.alpha = default_alpha(len(self.segments)) if guarantee.alpha is None else float(guarantee.alpha)
        self.certify_rank = self._certify_rank()
        # what every call of the search reuses: each segment's recorded trace (refinement simulates new budgets on
        # it) and its full-cache logits (each round of confirmations compares against them)
        self._traces = tempfile.TemporaryDirectory(prefix="kvsim-recommend-")
        self._fulls: dict[str, np.ndarray] = {}

    # ----- the two sides -----

    def _certify_rank(self) -> int:
        """The units of the guarantee that must meet the target (`conformal_rank`; refuses a level too fine)."""
        return conformal_rank(len(self.segments), self.alpha)

    def simulate(self, budgets: Sequence[int] | None = None) -> pd.DataFrame:
        """Mean over the segments of every simulated loss asked for, per (label, budget), for ``budgets`` (default:
        the ladder), added to the table; the candidates whose minimum budget exceeds a rung are left out of it.
        With ``race`` (and more than one segment), the first call simulates every candidate on the first segment and
        only `race_survivors` on the others; a later call (refinement) simulates the survivors. A candidate raced
        out keeps its first segment's losses in the table (``units`` 1) and is not ranked (`ranked`)."""
        if self.sim_loss not in SIM_LOSSES:
            raise ValidateError(f"unknown simulated loss {self.sim_loss!r}; choose from {SIM_LOSSES}")
        budgets = self.budgets if budgets is None else budgets
        labels = list(self.cands) if self.survivors is None else sorted(self.survivors)
        if self.race is None or len(self.segments) == 1 or self.survivors is not None:
            rows = self._simulated(self.segments, labels, budgets)
        else:
            rows = self._simulated(self.segments[:1], labels, budgets)
            self.survivors = race_survivors(pd.DataFrame(rows), self.sim_loss, self.race)
            if self.progress:
                self.log(f"raced on the first segment: {len(self.survivors)} of {len(self.cands)} candidates (the "
                         f"{self.race} best at some budget) go on to the other {len(self.segments) - 1}")
            rows += self._simulated(self.segments[1:], sorted(self.survivors), budgets)
        df = pd.DataFrame(rows)
        return self._add_table(df, [*(c for c in SIM_LOSSES if c in df), "kv_bytes_mean"])

    def _simulated(self, segments: Sequence[Segment], labels: Sequence[str], budgets: Sequence[int]) -> list[dict]:
        """The simulated rows of ``labels`` at ``budgets`` on ``segments``: the engine's losses come with every
        replay; the error after W_O only when it ranks (it costs more than the replay itself)."""
        configs = [(self.cands[lab].policy, b) for lab in labels for b in budgets
                   if self.cands[lab].policy.min_budget() <= b]
        return simulated(self.model, segments, configs, n_prompt=self.n_prompt, model_id=self.model_id,
                         store=self.sim_store, progress=self.progress, losses=(*ENGINE_LOSSES, self.sim_loss),
                         trace_dir=self._traces.name)

    def _add_table(self, df: pd.DataFrame, cols: Sequence[str]) -> pd.DataFrame:
        """The per-(label, budget) means of ``cols`` over the units, appended to the simulated table."""
        grouped = df.groupby(["label", "budget"])
        table = grouped[list(cols)].mean().reset_index()
        table["units"] = grouped.size().to_numpy()          # how many units each mean is over
        table["family"] = table.label.map(self.family)
        old = getattr(self, "table", None)
        self.table = table if old is None else pd.concat([old, table[~table.budget.isin(old.budget)]],
                                                         ignore_index=True)
        return self.table

    def ranked(self, budget: int) -> list[str]:
        """The labels simulated at ``budget``, best first by the simulated loss (raced-out candidates left out)."""
        part = self.table[self.table.budget == budget]
        if self.survivors is not None:
            part = part[part.label.isin(self.survivors)]
        return part.sort_values([self.sim_loss, "label"]).label.tolist()

    def confirm(self, cells: Sequence[tuple[str, int]],
                ahead: Callable[[], Sequence[tuple[str, int]]] = tuple) -> None:
        """Closed-loop runs of the (label, budget) cells not yet measured, on every segment (`_measure`): their
        losses per segment, their mean (``measured``) and the rungs' upper bounds (`_bound_rung`). The cells
        ``ahead()`` names (asked only when this runs the model at all and ``lookahead`` is on: never a batch of
        their own) ride along in the same batch but are not measured yet: they go into the store, where a later
        `confirm` finds them without a model run, so the search decides exactly as it would without them."""
        todo = [(lab, int(b)) for lab, b in dict.fromkeys(cells) if (lab, int(b)) not in self.measured]
        if not todo:
            return
        due = self.lookahead and any(c not in self.sent for c in todo)
        extra = [(lab, int(b)) for lab, b in dict.fromkeys(ahead())
                 if (lab, int(b)) not in self.measured and (lab, int(b)) not in todo] if due else []
        new = [c for c in (*todo, *extra) if c not in self.sent]
        self.sent.update(new)
        self.runs += len(new) * len(self.segments)
        for cell, losses in zip(todo, self._measure([*todo, *extra])):
            self.segment_losses[cell] = losses
            self.measured[cell] = float(losses.mean())
        for b in {b for _, b in todo}:
            self._bound_rung(b)

    def _measure(self, todo: Sequence[tuple[str, int]]) -> list[np.ndarray]:
        """The (label, budget) cells ``todo`` run closed loop on every segment: each one's loss per segment (and
        its standard error over token blocks, into ``block_se``)."""
        configs = [(self.cands[lab].policy, b) for lab, b in todo]
        df = closed_loop(self.model, self.segments, configs, self.closed_store, n_prompt=self.n_prompt,
                         model_id=self.model_id, progress=self.progress, backend=self.backend, log=self.log,
                         ray=self.ray, fulls=self._fulls)
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
        cells = [k for k in self.segment_losses if k[1] == budget]
        dev = [self.segment_losses[k] - self.measured[k] for k in cells]
        dof = sum(len(d) - 1 for d in dev)
        pooled = sum(float(d @ d) for d in dev) / dof if dof else 0.0
        t_level = float(stats.t.ppf(stats.norm.cdf(self.margin_z), dof)) if dof and self.margin_z > 0 else 0.0
        for k in cells:
            seg_margin = t_level * np.sqrt(pooled / len(self.segment_losses[k]))
            self.bound[k] = self.measured[k] + max(self.margin_z * self.block_se[k], seg_margin)

    def _standard_error(self, rows: pd.DataFrame, mean: float) -> float:
        """The standard error of a confirmed cell's mean loss: for ΔNLL over blocks of `SE_BLOCK` consecutive
        scored tokens of every segment (neighbouring tokens share their errors), for top-1 disagreement the
        binomial one over the scored tokens."""
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

    def _shortlist(self, budget: int) -> list[tuple[str, int]]:
        """The cells a rung's confirmation runs: the simulator's `shortlist` at ``budget``."""
        return [(lab, budget) for lab in shortlist(self.ranked(budget), self.family, self.validate, self.per_family)]

    def _confirm_rung(self, budget: int, ahead: Callable[[], Sequence[tuple[str, int]]] = tuple) -> None:
        """Confirm the rung's shortlist, with ``ahead()``'s cells run ahead in the same batch (`confirm`)."""
        self.confirm(self._shortlist(budget), ahead)

    def next_cells(self, i: int) -> list[tuple[str, int]]:
        """What the search confirms next if rung ``i`` meets the target: the shortlist of the rung below and what
        it refines between the two (`refine_cells`). Run ahead with rung ``i``'s own confirmations, they make the two
        or three rounds of a typical search one model batch; if the rung misses, they are runs spent for nothing."""
        return [] if i == 0 else [*self._shortlist(self.budgets[i - 1]), *self.refine_cells(i - 1)]

    def refine_cells(self, j: int) -> list[tuple[str, int]]:
        """The shortlist of the first budget `_refine` tries between rungs ``j`` and ``j + 1`` (simulated here if
        it is not yet): what the search confirms next if rung ``j`` misses the target and rung ``j + 1`` meets it."""
        points = [] if self.refine is None else refine_points(self.budgets[j], self.budgets[j + 1], self.refine)
        if not points:
            return []
        mid = points[len(points) // 2]
        self._simulate_new(mid)
        return self._shortlist(mid)

    def _simulate_new(self, budget: int) -> None:
        """Simulate ``budget`` unless the table has it."""
        if budget not in set(self.table.budget):
            self.simulate([budget])

    def search(self) -> int | None:
        """The smallest budget whose confirmed best meets the target (None: no rung does): the smallest rung of
        the ladder, then the budgets between it and the rung below (`refine`)."""
        i = self._search_ladder()
        if i is None or i == 0 or self.refine is None:
            return None if i is None else self.budgets[i]
        return self._refine(self.budgets[i - 1], self.budgets[i])

    def _search_ladder(self) -> int | None:
        """Index of the smallest rung of the ladder whose confirmed best meets the target (None: no rung does)."""
        self.confirm([(self.ranked(b)[0], b) for b in self.budgets])       # calibration: one run per rung
        met = [i for i, b in enumerate(self.budgets) if self.target.met(self.best_measured(b)[1])]
        i = met[0] if met else len(self.budgets) - 1
        while True:
            self._confirm_rung(self.budgets[i], lambda: self.next_cells(i))
            if not self.target.met(self.best_measured(self.budgets[i])[1]):
                return None                                               # only when i is the top rung
            if i == 0:
                return 0
            self._confirm_rung(self.budgets[i - 1], lambda: self.refine_cells(i - 1))
            if not self.target.met(self.best_measured(self.budgets[i - 1])[1]):
                return i
            i -= 1

    def _refine(self, lo: int, hi: int) -> int:
        """Bisect the budgets between ``lo`` (its confirmed best misses the target) and ``hi`` (it meets it):
        each one tried is simulated, then its simulator's best confirmed, as a rung is. Returns the smallest
        budget found meeting the target."""
        points = refine_points(lo, hi, self.refine)
        while points:
            mid = points[len(points) // 2]
            if self.progress:
                self.log(f"refining between budgets {lo} and {hi}: trying {mid}")
            self._simulate_new(mid)
            self.rungs = sorted({*self.rungs, mid})
            self._confirm_rung(mid)
            best = self.best_measured(mid)
            if best is not None and self.target.met(best[1]):
                hi, points = mid, [b for b in points if b < mid]
            else:
                lo, points = mid, [b for b in points if b > mid]
        return hi

    def certify(self, label: str, budget: int) -> dict[str, Any]:
        """The distribution-free guarantee of configuration ``label`` (the answer's, at ``budget``): it runs at
        every rung of the ladder above ``budget``; each unit's loss is made non-increasing in the budget (its worst
        at that budget or any larger one measured), and the certified budget is the smallest, going down from the
        top rung, at which at least `certify_rank` of the ``n`` units meet the target (see the module docstring).
        ``None`` when even the top rung does not."""
        rungs = sorted({budget, *(b for b in self.budgets if b > budget)})
        self.confirm([(label, b) for b in rungs])
        n, k = len(self.segments), self.certify_rank
        worst, certified, steps = np.full(n, -np.inf), None, []
        for b in reversed(rungs):
            worst = np.maximum(worst, self.segment_losses[label, b])
            met = int(np.sum(worst <= self.target.limit))
            steps.append({"budget": b, "units_met": met, "kth_loss": float(np.sort(worst)[k - 1])})
            if met < k:
                break
            certified = b
        return {"kind": "conformal", "alpha": self.alpha, "units": self.unit_name, "n_units": n, "units_needed": k,
                "label": label, "budget": certified, "answer_budget": budget,
                "cost_ratio": certified / budget if certified else None, "steps": steps[::-1],
                "statement": self._guarantee_statement(label, certified, n, k)}

    #: what the guarantee's units are (segments of the user's texts; a retrieval target's: pass-key prompts)
    unit_name = "segments"

    def _guarantee_statement(self, label: str, budget: int | None, n: int, k: int) -> str:
        if budget is None:
            return (f"not certified at any budget tried: at the largest, {label} met {self.target} on fewer than "
                    f"{k} of the {n} {self.unit_name}")
        return (f"at budget {budget}, {label} met {self.target} on at least {k} of the {n} {self.unit_name} (each "
                f"one's loss taken as its worst at this budget or any larger one), so a new window of your text, "
                f"exchangeable with these, meets it with probability at least {1 - self.alpha:.0%}; nothing is "
                f"assumed of how the losses are distributed")

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.simulate()
        t_sim = time.perf_counter()
        found = self.search()
        b = found if found is not None else self.budgets[-1]
        choice = self.best_measured(b)[0]
        t_search = time.perf_counter()
        guarantee = self.certify(choice, b)
        t_certify = time.perf_counter()
        cal = fit_calibration([self._sim(lab, bb) for lab, bb in self.measured], list(self.measured.values()))
        self.table["predicted"] = cal.predict(self.table[self.sim_loss])
        self.table["measured"] = [self.measured.get((lab, int(bb)), float("nan"))
                                  for lab, bb in zip(self.table.label, self.table.budget)]
        per_budget = [self._rung(bb) for bb in self.rungs]
        answer = self._answer(found is not None, b)
        return {"model": self.model_id, "target": str(self.target), "target_column": self.target.column,
                "target_limit": self.target.limit, "budgets": self.budgets, "rungs": self.rungs,
                "refine": self.refine, "n_prompt": self.n_prompt,
                "n_decode": len(self.segments[0].ids) - self.n_prompt, "segments": [s.name for s in self.segments],
                "sim_loss": self.sim_loss, "validate": self.validate, "per_family": self.per_family,
                "answer": answer, "guarantee": guarantee, "per_budget": per_budget,
                "calibration": {"a": cal.a, "b": cal.b, "n": cal.n, "rms_log": cal.rms_log},
                "confidence": self._confidence(cal, answer, guarantee), "model_runs": self.runs,
                "model_runs_ahead_unused": len(self.sent - set(self.measured)) * len(self.segments),
                "raced": self._race_report(), "front": front(self._ranked_table()),
                "configurations": self.table.to_dict("records"), "seconds": time.perf_counter() - t0,
                "stage_seconds": {"simulate": t_sim - t0, "search": t_search - t_sim, "certify": t_certify - t_search}}

    # ----- the report's parts -----

    def _ranked_table(self) -> pd.DataFrame:
        """The table's rows the search ranks: every candidate's, or the race's survivors'."""
        return self.table if self.survivors is None else self.table[self.table.label.isin(self.survivors)]

    def _race_report(self) -> dict[str, Any] | None:
        """How the race cut the simulation (None: every candidate was simulated on every segment)."""
        if self.survivors is None:
            return None
        return {"keep": self.race, "candidates": len(self.cands), "survivors": sorted(self.survivors),
                "raced_on": self.segments[0].name}

    def _sim(self, label: str, budget: int) -> float:
        row = self.table[(self.table.label == label) & (self.table.budget == budget)]
        return float(row[self.sim_loss].iloc[0])

    def _cell(self, label: str, budget: int) -> dict[str, Any]:
        row = self.table[(self.table.label == label) & (self.table.budget == budget)].iloc[0]
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

    def _answer(self, met: bool, b: int) -> dict[str, Any]:
        done = sorted((v, lab) for (lab, bb), v in self.bound.items() if bb == b)
        pick = self._cell(done[0][1], b)
        runner = next((self._cell(lab, b) for _, lab in done[1:]
                       if self.cands[lab].family != pick["family"]), None) or (
            self._cell(done[1][1], b) if len(done) > 1 else None)
        return {"met": met, "budget": b, "choice": pick, "runner_up": runner,
                "budget_share_of_prompt": b / self.n_prompt, "margin": self._margin(done[0][1], b),
                "kvpress": export_summary(self.cands[pick["label"]].policy, b, self.n_prompt, pick["spec"])}

    def _margin(self, label: str, budget: int) -> dict[str, float]:
        """How clearly a confirmed cell met (or missed) the target: its distance from the target in units of the
        standard error over segments (the cell's own spread; its token blocks' when it has one segment), and the
        share of the segments that met it on their own."""
        losses = self.segment_losses[label, budget]
        se = float(np.std(losses, ddof=1) / np.sqrt(len(losses))) if len(losses) > 1 else self.block_se[label, budget]
        gap = self.target.limit - float(losses.mean())
        return {"t": gap / se if se > 0 else (np.inf if gap >= 0 else -np.inf), "segment_se": se,
                "units_met_share": float(np.mean(losses <= self.target.limit))}

    def _confidence(self, cal: Calibration, answer: dict[str, Any], guarantee: dict[str, Any]) -> dict[str, Any]:
        """Whether to expect the answer to hold on text it has not seen: `confidence_level` of the answer's margin
        (its distance from the target in standard errors over segments, `_margin`) capped by its certificate
        (``guarantee``: none certified is low, high needs the answer's own budget), chosen on one model's held-out
        outcomes and judged on the other's (``benchmarks/recommend.py``); beside it, how often the simulator
        ordered two confirmed configurations of one rung as the model did, and the calibration's error."""
        agree = total = 0
        for b in self.rungs:
            cells = [(lab, v) for (lab, bb), v in self.measured.items() if bb == b]
            for i, (la, va) in enumerate(cells):
                for lb, vb in cells[i + 1:]:
                    ds, dm = self._sim(la, b) - self._sim(lb, b), va - vb
                    if ds != 0 and dm != 0:
                        total += 1
                        agree += (ds > 0) == (dm > 0)
        share = agree / total if total else float("nan")
        t = answer["margin"]["t"]
        level = confidence_level(answer["met"], t, guarantee["budget"], answer["budget"])
        if not answer["met"]:
            advice = "The target was not met at any budget tried: give larger budgets (--budgets) or a looser target"
        else:
            advice = CONFIDENCE_ADVICE["uncertified" if guarantee["budget"] is None else level]
        return {"level": level, "margin_t": t, "certified_at_answer": guarantee["budget"] == answer["budget"],
                "pair_agreement": share, "pairs": total, "calibration_rms_log": cal.rms_log, "advice": advice}


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
