"""Needle retrieval: exact-length prompts with the key where it belongs, resumable store, prediction scoring,
heatmap; closed loop and simulator on a tiny random-weight model with a character tokenizer."""
import numpy as np
import pandas as pd
import pytest
import torch

from gpu_validate.needle import (FEATURES, fit_threshold, make_grid, make_prompt, needle_features, plot_needle,
                                 prediction_report, run_needle, summarize)
from gpu_validate.runner import ValidateError
from policies.registry import get_policy
from sim.store import ResultStore

torch.set_num_threads(1)
TEXT = ("The quick brown fox jumps over the lazy dog while seven wizards quietly judge the boxing match. " * 8)


class CharTok:
    """Character tokenizer over a 101-token vocabulary (enough for the tiny model)."""

    def encode(self, text):
        return [ord(c) % 101 for c in text]

    def __call__(self, text, verbose=False):
        return {"input_ids": self.encode(text)}


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


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
    assert set(f[0]) == set(FEATURES)
    assert all(v == pytest.approx(1.0) for v in f[0].values())
    assert 0.0 <= f[1]["retained_share"] < 1.0 and 0.0 <= f[1]["weakest_layer"] <= f[1]["retained_share"]


def test_threshold_and_prediction_report():
    assert fit_threshold(np.array([0.1, 0.2, 0.8, 0.9]), np.array([0, 0, 1, 1])) == pytest.approx(0.5)
    df = pd.DataFrame({"seed": [0, 0, 0, 0, 1, 1, 1, 1], "label": ["a"] * 8,
                       "retained_share": [0.1, 0.2, 0.8, 0.9, 0.15, 0.7, 0.95, 0.4],
                       "weakest_layer": [0.9, 0.2, 0.8, 0.1, 0.0, 0.0, 0.0, 0.0],   # useless on the train seed
                       "success": [False, False, True, True, False, True, True, True]})
    r = prediction_report(df, [0])
    assert r["feature"] == "retained_share" and r["candidates"]["weakest_layer"]["train_agreement"] < 1.0
    assert r["threshold"] == pytest.approx(0.5)
    assert r["sim_agreement"] == pytest.approx(0.75)
    assert r["confusion"] == {"model_ok_pred_ok": 2, "model_ok_pred_fail": 1, "model_fail_pred_ok": 0,
                              "model_fail_pred_fail": 1}
    with pytest.raises(ValidateError, match="both sides"):
        prediction_report(df, [0, 1])
    # with the full cache's outcome per prompt: a prompt the full cache fails is predicted as a miss
    df["full_success"] = [True, True, True, True, True, True, False, True]
    r = prediction_report(df, [0])
    assert r["sim_and_full_agreement"] == pytest.approx(0.5)   # seed 1's third cell is now predicted a miss
    assert r["sim_agreement_where_full_succeeds"] == pytest.approx(2 / 3)
    assert r["n_test_cells_where_full_succeeds"] == 3


def test_needle_cli_on_tiny_local_model(llama, tmp_path, capsys):
    import json
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sim.cli import main

    vocab = {c: i for i, c in enumerate(string.printable[:100])} | {"[UNK]": 100}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(tmp_path / "m")
    llama.save_pretrained(tmp_path / "m")
    (tmp_path / "text.txt").write_text(TEXT)
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
