"""`traces.layer_subset.select_layers`: a layer subset of a recorded hybrid trace keeps each layer's arrays and
attention (sliding stays sliding), is written down in the trace's identity, and an unknown layer is refused by name."""
from __future__ import annotations

import numpy as np
import pytest

from sim.experiments.specs import trace_id
from sim.replay.plan import compressed_layers
from traces.format import TraceError, load_trace, write_trace
from traces.layer_subset import select_layers
from traces.synthetic import make_synthetic_trace


@pytest.fixture
def hybrid(tmp_path):
    src = make_synthetic_trace("mixed", n_layers=4, n_tokens=48, n_prompt=32, head_dim=16, windows=[8, 8, None, 8])
    return load_trace(write_trace(tmp_path / "t", src.meta, [src.layer(i) for i in range(4)]))


def test_a_subset_keeps_each_layers_arrays_and_attention(hybrid):
    sub = select_layers(hybrid, [2, 1])
    assert sub.meta.model.layer_ids == (2, 1) and sub.n_layers == 2
    assert [a.sliding for a in sub.meta.model.attention] == [False, True]
    assert compressed_layers(sub) == [0]                        # the global layer, first in this order
    np.testing.assert_array_equal(sub.layer(0).k, hybrid.layer(2).k)
    np.testing.assert_array_equal(sub.layer(1).q, hybrid.layer(1).q)
    assert sub.meta.n_tokens == hybrid.meta.n_tokens and sub.meta.source["layers_evaluated"] == [2, 1]
    assert len({trace_id(sub), trace_id(select_layers(hybrid, [1, 2])), trace_id(hybrid)}) == 3


def test_an_unknown_layer_is_named(hybrid):
    with pytest.raises(TraceError, match=r"layers \[7\] not in the trace .*\[0, 1, 2, 3\]"):
        select_layers(hybrid, [1, 7])
    with pytest.raises(TraceError, match="not in the trace"):
        select_layers(hybrid, [])
