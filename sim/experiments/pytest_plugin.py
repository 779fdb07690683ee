"""pytest plugin: the ``kvsim_fuzz`` fixture lets users fuzz their own policies in their own test suites.

    def test_my_policy(kvsim_fuzz):
        kvsim_fuzz("my_policy", max_examples=300)     # or a zero-argument factory returning a Policy

It fails the test with the invariant that broke and the path of the saved, shrunk failing trace.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest


@pytest.fixture
def kvsim_fuzz(tmp_path) -> Callable[..., Any]:
    from sim.experiments.fuzz import fuzz_policy

    def run(policy: Any, **kwargs: Any):
        kwargs.setdefault("save_failures", tmp_path / "kvsim-fuzz")
        report = fuzz_policy(policy, **kwargs)
        if report.failure:
            pytest.fail(f"{report.failure}\nshrunk failing trace saved at {report.saved}", pytrace=False)
        return report

    return run
