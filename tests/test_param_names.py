"""Kernels read their hyperparameters by name (``params[P.name]``): reordering a schema re-indexes every kernel,
and a class whose index disagrees with its schema is refused, so no kernel can be fed another parameter's value.
Also: one definition of a recent window, shared by H2O, Ada-H2O and Bumblebee."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from policies import PolicyError, get_policy, policy_class
from policies.core import registry
from policies.core.base import Param, Policy, param_indices
from policies.core.registry import register
from sim.replay.policy_replay import replay
from traces.synthetic import make_synthetic_trace

ROOT = Path(__file__).resolve().parents[1]

#: module, policy name, non-default parameters that change the kept sets
CASES = [
    ("random_policy", "random", {"seed": 11, "protect_recent": 3}),
    ("tova", "tova", {"scope": "head", "group_reduce": "max"}),
    ("h2o", "h2o", {"recent_ratio": 0.25, "group_reduce": "max"}),
]


def _permuted_module(module: str, name: str, tmp_path: Path):
    """Import a copy of policies/<module>.py whose SCHEMA lists its parameters in reverse order."""
    src = (ROOT / "policies" / f"{module}.py").read_text()
    head, body = src.split("SCHEMA = (", 1)
    block, tail = body.split("\n)\n", 1)
    params = re.findall(r"\n    Param\(.*?\),(?=\n    Param\(|$)", block, flags=re.S)
    assert len(params) >= 2 and "".join(params) == block, f"cannot split the schema of {module}"
    src = head + "SCHEMA = (" + "".join(reversed(params)) + "\n)\n" + tail
    new_name = f"{name}_reordered"
    src = src.replace(f'name = "{name}"', f'name = "{new_name}"')
    path = tmp_path / f"{module}_reordered.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"kvsim_test_{module}_reordered", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod, new_name


@pytest.mark.parametrize("module, name, params", CASES, ids=[c[1] for c in CASES])
def test_reordering_a_schema_does_not_change_what_the_kernel_reads(module, name, params, tmp_path):
    trace = make_synthetic_trace("zipf", n_tokens=96, n_prompt=16, n_layers=1, seed=2)
    mod, new_name = _permuted_module(module, name, tmp_path)
    try:
        cls = policy_class(new_name)
        assert [p.name for p in cls.schema] == [p.name for p in reversed(policy_class(name).schema)]
        assert list(cls.P._fields) == [p.name for p in cls.schema]
        original, reordered = get_policy(name, **params), get_policy(new_name, **params)
        assert not np.array_equal(original.param_vector(), reordered.param_vector())   # the vector did move
        a = replay(trace, original, 12, record_kept=(16, 80))
        b = replay(trace, reordered, 12, record_kept=(16, 80))
        np.testing.assert_array_equal(a.kept, b.kept)
        np.testing.assert_array_equal(a.metrics, b.metrics)
    finally:
        registry._REGISTRY.pop(new_name, None)
        sys.modules.pop(mod.__name__, None)


def test_a_class_whose_index_disagrees_with_its_schema_is_refused():
    from policies import tova

    with pytest.raises(PolicyError, match="parameter index P"):
        @register
        class Swapped(Policy):
            name = "tova_swapped_schema"
            schema = tuple(reversed(tova.SCHEMA))
            P = tova.P                      # the kernel's index, built from the other order
            step_fn = tova.TOVA.step_fn
    assert "tova_swapped_schema" not in registry._REGISTRY


def test_param_indices_names_positions():
    idx = param_indices((Param("a", 1), Param("b", 2)))
    assert (idx.a, idx.b) == (0, 1)
    with pytest.raises(PolicyError, match="duplicate"):
        param_indices((Param("a", 1), Param("a", 2)))


@pytest.mark.parametrize("name", ["streaming_llm", "random", "tova", "h2o"])
def test_converted_kernels_read_no_bare_positions(name):
    cls = policy_class(name)
    src = Path(sys.modules[cls.__module__].__file__).read_text()
    assert cls.P is not None and not re.search(r"params\[\d", src), f"{name} reads params by position"


def test_one_recent_window_for_h2o_and_bumblebee():
    from policies.core.scorer import recent_slots

    for budget in (1, 2, 3, 7, 64):
        for ratio in (0.0, 0.1, 0.25, 0.5, 0.99, 1.0):
            h2o = get_policy("h2o", recent_ratio=ratio).guarantees(budget).recent
            bb = get_policy("bumblebee", recent_ratio=ratio).guarantees(budget).recent
            assert h2o == bb == recent_slots(budget, ratio) == min(budget, round(budget * ratio))
    assert recent_slots(5, 0.0) == 0 and recent_slots(1, 0.5) == 0 and recent_slots(3, 1.0) == 3
