"""The fuzzer: >= 5k generated cases across all registered policies (about 60 a policy; KVSIM_FUZZ_CASES for a
deeper run), and it catches and saves a broken policy."""
from __future__ import annotations

import math
import os

import pytest
from numba import njit

from policies import Policy, list_policies
from policies.core.base import STEP_SIG
from sim.experiments.fuzz import fuzz_policy
from traces.format import load_trace

TOTAL_CASES = int(os.environ.get("KVSIM_FUZZ_CASES", "5000"))
POLICIES = list_policies()


@pytest.mark.parametrize("name", POLICIES)
def test_registered_policy_survives_fuzzing(name):
    per_policy = math.ceil(TOTAL_CASES / len(POLICIES))
    report = fuzz_policy(name, max_examples=per_policy, seed=0)
    assert report.failure is None, report.failure
    assert report.cases >= per_policy
    assert report.effective >= 0.9 * report.cases, f"only {report.effective}/{report.cases} cases ran"
    assert len(report.shapes) >= 5          # the adversarial shapes are all exercised


@njit(STEP_SIG, cache=True)
def _off_by_one_step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep,
                     merge_to, merge_w):
    for h in range(lengths.shape[0]):
        for i in range(max(0, lengths[h] - budget[h] - 1)):   # bug: keeps one slot too many
            keep[h, i] = 0


class _OffByOne(Policy):
    name = "test_off_by_one"
    step_fn = _off_by_one_step


def test_fuzzer_catches_shrinks_and_saves_a_broken_policy(tmp_path):
    report = fuzz_policy(lambda: _OffByOne(), max_examples=200, save_failures=tmp_path, seed=0)
    assert report.failure and "over its budget" in report.failure
    saved = load_trace(report.saved)                  # the shrunk case replays as an ordinary trace
    assert saved.meta.n_tokens <= 4                   # hypothesis shrank it to a tiny case
    assert "over its budget" in (report.saved / "FAILURE.txt").read_text()


def test_plugin_fixture(pytester):
    pytester.makepyfile("""
        def test_user_policy(kvsim_fuzz):
            kvsim_fuzz("h2o", max_examples=20)
    """)
    # "-p no:kvsim" skips the installed entry point so the explicit load works installed or not
    pytester.runpytest("-p", "no:kvsim", "-p", "sim.experiments.pytest_plugin").assert_outcomes(passed=1)
