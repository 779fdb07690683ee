"""benchmarks/ruler_lm_eval.py's own settings: the RULER tasks it names offline and those it lists as downloading
are disjoint, its policies parse, a run at another length writes a result of its own, and the harness check
compares only docs whose prompt the closed loop saw. (A doc turned into the simulator's prompt is the library's:
tests/test_lm_eval_docs.py.)"""
from __future__ import annotations

from benchmarks.ruler_lm_eval import DOWNLOADING_TASKS, OFFLINE_TASKS, POLICIES, result_name
from sim.experiments.specs import parse_policy


def test_task_lists_are_disjoint_and_policies_parse():
    assert not set(OFFLINE_TASKS) & set(DOWNLOADING_TASKS)
    assert {"niah_single_1", "ruler_vt", "ruler_cwe"} <= set(OFFLINE_TASKS)
    assert len(POLICIES) >= 6
    for spec in POLICIES:
        parse_policy(spec)


def test_a_longer_run_keeps_the_4k_result():
    assert result_name("gemma3-270m", 4096) == "ruler_lm_eval_gemma3-270m"
    assert result_name("gemma3-270m", 8192) == "ruler_lm_eval_gemma3-270m_8k"


def test_the_harness_check_compares_only_docs_with_the_same_prompt():
    from benchmarks.ruler_lm_eval import harness_check

    done = [{"task": "t", "doc": 0, "policy": "full", "context": "A", "generation": "x"},
            {"task": "t", "doc": 1, "policy": "full", "context": "B", "generation": "y"},
            {"task": "t", "doc": 2, "policy": "full", "context": "C", "generation": "z"},
            {"task": "t", "doc": 0, "policy": "snapkv", "generation": "w"}]
    via = {("t", 0): ("A", "x"), ("t", 1): ("B", "q"), ("t", 2): ("other prompt", "z")}
    got = harness_check(via, done)
    assert (got["docs"], got["compared"], got["same_generation"], got["other_prompt"]) == (3, 2, 1, 1)
    assert got["differing"] == [{"task": "t", "doc": 1, "harness": "q", "batched": "y"}]
