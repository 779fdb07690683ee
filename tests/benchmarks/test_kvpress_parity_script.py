"""benchmarks/kvpress_parity.py itself, without kvpress or a network: its report of a comparison (the worst row, the
diagnosis of differing tokens by kvpress's scores), the table of cases (JSON press specs, kvsim specs the registry
accepts, the presses read from the policies' declarations, an explicit press only where a declaration refuses),
and the kvsim side's "compress the prompt once" on a small synthetic trace (prefill selector and streamed prompt
alike). The library parts it uses are tested with the library: tests/test_kept_sets.py (masks, Jaccard) and
tests/test_kvpress_export.py (the declarations, the count rule, whether an export's promise holds)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.kvpress_parity import CASES, available, diagnosis, file_tag, fill, kvsim_kept, summarize
from policies.core.kvpress_press import MIN_JACCARD, NoKvpressPress, export, press_repr
from sim.experiments.specs import parse_policy
from sim.replay.policy_replay import layer_inputs
from traces.synthetic import make_synthetic_trace


def test_summarize_names_the_worst_row():
    a = np.zeros((2, 2, 6), bool)
    a[..., :3] = True
    b = a.copy()
    b[1, 0, 2], b[1, 0, 5] = False, True
    s = summarize(a, b)
    assert s["jaccard_min"] == pytest.approx(0.5) and s["rows_identical"] == 3 and s["rows"] == 4
    assert s["rows_differing"] == [[1, 0]]
    assert s["worst"] == {"layer": 1, "kv_head": 0, "jaccard": 0.5, "kvpress_only": [2], "kvsim_only": [5]}


def test_diagnosis_tells_ties_at_the_cut_from_far_differences():
    scores = np.array([[[5.0, 4.0, 3.0, 3.0, 1.0, 0.0]]])
    a = np.array([[[1, 1, 1, 0, 0, 0]]], bool)                 # kvpress kept 2 of the tied pair
    b = np.array([[[1, 1, 0, 1, 0, 0]]], bool)                 # kvsim kept 3: an exact tie at the cut
    assert diagnosis(scores, a, b) == {"differing_tokens": 2, "max_rank_from_cut": 0, "tied_with_cut_score": 2}
    far = np.array([[[0, 1, 1, 0, 0, 1]]], bool)               # the best token dropped for the worst: far from the cut
    assert diagnosis(scores, a, far) == {"differing_tokens": 2, "max_rank_from_cut": 2, "tied_with_cut_score": 0}
    assert diagnosis(scores, a, a) is None


def test_the_table_is_data():
    assert {"SnapKV", "StreamingLLM", "Knorm", "KeyDiff", "ExpectedAttention", "LagKV", "ChunkKV(SnapKV)", "TOVA",
            "PyramidKV", "AdaKV(SnapKV)", "CriticalKV(ExpectedAttention)"} <= set(CASES)
    for name, case in CASES.items():
        assert "," not in name                                 # --only splits on commas
        assert case.budgets in ("kvpress", "base", "prompt") and case.attn in (None, "sdpa", "eager")
        if available(case) is None:                            # the registry accepts every runnable spec
            policy = parse_policy(fill(case.kvsim, {"tau": -1.5}))
            for _, spec in case.diagnostics:
                parse_policy(spec)
        else:
            assert available(case).startswith("not available")
            continue
        press = case.press if case.press is not None else policy.kvpress_press().press
        json.dumps(press)                                      # crosses to the kvpress process as JSON
        assert press["cls"].endswith("Press") and press_repr(press).startswith(press["cls"] + "(")
    tags = [file_tag(n) for n in CASES]                      # each row's kvpress output goes to its own file
    assert len(set(tags)) == len(tags) and file_tag("KVzip+") != file_tag("KVzip")
    assert press_repr(CASES["AdaKV(SnapKV)"].press) == \
        "AdaKVPress(press=SnapKVPress(window_size=64, kernel_size=5), alpha_safeguard=0.2)"


def test_rows_without_a_press_are_the_policies_declarations():
    """Most rows compare the press the kvsim policy declares (what `kvsim export --kvpress` prints); the presses
    these rows named before the declarations existed are what the declarations give."""
    before = {"SnapKV": {"cls": "SnapKVPress", "window_size": 64, "kernel_size": 5},
              "StreamingLLM": {"cls": "StreamingLLMPress", "n_sink": 4},
              "TOVA (prompt score)": {"cls": "TOVAPress"},
              "ChunkKV(SnapKV) (kvpress reading)": {"cls": "ChunkKVPress", "chunk_length": 20, "press": {
                  "cls": "SnapKVPress", "window_size": 64, "kernel_size": 5}},
              "CUR": {"cls": "CURPress", "num_sinks": 4, "leverage_type": "kv_product",
                      "use_local_approximation": True, "local_window_size": 16},
              "KVzip": {"cls": "KVzipPress", "n_sink": 4, "layerwise": False, "chunk_size": 2048},
              "DuoAttention (on the fly)": {"cls": "DuoAttentionPress", "head_compression_ratio": 0.5,
                                            "on_the_fly_scoring": True}}
    for name, press in before.items():
        assert CASES[name].press is None
        assert parse_policy(CASES[name].kvsim).kvpress_press().press == press
    derived = [n for n, c in CASES.items() if c.press is None and available(c) is None]
    assert len(derived) >= 12
    for name in derived:                                   # each exports at kvpress's 512 of 1024 with sets >= 0.99
        policy = parse_policy(fill(CASES[name].kvsim, {"tau": -1.5}))
        if policy.kvpress_press().unit > 1:                # ChunkKV keeps whole chunks: 512 is not 20 x k, 1024 neither
            with pytest.raises(NoKvpressPress, match="part-chunk"):
                export(policy, 512, 1024)
            assert export(policy, 500, 1000).jaccard_floor == 1.0
            continue
        assert export(policy, 512, 1024).jaccard_floor >= MIN_JACCARD, name


def test_fill_replaces_placeholders():
    press = {"cls": "DMSPress", "press": {"cls": "KnormPress"}, "threshold": "{tau}"}
    assert fill(press, {"tau": -2.5}) == {"cls": "DMSPress", "press": {"cls": "KnormPress"}, "threshold": -2.5}
    assert fill("threshold(knorm, tau={tau})", {"tau": -2.5}) == "threshold(knorm, tau=-2.5)"
    assert fill("snapkv:window_size=64", {}) == "snapkv:window_size=64"


def test_an_explicit_press_only_where_the_declaration_refuses():
    """A row names its press only to show a difference kvsim's declaration refuses to promise (kvsim's defaults
    against kvpress's, another rule); every other row compares the press the policy declares, so the mapping from a
    kvsim policy to its press is written once, in the policy (``Policy.kvpress_press``)."""
    explicit = [n for n, c in CASES.items() if c.press is not None and c.kvsim is not None and available(c) is None]
    assert explicit
    for name in explicit:
        with pytest.raises(NoKvpressPress):
            parse_policy(fill(CASES[name].kvsim, {"tau": -1.5})).kvpress_press()


@pytest.fixture(scope="module")
def small():
    trace = make_synthetic_trace("mixed", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=33,
                                 n_prompt=32, seed=5)
    return trace, layer_inputs(trace)


def test_kvsim_side_compresses_the_prompt_once(small):
    trace, inputs = small
    budgets = np.array([[12, 12], [9, 9]])
    kept = kvsim_kept(trace, inputs, parse_policy("knorm:n_sink=0,n_recent=0"), budgets)
    assert kept.shape == (2, 2, 32) and (kept.sum(-1) == budgets).all()
    k = np.asarray(trace.layer(1).k[:32, 0], np.float64)    # knorm: the lowest key norms, nothing protected
    assert set(np.flatnonzero(kept[1, 0])) == set(np.argsort(np.linalg.norm(k, axis=1), kind="stable")[:9])
    streamed = kvsim_kept(trace, inputs, parse_policy("streaming_llm:n_sinks=4"), np.full((2, 2), 12))
    expect = np.zeros(32, bool)
    expect[:4] = expect[-8:] = True
    assert (streamed == expect).all()


def test_triattention_row_says_why_there_is_no_parity():
    """kvsim has TriAttention at the released code's defaults (the row's params); kvpress 0.5.5 has no press for it."""
    case = CASES["TriAttention"]
    assert available(case).startswith("not available: kvpress 0.5.5 ships no TriAttention press")
    policy = parse_policy(case.kvsim)
    assert {k: policy.params[k] for k in case.params} == case.params
    with pytest.raises(NoKvpressPress, match="ships no TriAttention press"):
        policy.kvpress_press()
