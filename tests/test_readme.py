"""The README's examples, and those of the documentation pages they point to, run as written."""
from __future__ import annotations

import re
from pathlib import Path

from policies import get_policy
from sim.experiments.fuzz import fuzz_policy
from sim.replay.policy_replay import replay
from traces.synthetic import make_synthetic_trace

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
PYTHON_API = (ROOT / "docs" / "guide" / "python-api.md").read_text(encoding="utf-8")
WRITING_POLICIES = (ROOT / "docs" / "guide" / "writing-policies.md").read_text(encoding="utf-8")


def _python_blocks(text: str = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_policy_example_registers_replays_and_survives_fuzzing():
    block = next(b for b in _python_blocks() if "class DecayedH2O" in b)
    # exec'd code has no importable module, which numba's on-disk cache needs to reload it
    exec(compile(block.replace("cache=True", "cache=False"), "README.md", "exec"), {"__name__": "readme_example"})
    trace = make_synthetic_trace("zipf", n_tokens=64, n_prompt=8, head_dim=16)
    res = replay(trace, get_policy("decayed_h2o", decay=0.8), 16)
    assert (res.slots <= 16).all() and 0 < res.summary()["mass_mean"] <= 1
    assert fuzz_policy("decayed_h2o", max_examples=50, seed=0).failure is None


def test_python_api_example_runs():
    block = next(b for b in _python_blocks() if "replay_oracle(trace" in b)
    block = block.replace("n_tokens=2048, n_prompt=256", "n_tokens=300, n_prompt=40")
    block = block.replace("[64, 128, 256]", "[16, 32, 64]").replace("budget=256", "budget=64")
    exec(compile(block, "README.md", "exec"), {})


def test_scorer_example_gets_both_combinators():
    block = next(b for b in _python_blocks(WRITING_POLICIES) if "class VNorm" in b)
    exec(compile(block.replace("cache=True", "cache=False"), "writing-policies.md", "exec"),
         {"__name__": "readme_scorer"})
    api = next(b for b in _python_blocks(WRITING_POLICIES) if "ada(get_policy(\"vnorm\"" in b)
    exec(compile(api, "writing-policies.md", "exec"), {})
    trace = make_synthetic_trace("zipf", n_tokens=64, n_prompt=16, head_dim=16)
    for spec, budget in [("vnorm", 16), ("ada(vnorm)", 16), ("decoding(vnorm)", 28)]:
        res = replay(trace, get_policy(spec), budget)
        assert 0 < res.summary()["mass_mean"] <= 1
        assert fuzz_policy(spec, max_examples=20, seed=0).failure is None


def _section(title: str, text: str = PYTHON_API) -> str:
    start = text.index(title)
    end = text.find("\n# ", start)
    return text[start:end if end >= 0 else len(text)]


def test_what_is_measured_names_every_metric_of_the_table():
    from sim.replay.metrics import METRICS

    text = " ".join(_section("## What is measured").split())
    for m in METRICS:
        after = text.split(f"**{m.name}**")
        assert len(after) > 1 and m.label in text, m.name
        assert f"({m.direction} is better)" in after[1][:80], m.name


def test_adding_a_metric_is_one_row_and_one_formula():
    """The README's worked example, applied to sim/replay/metrics.py, gives a measured, summarised, ranked metric."""
    import importlib.util
    import sys
    import types

    import numpy as np

    text = _section("## What is measured")
    row, formula = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    spec = importlib.util.find_spec("sim.replay.metrics")
    src = Path(spec.origin).read_text(encoding="utf-8").replace("cache=True", "cache=False")
    table_end = "\n)\nNAMES: tuple"
    assert src.count(table_end) == 1 and src.count("    out[M.l1_bound] = ") == 1
    src = src.replace(table_end, "\n" + row.rstrip("\n") + table_end)
    last = src.index("\n", src.index("    out[M.l1_bound] = "))
    src = src[:last + 1] + formula + src[last + 1:]
    mod = types.ModuleType("readme_metrics")
    sys.modules[mod.__name__] = mod       # dataclasses look their module up
    try:
        exec(compile(src, "sim/replay/metrics.py (README example)", "exec"), mod.__dict__)
    finally:
        del sys.modules[mod.__name__]
    assert mod.NAMES[-1] == "err_abs" and mod.N_METRICS == len(mod.METRICS)
    out = np.zeros(mod.N_METRICS)
    mod.measure(0.5, 0.7, np.array([3.0, 4.0], np.float32), np.zeros(2), 1.0, 2.0, out)
    assert out[mod.M.err_abs] == 5.0 and out[mod.M.err] == 1.0 and out[mod.M.mass] == 0.5
    assert mod.summarise(np.ones((1, 2, mod.N_METRICS)))["err_abs_mean"] == 1.0
    assert mod.column("err_abs_mean").direction == "lower"
