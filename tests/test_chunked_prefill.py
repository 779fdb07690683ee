"""Chunked prefill: a streamed prompt taken C tokens per policy step, in the engine, the numpy reference and the
closed loop alike (open-loop kept sets equal for C in {1, 16, P}), on global and sliding-window layers."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch

from gpu_validate.closedloop.model_metrics import kept_set_agreement
from policies import PolicyError, get_policy, list_policies
from sim.replay.numpy_reference import reference_replay_layer
from sim.replay.layer_inputs import load_layers
from sim.replay.policy_replay import replay
from sim.replay.plan import effective_chunk
from traces.format import load_trace
from traces.recorder import record_trace
from traces.synthetic import make_synthetic_trace

torch.set_num_threads(1)
STREAMED = [n for n in list_policies() if not get_policy(n).is_oracle and not get_policy(n).has_prefill
            and get_policy(n).multi_token_steps]


@pytest.mark.parametrize("name", STREAMED)
@pytest.mark.parametrize("chunk", [7, 40])
def test_engine_matches_reference_in_chunks(name, chunk):
    trace = make_synthetic_trace("mixed", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=56,
                                 n_prompt=40, seed=9, windows=[None, 6])
    policy = get_policy(name)
    budget = max(policy.min_budget(), 12)
    res = replay(trace, policy, budget, chunk=chunk, sliding="compress", record_kept=(40, 16))
    for j, layer in enumerate(res.layer_index):
        li = load_layers(trace)[layer]
        metrics, slots, kept = reference_replay_layer(policy, int(layer), li, res.budgets[j], 40, li.attention.scale,
                                                      chunk=chunk)
        np.testing.assert_allclose(res.metrics[j][..., :4], metrics[..., :4], rtol=1e-4, atol=5e-5)
        np.testing.assert_array_equal(res.slots[j], slots)
        for r in range(16):
            for h in range(2):
                row = res.kept[j, r, h]
                np.testing.assert_array_equal(row[row >= 0], kept[len(kept) - 16 + r][h])


def test_chunks_change_what_is_kept_and_one_is_token_by_token():
    trace = make_synthetic_trace("zipf", n_layers=1, n_tokens=96, n_prompt=80, seed=2)
    h2o = get_policy("h2o")
    one = replay(trace, h2o, 16)
    np.testing.assert_array_equal(one.metrics, replay(trace, h2o, 16, chunk=1).metrics)
    assert not np.array_equal(one.metrics, replay(trace, h2o, 16, chunk=80).metrics)


def test_policies_that_step_token_by_token_refuse_chunks():
    trace = make_synthetic_trace("mixed", n_layers=1, n_tokens=64, n_prompt=48)
    with pytest.raises(PolicyError, match="cannot take its prompt in chunks of 8"):
        replay(trace, get_policy("cascading"), 16, chunk=8)
    assert effective_chunk(get_policy("cascading"), 8) == 1          # a sweep runs it token by token
    assert effective_chunk(get_policy("snapkv"), 8) == 1             # a prefill selector sees the whole prompt
    assert effective_chunk(get_policy("h2o"), 8) == 8
    with pytest.raises(ValueError, match="chunk must be an integer >= 1"):
        replay(trace, get_policy("h2o"), 16, chunk=0)


def _model(kind: str):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=256)).eval()
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, sliding_window=8, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"])).eval()


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model_and_trace(request, tmp_path_factory):
    model = _model(request.param)
    ids = torch.randint(0, 101, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    path = tmp_path_factory.mktemp(request.param) / "t"
    record_trace(model, ids, path, n_prompt=40, n_decode=20, teacher_forced=True, single_pass=True, progress=False)
    return model, load_trace(path)


@pytest.mark.parametrize("policy", ["h2o", "tova", "d2o", "streaming_llm", "critical(h2o)"])
@pytest.mark.parametrize("chunk", [1, 16, 40])
def test_closed_loop_chunks_keep_the_simulators_sets(model_and_trace, policy, chunk):
    """Open loop (the model's output from the full cache, the policy alongside): the runner's chunked prefill
    keeps exactly the simulator's sets at every decode step, sliding layers compressed under their window."""
    model, trace = model_and_trace
    out = kept_set_agreement(model, trace, get_policy(policy), 10, 16, sliding="compress", chunk=chunk)
    assert out["kept_agreement"] == 1.0


def test_runner_prompt_forward_in_chunks_is_the_model(model_and_trace, monkeypatch):
    """The closed loop's own prompt forward goes PROMPT_CHUNK tokens at a time through the model's cache: with
    chunks of 7 the full cache still gives the unmodified model's logits, sliding layers included."""
    import gpu_validate.closedloop.prompt_store as prompt_store
    from gpu_validate.closedloop.chunked_forward import full_model_logits
    from gpu_validate.closedloop.runner import CompressedRunner

    model, trace = model_and_trace
    ids = trace.tokens.token_id.tolist()
    monkeypatch.setattr(prompt_store, "PROMPT_CHUNK", 7)
    res = CompressedRunner(model, get_policy("full"), 8, keep_logits=True).run(ids[:40], continuation=ids[40:])
    np.testing.assert_allclose(res.logits, full_model_logits(model, ids)[39:59], rtol=1e-4, atol=1e-4)


def test_whole_prompt_chunk_sums_are_computed_once_per_prepared_layer(monkeypatch):
    import sim.replay.step_plan as sr

    trace = make_synthetic_trace("mixed", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=56,
                                 n_prompt=40, seed=9)
    inputs = load_layers(trace)
    calls = []
    real = sr.causal_column_sums
    monkeypatch.setattr(sr, "causal_column_sums", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = [replay(trace, get_policy(n), 12, inputs=inputs, chunk=40) for n in ("h2o", "tova")]
    again = replay(trace, get_policy("h2o"), 16, inputs=inputs, chunk=40)
    assert len(calls) == 2 and again.budget == 16                # one per layer, shared by policies and budgets
    streamed = replay(trace, get_policy("h2o"), 12, chunk=40)      # no prepared inputs: computed, same result
    np.testing.assert_array_equal(first[0].slots, streamed.slots)
    np.testing.assert_allclose(first[0].metrics, streamed.metrics)
