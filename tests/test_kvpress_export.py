"""Each policy's kvpress counterpart (``Policy.kvpress_press``) and ``kvsim export --kvpress``: the ratio arithmetic,
every registered policy's declaration (a press or a reason), the refusals that name their cause, and the command's
output as Python. Whether the declared presses keep kvsim's sets inside kvpress is benchmarks/kvpress_parity.py's
job (tests/benchmarks/test_kvpress_parity_script.py checks its table against these declarations)."""
from __future__ import annotations

import ast
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.core.kvpress_press import (MIN_JACCARD, KvpressPress, NoKvpressPress, compression_ratio, export,
                                         export_holds, n_kept)
from policies.core.registry import list_policies
from sim.cli import main
from sim.experiments.specs import parse_policy


@settings(max_examples=300, deadline=None)
@given(total=st.integers(1, 200_000), data=st.data())
def test_the_ratio_keeps_exactly_the_budget(total, data):
    kept = data.draw(st.integers(1, total))
    r = compression_ratio(kept, total)
    assert 0.0 <= r < 1.0 and n_kept(total, r) == kept


def test_kvpress_count_rule():
    assert n_kept(1024, 0.5) == 512 and n_kept(1024, 0.75) == 256 and n_kept(10, 0.99) == 1 and n_kept(8, 1.0) == 0


def test_an_export_holds_with_ties_at_the_cut():
    assert export_holds(1.0, 0.996) and export_holds(255 / 257, 255 / 257) and not export_holds(1.0, 0.98)
    assert export_holds(0.995, 0.99) and not export_holds(0.98, 1.0)


def test_round_ratios_stay_round():
    assert compression_ratio(256, 1024) == 0.75 and compression_ratio(512, 1024) == 0.5
    assert compression_ratio(1024, 1024) == 0.0 and compression_ratio(2000, 1024) == 0.0


def test_every_policy_declares_a_press_or_why_not():
    """The registry, plain policies and listed combinators: a JSON press spec of kvpress classes, or a reason."""
    declared, refused = [], []
    for name in list_policies():
        policy = parse_policy(name)
        try:
            c = policy.kvpress_press()
        except NoKvpressPress as e:
            assert str(e).strip(), name
            refused.append(name)
            continue
        assert isinstance(c, KvpressPress) and c.press["cls"].endswith("Press")
        json.dumps(c.press)
        assert c.budgets in ("uniform", "prompt") and c.attn in ("sdpa", "eager") and c.unit >= 1
        declared.append(name)
    assert {"knorm", "keydiff", "streaming_llm", "window", "expected_attention", "cur", "observed_attention",
            "qfilter", "kvzip", "duo_attention"} <= set(declared)
    assert {"h2o", "tova", "pyramidkv", "buzz", "full", "snapkv", "lagkv"} <= set(refused)


@pytest.mark.parametrize("spec, cause", [
    ("pyramidkv", "layer budgets differ"),
    ("ada(knorm:n_recent=0)", "AdaKVPress guarantees"),
    ("ada_snapkv:pooling=avg", "AdaKVPress guarantees"),
    ("tova", "ada(tova, floor_alpha=1)"),
    ("decoding(knorm)", "DecodingPress"),
    ("snapkv", "snapkv:pooling=avg keeps its sets"),
    ("lagkv", "partial_reference=false,std_ddof=1"),
    ("cur:use_random_leverage=true", "use_random_leverage=false"),
    ("h2o", "no press"),
    ("full", "without a press"),
])
def test_refusals_say_why(spec, cause):
    with pytest.raises(NoKvpressPress, match=cause.replace("(", r"\(").replace(")", r"\)")):
        export(parse_policy(spec), 256, 1024, spec)


def test_combinators_wrap_the_inner_press():
    crit = parse_policy("critical(expected_attention:n_recent=0, first_stage_ratio=0.5)").kvpress_press()
    assert crit.press["cls"] == "CriticalKVPress" and crit.press["press"]["cls"] == "ExpectedAttentionPress"
    assert crit.differs_by == 2                      # kvpress counts its 4 sinks inside stage 1: 4 x (1 - 0.5)
    dms = parse_policy("threshold(knorm:n_recent=0, tau=-17.4)").kvpress_press()
    assert dms.press == {"cls": "DMSPress", "press": {"cls": "KnormPress"}, "threshold": -17.4,
                         "sliding_window_size": 128, "decoding": True}
    assert not dms.sets_ratio and dms.budgets == "prompt"
    assert parse_policy("ada(tova, floor_alpha=1)").kvpress_press().press == {"cls": "TOVAPress"}
    both = parse_policy("critical(ada(tova, floor_alpha=1))").kvpress_press()
    assert both.press == {"cls": "CriticalKVPress", "press": {"cls": "TOVAPress"}, "epsilon": 1e-4,
                          "first_stage_ratio": 0.5}


def test_protected_tokens_bound_the_promise():
    knorm = parse_policy("knorm")                    # keeps its newest token; KnormPress protects none
    assert knorm.kvpress_press().differs_by == 1
    assert export(knorm, 256, 1024).jaccard_floor == pytest.approx(255 / 257)
    assert export(parse_policy("knorm:n_recent=0"), 256, 1024).jaccard_floor == 1.0
    with pytest.raises(NoKvpressPress, match="below|< 0.99"):
        export(knorm, 64, 1024)                      # 63 / 65 < 0.99
    assert export(knorm, 2048, 1024).ratio == 0.0    # the prompt fits: nothing to compress, no difference
    assert export(knorm, 199, 1024).jaccard_floor >= MIN_JACCARD


def test_export_prints_python_that_builds_the_press(capsys):
    assert main(["export", "--kvpress", "ada(tova, floor_alpha=1)", "--budget", "256", "--prompt-tokens",
                 "1024"]) == 0
    out = capsys.readouterr().out
    tree = ast.parse(out)
    assert "from kvpress import TOVAPress" in out and "press = TOVAPress()" in out
    assert "press.compression_ratio = 0.75" in out and "the same kept sets" in out
    assert any(isinstance(n, ast.Assign) for n in tree.body)
    assert main(["export", "--kvpress", "observed_attention:n_recent=0", "--budget", "100", "--prompt-tokens",
                 "300", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["press"] == {"cls": "ObservedAttentionPress"} and got["attn_implementation"] == "eager"
    assert n_kept(300, got["compression_ratio"]) == 100 and got["jaccard_floor"] == 1.0


def test_export_refuses_with_status_2(capsys):
    assert main(["export", "--kvpress", "h2o", "--budget", "256", "--prompt-tokens", "1024"]) == 2
    assert "kvsim export: error: h2o: kvpress has no press" in capsys.readouterr().err


def test_the_recommendation_line():
    """What `kvsim recommend` prints and stores beside its `kvsim generate` line."""
    from policies.core.kvpress_press import export_summary, summary_line

    ok = export_summary(parse_policy("keydiff:n_recent=0"), 128, 512, "keydiff:n_recent=0")
    assert ok["compression_ratio"] == 0.75 and json.loads(json.dumps(ok)) == ok
    assert summary_line(ok).startswith("In kvpress: KeyDiffPress(), compression_ratio=0.75 (the same kept prompt")
    refused = export_summary(parse_policy("h2o"), 128, 512)
    assert summary_line(refused).startswith("No kvpress press keeps the same tokens: h2o: kvpress has no press")
