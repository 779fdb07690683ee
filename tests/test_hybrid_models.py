"""Gemma-3 (sliding-window + global layers, one KV head, QK-norm, a RoPE base per layer type) and Qwen3 (QK-norm)
from random-weight configs: recorded faithfully past the window, the manifest naming each layer's attention, and
closed loop equal to the simulator (open-loop kept sets, every step and head) in both sliding modes; batched ==
solo as for Llama."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (as tests/test_validate.py)

import numpy as np
import pytest
import torch

from gpu_validate.closedloop.model_metrics import kept_set_agreement
from gpu_validate.closedloop.jobs import BatchJob
from gpu_validate.closedloop.runner import CompressedRunner, run_batch
from policies.core.registry import get_policy, list_policies
from sim.replay.policy_replay import replay
from traces.format import load_trace
from traces.recorder import record_trace
from tests.random_models import random_gemma3
from tests.short_schedules import short_policy

torch.set_num_threads(1)
WINDOW = 8
CLOSED_LOOP = [n for n in list_policies() if not get_policy(n).is_oracle]
#: raw key-norm rankings tie on this random model and the single-pass trace breaks ties differently from the
#: token-by-token runner (as in tests/test_validate.py)
NORM_TIES = {"knorm", "ada(knorm)", "decoding(knorm)", "critical(knorm)"}


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def gemma():
    return random_gemma3(window=WINDOW)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module")
def gemma_trace(gemma, ids, tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma") / "t"
    record_trace(gemma, ids, path, n_prompt=16, n_decode=24, teacher_forced=True, single_pass=True, progress=False)
    return load_trace(path)


def test_gemma3_manifest_names_each_layers_attention(gemma_trace):
    attn = gemma_trace.meta.model.attention
    assert [a.kind for a in attn] == ["sliding", "sliding", "global", "sliding"]
    assert [a.window for a in attn] == [WINDOW, WINDOW, None, WINDOW]
    assert [a.rope_theta for a in attn] == [1e4, 1e4, 1e6, 1e4]    # Gemma-3's local and global bases
    assert all(a.scale == pytest.approx(24 ** -0.5) for a in attn)  # query_pre_attn_scalar, not head_dim
    assert gemma_trace.meta.n_tokens == 40 > WINDOW                  # recorded past the window


def test_gemma3_token_by_token_recording_equals_single_pass(gemma, ids, gemma_trace, tmp_path):
    """Decoding through HF's sliding cache (a sliding layer hands over only its window) records what one causal
    pass records, and both pass the windowed faithfulness check."""
    record_trace(gemma, ids, tmp_path / "tbt", n_prompt=16, n_decode=24, teacher_forced=True, progress=False)
    tbt = load_trace(tmp_path / "tbt")
    for i in range(4):
        a, b = gemma_trace.layer(i), tbt.layer(i)
        np.testing.assert_allclose(np.asarray(a.k), np.asarray(b.k), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(a.o), np.asarray(b.o), rtol=1e-4, atol=1e-5)
    assert max(tbt.meta.source["faithfulness_rel_err"].values()) < 1e-4


@pytest.mark.parametrize("sliding", ["keep", "compress"])
@pytest.mark.parametrize("policy", ["h2o", "snapkv", "streaming_llm", "tova", "d2o", "pyramidkv", "bumblebee",
                                    "expected_attention", "cascading", "buzz", "ada_snapkv"])
def test_gemma3_open_loop_kept_sets_equal_simulator(gemma, gemma_trace, policy, sliding):
    pol = short_policy(policy)
    out = kept_set_agreement(gemma, gemma_trace, pol, max(6, pol.min_budget()), 20, sliding=sliding)
    layers = 1 if sliding == "keep" else 4
    assert out["n_compared"] == layers * 1 * 20
    assert out["kept_agreement"] == 1.0


def test_gemma3_closed_loop_full_cache_is_the_model(gemma, ids):
    """The full cache closed loop (sliding layers keeping their window) gives the unmodified model's logits."""
    from gpu_validate.closedloop.chunked_forward import full_model_logits

    res = CompressedRunner(gemma, get_policy("full"), 8, keep_logits=True).run(ids[:12], continuation=ids[12:40])
    np.testing.assert_allclose(res.logits, full_model_logits(gemma, ids)[11:39], rtol=1e-4, atol=1e-4)


def test_gemma3_full_logits_in_chunks_cross_the_window(gemma, ids):
    """Chunks shorter than the sliding window, over more tokens than it, through the model's own (sliding) cache:
    the same logits as one forward."""
    from gpu_validate.closedloop.chunked_forward import full_model_logits

    one = full_model_logits(gemma, ids)
    np.testing.assert_allclose(full_model_logits(gemma, ids, start=5, chunk=WINDOW - 1), one[5:], rtol=1e-4, atol=1e-4)


def test_gemma3_memory_counts_the_windows(gemma, gemma_trace, ids):
    """Held K+V bytes: the policy's slots on the global layer plus each sliding layer's window, in closed loop
    and in the simulator alike."""
    pol = get_policy("h2o")
    res = CompressedRunner(gemma, pol, 6).run(ids[:16], continuation=ids[16:40])
    sim = replay(gemma_trace, pol, 6)
    elem = res.extra["cache_elem_bytes"]
    sim_slots = sim.slots.sum(axis=(0, 2)) + sim.held_elsewhere
    np.testing.assert_array_equal(res.kv_bytes, sim_slots[:len(res.kv_bytes)] * 2 * 32 * elem)


def test_gemma3_batched_equals_solo(gemma, ids):
    jobs = [BatchJob(short_policy(n), b, ids[:16], continuation=ids[16:30])
            for n in CLOSED_LOOP if n not in NORM_TIES for b in (6,) if b >= short_policy(n).min_budget()]
    batched = run_batch(gemma, jobs, keep_logits=True, record_kept=(16, 6))
    for job, got in zip(jobs, batched):
        solo = CompressedRunner(gemma, job.policy, job.budget, keep_logits=True, record_kept=(16, 6)).run(
            job.prompt, continuation=job.continuation)
        assert got.top1.tolist() == solo.top1.tolist()
        np.testing.assert_allclose(got.logits, solo.logits, rtol=1e-4, atol=1e-5)
        assert np.array_equal(got.kept, solo.kept)


def test_qwen3_records_faithfully_and_matches_the_simulator(ids, tmp_path):
    model = _qwen3()
    record_trace(model, ids, tmp_path / "q", n_prompt=16, n_decode=24, teacher_forced=True, single_pass=True,
                 progress=False)
    trace = load_trace(tmp_path / "q")
    assert [a.kind for a in trace.meta.model.attention] == ["global", "global"]
    assert trace.meta.attention(0).rope_theta == model.config.rope_parameters["rope_theta"]
    for name in ("h2o", "snapkv", "expected_attention"):
        assert kept_set_agreement(model, trace, get_policy(name), 8, 20)["kept_agreement"] == 1.0
