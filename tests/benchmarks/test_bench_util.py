"""benchmarks._util: the evaluations' ``--trace/--layers/--real-only`` options give a layer subset of a recorded
hybrid trace that keeps each layer's attention, and long-trace results are named after the trace. (The subset itself
is the library's `traces.layer_subset.select_layers`: tests/test_layer_subset.py.)"""
from __future__ import annotations

import argparse

from benchmarks._util import add_real_trace_args, real_model_trace, result_name, trace_fields
from sim.replay.plan import compressed_layers
from traces.format import write_trace
from traces.synthetic import make_synthetic_trace


def test_layer_subset_of_a_hybrid_trace_keeps_its_attention(tmp_path):
    src = make_synthetic_trace("mixed", n_layers=4, n_tokens=48, n_prompt=32, head_dim=16,
                               windows=[8, 8, None, 8])
    path = write_trace(tmp_path / "t", src.meta, [src.layer(i) for i in range(4)])
    ap = argparse.ArgumentParser()
    add_real_trace_args(ap)
    args = ap.parse_args(["--trace", str(path), "--layers", "1,2", "--real-only"])
    trace = real_model_trace(args, tmp_path)
    assert [a.sliding for a in trace.meta.model.attention] == [True, False]
    assert compressed_layers(trace) == [1]
    fields = trace_fields(trace)
    assert fields["layers"] == [1, 2] and fields["context_tokens"] == 48 and fields["n_decode"] == 16
    assert result_name("eval_x", trace, args.real_only) == f"eval_x_{fields['model']}_1k"
    assert result_name("eval_x", trace, False) == "eval_x"
