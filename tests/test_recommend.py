"""`kvsim recommend`: the target and the candidate grid, the calibration, the budget search's invariants (property
tests on synthetic loss tables), and the whole recommendation on the tiny model, from Python and from the CLI."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_validate.jobs import ValidateError
from gpu_validate.recommend import Calibration, Recommender, fit_calibration, shortlist
from gpu_validate.recommend_grid import FAMILY_GRID, Target, budget_ladder, candidates
from policies import get_policy
from policies.errors import PolicyError


@pytest.mark.parametrize("flip,rms,level", [(False, 0.2, "high"), (False, 1.5, "medium"), (True, 0.2, "low"),
                                             (True, 1.5, "low")])
def test_confidence_trusts_the_confirmed_order_over_the_calibration(flip, rms, level):
    """An order of confirmed pairs that held keeps the level at least medium however loose the calibration (a
    retrieval target's measured shares of 0 defeat a log-scale fit); an order that failed makes it low."""
    from types import SimpleNamespace

    sims = {("a", 64): 0.1, ("b", 64): 0.2, ("c", 64): 0.3}
    measured = {k: (-v if flip else v) for k, v in sims.items()}
    fake = SimpleNamespace(budgets=[64], measured=measured, _sim=lambda lab, b: sims[(lab, b)])
    conf = Recommender._confidence(fake, Calibration(0.0, 1.0, 3, rms))
    assert (conf["level"], conf["pairs"], conf["pair_agreement"]) == (level, 3, 0.0 if flip else 1.0)
    assert ("ordered the confirmed configurations as the model did" in conf["advice"]) == (not flip)


def test_target_parse_and_errors():
    t = Target.parse("dnll=0.05")
    assert (t.column, t.limit, t.met(0.05), t.met(0.051)) == ("delta_nll", 0.05, True, False)
    t = Target.parse("top1=0.95")
    assert t.column == "top1_disagreement" and t.limit == pytest.approx(0.05) and str(t) == "top1=0.95"
    for bad, word in (("ppl=3", "NAME=VALUE"), ("dnll", "NAME=VALUE"), ("dnll=x", "not a number"),
                      ("top1=1.5", "top1"), ("dnll=-1", "dnll")):
        with pytest.raises(ValidateError, match=word):
            Target.parse(bad)


def test_grid_defaults_first_and_valid():
    cands = candidates()
    assert len(cands) == sum(len(v) for v in FAMILY_GRID.values())
    for fam, specs in FAMILY_GRID.items():
        mine = [c for c in cands if c.family == fam]
        assert mine[0].default and not any(c.default for c in mine[1:])
        assert mine[0].policy.params == get_policy(mine[0].policy.name).params      # the paper default
        assert len({c.label for c in mine}) == len(specs)
        assert all(c.policy.min_budget() <= 64 for c in mine)
    assert [c.label for c in candidates("tova;h2o:recent_ratio=0.3")] == ["tova", "h2o(recent_ratio=0.3)"]
    with pytest.raises(PolicyError):
        candidates("no_such_policy")
    with pytest.raises(ValidateError, match="future attention"):
        candidates("oracle")
    with pytest.raises(ValidateError, match="twice"):
        candidates("h2o;h2o:recent_ratio=0.1")


def test_budget_ladder():
    auto = budget_ladder(512)
    assert auto == sorted(auto) and auto[0] >= 16 and auto[-1] <= 0.75 * 512 and len(auto) >= 5
    assert all(b2 / b1 <= 1.6 for b1, b2 in zip(auto, auto[1:]))
    assert budget_ladder(512, "128,64") == [64, 128]
    with pytest.raises(ValidateError, match="whole"):
        budget_ladder(512, "64,512")
    with pytest.raises(ValidateError, match="integers"):
        budget_ladder(512, "64,a")


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


class _TableRecommender(Recommender):
    """A recommender whose simulated table and model losses are given: the search logic alone."""

    def __init__(self, sim: np.ndarray, model: np.ndarray, target: float, k: int, tmp_path) -> None:
        from gpu_validate.recommend_grid import Candidate

        labels = [f"c{i}" for i in range(sim.shape[0])]
        cands = [Candidate(f"f{i % 3}", get_policy("h2o", recent_ratio=(i + 1) / (sim.shape[0] + 2)), i < 3)
                 for i in range(sim.shape[0])]
        self.names = {c.label: lab for c, lab in zip(cands, labels)}
        super().__init__(None, [object()], cands, [16 * (j + 1) for j in range(sim.shape[1])],
                         Target.parse(f"dnll={target}"), n_prompt=1000, model_id="m", out=tmp_path, validate=k)
        self.loss = {(c.label, b): model[i, j] for i, c in enumerate(cands) for j, b in enumerate(self.budgets)}
        self.table = pd.DataFrame([{"label": c.label, "budget": b, "l1_mean": sim[i, j], "family": c.family,
                                    "kv_bytes_mean": float(b)}
                                   for i, c in enumerate(cands) for j, b in enumerate(self.budgets)])

    def confirm(self, cells):
        for lab, b in cells:
            if (lab, b) not in self.measured:
                self.measured[lab, b] = self.bound[lab, b] = self.loss[lab, b]
                self.runs += 1


@pytest.mark.parametrize("margin_z", [0.0, 1.645])
def test_upper_bound_takes_the_larger_of_the_token_and_the_segment_margin(margin_z, tmp_path):
    from scipy.stats import norm, t

    rec = _TableRecommender(np.ones((2, 1)), np.ones((2, 1)), 0.1, 1, tmp_path)
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
@given(n_cfg=st.integers(2, 6), n_budgets=st.integers(1, 5), k=st.integers(1, 4), target=st.floats(0.05, 0.5),
       seed=st.integers(0, 10 ** 6))
def test_search_answers_the_smallest_confirmed_budget(n_cfg, n_budgets, k, target, seed, tmp_path_factory):
    rng = np.random.default_rng(seed)
    model = np.sort(rng.uniform(0, 1, (n_cfg, n_budgets)), axis=1)[:, ::-1]   # loss falls with the budget
    sim = model * rng.uniform(0.5, 2.0, model.shape)                         # a noisy simulator
    rec = _TableRecommender(sim, model, target, k, tmp_path_factory.mktemp("rec"))
    found = rec.search()
    best = {b: rec.best_measured(b) for b in rec.budgets}
    assert all(v is not None for v in best.values())                        # every rung calibrated
    if found is None:
        assert not any(rec.target.met(v) for (_, b), v in rec.measured.items())
    else:
        b = rec.budgets[found]
        assert rec.target.met(best[b][1])
        # no smaller rung has a confirmed configuration that meets the target
        assert not any(rec.target.met(v) for (_, bb), v in rec.measured.items() if bb < b)
        if found > 0:                                                         # the rung below was searched
            below = rec.budgets[found - 1]
            assert sum(bb == below for _, bb in rec.measured) >= min(k, n_cfg)
    assert rec.runs == len(rec.measured) <= n_cfg * n_budgets


@pytest.fixture(scope="module")
def tiny_segments():
    import torch

    from gpu_validate.segments import make_segments
    from traces.model import read_text
    from traces.models import load_model

    torch.set_grad_enabled(False)
    model, tok = load_model("tiny", progress=False)
    ids = tok(read_text("default")[0], verbose=False)["input_ids"]
    return model, make_segments({"default": ids}, 2, 96)


def test_recommend_on_the_tiny_model_resumes_without_model_runs(tiny_segments, tmp_path, monkeypatch):
    from gpu_validate import segments as seg_mod
    from gpu_validate.recommend import recommend

    model, segs = tiny_segments
    kw = dict(n_prompt=64, model_id="tiny", out=tmp_path, validate=2, progress=False, log=lambda s: None)
    cands = candidates("h2o;streaming_llm;tova")
    rep = recommend(model, segs, cands, [16, 32, 48], Target.parse("dnll=0.05"), **kw)
    json.dumps(rep, default=float)                                           # JSON-ready
    a = rep["answer"]
    by_budget = {r["budget"]: r for r in rep["per_budget"]}
    assert a["budget"] in by_budget and a["choice"]["measured"] is not None
    if a["met"]:                          # met with its margin: the upper bound, above the mean, is within
        assert a["choice"]["measured"] <= a["choice"]["upper_bound"] <= 0.05
    assert rep["model_runs"] == 2 * sum(len(r["confirmed"]) for r in rep["per_budget"])
    measured = [c for c in rep["configurations"] if not np.isnan(c["measured"])]
    assert len(measured) == rep["model_runs"] // 2 and all(c["predicted"] > 0 for c in rep["configurations"])
    assert [f["budget"] for f in rep["front"]] == [16, 32, 48]

    def no_model(*args, **kwargs):
        raise AssertionError("a resumed recommendation ran the model")

    monkeypatch.setattr(seg_mod, "run_batch", no_model)
    again = recommend(model, segs, cands, [16, 32, 48], Target.parse("dnll=0.05"), **kw)
    assert again["answer"] == rep["answer"]


def test_closed_loop_on_ray_workers_equals_in_process(tiny_segments, tmp_path):
    """``--ray``: every batch a Ray task on a worker that loads the model itself; the same rows as in this
    process (a local Ray cluster stands in for a remote one)."""
    ray = pytest.importorskip("ray")
    from gpu_validate.segments import RayTarget, closed_loop
    from policies import get_policy
    from sim.store import ResultStore

    model, segs = tiny_segments
    configs = [(get_policy("h2o"), 16), (get_policy("tova"), 32), (get_policy("streaming_llm", n_sinks=2), 16)]
    kw = dict(n_prompt=64, model_id="tiny", progress=False, log=lambda s: None, max_rows=2)
    here = closed_loop(model, segs, configs, ResultStore(tmp_path / "here"), **kw)
    try:
        there = closed_loop(model, segs, configs, ResultStore(tmp_path / "ray"), ray=RayTarget("local", "tiny"),
                            **kw)
    finally:
        ray.shutdown()
    cols = ["key", "label", "budget", "segment", "delta_nll", "top1_disagreement"]
    a, b = (df[cols].sort_values("key").reset_index(drop=True) for df in (here, there))
    assert len(a) == 6
    pd.testing.assert_frame_equal(a, b)


def test_recommend_cli_writes_json_page_and_plot(tmp_path, capsys):
    from sim.cli import main

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
    assert "Use it: kvsim generate --model tiny --policy" in printed
    assert main(["recommend", "--model", "tiny", "--target", "ppl=3", "--out", str(out)]) == 2
