"""Registered policies at parameters that fit their schedule into the tests' short traces (tens of tokens): the
registry tests build each policy with ``short_policy(name)``. TriAttention's released schedule needs a budget of at
least its ``divide_length`` (128); its rule is the same at 4."""
from __future__ import annotations

from typing import Any

from policies import Policy, get_policy

#: per policy name, the parameters that shorten its schedule
SHORT = {"triattention": {"divide_length": 4}}


def short_policy(name: str, **params: Any) -> Policy:
    """``get_policy(name)`` with ``SHORT``'s parameters for it (explicit ``params`` win)."""
    return get_policy(name, **{**SHORT.get(name, {}), **params})
