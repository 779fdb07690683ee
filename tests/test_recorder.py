"""Recorder tests on random-weight models built from configs (no download): faithfulness, GQA, RoPE, fp16."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from traces.capture import CaptureError
from traces.faithful import UnfaithfulTraceError, layer_faithfulness, verify_trace_against_model
from traces.format import load_trace
from traces.models import ModelError, load_model
from traces.recorder import RecordError, record_trace

torch.set_num_threads(1)
VOCAB = 97


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0,
                     eos_token_id=0, initializer_range=0.2)
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, VOCAB, 80).tolist()


def test_llama_gqa_trace_is_faithful_every_layer(llama, ids, tmp_path):
    res = record_trace(llama, ids, tmp_path / "t", n_prompt=24, n_decode=16, teacher_forced=True, progress=False)
    assert [r.layer for r in res.faithfulness] == [0, 1, 2]
    assert all(r.rel_err < 1e-5 for r in res.faithfulness)
    tr = load_trace(tmp_path / "t")
    m = tr.meta.model
    assert (m.n_q_heads, m.n_kv_heads, m.head_dim, m.rope, tr.meta.n_tokens, tr.meta.n_prompt) == (4, 2, 16, "rope", 40, 24)
    assert tr.meta.softmax_scale == pytest.approx(16 ** -0.5)
    # independent replay: a fresh single forward pass through the model agrees with the stored q/k/v
    assert all(r.rel_err < 1e-5 for r in verify_trace_against_model(tr, llama))


def test_gpt2_trace_is_faithful(gpt2, ids, tmp_path):
    res = record_trace(gpt2, ids, tmp_path / "g", n_prompt=30, n_decode=10, progress=False)
    assert all(r.rel_err < 1e-5 for r in res.faithfulness)
    tr = load_trace(tmp_path / "g")
    assert tr.meta.model.rope == "none" and tr.meta.model.n_kv_heads == 4
    verify_trace_against_model(tr, gpt2)


def test_recorded_nll_matches_plain_forward(llama, ids, tmp_path):
    record_trace(llama, ids, tmp_path / "t", n_prompt=10, n_decode=20, teacher_forced=True, progress=False)
    tok = load_trace(tmp_path / "t").tokens
    with torch.no_grad():
        logp = torch.log_softmax(llama(input_ids=torch.tensor([ids[:30]])).logits[0].float(), -1)
    want = -logp[:-1].gather(1, torch.tensor(ids[1:30])[:, None])[:, 0].numpy()
    assert math.isnan(tok["nll"][0]) and tok["top1_id"][0] == -1
    np.testing.assert_allclose(tok["nll"].to_numpy()[1:], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(tok["top1_id"].to_numpy()[1:], logp[:-1].argmax(-1).numpy())
    assert list(tok["token_id"]) == ids[:30] and tok["is_prompt"].sum() == 10


def test_greedy_decode_feeds_top1(llama, ids, tmp_path):
    record_trace(llama, ids[:12], tmp_path / "t", n_prompt=12, n_decode=8, progress=False)
    tok = load_trace(tmp_path / "t").tokens
    dec = tok[~tok["is_prompt"]]
    np.testing.assert_array_equal(dec["token_id"].to_numpy(), dec["top1_id"].to_numpy())


def test_gqa_grouping_query_head_uses_kv_head_h_div_group(llama, ids, tmp_path):
    record_trace(llama, ids, tmp_path / "full", n_prompt=20, n_decode=5, teacher_forced=True, progress=False)
    full = load_trace(tmp_path / "full")
    la = full.layer(1)
    q, k, v = (np.asarray(x) for x in (la.q, la.k, la.v))
    # the stored reference follows h // group; the other plausible convention (h % Hkv) does not match it
    wrong = q[:, [0, 2, 1, 3]]
    _, _, o_wrong = layer_faithfulness(1, wrong, k, v, np.asarray(la.o), full.meta.softmax_scale)
    assert not np.allclose(o_wrong[:, [0, 2, 1, 3]], la.o, atol=1e-3)
    # a KV-head subset keeps exactly that head's query group
    record_trace(llama, ids, tmp_path / "sub", n_prompt=20, n_decode=5, teacher_forced=True, kv_heads=[1],
                 layers=[0, 2], progress=False)
    sub = load_trace(tmp_path / "sub")
    assert sub.meta.model.layer_ids == (0, 2) and (sub.meta.model.n_q_heads, sub.meta.model.n_kv_heads) == (2, 1)
    assert sub.meta.source["q_heads"] == [2, 3]
    # W_O is stored per layer, restricted to the kept query heads' columns (head_dim 16 here)
    assert full.has_wo and full.meta.model.hidden_size == 64
    np.testing.assert_array_equal(full.wo()[1], llama.model.layers[1].self_attn.o_proj.weight.detach().numpy())
    np.testing.assert_array_equal(sub.wo()[1], full.wo()[2][:, 32:64])
    for i, layer in enumerate((0, 2)):
        a, b = sub.layer(i), full.layer(layer)
        np.testing.assert_array_equal(a.q, np.asarray(b.q)[:, 2:4])
        np.testing.assert_array_equal(a.k, np.asarray(b.k)[:, 1:2])
        np.testing.assert_allclose(a.o, np.asarray(b.o)[:, 2:4], rtol=1e-5, atol=1e-6)


def test_keys_are_recorded_post_rope_at_their_positions(llama, ids, tmp_path):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = llama.model.layers[1].self_attn
    pre = {"q": [], "k": []}
    hooks = [attn.q_proj.register_forward_hook(lambda m, i, o: pre["q"].append(o[0].detach())),
             attn.k_proj.register_forward_hook(lambda m, i, o: pre["k"].append(o[0].detach()))]
    try:
        record_trace(llama, ids, tmp_path / "t", n_prompt=16, n_decode=12, teacher_forced=True, progress=False)
    finally:
        for h in hooks:
            h.remove()
    T, d = 28, 16
    q0 = torch.cat(pre["q"]).reshape(T, 4, d).transpose(0, 1)[None]
    k0 = torch.cat(pre["k"]).reshape(T, 2, d).transpose(0, 1)[None]
    cos, sin = llama.model.rotary_emb(k0, position_ids=torch.arange(T)[None])
    q_rot, k_rot = apply_rotary_pos_emb(q0, k0, cos, sin)
    la = load_trace(tmp_path / "t").layer(1)
    np.testing.assert_allclose(la.k, k_rot[0].transpose(0, 1).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(la.q, q_rot[0].transpose(0, 1).numpy(), rtol=1e-5, atol=1e-5)
    # the rotation is real: beyond position 0, stored keys differ from the pre-RoPE projections
    assert not np.allclose(la.k[1:], k0[0].transpose(0, 1).numpy()[1:], atol=1e-3)
    np.testing.assert_allclose(la.k[0], k0[0, :, 0].numpy(), rtol=1e-5, atol=1e-6)


def test_fp16_round_trip(llama, ids, tmp_path):
    kw = dict(n_prompt=20, n_decode=10, teacher_forced=True, progress=False)
    record_trace(llama, ids, tmp_path / "f32", **kw)
    res = record_trace(llama, ids, tmp_path / "f16", dtype="float16", **kw)
    a, b = load_trace(tmp_path / "f32"), load_trace(tmp_path / "f16")
    assert b.meta.dtype == "float16"
    for i in range(a.n_layers):
        for name in ("q", "k", "v"):
            got = getattr(b.layer(i), name)
            assert got.dtype == np.float16
            np.testing.assert_array_equal(got, np.asarray(getattr(a.layer(i), name)).astype(np.float16))
        assert b.layer(i).o.dtype == np.float32
    assert all(r.rel_err < 2e-2 for r in res.faithfulness)
    verify_trace_against_model(b, llama)


def test_unfaithful_recording_writes_nothing(llama, ids, tmp_path):
    with pytest.raises(UnfaithfulTraceError, match="layer 0"):
        record_trace(llama, ids, tmp_path / "t", n_prompt=8, n_decode=2, progress=False, tol=-1.0)
    assert not (tmp_path / "t").exists()


def test_tampered_trace_fails_replay_check(llama, ids, tmp_path):
    record_trace(llama, ids, tmp_path / "t", n_prompt=16, n_decode=4, teacher_forced=True, progress=False)
    tr = load_trace(tmp_path / "t")
    tok = tr.tokens
    tok.loc[5, "token_id"] = (tok.loc[5, "token_id"] + 1) % VOCAB   # replay a different text
    tr_obj = type("T", (), {"tokens": tok, "meta": tr.meta, "layer": tr.layer, "path": tr.path})()
    with pytest.raises(UnfaithfulTraceError):
        verify_trace_against_model(tr_obj, llama)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_prompt=0, n_decode=4), "n_prompt"),
    (dict(n_prompt=4, n_decode=-1), "n_decode"),
    (dict(n_prompt=70, n_decode=20, teacher_forced=True), "needs 90"),
    (dict(n_prompt=80, n_decode=200), "context of 256"),
    (dict(n_prompt=4, n_decode=2, layers=[3]), r"layers \[3\] out of range"),
    (dict(n_prompt=4, n_decode=2, layers=[0, 0]), "duplicates"),
    (dict(n_prompt=4, n_decode=2, layers=[]), "empty"),
    (dict(n_prompt=4, n_decode=2, kv_heads=[2]), r"kv_heads \[2\] out of range"),
    (dict(n_prompt=4, n_decode=2, dtype="bfloat16"), "dtype"),
])
def test_bad_arguments(llama, ids, tmp_path, kwargs, match):
    with pytest.raises(RecordError, match=match):
        record_trace(llama, ids, tmp_path / "t", progress=False, **kwargs)
    assert not (tmp_path / "t").exists()


def test_existing_output_and_missing_model(llama, ids, tmp_path):
    (tmp_path / "t").mkdir()
    with pytest.raises(FileExistsError):
        record_trace(llama, ids, tmp_path / "t", n_prompt=4, n_decode=1, progress=False)
    with pytest.raises(ModelError, match="not a model name"):
        load_model(str(tmp_path / "nope"))
    assert isinstance(RecordError("x"), ValueError) and isinstance(CaptureError("x"), ValueError)


def test_half_precision_model_records_within_its_tolerance(llama, ids, tmp_path):
    import copy

    half = copy.deepcopy(llama).to(torch.bfloat16)
    res = record_trace(half, ids, tmp_path / "t", n_prompt=20, n_decode=6, teacher_forced=True, progress=False)
    assert all(r.rel_err < 5e-2 for r in res.faithfulness)
    assert load_trace(tmp_path / "t").meta.source["model_dtype"] == "torch.bfloat16"


def test_single_pass_equals_stepwise_decode(llama, ids, tmp_path):
    kw = dict(n_prompt=12, n_decode=20, teacher_forced=True, progress=False)
    record_trace(llama, ids, tmp_path / "a", **kw)
    record_trace(llama, ids, tmp_path / "b", single_pass=True, **kw)
    a, b = load_trace(tmp_path / "a"), load_trace(tmp_path / "b")
    for i in range(a.n_layers):
        for name in ("q", "k", "v", "lse", "o"):
            np.testing.assert_allclose(getattr(a.layer(i), name), getattr(b.layer(i), name), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(a.tokens["nll"], b.tokens["nll"], rtol=1e-4, atol=1e-5)
    with pytest.raises(RecordError, match="single_pass needs teacher_forced"):
        record_trace(llama, ids, tmp_path / "c", n_prompt=4, n_decode=2, single_pass=True, progress=False)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_gqa_rope_families_are_faithful(family, ids, tmp_path):
    import transformers

    cfg_cls, model_cls = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                          "mistral": ("MistralConfig", "MistralForCausalLM")}[family]
    torch.manual_seed(2)
    cfg = getattr(transformers, cfg_cls)(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128)
    model = getattr(transformers, model_cls)(cfg).eval()
    res = record_trace(model, ids, tmp_path / "t", n_prompt=20, n_decode=8, progress=False)
    assert all(r.rel_err < 1e-5 for r in res.faithfulness)
    tr = load_trace(tmp_path / "t")
    assert (tr.meta.model.n_q_heads, tr.meta.model.n_kv_heads, tr.meta.source["model_type"]) == (4, 1, family)


@pytest.mark.parametrize("single_pass", [True, False])
def test_chunked_prefill_records_what_one_forward_records(llama, ids, tmp_path, single_pass):
    """Feeding the prompt (or the whole teacher-forced text) in chunks of 7 through the model's own cache gives
    the arrays, references and per-token NLL of one forward over everything, to float32 rounding."""
    kw = dict(n_prompt=40, n_decode=24, teacher_forced=True, single_pass=single_pass, progress=False)
    record_trace(llama, ids, tmp_path / "one", chunk=1000, **kw)
    record_trace(llama, ids, tmp_path / "chunked", chunk=7, **kw)
    one, chunked = load_trace(tmp_path / "one"), load_trace(tmp_path / "chunked")
    assert chunked.meta.source["prefill_chunk"] == 7
    for i in range(one.n_layers):
        for a, b in zip(one.layer(i), chunked.layer(i)):
            if a is not None:
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(one.tokens.nll.to_numpy(), chunked.tokens.nll.to_numpy(), rtol=1e-4, atol=1e-5)
    assert (one.tokens.top1_id == chunked.tokens.top1_id).all()
    assert chunked.tokens.nll.isna().sum() == 1                     # position 0 only


@pytest.mark.parametrize("single_pass", [True, False])
def test_without_prompt_scores_only_decoded_positions_are_scored(llama, ids, tmp_path, single_pass):
    """prompt_scores=False: the same arrays and decode NLL; the prompt positions' NLL and top-1 are left out."""
    kw = dict(n_prompt=40, n_decode=24, teacher_forced=True, single_pass=single_pass, progress=False, chunk=7)
    record_trace(llama, ids, tmp_path / "all", **kw)
    record_trace(llama, ids, tmp_path / "dec", prompt_scores=False, **kw)
    full, dec = load_trace(tmp_path / "all"), load_trace(tmp_path / "dec")
    for i in range(full.n_layers):
        for a, b in zip(full.layer(i), dec.layer(i)):
            if a is not None:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert dec.tokens.nll[:40].isna().all() and (dec.tokens.top1_id[:40] == -1).all()
    np.testing.assert_allclose(dec.tokens.nll[40:], full.tokens.nll[40:], rtol=1e-5, atol=1e-6)
    assert (dec.tokens.top1_id[40:] == full.tokens.top1_id[40:]).all()
    assert dec.meta.source["mean_nll_decode"] == pytest.approx(full.meta.source["mean_nll_decode"], rel=1e-5)
