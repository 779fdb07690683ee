"""benchmarks/ruler_lm_eval.py's own settings: the RULER tasks it names offline and those it lists as downloading
are disjoint, and its policies parse. (A doc turned into the simulator's prompt is the library's:
tests/test_lm_eval_docs.py.)"""
from __future__ import annotations

from benchmarks.ruler_lm_eval import DOWNLOADING_TASKS, OFFLINE_TASKS, POLICIES
from sim.experiments.specs import parse_policy


def test_task_lists_are_disjoint_and_policies_parse():
    assert not set(OFFLINE_TASKS) & set(DOWNLOADING_TASKS)
    assert {"niah_single_1", "ruler_vt", "ruler_cwe"} <= set(OFFLINE_TASKS)
    assert len(POLICIES) >= 6
    for spec in POLICIES:
        parse_policy(spec)
