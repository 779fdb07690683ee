"""Needle retrieval: exact-length prompts with the key where it belongs, resumable store, prediction scoring,
heatmap; closed loop and simulator on a tiny random-weight model with a character tokenizer."""
import numpy as np
import pandas as pd
import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_validate.studies.needle import prediction as needle_prediction
from gpu_validate.studies.needle.runs import run_needle
from gpu_validate.studies.needle.prediction import DIAGNOSTICS, FEATURES, needle_features, stored_features
from gpu_validate.studies.needle.prompts import make_grid, make_prompt
from gpu_validate.studies.needle.scores import (FIT_OBJECTIVES, binary_scores, confusion_scores, fit_threshold, plot_needle,
                                        prediction_report, summarize)
from gpu_validate.validate_error import ValidateError
from policies.core.registry import get_policy
from sim.experiments.store import ResultStore
from tests.random_models import random_llama

torch.set_num_threads(1)
TEXT = ("The quick brown fox jumps over the lazy dog while seven wizards quietly judge the boxing match. " * 8)


class CharTok:
    """Character tokenizer over a 101-token vocabulary (enough for the tiny model), with the parts of the HF call
    interface the prompts use (offsets, special tokens: none) and a decoder."""

    bos_token_id = None

    def encode(self, text):
        return [ord(c) % 101 for c in text]

    def __call__(self, text, verbose=False, add_special_tokens=True, return_offsets_mapping=False):
        out = {"input_ids": self.encode(text)}
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return out

    def decode(self, ids):
        return "".join(chr(i) if 32 <= i < 101 else "?" for i in ids)


@pytest.fixture(scope="module")
def llama():
    return random_llama(max_positions=512)


def test_prompt_has_exact_length_and_key_positions():
    tok = CharTok()
    filler = tok.encode(TEXT)
    for depth in (0.0, 0.5, 1.0):
        p = make_prompt(tok, filler, 320, depth, seed=3)
        assert len(p.ids) == 320
        assert [p.ids[i] for i in p.key_positions] == tok.encode(p.key) * 2
        assert p.answer == tuple(tok.encode(" " + p.key))
    a, b = make_prompt(tok, filler, 320, 0.5, 0), make_prompt(tok, filler, 320, 0.5, 1)
    assert a.key != b.key or a.ids != b.ids
    near, far = make_prompt(tok, filler, 320, 0.0, 0), make_prompt(tok, filler, 320, 1.0, 0)
    assert near.key_positions[0] < far.key_positions[0]
    with pytest.raises(ValidateError, match="no room"):
        make_prompt(tok, filler, 100, 0.5, 0)
    with pytest.raises(ValidateError, match="depth"):
        make_prompt(tok, filler, 320, 1.5, 0)


def test_closed_loop_store_resumes_and_full_cache_matches_greedy(llama, tmp_path):
    tok = CharTok()
    prompts = make_grid(tok, TEXT, [280], [0.0, 1.0], [0])
    configs = [(get_policy("full"), 1), (get_policy("streaming_llm"), 16), (get_policy("snapkv"), 16)]
    store = ResultStore(tmp_path / "store")
    df = run_needle(llama, prompts, configs, store, model_id="tiny", progress=False, log=lambda s: None)
    assert len(df) == 6 and set(df.policy) == {"full", "streaming_llm", "snapkv"}
    # success is the exact match of greedy decoding with the key's tokens, checked against the plain model
    for p in prompts:
        ids = list(p.ids)
        for _ in range(len(p.answer)):
            ids.append(int(llama(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        row = df[(df.prompt_id == p.prompt_id) & (df.policy == "full")].iloc[0]
        assert bool(row.success) == (tuple(ids[len(p.ids):]) == p.answer)
    n_parts = len(store.parts())
    df2 = run_needle(llama, prompts, configs, store, model_id="tiny", progress=False, log=lambda s: None)
    assert len(store.parts()) == n_parts and len(df2) == 6    # nothing rerun
    s = summarize(df2)
    assert set(s["accuracy"]) == {"streaming_llm@16", "snapkv@16"}
    assert plot_needle(df2, tmp_path / "n.png").stat().st_size > 0


def test_features_full_budget_retains_everything_and_small_budget_less(llama):
    tok = CharTok()
    p = make_prompt(tok, tok.encode(TEXT), 280, 0.5, 0)
    f = needle_features(llama, p, [(get_policy("streaming_llm"), 286), (get_policy("streaming_llm", n_sinks=4), 8)])
    assert set(f[0]) == set(FEATURES) | set(DIAGNOSTICS) | {"kv_bytes_mean"}
    assert all(f[0][k] == pytest.approx(1.0) for k in FEATURES)
    assert f[1]["weakest_layer_index"] in (0, 1) and 0 <= f[1]["weakest_step_index"] < len(p.answer)
    assert f[1]["weakest_answer_step"] <= f[1]["retained_share"] and 0.0 <= f[1]["copy_target"] <= 1.0
    assert 0.0 <= f[1]["retained_share"] < 1.0 and 0.0 <= f[1]["weakest_layer"] <= f[1]["retained_share"]
    assert f[1]["kv_bytes_mean"] < f[0]["kv_bytes_mean"]            # 8 slots hold less than the whole prompt


def test_threshold_and_prediction_report():
    assert fit_threshold(np.array([0.1, 0.2, 0.8, 0.9]), np.array([0, 0, 1, 1])) == pytest.approx(0.5)
    df = pd.DataFrame({"seed": [0, 0, 0, 0, 1, 1, 1, 1], "label": ["a"] * 8,
                       "retained_share": [0.1, 0.2, 0.8, 0.9, 0.15, 0.7, 0.95, 0.4],
                       "weakest_layer": [0.9, 0.2, 0.8, 0.1, 0.0, 0.0, 0.0, 0.0],   # useless on the train seed
                       "success": [False, False, True, True, False, True, True, True]})
    r = prediction_report(df, [0])
    assert r["objective"] == "balanced_accuracy" and r["candidates"]["weakest_layer"]["train_balanced_accuracy"] < 1
    assert r["feature"] == "retained_share" and r["candidates"]["weakest_layer"]["train_agreement"] < 1.0
    assert r["threshold"] == pytest.approx(0.5)
    assert r["sim_agreement"] == pytest.approx(0.75)
    assert r["confusion"] == {"model_ok_pred_ok": 2, "model_ok_pred_fail": 1, "model_fail_pred_ok": 0,
                              "model_fail_pred_fail": 1}
    assert r["base_rate"] == pytest.approx(0.75) and r["balanced_accuracy"] == pytest.approx((2 / 3 + 1) / 2)
    assert r["mcc"] == pytest.approx(2 / np.sqrt(2 * 3 * 1 * 2))
    assert prediction_report(df, [0], objective="agreement")["threshold"] == pytest.approx(0.5)
    with pytest.raises(ValidateError, match="objective"):
        prediction_report(df, [0], objective="accuracy")
    with pytest.raises(ValidateError, match="both sides"):
        prediction_report(df, [0, 1])
    # with the full cache's outcome per prompt: a prompt the full cache fails is predicted as a miss
    df["full_success"] = [True, True, True, True, True, True, False, True]
    r = prediction_report(df, [0])
    assert r["sim_and_full_agreement"] == pytest.approx(0.5)   # seed 1's third cell is now predicted a miss
    assert r["sim_agreement_where_full_succeeds"] == pytest.approx(2 / 3)
    assert r["n_test_cells_where_full_succeeds"] == 3


def _calls(tp: int, fn: int, fp: int, tn: int) -> tuple[np.ndarray, np.ndarray]:
    """(truth, prediction) holding the given confusion."""
    truth = np.array([True] * (tp + fn) + [False] * (fp + tn))
    pred = np.array([True] * tp + [False] * fn + [True] * fp + [False] * tn)
    return truth, pred


def test_binary_scores_on_the_issues_confusion():
    """The committed SmolLM2 result: agreement 0.867 looks good next to nothing, less so next to its base rate."""
    tp, fn, fp, tn = 64, 47, 33, 456
    s = binary_scores(*_calls(tp, fn, fp, tn))
    assert s["confusion"] == {"model_ok_pred_ok": tp, "model_ok_pred_fail": fn, "model_fail_pred_ok": fp,
                              "model_fail_pred_fail": tn}
    assert s["n"] == 600 and s["agreement"] == pytest.approx(520 / 600)
    assert s["base_rate"] == pytest.approx(489 / 600)                      # 0.815: the failures
    assert s["balanced_accuracy"] == pytest.approx((tp / (tp + fn) + tn / (tn + fp)) / 2)
    assert s["balanced_accuracy"] == pytest.approx(0.7545, abs=1e-4)
    mcc = (tp * tn - fp * fn) / np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert s["mcc"] == pytest.approx(mcc) and s["mcc"] == pytest.approx(0.537, abs=1e-3)
    assert confusion_scores(s["confusion"]) == s                              # the same scores from a stored confusion


def test_binary_scores_of_constant_and_degenerate_calls():
    truth = np.array([True] * 20 + [False] * 80)
    for const in (True, False):
        s = binary_scores(truth, np.full(100, const))
        assert s["balanced_accuracy"] == 0.5 and s["mcc"] == 0.0
    assert binary_scores(truth, np.zeros(100, bool))["agreement"] == pytest.approx(s["base_rate"])
    one_class = binary_scores(np.zeros(5, bool), np.array([0, 1, 0, 0, 1], bool))
    assert np.isnan(one_class["balanced_accuracy"]) and one_class["mcc"] == 0.0 and one_class["base_rate"] == 1.0
    empty = binary_scores([], [])
    assert empty["n"] == 0 and all(np.isnan(empty[k]) for k in ("agreement", "base_rate", "balanced_accuracy", "mcc"))
    with pytest.raises(ValidateError, match="shape"):
        binary_scores([True], [True, False])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=60))
def test_binary_scores_properties(pairs):
    t, p = np.array(pairs, bool).T
    s = binary_scores(t, p)
    assert -1.0 - 1e-12 <= s["mcc"] <= 1.0 + 1e-12
    assert 0.5 <= s["base_rate"] <= 1.0 and 0.0 <= s["agreement"] <= 1.0
    assert np.isnan(s["balanced_accuracy"]) == (t.all() or not t.any())
    if not np.isnan(s["balanced_accuracy"]):
        assert 0.0 <= s["balanced_accuracy"] <= 1.0
        assert binary_scores(t, ~p)["balanced_accuracy"] == pytest.approx(1 - s["balanced_accuracy"])
    # MCC is symmetric in the two sides, and neither score depends on which outcome is called positive
    assert binary_scores(p, t)["mcc"] == pytest.approx(s["mcc"])
    flipped = binary_scores(~t, ~p)
    assert flipped["mcc"] == pytest.approx(s["mcc"]) and flipped["agreement"] == pytest.approx(s["agreement"])
    assert flipped["balanced_accuracy"] == pytest.approx(s["balanced_accuracy"], nan_ok=True)
    assert binary_scores(t, ~p)["mcc"] == pytest.approx(-s["mcc"])
    assert binary_scores(t, t)["mcc"] == (1.0 if t.any() and not t.all() else 0.0)


def test_fit_objective_balanced_accuracy_finds_the_rare_hits():
    """90 % failures: the agreement cut gives up half the hits for 5 more failures right; the balanced-accuracy cut
    keeps every hit."""
    feature = np.array([0.3] * 5 + [0.9] * 5 + [0.1] * 80 + [0.5] * 10)
    success = np.array([True] * 10 + [False] * 90)
    by_agreement = fit_threshold(feature, success, "agreement")
    by_ba = fit_threshold(feature, success)                                  # the default
    assert by_agreement == pytest.approx(0.7) and by_ba == pytest.approx(0.2)
    s_agree, s_ba = binary_scores(success, feature >= by_agreement), binary_scores(success, feature >= by_ba)
    assert s_ba["balanced_accuracy"] > s_agree["balanced_accuracy"] and s_agree["agreement"] > s_ba["agreement"]
    assert s_ba["balanced_accuracy"] == pytest.approx((1 + 80 / 90) / 2)
    # one class only: balanced accuracy is undefined, the cut falls back to agreement
    assert fit_threshold(np.array([0.2, 0.4]), np.array([False, False])) > 0.4
    with pytest.raises(ValidateError, match="objective"):
        fit_threshold(feature, success, "f1")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=2, max_size=40))
def test_fit_threshold_maximises_its_objective(cells):
    f, y = np.array([c[0] for c in cells]), np.array([c[1] for c in cells])
    ba = {o: binary_scores(y, f >= fit_threshold(f, y, o)) for o in FIT_OBJECTIVES}
    assert ba["agreement"]["agreement"] >= ba["balanced_accuracy"]["agreement"] - 1e-12
    if y.any() and not y.all():
        assert ba["balanced_accuracy"]["balanced_accuracy"] >= ba["agreement"]["balanced_accuracy"] - 1e-12


def test_prediction_report_scores_every_group():
    rng = np.random.default_rng(0)
    rows = [{"seed": s, "length": L, "label": lab, "budget": b, "retained_share": float(x),
             "success": bool(x + rng.normal(0, 0.2) > 0.7)}
            for s in (1, 2, 3) for L in (256, 512) for lab in ("h2o", "snapkv") for b in (32, 64)
            for x in rng.uniform(size=4)]
    r = prediction_report(pd.DataFrame(rows), [1])
    keys = {"n", "agreement", "base_rate", "balanced_accuracy", "mcc", "confusion", "accuracy", "predicted_accuracy"}
    assert set(r["per_policy"]) == {"h2o", "snapkv"} and set(r["per_length"]) == {256, 512}
    assert set(r["per_config"]) == {f"{p}@{b}" for p in ("h2o", "snapkv") for b in (32, 64)}
    for group in ("per_policy", "per_config", "per_length"):
        assert all(set(v) == keys for v in r[group].values())
        assert sum(v["n"] for v in r[group].values()) == r["n_test_cells"] == 64
        for name in r["confusion"]:                                   # the groups split the overall confusion
            assert sum(v["confusion"][name] for v in r[group].values()) == r["confusion"][name]
    for k in ("sim_agreement", "base_rate", "balanced_accuracy", "mcc"):
        assert np.isfinite(r[k])
    assert set(r["candidates"]["retained_share"]) >= {"heldout_balanced_accuracy", "heldout_mcc", "train_mcc"}


def test_feature_store_resumes_and_recomputes_only_missing_cells(monkeypatch, tmp_path):
    tok = CharTok()
    prompts = make_grid(tok, TEXT, [280], [0.0, 1.0], [1])
    calls = []

    def fake(model, prompt, configs, *, model_id="model", chunk=1):
        calls.append((prompt.prompt_id, [(p.label(), b) for p, b in configs]))
        return [{f: b / 100 for f in FEATURES} for _, b in configs]

    monkeypatch.setattr(needle_prediction, "needle_features", fake)
    store = ResultStore(tmp_path / "sim")
    snap, h2o = get_policy("snapkv"), get_policy("h2o")
    df = stored_features(None, prompts, [(snap, 16), (h2o, 16)], store, model_id="tiny", progress=False,
                         log=lambda s: None)
    assert len(calls) == 2 and len(df) == 4 and len(store.parts()) == 2   # one part file per prompt
    assert list(df.columns) == ["prompt_id", "label", "budget", *FEATURES]
    assert (df.retained_share == 0.16).all()
    calls.clear()
    df = stored_features(None, prompts, [(snap, 16), (h2o, 16), (snap, 32)], store, model_id="tiny",
                         progress=False, log=lambda s: None)
    assert calls == [(p.prompt_id, [("snapkv", 32)]) for p in prompts]     # only the new cells
    assert len(df) == 6 and sorted(df[df.label == "snapkv"].budget) == [16, 16, 32, 32]
    calls.clear()
    stored_features(None, prompts, [(snap, 16)], store, model_id="tiny", progress=False, log=lambda s: None)
    assert calls == []
    stored_features(None, prompts, [(snap, 16)], store, model_id="other", progress=False, log=lambda s: None)
    assert len(calls) == 2                                                   # another model is another cell


def test_cli_fit_objectives_match_the_library():
    from gpu_validate.model_commands import needle_cmd

    assert needle_cmd.FIT_OBJECTIVES == FIT_OBJECTIVES


def _save_local_model(llama, tmp_path) -> None:
    """The tiny model with a character-level HF tokenizer at tmp_path/m, and the filler text at tmp_path/text.txt."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(string.printable[:100])} | {"[UNK]": 100}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(tmp_path / "m")
    llama.save_pretrained(tmp_path / "m")
    (tmp_path / "text.txt").write_text(TEXT)


def test_pick_device_prefers_cuda_and_triton(monkeypatch):
    from gpu_validate.kvcache.backends import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device() == ("cuda", "triton")
    assert pick_device("cpu") == ("cpu", "torch") and pick_device(None, "torch") == ("cuda", "torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device() == ("cpu", "torch") and pick_device("cuda:1") == ("cuda:1", "triton")


def test_needle_cli_hands_device_and_backend_to_the_experiment(monkeypatch, tmp_path):
    """`kvsim needle` is the experiment's API with the parsed options: --device/--backend reach it (None: the
    experiment picks CUDA and Triton when a GPU is present)."""
    from gpu_validate.studies.needle import experiment as needle_experiment
    from sim.cli import main

    seen = []

    def fake(spec, *, command=None, progress=True):
        seen.append((spec, command))
        return needle_experiment.NeedleResult({}, pd.DataFrame())

    monkeypatch.setattr(needle_experiment, "run_needle_experiment", fake)
    assert main(["needle", "--model", "m", "--out", str(tmp_path / "n.json"), "--quiet"]) == 1   # nothing reported
    assert main(["needle", "--model", "m", "--device", "cuda", "--backend", "torch", "--budgets", "8",
                 "--out", str(tmp_path / "n.json"), "--quiet"]) == 1
    (a, cmd), (b, _) = seen
    assert (a.device, a.backend, b.device, b.backend) == (None, None, "cuda", "torch")
    assert a.lengths == needle_experiment.NeedleSpec().lengths and b.budgets == [8]
    assert cmd.startswith("kvsim needle --model m")


def test_needle_experiment_api_returns_the_report(llama, tmp_path):
    """The library call the CLI and benchmarks/ruler.py make: the report comes back as a dict (on the device and
    backend it ran with), a caller's fields join it before the one atomic write."""
    import json

    from gpu_validate.studies.needle.experiment import NeedleSpec, run_needle_experiment, write_needle_report

    _save_local_model(llama, tmp_path)
    spec = NeedleSpec(model=str(tmp_path / "m"), text=str(tmp_path / "text.txt"), lengths=[260], depths=[0.0, 1.0],
                      seeds=[1], policies="streaming_llm", budgets=[16], store=str(tmp_path / "store"), device="cpu")
    res = run_needle_experiment(spec, command="test", progress=False, log=lambda s: None)
    assert not res.empty and res.report["device"] == "cpu" and res.report["backend"] == "torch"
    assert res.report["command"] == "test" and set(res.table.policy) == {"full", "streaming_llm"}
    res.report["extra_field"] = 1
    out = write_needle_report(res, tmp_path / "o" / "needle.json", log=lambda s: None)
    rep = json.loads(out.read_text())
    assert rep["extra_field"] == 1 and rep["plot"] == str(tmp_path / "o" / "needle.png")
    assert not list((tmp_path / "o").glob(".*"))                      # no temp file left behind


def test_needle_cli_on_tiny_local_model(llama, tmp_path, capsys, monkeypatch):
    import json

    from sim.cli import main

    _save_local_model(llama, tmp_path)
    out = tmp_path / "needle.json"
    rc = main(["needle", "--model", str(tmp_path / "m"), "--text", str(tmp_path / "text.txt"), "--lengths", "260",
               "--depths", "0,1", "--seeds", "1,2", "--policies", "streaming_llm;snapkv", "--budgets", "16",
               "--predict", "--train-seeds", "1", "--store", str(tmp_path / "store"), "--out", str(out),
               "--quiet"])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["policies"] == ["streaming_llm", "snapkv"] and rep["n_prompts"] == 4
    assert 0.0 <= rep["full_accuracy"] <= 1.0 and 0.0 <= rep["sim_agreement"] <= 1.0
    assert rep["prediction"]["n_test_cells"] == 4 and set(rep["accuracy"]) == {"streaming_llm@16", "snapkv@16"}
    assert (tmp_path / "needle.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "simulator prediction on held-out seeds [2]" in printed and f"page: {tmp_path / 'needle.html'}" in printed
    page = (tmp_path / "needle.html").read_text()
    assert "simulator: retrieves" in page and page.count('<img src="data:image/png;base64,') == 1
    assert rep["prediction"]["base_rate"] >= 0.5 and rep["model_reliability"]["train_seeds"] == [1]
    for k in ("model", "policies", "budgets", "lengths", "full_accuracy", "sim_agreement", "base_rate",
              "balanced_accuracy", "mcc"):
        assert k in rep
    assert rep["base_rate"] == rep["prediction"]["base_rate"] and rep["mcc"] == rep["prediction"]["mcc"]
    assert rep["fit_objective"] == rep["prediction"]["objective"] == "balanced_accuracy"
    c = rep["prediction"]["confusion"]
    assert len(rep["wrong_calls"]) == c["model_ok_pred_fail"] + c["model_fail_pred_ok"]   # every wrong call named
    assert all({"prompt_id", "label", "budget", "first_wrong_answer_step", "generated", *DIAGNOSTICS} <= set(w)
               for w in rep["wrong_calls"])
    assert "balanced accuracy" in printed and "MCC" in printed and "balanced accuracy" in page
    assert len(ResultStore(tmp_path / "store-sim").load()) == 8              # the features, stored
    # a second run re-fits from the stored features (no trace recorded) with the other objective

    def no_trace(*a, **k):
        raise AssertionError("features recomputed")

    monkeypatch.setattr(needle_prediction, "needle_features", no_trace)
    assert main(["needle", "--model", str(tmp_path / "m"), "--text", str(tmp_path / "text.txt"), "--lengths", "260",
                 "--depths", "0,1", "--seeds", "1,2", "--policies", "streaming_llm;snapkv", "--budgets", "16",
                 "--predict", "--train-seeds", "1", "--store", str(tmp_path / "store"), "--out", str(out),
                 "--quiet", "--fit-objective", "agreement"]) == 0
    rep2 = json.loads(out.read_text())
    assert rep2["fit_objective"] == "agreement" and rep2["prediction"]["n_test_cells"] == 4
