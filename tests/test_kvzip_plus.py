"""KVzip+: its scores against kvpress's ``score_kvzip`` with ``kvzip_plus_normalization`` written out directly, the
repeat tokens' hidden-state norms in the trace format (recorded, round trip, the error without them) and the pass
run by the recorder equal to the closed loop's (open-loop kept sets equal to the simulator's)."""
from __future__ import annotations

import numpy as np
import pytest

from policies.kvzip import reconstruction_scores
from policies.kvzip_plus import value_output_norms
from sim.experiments.specs import parse_policy
from traces.format import TraceError, load_trace
from traces.reconstruction import make_plan


def _kvpress_plus(recon_q, recon_k, k, v, wo, h_norm, plan, n_sink, scale):
    """kvpress's score with KVzip+'s normalisation per chunk, query head and repeat row: softmax over sinks, chunk
    and repeat tokens; divide row t by ||h_t||; multiply column i by ||W_O^(g) v_i||; max over group and rows."""
    n_prompt, hkv, d = k.shape
    g_n = recon_q.shape[1] // hkv
    hidden = wo.shape[0]
    out = np.zeros((hkv, n_prompt))
    for start, end, r0, n in plan.layout():
        sink = min(n_sink, start)
        for h in range(hkv):
            keys = np.concatenate([k[:sink, h], k[start:end, h], recon_k[r0:r0 + n, h]]).astype(np.float64)
            for g in range(g_n):
                w = wo.reshape(hidden, hkv, g_n, d)[:, h, g, :].astype(np.float64)          # kvpress's view
                col = np.linalg.norm(v[start:end, h].astype(np.float64) @ w.T, axis=-1)
                for i in range(n):
                    visible = sink + end - start + i + 1
                    logits = keys[:visible] @ recon_q[r0 + i, h * g_n + g].astype(np.float64) * scale
                    p = np.exp(logits - logits.max())
                    p /= p.sum()
                    score = p[sink:sink + end - start] / h_norm[r0 + i] * col
                    out[h, start:end] = np.maximum(out[h, start:end], score)
    return out


@pytest.mark.parametrize("chunk,n_sink", [(64, 4), (16, 4), (7, 0)])
def test_scores_equal_kvpress_plus_formula(chunk, n_sink):
    rng = np.random.default_rng(chunk + n_sink)
    P, hq, hkv, d, hidden = 40, 4, 2, 8, 12
    plan = make_plan(list(range(P)), chunk, lambda text: [1000 + len(text) % 7, 1001])
    R = plan.n_tokens
    rq = rng.standard_normal((R, hq, d)).astype(np.float32)
    rk = rng.standard_normal((R, hkv, d)).astype(np.float32)
    k = rng.standard_normal((P, hkv, d)).astype(np.float32)
    v = rng.standard_normal((P, hkv, d)).astype(np.float32)
    wo = rng.standard_normal((hidden, hq * d)).astype(np.float32)
    h_norm = rng.uniform(0.5, 3.0, R).astype(np.float32)
    got = reconstruction_scores(rq, rk, k, plan.layout(), n_sink, d ** -0.5, (1.0 / h_norm).astype(np.float32),
                                value_output_norms(v, wo, hq))
    want = _kvpress_plus(rq, rk, k, v, wo, h_norm, plan, n_sink, d ** -0.5)
    np.testing.assert_allclose(got, want, rtol=5e-5, atol=1e-8)
    plain = reconstruction_scores(rq, rk, k, plan.layout(), n_sink, d ** -0.5)
    assert not np.allclose(got, plain)                                  # the normalisation changes the scores


def test_value_output_norms_without_wo_are_value_norms():
    v = np.random.default_rng(0).standard_normal((5, 2, 4))
    np.testing.assert_allclose(value_output_norms(v, None, 4), np.repeat(np.linalg.norm(v, axis=-1).T, 2, axis=0))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    import torch

    from tests.random_models import random_llama
    from traces.recorder import record_trace

    model = random_llama()
    ids = torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    path = tmp_path_factory.mktemp("kvzip_plus") / "t"
    record_trace(model, ids, path, n_prompt=24, n_decode=16, teacher_forced=True, single_pass=True, progress=False,
                 reconstruction_chunk=8)
    return model, load_trace(path, verify=True)


def test_the_recorder_keeps_the_hidden_norms(recorded):
    model, trace = recorded
    assert trace.has_recon_h and trace.has_wo
    norms = np.asarray(trace.reconstruction_hidden_norms(0))
    assert norms.shape == (trace.meta.reconstruction.n_tokens,) and (norms > 0).all()


def test_a_trace_without_the_norms_says_how_to_record_them(recorded, tmp_path):
    import json
    import shutil

    _, trace = recorded
    old = tmp_path / "old"
    shutil.copytree(trace.path, old)
    m = json.loads((old / "manifest.json").read_text())
    m["has_recon_h"] = False                       # a trace recorded before KVzip+: its norms were never written
    m["arrays"] = {k: v for k, v in m["arrays"].items() if not k.endswith("recon_h.npy")}
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TraceError, match="kvsim record --kvzip"):
        load_trace(old).reconstruction_hidden_norms(0)


def test_closed_loop_equals_simulator(recorded):
    """The recorder's norms and the closed loop's (a pre-hook on each attention module) give the same scores: the
    open-loop kept sets equal the simulator's."""
    from gpu_validate.closedloop.model_metrics import kept_set_agreement

    model, trace = recorded
    for spec in ("kvzip_plus:chunk_size=8", "kvzip_plus:chunk_size=8,layerwise=true"):
        out = kept_set_agreement(model, trace, parse_policy(spec), 10, 12)
        assert out["kept_agreement"] == 1.0, spec
    # and the normalisation matters on this model: KVzip keeps other tokens somewhere
    from sim.replay.policy_replay import replay

    plus = replay(trace, parse_policy("kvzip_plus:chunk_size=8"), 10, record_kept=(24, 1)).kept
    plain = replay(trace, parse_policy("kvzip:chunk_size=8"), 10, record_kept=(24, 1)).kept
    assert not np.array_equal(np.sort(plus, axis=-1), np.sort(plain, axis=-1))


def test_a_zero_hidden_state_is_refused_with_the_reason():
    """Gemma-3's padding token (id 0) has a zero embedding: reread in the pass it reaches the first layer's attention
    as a zero hidden state, on which KVzip+'s 1 / ||h_t|| is undefined; the closed loop says so."""
    from gpu_validate.closedloop.jobs import BatchJob
    from gpu_validate.closedloop.runner import run_batch
    from policies import get_policy
    from tests.random_models import random_gemma3

    model = random_gemma3(("sliding_attention", "full_attention"))
    ids = [5, 9, 0, 17, 3, 8, 21, 4, 30, 2, 11, 6]
    with pytest.raises(Exception, match="zero hidden state"):
        run_batch(model, [BatchJob(get_policy("kvzip_plus"), 6, ids[:10], continuation=ids[10:])], sliding="compress")
