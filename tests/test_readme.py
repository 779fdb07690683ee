"""The README's examples run as written."""
from __future__ import annotations

import re
from pathlib import Path

from policies import get_policy
from sim.fuzz import fuzz_policy
from sim.replay import replay
from traces.synthetic import make_synthetic_trace

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


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
    block = next(b for b in _python_blocks() if "class VNorm" in b)
    exec(compile(block.replace("cache=True", "cache=False"), "README.md", "exec"), {"__name__": "readme_scorer"})
    api = next(b for b in _python_blocks() if "ada(get_policy(\"vnorm\"" in b)
    exec(compile(api, "README.md", "exec"), {})
    trace = make_synthetic_trace("zipf", n_tokens=64, n_prompt=16, head_dim=16)
    for spec, budget in [("vnorm", 16), ("ada(vnorm)", 16), ("decoding(vnorm)", 28)]:
        res = replay(trace, get_policy(spec), budget)
        assert 0 < res.summary()["mass_mean"] <= 1
        assert fuzz_policy(spec, max_examples=20, seed=0).failure is None
