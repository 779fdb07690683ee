"""LagKV's incremental scoring (``lag_scores_cached``) equals scoring every partition afresh (``lag_scores``), bit for
bit, over random histories of evictions and appends with the slot state travelling with its slots."""
import numpy as np
from hypothesis import given, settings, strategies as st

from policies.lagkv import SLOT_FIELDS, lag_scores, lag_scores_cached


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), n_sink=st.integers(0, 4), lag=st.integers(2, 9),
       cross=st.booleans(), partial_ref=st.booleans(), ddof=st.integers(0, 1))
def test_cached_scores_equal_fresh_ones(seed, n_sink, lag, cross, partial_ref, ddof):
    rng = np.random.default_rng(seed)
    T, d = 60, 8
    keys = rng.standard_normal((T, d)).astype(np.float32)
    values = rng.standard_normal((T, d)).astype(np.float32)
    pos = list(range(20))                                    # the prompt, then one token a step
    state = np.zeros((len(pos), SLOT_FIELDS))
    for t in range(20, T):
        n = len(pos)
        p = np.array(pos, np.int64)
        fresh = np.empty(n)
        lag_scores(keys[p], values[p], p, n, n_sink, lag, fresh, cross, partial_ref, ddof)
        cached = np.empty(n)
        lag_scores_cached(keys[p], values[p], p, n, n_sink, lag, cached, cross, partial_ref, ddof, state)
        np.testing.assert_array_equal(cached, fresh)
        # evict 0-2 random slots (their state goes with them), append the next token with a zero state
        drop = set(rng.choice(n, size=int(rng.integers(0, 3)), replace=False).tolist()) if n > 4 else set()
        keep = [i for i in range(n) if i not in drop]
        pos = [pos[i] for i in keep] + [t]
        state = np.vstack([state[keep], np.zeros((1, SLOT_FIELDS))])
