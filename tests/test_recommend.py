"""`kvsim recommend`: the target and the candidates (each policy's declared search grid), the calibration, the
budget search's invariants and its refinement between rungs, the distribution-free guarantee (property tests on
synthetic loss tables), the confidence, and the whole recommendation on the tiny model, from Python and from the
CLI (whose "Use it" command runs)."""
from __future__ import annotations

import json
import math
import shlex

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_validate.validate_error import ValidateError
from gpu_validate.studies.recommendation.recommend_search import (REFINE, ExecutionSettings, GuaranteeSettings,
                                                                  Recommender, SearchSettings, race_survivors,
                                                                  refine_points, shortlist)
from gpu_validate.studies.recommendation.recommend_statistics import (CONFIDENCE, MARGIN_Z, confidence_level,
                                                                      conformal_rank, default_alpha, fit_calibration)
from gpu_validate.studies.recommendation.candidates import COMBINATORS, Target, budget_ladder, candidates, families
from policies import get_policy
from policies.core.errors import PolicyError


def test_target_parse_and_errors():
    t = Target.parse("dnll=0.05")
    assert (t.column, t.limit, t.met(0.05), t.met(0.051)) == ("delta_nll", 0.05, True, False)
    t = Target.parse("top1=0.95")
    assert t.column == "top1_disagreement" and t.limit == pytest.approx(0.05) and str(t) == "top1=0.95"
    for bad, word in (("ppl=3", "NAME=VALUE"), ("dnll", "NAME=VALUE"), ("dnll=x", "not a number"),
                      ("top1=1.5", "top1"), ("dnll=-1", "dnll")):
        with pytest.raises(ValidateError, match=word):
            Target.parse(bad)


def test_every_registered_policy_and_the_combinators_are_candidates():
    """``all`` is every registered policy but the full cache and the oracle, and ada(·) / critical(·) over every
    scorer they accept, each expanded from its own ``search_grid`` with the paper default first."""
    from policies.core.registry import list_policies, policy_class

    names = families()
    plain = [n for n in list_policies(combinators=False)
             if not (policy_class(n).is_oracle or policy_class(n).unbounded)]
    assert set(plain) <= set(names) and "full" not in names and "oracle" not in names
    wrapped = [n for n in list_policies() if "(" in n and n.split("(")[0] in COMBINATORS]
    assert set(names) == set(plain) | set(wrapped) and "ada(knorm)" in names and "critical(snapkv)" in names
    assert not any(n.startswith(("decoding(", "threshold(")) for n in names)
    cands = candidates()
    for fam in names:
        mine = [c for c in cands if c.family == fam]
        cls = policy_class(fam)
        assert len(mine) == len(cls.search_configs()) >= 1
        assert mine[0].default and not any(c.default for c in mine[1:])
        assert mine[0].policy.params == cls().params                     # the paper default first
    # the benchmark's families keep their four values (its stored closed-loop grid is keyed by them)
    assert [c.label for c in cands if c.family == "h2o"] == [
        "h2o", "h2o(recent_ratio=0.1)", "h2o(recent_ratio=0.25)", "h2o(recent_ratio=0.75)"]
    assert len([c for c in cands if c.family == "expected_attention"]) == 4          # two booleans, crossed
    assert [c.label for c in candidates("tova;h2o:recent_ratio=0.3")] == ["tova", "h2o(recent_ratio=0.3)"]
    assert [c.default for c in candidates("snapkv")] == [True, False, False, False]
    with pytest.raises(PolicyError):
        candidates("no_such_policy")
    with pytest.raises(ValidateError, match="future attention"):
        candidates("oracle")
    with pytest.raises(ValidateError, match="whole cache"):
        candidates("full")
    with pytest.raises(ValidateError, match="twice"):
        candidates("h2o;h2o:recent_ratio=0.1")


def test_a_new_policy_is_a_candidate_from_its_own_declaration():
    """A policy registered anywhere (a plug-in) is searched over the grid it declares, with no edit in kvsim."""
    from policies.core.base import Param, param_indices
    from policies.core.registry import _REGISTRY, register
    from policies.window import SlidingWindow as Window

    class Declared(Window):
        name = "test_declared_window"
        schema = (Param("slack", 2, "int", 0, 8),)
        P = param_indices(schema)
        search_grid = {"slack": (2, 0, 4)}

    register(Declared)
    try:
        assert "test_declared_window" in families()
        assert [c.policy.params["slack"] for c in candidates("test_declared_window")] == [2, 0, 4]
    finally:
        del _REGISTRY["test_declared_window"]


@pytest.mark.parametrize("grid,word", [({"nope": (1,)}, "not a searchable"), ({"slack": (0, 2)}, "paper default"),
                                       ({"slack": (2, 9)}, "above the maximum"), ({"slack": (2, 2)}, "twice")])
def test_a_bad_search_grid_is_refused_naming_the_policy(grid, word):
    from policies.core.base import Param
    from policies.window import SlidingWindow as Window

    bad = type("Bad", (Window,), {"name": "bad_grid", "schema": (Param("slack", 2, "int", 0, 8),),
                                  "search_grid": grid})
    with pytest.raises(PolicyError, match=word):
        bad.search_configs()


def test_budget_ladder():
    auto = budget_ladder(512)
    assert auto == sorted(auto) and auto[0] >= 16 and auto[-1] <= 0.75 * 512 and len(auto) >= 5
    assert all(b2 / b1 <= 1.6 for b1, b2 in zip(auto, auto[1:]))
    assert budget_ladder(512, "128,64") == [64, 128]
    with pytest.raises(ValidateError, match="whole"):
        budget_ladder(512, "64,512")
    with pytest.raises(ValidateError, match="integers"):
        budget_ladder(512, "64,a")


@given(lo=st.integers(8, 2000), ratio=st.floats(1.0, 4.0))
def test_refine_points_split_a_gap_into_steps_of_at_most_refine(lo, ratio):
    hi = int(lo * ratio)
    pts = refine_points(lo, hi)
    assert pts == sorted(set(pts)) and all(lo < b < hi and b % 8 == 0 for b in pts)
    chain = [lo, *pts, hi]
    # each step is within REFINE, or as fine as multiples of 8 allow
    assert all(b / a <= REFINE + 1e-9 or b - a <= 8 for a, b in zip(chain, chain[1:])) or len(pts) == 0 and hi - lo <= 16
    assert refine_points(256, 384) == [312] and refine_points(128, 256) == [152, 184, 216]


def test_conformal_rank_and_the_levels_it_refuses():
    assert conformal_rank(6, 1 / 7) == 6 and conformal_rank(9, 0.1) == 9 and conformal_rank(19, 0.1) == 18
    with pytest.raises(ValidateError, match="certify no level below"):
        conformal_rank(3, 0.2)
    with pytest.raises(ValidateError, match="alpha"):
        conformal_rank(10, 1.5)
    assert default_alpha(3) == 0.25 and default_alpha(9) == 0.1 and default_alpha(40) == 0.1


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), alpha=st.floats(0.05, 0.5), seed=st.integers(0, 10 ** 6))
def test_conformal_rank_holds_its_level_on_exchangeable_units(n, alpha, seed):
    """The rank's guarantee, exactly: over every draw of n + 1 exchangeable units (any continuous distribution),
    the new unit falls at or below the k-th smallest of the n others with probability k / (n + 1) >= 1 - alpha."""
    if (n + 1) * (1 - alpha) > n:
        with pytest.raises(ValidateError):
            conformal_rank(n, alpha)
        return
    k = conformal_rank(n, alpha)
    x = np.random.default_rng(seed).lognormal(size=(4000, n + 1))
    cover = np.mean(x[:, -1] <= np.sort(x[:, :-1], axis=1)[:, k - 1])
    assert k / (n + 1) >= 1 - alpha - 1e-9
    assert cover >= 1 - alpha - 4 * math.sqrt(alpha * (1 - alpha) / 4000) - 1e-9


def test_calibration_recovers_a_power_law_and_never_inverts():
    sim = np.array([0.1, 0.2, 0.4, 0.8])
    cal = fit_calibration(sim, 0.3 * sim ** 1.7)
    assert (cal.b, np.exp(cal.a), cal.rms_log) == pytest.approx((1.7, 0.3, 0.0), abs=1e-9)
    assert fit_calibration(sim, 1 / sim).b == 0.0            # a falling fit is held flat, not inverted
    one = fit_calibration([0.5], [0.1])
    assert (one.b, float(one.predict(0.5))) == pytest.approx((1.0, 0.1))


def test_shortlist_caps_each_family():
    fams = {"a1": "a", "a2": "a", "a3": "a", "b1": "b", "c1": "c"}
    assert shortlist(["a1", "a2", "a3", "b1", "c1"], fams, 3, 2) == ["a1", "a2", "b1"]
    assert shortlist(["a1", "a2", "a3", "b1", "c1"], fams, 3, 1) == ["a1", "b1", "c1"]


def test_confidence_levels_follow_the_margin_capped_by_the_certificate():
    hi, med = CONFIDENCE["high"], CONFIDENCE["medium"]
    assert hi > med
    margins = (math.inf, hi, (hi + med) / 2, med, med - 1e-6, -1.0)
    # certified at the answer's own budget: the margin alone decides
    assert [confidence_level(True, x, 128, 128) for x in margins] == [
        "high", "high", "medium", "medium", "low", "low"]
    # certified only above it: never high
    assert [confidence_level(True, x, 192, 128) for x in margins] == [
        "medium", "medium", "medium", "medium", "low", "low"]
    # certified nowhere, or no claim: low whatever the margin
    assert {confidence_level(True, x, None, 128) for x in margins} == {"low"}
    assert {confidence_level(False, x, 128, 128) for x in margins} == {"low"}


class _TableRecommender(Recommender):
    """A recommender whose simulated and model losses are functions of the budget: the search logic alone.
    Configuration i's model loss on unit u at budget b is ``scale[i] * unit[u] * (b0 / b) ** power[i]`` (falling
    with the budget), its simulated loss that times a per-configuration noise factor."""

    def __init__(self, n_cfg: int, n_units: int, budgets, target: float, k: int, tmp_path, seed: int, *,
                 refine: float | None = REFINE, margin_z: float = MARGIN_Z) -> None:
        from gpu_validate.studies.recommendation.candidates import Candidate

        rng = np.random.default_rng(seed)
        cands = [Candidate(f"f{i % 3}", get_policy("h2o", recent_ratio=(i + 1) / (n_cfg + 2)), i < 3)
                 for i in range(n_cfg)]
        self.scale, self.power = rng.uniform(0.05, 1.0, n_cfg), rng.uniform(0.5, 2.5, n_cfg)
        self.unit = rng.lognormal(0.0, 0.4, n_units)
        self.noise = rng.uniform(0.5, 2.0, n_cfg)
        self.index = {c.label: i for i, c in enumerate(cands)}
        super().__init__(None, [object()] * n_units, cands, budgets, Target.parse(f"dnll={target}"), n_prompt=10_000,
                         model_id="m", out=tmp_path, search=SearchSettings(validate=k, refine=refine),
                         guarantee=GuaranteeSettings(margin_z=margin_z), execution=ExecutionSettings(progress=False))

    def model_loss(self, label: str, b: int) -> np.ndarray:
        i = self.index[label]
        return self.scale[i] * self.unit * (self.budgets[0] / b) ** self.power[i]

    def simulate(self, budgets=None):
        budgets = self.budgets if budgets is None else budgets
        rows = [{"label": lab, "budget": b, "l1_mean": float(self.model_loss(lab, b).mean() * self.noise[i]),
                 "kv_bytes_mean": float(b)} for lab, i in self.index.items() for b in budgets]
        return self._add_table(pd.DataFrame(rows), ["l1_mean", "kv_bytes_mean"])

    def _measure(self, todo):
        for cell in todo:
            self.block_se[cell] = 0.0
        return [self.model_loss(lab, b) for lab, b in todo]


@pytest.mark.parametrize("margin_z", [0.0, 1.645])
def test_upper_bound_takes_the_larger_of_the_token_and_the_segment_margin(margin_z, tmp_path):
    from scipy.stats import norm, t

    rec = _TableRecommender(2, 2, [64], 0.1, 1, tmp_path, 0)
    rec.margin_z = margin_z
    a, b = (lab for lab in rec.cands)
    budget = rec.budgets[0]
    # segments that differ much more than the token blocks say (a): the pooled segment margin wins for both
    rec.segment_losses = {(a, budget): np.array([0.02, 0.10]), (b, budget): np.array([0.05, 0.07])}
    rec.measured = {k: float(v.mean()) for k, v in rec.segment_losses.items()}
    rec.block_se = {(a, budget): 0.001, (b, budget): 0.06}
    rec._bound_rung(budget)
    pooled = (2 * 0.04 ** 2 + 2 * 0.01 ** 2) / 2                     # two cells, one degree of freedom each
    seg = float(t.ppf(norm.cdf(margin_z), 2)) * np.sqrt(pooled / 2) if margin_z else 0.0
    assert rec.bound[a, budget] == pytest.approx(0.06 + seg)
    assert rec.bound[b, budget] == pytest.approx(0.06 + max(margin_z * 0.06, seg))
    if margin_z == 0:               # judged on the mean
        assert rec.bound == rec.measured
    else:                           # a noisy cell's own token margin can exceed the pooled one
        assert margin_z * 0.06 > seg and rec.bound[b, budget] > rec.bound[a, budget]


@settings(max_examples=60, deadline=None)
@given(n_cfg=st.integers(2, 6), n_budgets=st.integers(1, 5), n_units=st.integers(2, 8), k=st.integers(1, 4),
       target=st.floats(0.02, 0.5), refine=st.booleans(), seed=st.integers(0, 10 ** 6))
def test_search_answers_the_smallest_confirmed_budget_and_refines_it(n_cfg, n_budgets, n_units, k, target, refine,
                                                                    seed, tmp_path_factory):
    budgets = [64 * 2 ** j for j in range(n_budgets)]
    rec = _TableRecommender(n_cfg, n_units, budgets, target, k, tmp_path_factory.mktemp("rec"), seed,
                            refine=REFINE if refine else None, margin_z=0.0)
    rec.simulate()
    found = rec.search()
    assert all(rec.best_measured(b) is not None for b in rec.budgets)            # every rung calibrated
    met = {b for (_, b), v in rec.bound.items() if rec.target.met(v)}
    if found is None:
        assert not met
        return
    assert rec.target.met(rec.best_measured(found)[1]) and found == min(met)     # nothing smaller was confirmed
    missed = [b for b in rec.rungs if b < found and rec.best_measured(b) is not None]
    if found > budgets[0]:                       # the budget below was searched, with the simulator's shortlist
        lo = max(missed)
        assert sum(bb == lo for _, bb in rec.measured) >= min(k, n_cfg)
        if refine:                               # within REFINE of a budget whose confirmed best misses
            assert found / lo <= REFINE + 1e-9 or found - lo <= 8
        else:
            assert lo in budgets and found in budgets
    assert set(rec.measured) <= rec.sent and rec.runs == n_units * len(rec.sent)     # confirmed or run ahead


@settings(max_examples=40, deadline=None)
@given(n_cfg=st.integers(2, 5), n_units=st.integers(3, 12), target=st.floats(0.02, 0.5), seed=st.integers(0, 10 ** 6))
def test_guarantee_certifies_where_k_units_meet_the_target_from_the_top_down(n_cfg, n_units, target, seed,
                                                                           tmp_path_factory):
    budgets = [64, 128, 256, 512]
    rec = _TableRecommender(n_cfg, n_units, budgets, target, 2, tmp_path_factory.mktemp("rec"), seed)
    rec.simulate()
    found = rec.search()
    b = found if found is not None else budgets[-1]
    label = rec.best_measured(b)[0]
    g = rec.certify(label, b)
    k = g["units_needed"]
    assert (g["n_units"], k, g["alpha"]) == (n_units, conformal_rank(n_units, default_alpha(n_units)),
                                             default_alpha(n_units))
    above = sorted({b, *(x for x in budgets if x > b)})
    assert all((label, x) in rec.measured for x in above)                     # it ran at every rung above
    if g["budget"] is not None:
        assert g["budget"] >= b
        for x in above:
            if x >= g["budget"]:             # monotone worst-case losses: k units meet at every budget from there up
                worst = np.max([rec.segment_losses[label, y] for y in above if y >= x], axis=0)
                assert np.sum(worst <= target) >= k
    else:
        assert np.sum(rec.segment_losses[label, budgets[-1]] <= target) < k


@pytest.fixture(scope="module")
def tiny_segments():
    import torch

    from gpu_validate.studies.fidelity.segments import make_segments
    from traces.model import read_text
    from traces.models import load_model

    torch.set_grad_enabled(False)
    model, tok = load_model("tiny", progress=False)
    ids = tok(read_text("default")[0], verbose=False)["input_ids"]
    return model, make_segments({"default": ids}, 2, 96)


def test_recommend_on_the_tiny_model_resumes_without_model_runs(tiny_segments, tmp_path, monkeypatch):
    from gpu_validate.studies.fidelity import segments as seg_mod
    from gpu_validate.studies.recommendation.recommender import recommend

    model, segs = tiny_segments
    kw = dict(n_prompt=64, model_id="tiny", out=tmp_path, search=SearchSettings(validate=2),
              execution=ExecutionSettings(progress=False, log=lambda s: None))
    cands = candidates("h2o;streaming_llm;tova")
    rep = recommend(model, segs, cands, [16, 32, 48], Target.parse("dnll=0.05"), **kw)
    json.dumps(rep, default=float)                                           # JSON-ready
    a = rep["answer"]
    by_budget = {r["budget"]: r for r in rep["per_budget"]}
    assert a["budget"] in by_budget and a["choice"]["measured"] is not None
    if a["met"]:                          # met with its margin: the upper bound, above the mean, is within
        assert a["choice"]["measured"] <= a["choice"]["upper_bound"] <= 0.05
    assert rep["model_runs"] == 2 * sum(len(r["confirmed"]) for r in rep["per_budget"]) + \
        rep["model_runs_ahead_unused"]
    measured = [c for c in rep["configurations"] if not np.isnan(c["measured"])]
    assert len(measured) == rep["model_runs"] // 2 and all(c["predicted"] > 0 for c in rep["configurations"])
    assert [f["budget"] for f in rep["front"]] == rep["rungs"] and {16, 32, 48} <= set(rep["rungs"])
    g = rep["guarantee"]
    assert (g["n_units"], g["units_needed"], g["alpha"]) == (2, 2, pytest.approx(1 / 3))
    assert g["budget"] is None or g["budget"] >= a["budget"]
    c = rep["confidence"]
    assert c["level"] == confidence_level(a["met"], c["margin_t"], g["budget"], a["budget"])
    assert c["certified_at_answer"] == (g["budget"] == a["budget"])
    stages = rep["stage_seconds"]                # where the wall time went, for the speed page
    assert set(stages) == {"simulate", "search", "certify"} and min(stages.values()) >= 0
    assert sum(stages.values()) <= rep["seconds"]

    def no_model(*args, **kwargs):
        raise AssertionError("a resumed recommendation ran the model")

    monkeypatch.setattr(seg_mod, "run_batch", no_model)
    again = recommend(model, segs, cands, [16, 32, 48], Target.parse("dnll=0.05"), **kw)
    assert again["answer"] == rep["answer"]


@settings(max_examples=40, deadline=None)
@given(n_cfg=st.integers(2, 6), n_budgets=st.integers(1, 5), n_units=st.integers(2, 6), k=st.integers(1, 3),
       target=st.floats(0.02, 0.5), refine=st.booleans(), seed=st.integers(0, 10 ** 6))
def test_looking_ahead_changes_the_batches_not_the_decisions(n_cfg, n_budgets, n_units, k, target, refine, seed,
                                                            tmp_path_factory):
    """The search with its next rounds run ahead measures, bounds and answers exactly what the round-by-round
    search does, in no more batches of model runs (a batch: a call with a cell the store does not hold yet)."""
    budgets = [64 * 2 ** j for j in range(n_budgets)]
    out = {}
    for ahead in (False, True):
        rec = _TableRecommender(n_cfg, n_units, budgets, target, k, tmp_path_factory.mktemp("rec"), seed,
                                refine=REFINE if refine else None)
        rec.lookahead = ahead
        stored, batches = set(), []
        measure = rec._measure

        def counted(todo, measure=measure, stored=stored, batches=batches):
            if set(todo) - stored:
                batches.append(len(todo))
            stored.update(todo)
            return measure(todo)

        rec._measure = counted
        rec.simulate()
        out[ahead] = (rec.search(), rec.measured, rec.bound, rec.rungs, len(batches))
    assert out[True][:4] == out[False][:4]
    assert out[True][4] <= out[False][4]


def test_race_survivors_are_the_best_few_at_some_budget():
    rows = pd.DataFrame({"label": ["a", "b", "c", "d"] * 2, "budget": [16] * 4 + [32] * 4,
                         "l1_mean": [0.1, 0.2, 0.3, 0.4, 0.9, 0.5, 0.1, 0.8]})
    assert race_survivors(rows, "l1_mean", 1) == {"a", "c"}
    assert race_survivors(rows, "l1_mean", 2) == {"a", "b", "c"}
    assert race_survivors(rows, "l1_mean", 4) == {"a", "b", "c", "d"}
    tie = pd.DataFrame({"label": ["b", "a"], "budget": [16, 16], "l1_mean": [0.1, 0.1]})
    assert race_survivors(tie, "l1_mean", 1) == {"a"}               # ties by label, as the search ranks


def test_a_raced_recommendation_simulates_the_survivors_on_the_other_segments(tiny_segments, tmp_path):
    """Racing on the first segment: every candidate simulated there, the survivors on the others; only the
    survivors are ranked, confirmed and in the front; with a race as wide as the candidates, the recommendation
    is the unraced one."""
    from gpu_validate.studies.recommendation.recommender import recommend
    from sim.experiments.store import ResultStore

    model, segs = tiny_segments
    cands = candidates("h2o;streaming_llm;tova;knorm;random")
    budgets = [16, 32]

    def run(race, out):
        return recommend(model, segs, cands, budgets, Target.parse("dnll=0.05"), n_prompt=64, model_id="tiny",
                         out=tmp_path / out, search=SearchSettings(validate=2, race=race, refine=None),
                         execution=ExecutionSettings(progress=False, log=lambda s: None))

    raced = run(1, "raced")
    survivors = set(raced["raced"]["survivors"])
    assert 1 <= len(survivors) <= len(budgets) < len(cands)
    sim = ResultStore(tmp_path / "raced" / "simulated").load()
    per_segment = sim.groupby("segment").label.nunique()
    assert per_segment[segs[0].name] == len(cands) and per_segment[segs[1].name] == len(survivors)
    units = {c["label"]: c["units"] for c in raced["configurations"]}
    assert all(units[lab] == (2 if lab in survivors else 1) for lab in units)
    confirmed = {lab for r in raced["per_budget"] for lab in r["confirmed"]}
    assert confirmed <= survivors and {f["label"] for f in raced["front"]} <= survivors
    wide, unraced = run(len(cands), "wide"), run(None, "unraced")
    assert unraced["raced"] is None and set(wide["raced"]["survivors"]) == {c.label for c in cands}
    assert wide["answer"] == unraced["answer"] and wide["per_budget"] == unraced["per_budget"]


def test_closed_loop_on_ray_workers_equals_in_process(tiny_segments, tmp_path, ray_local):
    """``--ray``: every batch a Ray task on a worker that loads the model itself; the same rows as in this
    process (a local Ray cluster stands in for a remote one)."""
    from gpu_validate.studies.fidelity.segments import RayTarget, closed_loop
    from policies import get_policy
    from sim.experiments.store import ResultStore

    model, segs = tiny_segments
    configs = [(get_policy("h2o"), 16), (get_policy("tova"), 32), (get_policy("streaming_llm", n_sinks=2), 16)]
    kw = dict(n_prompt=64, model_id="tiny", progress=False, log=lambda s: None, max_rows=2)
    here = closed_loop(model, segs, configs, ResultStore(tmp_path / "here"), **kw)
    there = closed_loop(model, segs, configs, ResultStore(tmp_path / "ray"), ray=RayTarget("local", "tiny"), **kw)
    cols = ["key", "label", "budget", "segment", "delta_nll", "top1_disagreement"]
    a, b = (df[cols].sort_values("key").reset_index(drop=True) for df in (here, there))
    assert len(a) == 6
    pd.testing.assert_frame_equal(a, b)


def test_recommend_cli_writes_json_page_and_plot(tmp_path, capsys):
    from sim.cli import main
    from sim.reports.webpage import esc

    out = tmp_path / "rec"
    rc = main(["recommend", "--model", "tiny", "--prompt-tokens", "64", "--decode-tokens", "32", "--segments", "1",
               "--target", "top1=0.6", "--policies", "streaming_llm;tova", "--budgets", "16,32", "--validate", "1",
               "--out", str(out), "--quiet", "--threads", "1"])
    assert rc == 0
    rep = json.loads((out / "recommend.json").read_text())
    assert rep["target_column"] == "top1_disagreement" and rep["texts"] == ["default"]
    page = (out / "recommend.html").read_text()
    assert 'data-fact="target"' in page and "data:image/png;base64" in page
    printed = capsys.readouterr().out
    use = next(line for line in printed.splitlines() if line.startswith("Use it: "))[len("Use it: "):]
    assert use.startswith("kvsim generate --model tiny --policy") and rep["model_spec"] == "tiny"
    assert f"<code>{esc(use)}</code>" in page                                # the page shows the same command
    argv = shlex.split(use)
    assert main([*argv[1:], "--max-new-tokens", "2", "--threads", "1"]) == 0   # and it runs
    assert main(["recommend", "--model", "tiny", "--target", "ppl=3", "--out", str(out)]) == 2
    # a level one segment cannot certify is refused before anything runs
    assert main(["recommend", "--model", "tiny", "--segments", "1", "--target", "dnll=0.1", "--alpha", "0.2",
                 "--out", str(out)]) == 2
    assert "certify no level below" in capsys.readouterr().err
    assert main(["recommend", "--model", "tiny", "--target", "dnll=0.1", "--race", "-1", "--out", str(out)]) == 2
    assert "--race must be >= 0" in capsys.readouterr().err
