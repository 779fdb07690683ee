"""KVzip: its scores against a direct implementation of kvpress's formula, its global allocation against kvpress's
ranking, the reconstruction pass in the trace format (round trip, tampering, the error without it), and the pass
run by the recorder equal to the one the closed loop runs (open-loop kept sets equal to the simulator's)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from policies.kvzip import _floor, _share, reconstruction_scores
from sim.replay.layer_inputs import PromptLayers, load_layers
from sim.replay.policy_replay import replay
from sim.experiments.specs import parse_policy
from traces.format import InMemoryTrace, LayerArrays, ModelInfo, TraceError, TraceMeta, load_trace, write_trace
from traces.reconstruction import ReconstructionError, make_plan, synthetic_reconstruction
from traces.synthetic import make_synthetic_trace


def _kvpress_scores(recon_q, recon_k, k, plan, n_sink, scale):
    """kvpress's ``score_kvzip`` written out per chunk, query head and repeat row (no blocking, no GEMM)."""
    n_prompt, hkv, _ = k.shape
    g_n = recon_q.shape[1] // hkv
    out = np.zeros((hkv, n_prompt))
    for start, end, r0, n in plan.layout():
        sink = min(n_sink, start)
        for h in range(hkv):
            keys = np.concatenate([k[:sink, h], k[start:end, h], recon_k[r0:r0 + n, h]]).astype(np.float64)
            for g in range(g_n):
                for i in range(n):
                    visible = sink + end - start + i + 1              # causal among the repeat tokens
                    logits = keys[:visible] @ recon_q[r0 + i, h * g_n + g].astype(np.float64) * scale
                    p = np.exp(logits - logits.max())
                    p /= p.sum()
                    out[h, start:end] = np.maximum(out[h, start:end], p[sink:sink + end - start])
    return out


@pytest.mark.parametrize("chunk,n_sink", [(64, 4), (16, 4), (16, 0), (7, 30)])
def test_scores_equal_kvpress_formula(chunk, n_sink):
    rng = np.random.default_rng(chunk + n_sink)
    P, hq, hkv, d = 40, 4, 2, 8
    ids = list(range(P))
    plan = make_plan(ids, chunk, lambda text: [1000 + len(text) % 7, 1001])     # a 2-token "instruction"
    R = plan.n_tokens
    rq = rng.standard_normal((R, hq, d)).astype(np.float32)
    rk = rng.standard_normal((R, hkv, d)).astype(np.float32)
    k = rng.standard_normal((P, hkv, d)).astype(np.float32)
    got = reconstruction_scores(rq, rk, k, plan.layout(), n_sink, d ** -0.5)
    np.testing.assert_allclose(got, _kvpress_scores(rq, rk, k, plan, n_sink, d ** -0.5), rtol=2e-5, atol=1e-7)


def test_plan_follows_kvpress_chunks():
    enc = {"\n\nRepeat the previous context exactly.": [1, 2], "\n": [9],
           "\n\nRepeat the part of the previous context exactly, starting with": [3]}
    plan = make_plan(list(range(100, 120)), 8, lambda text: enc[text])
    assert [(c.start, c.end) for c in plan.chunks] == [(0, 8), (8, 16), (16, 20)]
    assert plan.chunks[0].ids == (1, 2, 9, *range(100, 108))
    assert plan.chunks[1].ids == (3, *range(100, 108), 9, *range(108, 116))     # previous chunk's last 8 tokens
    assert plan.chunks[2].ids[:1 + 8] == (3, *range(108, 116))
    bare = make_plan(list(range(5)), 2)
    assert bare.instruction == "none" and bare.chunks[0].ids == (0, 1)


def test_global_allocation_is_kvpress_ranking():
    """Each head's share is its count in the top ``budget * L * Hkv`` of every score, sinks first (kvpress's
    ``compress_post`` with ``score = max + 1`` on the sinks), and the kept sets are those tokens."""
    trace = make_synthetic_trace("mixed", n_layers=3, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=80,
                                 n_prompt=64, seed=5)
    policy = parse_policy("kvzip")
    P, budget = 64, 16
    res = replay(trace, policy, budget, record_kept=(P, 1))
    scores = np.stack(policy.prompt_scores(PromptLayers(trace, load_layers(trace), range(3), P)))
    ranked = scores.copy()
    ranked[..., :4] = np.inf
    cut = np.sort(ranked.reshape(-1))[::-1][budget * 3 * 2 - 1]
    want = (ranked >= cut).sum(-1)
    np.testing.assert_array_equal(_floor(want, policy.min_budget()), res.budgets)
    assert res.budgets.sum() == budget * 3 * 2 and len(set(res.budgets.reshape(-1).tolist())) > 1
    for layer in range(3):
        for h in range(2):
            kept = res.kept[layer, 0, h]
            prompt_kept = set(kept[(kept >= 0) & (kept < P)].tolist())
            top = set(np.argsort(-ranked[layer, h], kind="stable")[:res.budgets[layer, h]].tolist())
            assert prompt_kept <= top          # the first decode step may have evicted one for the new token


def test_floor_raises_small_shares_from_the_largest():
    out = _floor(np.array([[0, 10], [1, 5]]), 2)
    assert out.sum() == 16 and out.min() == 2 and out.tolist() == [[2, 7], [2, 5]]
    np.testing.assert_array_equal(_share(np.array([[3.0, 1.0, 2.0], [0.5, 9.0, 0.1]]), 3, 0), [2, 1])


def test_layerwise_ranks_each_layer_alone():
    trace = make_synthetic_trace("mixed", n_layers=2, n_q_heads=2, n_kv_heads=2, head_dim=16, n_tokens=60,
                                 n_prompt=48, seed=2)
    res = replay(trace, parse_policy("kvzip:layerwise=true"), 12)
    np.testing.assert_array_equal(res.budgets.sum(axis=1), [24, 24])


def _qkv_trace(with_recon: bool, P: int = 12, T: int = 16) -> InMemoryTrace:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, 2, 4)).astype(np.float32)
    k = rng.standard_normal((T, 1, 4)).astype(np.float32)
    v = rng.standard_normal((T, 1, 4)).astype(np.float32)
    plan, rq, rk = synthetic_reconstruction(q, k, P, 5) if with_recon else (None, None, None)
    meta = TraceMeta(ModelInfo("m", 1, 2, 1, 4), T, P, reconstruction=plan)
    return InMemoryTrace(meta, [LayerArrays(q, k, v, recon_q=rq, recon_k=rk)])


def test_recorded_trace_without_the_pass_names_the_option():
    with pytest.raises(TraceError, match="kvsim record --kvzip"):
        replay(_qkv_trace(False), parse_policy("kvzip"), 6)


def test_trace_round_trip_and_tampering(tmp_path):
    trace = _qkv_trace(True)
    path = write_trace(tmp_path / "t", trace.meta, [trace.layer(0)])
    back = load_trace(path)
    assert back.meta.reconstruction == trace.meta.reconstruction
    plan, rq, rk = back.reconstruction(0)
    np.testing.assert_array_equal(rq, trace.layer(0).recon_q)
    a = replay(trace, parse_policy("kvzip:chunk_size=5"), 6, record_kept=(12, 4))
    b = replay(back, parse_policy("kvzip:chunk_size=5"), 6, record_kept=(12, 4))
    np.testing.assert_array_equal(a.kept, b.kept)
    with pytest.raises(Exception, match="chunk_size=5"):
        replay(back, parse_policy("kvzip"), 6)                     # recorded in chunks of 5, asked for 2048
    arr = np.load(path / "layers/000/recon_k.npy")
    arr[0, 0, 0] += 1.0
    np.save(path / "layers/000/recon_k.npy", arr)
    with pytest.raises(TraceError, match="recon_k.npy: checksum mismatch"):
        load_trace(path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["reconstruction"]["chunks"][0]["end"] = 4
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="reconstruction"):
        load_trace(path, verify=False)


def test_writer_refuses_half_a_pass(tmp_path):
    trace = _qkv_trace(True)
    la = trace.layer(0)
    with pytest.raises(TraceError, match="recon_q and recon_k go together"):
        write_trace(tmp_path / "t", trace.meta, [la._replace(recon_k=None)])
    with pytest.raises(ReconstructionError):
        make_plan([1, 2, 3], 0)


def test_chunked_pass_closed_loop_equals_simulator(tmp_path):
    """A pass in several chunks, recorded and run by the closed loop (random-weight Llama, no tokenizer: bare
    chunks): the open-loop kept sets equal the simulator's."""
    import torch

    from gpu_validate.closedloop.model_metrics import kept_set_agreement
    from tests.random_models import random_llama
    from traces.recorder import record_trace

    model = random_llama()
    ids = torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    record_trace(model, ids, tmp_path / "t", n_prompt=24, n_decode=16, teacher_forced=True, single_pass=True,
                 progress=False, reconstruction_chunk=8)
    trace = load_trace(tmp_path / "t")
    assert [(c.start, c.end) for c in trace.meta.reconstruction.chunks] == [(0, 8), (8, 16), (16, 24)]
    for spec in ("kvzip:chunk_size=8", "kvzip:chunk_size=8,layerwise=true", "critical(kvzip:chunk_size=8)"):
        out = kept_set_agreement(model, trace, parse_policy(spec), 10, 12)
        assert out["kept_agreement"] == 1.0, spec


def test_recorder_hands_its_prompt_cache_to_the_pass(tmp_path, monkeypatch):
    """When the recorder's prompt forwards are the pass's own (default chunks ending at the prompt's end), the pass
    starts from the recorder's cache instead of feeding the prompt again, and stores the same arrays bit for bit."""
    import torch

    import traces.recorder as recorder
    from tests.random_models import random_llama
    from traces.hf.reconstruction_pass import run_reconstruction

    handed = []

    def spy(*args, **kwargs):
        handed.append(kwargs.get("prompt_cache") is not None)
        return run_reconstruction(*args, **kwargs)

    monkeypatch.setattr(recorder, "run_reconstruction", spy)
    model = random_llama()
    ids = torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    for single_pass, reuses in ((False, True), (True, False)):   # 24 is not a multiple of the 512-token chunk
        out = tmp_path / f"t{single_pass}"
        recorder.record_trace(model, ids, out, n_prompt=24, n_decode=16, teacher_forced=True,
                              single_pass=single_pass, progress=False, reconstruction_chunk=8)
        assert handed[-1] is reuses
        trace = load_trace(out)
        layers = list(range(trace.meta.model.n_layers))
        with torch.no_grad():
            fresh = run_reconstruction(model, ids[:24], trace.meta.reconstruction, layers)
        for layer in layers:
            _, rq, rk = trace.reconstruction(layer)
            np.testing.assert_array_equal(rq, fresh[layer][0])
            np.testing.assert_array_equal(rk, fresh[layer][1])
