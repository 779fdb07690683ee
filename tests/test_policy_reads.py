"""What a policy declares it reads is what it reads: a policy with ``reads_keys = False`` keeps the same slots when
the cached keys change without changing any attention logit, one with ``reads_values = False`` when the values
change. The GPU closed loop relies on it: it copies a layer's keys / values to the host for the policy steps only
when some row's policy reads them (`gpu_validate.closedloop.batch_runner`).

Keys change without changing a logit: the queries are zero in the second half of the head dimension, and the two
traces' keys differ only there, so every q.k (a float32 sum of the same products plus exact zeros) is bitwise the
same and so is every attention probability. Values never enter a probability."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import get_policy, list_policies
from sim.replay.policy_replay import replay
from tests.short_schedules import short_policy
from traces.format import InMemoryTrace, LayerArrays, ModelInfo, TraceMeta
from traces.reference import full_attention_reference
from traces.synthetic import random_output_projection

CLOSED_LOOP = [n for n in list_policies() if not get_policy(n).is_oracle]
NO_KEYS = [n for n in CLOSED_LOOP if not get_policy(n).reads_keys]
NO_VALUES = [n for n in CLOSED_LOOP if not get_policy(n).reads_values]


def _trace(q, k, v, n_prompt: int, seed: int) -> InMemoryTrace:
    T, hq, d = q.shape
    hkv = k.shape[1]
    lse, o = full_attention_reference(q, k, v, d ** -0.5)
    meta = TraceMeta(ModelInfo("reads", 1, hq, hkv, d, rope="none", hidden_size=hq * d), T, n_prompt,
                     kind="synthetic", source={"generator": "tests/test_policy_reads.py", "seed": seed})
    return InMemoryTrace(meta, [LayerArrays(q, k, v, lse, o, random_output_projection(hq, d, seed))])


def _twin_traces(seed: int, T: int, n_prompt: int, what: str) -> tuple[InMemoryTrace, InMemoryTrace]:
    """Two traces with the same attention probabilities everywhere, differing in the keys (``what='keys'``) or
    in the values."""
    rng = np.random.default_rng(seed)
    hq, hkv, d = 4, 2, 16
    q = rng.standard_normal((T, hq, d)).astype(np.float32)
    k = rng.standard_normal((T, hkv, d)).astype(np.float32)
    v = rng.standard_normal((T, hkv, d)).astype(np.float32)
    k2, v2 = k.copy(), v.copy()
    if what == "keys":
        q[:, :, d // 2:] = 0.0
        k2[:, :, d // 2:] = rng.standard_normal((T, hkv, d - d // 2)).astype(np.float32) * 3.0
    else:
        v2[:] = rng.standard_normal((T, hkv, d)).astype(np.float32) * 3.0
    return _trace(q, k, v, n_prompt, seed), _trace(q, k2, v2, n_prompt, seed)


def _same_decisions(name: str, what: str, seed: int, T: int, n_prompt: int, frac: float) -> None:
    a, b = _twin_traces(seed, T, n_prompt, what)
    policy = short_policy(name)
    budget = max(policy.min_budget(), int(frac * T))
    if budget > T:
        pytest.skip(f"{name}'s minimum budget exceeds the trace")
    ra = replay(a, policy, budget, record_kept=(0, T))
    rb = replay(b, short_policy(name), budget, record_kept=(0, T))
    np.testing.assert_array_equal(ra.kept, rb.kept, err_msg=f"{name} declares it does not read the {what}, "
                                                             f"but its kept sets changed with them")


@pytest.mark.parametrize("name", NO_KEYS)
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), T=st.integers(24, 64), frac=st.floats(0.2, 0.8), p=st.floats(0.0, 0.6))
def test_declared_keyless_policies_ignore_keys(name, seed, T, frac, p):
    _same_decisions(name, "keys", seed, T, int(p * T), frac)


@pytest.mark.parametrize("name", NO_VALUES)
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), T=st.integers(24, 64), frac=st.floats(0.2, 0.8), p=st.floats(0.0, 0.6))
def test_declared_valueless_policies_ignore_values(name, seed, T, frac, p):
    _same_decisions(name, "values", seed, T, int(p * T), frac)


def test_declarations_cover_the_readers():
    """The policies known to read keys (key norms, key similarity, merges) say so; critical(...) reads values."""
    for name in ("knorm", "keydiff", "d2o", "bumblebee", "qfilter", "cur", "expected_attention", "lagkv"):
        assert get_policy(name).reads_keys, name
    assert get_policy("critical(h2o)").reads_values
    assert not get_policy("decoding(snapkv)").reads_keys
