"""``kvsim recommend --target retrieval=X``: the recommendation's search
(`gpu_validate.studies.recommendation.recommend_search.Recommender`) on
needle retrieval instead of next-token loss.

The units are pass-key prompts (`gpu_validate.studies.needle.prompts.make_grid`) laid into the user's own texts at the
prompt length, ``per_text`` seeds × `DEPTHS` per text, instead of text segments. Retrieval is measured relative
to the full cache: the full cache runs every prompt first (`solved_prompts`), and the recommendation is made on
the prompts it answers, so ``retrieval=0.95`` means "of the prompts the model itself answers, the compressed
cache answers at least 95%". Its loss is the failure share on those prompts (``retrieval_failure``).

- **Simulate**: each prompt plus its answer recorded teacher-forced and every configuration replayed
  (`gpu_validate.studies.needle.prediction.stored_features`); the simulated loss is one minus `RETRIEVAL_FEATURE`, the
  share of the full cache's attention on the pass key that the policy still holds at the answer steps (the feature
  that predicted retrieval best across models: ``benchmarks/results/ruler_transfer.json``, fitted on SmolLM2 and
  judged on Gemma-3, balanced accuracy 0.86).
- **Confirm**: the configurations run closed loop on every solved prompt (`gpu_validate.studies.needle.runs.run_needle`,
  greedy decoding, success when the generation holds the key).
- **Bound**: a configuration meets the target when the one-sided Clopper-Pearson upper limit of its failure
  share (at the level of ``margin_z``) does, so a handful of prompts cannot certify a high target: with n prompts
  all answered the limit is 1 - 0.05^(1/n) (12 prompts: 0.22, so retrieval=0.78 at best; 59 for 0.95).
  `certifiable` says what the prompts can certify, and the recommendation refuses a target they cannot.
- **Guarantee**: that bound is already distribution-free (an exact binomial limit: it assumes only that future
  prompts are exchangeable with these), so the answer's budget is the certified one, at the level ``alpha`` =
  1 - Φ(``margin_z``) (``--alpha`` sets it; default 0.05).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
from scipy.stats import beta, norm

from gpu_validate.studies.needle.prediction import stored_features
from gpu_validate.studies.needle.prompts import NeedlePrompt, make_grid
from gpu_validate.studies.needle.runs import config_key, run_needle
from gpu_validate.studies.recommendation.candidates import Candidate, Target
from gpu_validate.studies.recommendation.recommend_search import (ExecutionSettings, GuaranteeSettings, Recommender,
                                                                  SearchSettings)
from gpu_validate.studies.recommendation.recommend_statistics import MARGIN_Z
from gpu_validate.validate_error import ValidateError
from policies import get_policy
from sim.experiments.store import ResultStore

#: the relative depths of the pass key in each text's prompts
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
#: the simulated predictor of retrieval (`gpu_validate.studies.needle.prediction.FEATURES`); its loss is 1 - the feature
RETRIEVAL_FEATURE = "copy_target"
SIM_LOSS = "retrieval_sim_loss"


def needle_units(tokenizer, texts: dict[str, str], prompt_tokens: int, per_text: int) -> list[NeedlePrompt]:
    """``per_text`` seeds × `DEPTHS` pass-key prompts of ``prompt_tokens`` tokens in each of ``texts`` (name ->
    text); each text gets its own seeds, so no two prompts share a store key."""
    out: list[NeedlePrompt] = []
    for i, text in enumerate(texts.values()):
        out += make_grid(tokenizer, text, [prompt_tokens], DEPTHS, range(i * per_text, (i + 1) * per_text))
    return out


def prompts_digest(prompts: Sequence[NeedlePrompt]) -> str:
    """A digest of the prompts' token ids: the name of the stores that hold their runs (a needle store's keys do
    not see the filler text, so another text gets other stores rather than another's results)."""
    return hashlib.sha256(json.dumps([list(p.ids) for p in prompts]).encode()).hexdigest()[:12]


def certifiable(n: int, margin_z: float) -> float:
    """The highest retrieval target ``n`` prompts can certify: one minus the Clopper-Pearson upper limit of the
    failure share when all ``n`` are answered."""
    return 1.0 if margin_z <= 0 else float((1.0 - norm.cdf(margin_z)) ** (1.0 / max(n, 1)))


def failure_upper_limit(failures: int, n: int, margin_z: float) -> float:
    """One-sided Clopper-Pearson upper limit of a failure share at the level of ``margin_z`` (0: the share)."""
    if margin_z <= 0:
        return failures / n
    return 1.0 if failures >= n else float(beta.ppf(norm.cdf(margin_z), failures + 1, n - failures))


def solved_prompts(model, prompts: Sequence[NeedlePrompt], store, *, model_id: str, backend: str,
                   decode: Callable[[list[int]], str], progress: bool = True,
                   log: Callable[[str], None] = print) -> list[NeedlePrompt]:
    """The prompts the full cache answers (each run once, stored in ``store``)."""
    df = run_needle(model, prompts, [(get_policy("full"), 1)], store, model_id=model_id, backend=backend,
                    decode=decode, progress=progress, log=log)
    ok = set(df[(df.policy == "full") & df.success.astype(bool)].prompt_id)
    return [p for p in prompts if p.prompt_id in ok]


class RetrievalRecommender(Recommender):
    """`Recommender` on solved needle prompts (the ``segments``): the simulated table from the needle features,
    measurements by closed-loop retrieval, bounds from the binomial failure count."""

    def __init__(self, model, prompts: Sequence[NeedlePrompt], cands: Sequence[Candidate], budgets: Sequence[int],
                 target: Target, *, decode: Callable[[list[int]], str], search: SearchSettings = SearchSettings(),
                 **kwargs) -> None:
        """``kwargs``: `Recommender`'s; the search ranks by `SIM_LOSS` whatever ``search`` names."""
        if target.column != "retrieval_failure":
            raise ValidateError(f"RetrievalRecommender takes a retrieval target, got {target}")
        super().__init__(model, prompts, cands, budgets, target, search=replace(search, sim_loss=SIM_LOSS), **kwargs)
        self.decode = decode

    unit_name = "pass-key prompts"

    def _certify_rank(self) -> int:
        """No conformal rank: the Clopper-Pearson bound certifies (the level is ``alpha``, from ``margin_z``)."""
        self.alpha = float(1.0 - norm.cdf(self.margin_z))
        return 0

    def simulate(self, budgets: Sequence[int] | None = None) -> pd.DataFrame:
        """Per (label, budget) of ``budgets`` (default: the ladder): the mean simulated loss over the prompts and
        the K/V bytes held while answering, added to the table."""
        budgets = self.budgets if budgets is None else budgets
        configs = [(c.policy, b) for c in self.cands.values() for b in budgets if c.policy.min_budget() <= b]
        df = stored_features(self.model, self.segments, configs, self.sim_store, model_id=self.model_id,
                             progress=self.progress, log=self.log)
        df[SIM_LOSS] = 1.0 - df[RETRIEVAL_FEATURE]
        return self._add_table(df, [SIM_LOSS, "kv_bytes_mean"])

    def certify(self, label: str, budget: int) -> dict[str, Any]:
        """The answer's own Clopper-Pearson limit is the guarantee: certified at the answer's budget when it met
        the target (no further runs)."""
        fails = self.segment_losses[label, budget]
        n, f = len(fails), int(fails.sum())
        ok = self.target.met(self.bound[label, budget])
        statement = (f"at budget {budget}, {label} answered {n - f} of the {n} {self.unit_name}; with probability at "
                     f"least {1 - self.alpha:.0%} over prompts drawn like these, it answers at least "
                     f"{self.target.value:.0%} of such prompts (one-sided Clopper-Pearson, exact binomial)"
                     if ok else f"not certified: at budget {budget}, {label} failed {f} of the {n} {self.unit_name}")
        return {"kind": "clopper_pearson", "alpha": self.alpha, "units": self.unit_name, "n_units": n,
                "units_needed": None, "label": label, "budget": budget if ok else None, "answer_budget": budget,
                "cost_ratio": 1.0 if ok else None, "steps": [{"budget": budget, "units_met": n - f,
                                                              "upper_limit": self.bound[label, budget]}],
                "statement": statement}

    def _margin(self, label: str, budget: int) -> dict[str, float]:
        """The margin of a failure share: its distance from the limit in binomial standard errors, the share
        smoothed by half a failure (so that no failure in n prompts is a finite margin that grows with n)."""
        fails = self.segment_losses[label, budget]
        n = len(fails)
        p = (fails.sum() + 0.5) / (n + 1)
        se = float(np.sqrt(p * (1 - p) / n))
        return {"t": (self.target.limit - float(fails.mean())) / se, "segment_se": se,
                "units_met_share": float(1 - fails.mean())}

    def _measure(self, todo: Sequence[tuple[str, int]]) -> list[np.ndarray]:
        """Closed-loop retrieval of the cells ``todo`` on every prompt: each one's failures (1.0) per prompt."""
        configs = [(self.cands[lab].policy, b) for lab, b in todo]
        df = run_needle(self.model, self.segments, configs, self.closed_store, model_id=self.model_id,
                        backend=self.backend, decode=self.decode, progress=self.progress, log=self.log)
        success = dict(zip(df.key, df.success.astype(bool)))
        return [np.array([not success[config_key(p, pol, b, self.model_id)] for p in self.segments], float)
                for pol, b in configs]

    def _bound_rung(self, budget: int) -> None:
        """Each confirmed cell's Clopper-Pearson limit of its failure share (a cell's own count: no pooling)."""
        for (lab, b), fails in self.segment_losses.items():
            if b == budget:
                self.bound[lab, b] = failure_upper_limit(int(fails.sum()), len(fails), self.margin_z)


def recommend_retrieval(model, tokenizer, texts: dict[str, str], cands: Sequence[Candidate], budgets: Sequence[int],
                        target: Target, *, prompt_tokens: int, per_text: int, model_id: str, out: str | Path,
                        backend: str, margin_z: float | None = None, alpha: float | None = None, progress: bool = True,
                        log: Callable[[str], None] | None = None,
                        search: SearchSettings = SearchSettings()) -> dict[str, Any]:
    """The retrieval recommendation on ``texts`` (see the module docstring), searching with ``search``.
    ``alpha``, when given, is the Clopper-Pearson level (``margin_z`` = Φ⁻¹(1 - alpha)). Returns the report, with
    the prompts made, those the full cache answers and the target they can certify."""
    if alpha is not None:
        if not 0 < alpha < 1:
            raise ValidateError(f"--alpha must be in (0, 1), got {alpha}")
        margin_z = float(norm.ppf(1 - alpha))
    z = MARGIN_Z if margin_z is None else margin_z
    log = log or (print if progress else (lambda s: None))
    prompts = needle_units(tokenizer, texts, prompt_tokens, per_text)
    root = Path(out) / f"retrieval-{prompts_digest(prompts)}"
    solved = solved_prompts(model, prompts, ResultStore(root / "closed_loop"), model_id=model_id, backend=backend,
                            decode=tokenizer.decode, progress=progress, log=log)
    if not solved:
        raise ValidateError(f"the full cache answers none of the {len(prompts)} pass-key prompts of {prompt_tokens} "
                            "tokens in these texts: retrieval cannot be a target for this model here (try shorter "
                            "--prompt-tokens, or a dnll/top1 target)")
    best = certifiable(len(solved), z)
    if target.value > best:
        raise ValidateError(f"{len(solved)} prompts the full cache answers (of {len(prompts)}) can certify at most "
                            f"retrieval={best:.2f} (one-sided {norm.cdf(z):.0%}: every one answered); give a lower "
                            "target, a larger --alpha or more prompts (--segments: pass-key seeds per text, each at 5 "
                            "depths)")
    rec = RetrievalRecommender(model, solved, cands, budgets, target, decode=tokenizer.decode, n_prompt=prompt_tokens,
                               model_id=model_id, out=root, search=search, guarantee=GuaranteeSettings(margin_z=z),
                               execution=ExecutionSettings(backend=backend, progress=progress, log=log))
    report = rec.run()
    report.update(model_runs=report["model_runs"] + len(prompts), retrieval_prompts=len(prompts),
                  retrieval_prompts_solved_by_full=len(solved), retrieval_certifiable=best,
                  retrieval_feature=RETRIEVAL_FEATURE, n_decode=None)
    return report
