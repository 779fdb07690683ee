"""``kvsim recommend --target retrieval=X`` (gpu_validate.studies.recommendation.retrieval): the target, the binomial
bound, the full-cache gate, and the search on the tiny model with a stand-in for the model's retrieval outcomes (the
shipped tiny model answers no pass key, which the CLI test checks)."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from gpu_validate.validate_error import ValidateError
from gpu_validate.studies.recommendation.candidates import Target, candidates
from gpu_validate.studies.recommendation.retrieval import certifiable, failure_upper_limit


def test_retrieval_target_is_a_share_of_pass_keys():
    t = Target.parse("retrieval=0.9")
    assert (t.column, t.limit, t.met(0.1), t.met(0.11)) == ("retrieval_failure", pytest.approx(0.1), True, False)
    for bad in ("retrieval=0", "retrieval=1.2"):
        with pytest.raises(ValidateError, match="retrieval in"):
            Target.parse(bad)


def test_clopper_pearson_bound_and_what_n_prompts_can_certify():
    from scipy.stats import norm

    miss = 1 - norm.cdf(1.645)                                                          # 0.05
    assert failure_upper_limit(0, 12, 1.645) == pytest.approx(1 - miss ** (1 / 12))     # 0.221
    assert failure_upper_limit(3, 12, 0.0) == 0.25 and failure_upper_limit(12, 12, 1.645) == 1.0
    assert failure_upper_limit(1, 12, 1.645) > failure_upper_limit(0, 12, 1.645)
    assert certifiable(59, 1.645) >= 0.95 > certifiable(58, 1.645)
    assert certifiable(5, 0.0) == 1.0


def _fake_run_needle(rule):
    """A stand-in for the closed loop: every (prompt, config) cell's success from ``rule(prompt, policy, budget)``,
    keyed as `gpu_validate.studies.needle.runs.run_needle` keys them; ``calls`` counts the cells each call ran
    (those not run before: the store's)."""
    from gpu_validate.studies.needle.runs import config_key

    calls, done = [], set()

    def run(model, prompts, configs, store, *, model_id, **kwargs):
        rows = [{"key": config_key(p, pol, b, model_id), "prompt_id": p.prompt_id, "policy": pol.name,
                 "label": pol.label(), "budget": int(b), "success": rule(p, pol, b)}
                for p in prompts for pol, b in configs]
        calls.append(len({r["key"] for r in rows} - done))
        done.update(r["key"] for r in rows)
        return pd.DataFrame(rows)
    return run, calls


def test_retrieval_recommendation_gates_on_the_full_cache_and_bounds_the_failures(tmp_path, monkeypatch):
    import torch

    from gpu_validate.studies.recommendation import retrieval
    from gpu_validate.studies.recommendation.recommend_search import SearchSettings
    from traces.model import read_text
    from traces.models import load_model

    torch.set_grad_enabled(False)
    model, tok = load_model("tiny", progress=False)
    unsolved = "L160-d0.9-s1"                      # the one prompt the full cache misses: left out

    def rule(p, pol, b):
        return p.prompt_id != unsolved if pol.name == "full" else b >= 48

    run, calls = _fake_run_needle(rule)
    monkeypatch.setattr(retrieval, "run_needle", run)                 # the closed loop, where retrieval calls it
    recommend_retrieval = retrieval.recommend_retrieval
    kw = dict(prompt_tokens=160, per_text=2, model_id="tiny", backend="torch", progress=False,
              search=SearchSettings(validate=2))
    cands = candidates("h2o;streaming_llm;tova")
    rep = recommend_retrieval(model, tok, {"default": read_text("default")[0]}, cands, [16, 32, 48, 64],
                              Target.parse("retrieval=0.7"), out=tmp_path, **kw)
    json.dumps(rep, default=float)
    assert (rep["retrieval_prompts"], rep["retrieval_prompts_solved_by_full"]) == (10, 9)
    assert rep["retrieval_certifiable"] == pytest.approx(certifiable(9, 1.645))
    a = rep["answer"]
    assert a["met"] and a["budget"] == 48 and a["choice"]["measured"] == 0.0
    assert a["choice"]["upper_bound"] == pytest.approx(1 - certifiable(9, 1.645))
    assert rep["model_runs"] == sum(calls) and rep["configurations"][0]["kv_bytes_mean"] > 0
    assert 40 in rep["rungs"]                    # refined between 32 (missed) and 48: 40 missed too
    g = rep["guarantee"]                         # the Clopper-Pearson bound is the distribution-free guarantee
    assert (g["kind"], g["budget"], g["n_units"], g["alpha"]) == ("clopper_pearson", 48, 9, pytest.approx(0.05, 1e-3))
    with pytest.raises(ValidateError, match="can certify at most retrieval=0.72"):
        recommend_retrieval(model, tok, {"default": read_text("default")[0]}, cands, [16, 32, 48, 64],
                            Target.parse("retrieval=0.9"), out=tmp_path, **kw)
    # a looser level certifies more from the same prompts: 0.4 ** (1/9) >= 0.9
    rep = recommend_retrieval(model, tok, {"default": read_text("default")[0]}, cands, [16, 32, 48, 64],
                              Target.parse("retrieval=0.9"), out=tmp_path, alpha=0.4, **kw)
    assert rep["guarantee"]["alpha"] == pytest.approx(0.4) and rep["answer"]["budget"] == 48


def test_retrieval_cli_says_when_the_model_answers_no_pass_key(tmp_path, capsys):
    from sim.cli import main

    assert main(["recommend", "--model", "tiny", "--segments", "1", "--prompt-tokens", "160", "--target",
                 "retrieval=0.5", "--policies", "h2o", "--device", "cpu", "--out", str(tmp_path), "--quiet"]) != 0
    assert "answers none of the 5 pass-key prompts" in capsys.readouterr().err
