"""The baselines ported to the scorer base keep exactly the kept sets of the hand-written kernels they replace.

``tests/data/kept_golden.json`` holds, per (trace, policy spec, budget), a SHA-256 of the kept positions of every
step and the slots held, written by the hand-written kernels (H2O, TOVA, StreamingLLM, SnapKV, PyramidKV,
Ada-SnapKV/-PyramidKV/-H2O, and the scorer base with its ada/decoding combinators as it was) before they were
deleted (``critical`` is not pinned: its first stage now ranks only the eviction candidates): ``python
tests/test_scorer_ports.py --write tests/data/kept_golden.json`` run on that tree. The traces are synthetic kinds
and a trace of the shipped tiny model (its own checksum is stored: a machine that records a different trace
skips that part rather than comparing unlike inputs).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).resolve().parent / "data" / "kept_golden.json"

SPECS = [
    "h2o", "h2o:recent_ratio=0.25,group_reduce=max", "h2o:recent_ratio=0.0,group_reduce=sum",
    "tova", "tova:scope=head,group_reduce=max",
    "streaming_llm", "streaming_llm:n_sinks=0",
    "snapkv", "snapkv:window_size=8,kernel_size=3,pooling=avg", "snapkv:window_size=8,group_reduce=rowmax",
    "snapkv:window_only=true,group_reduce=max",
    "pyramidkv", "pyramidkv:window_size=8,beta=5.0",
    "ada_snapkv", "ada_snapkv:floor_alpha=0.2,window_size=8", "ada_snapkv:decode_alloc=flat,window_size=8",
    "ada_snapkv:rounding=released,group_reduce=max,window_only=true",
    "ada_pyramidkv:window_size=8", "ada_pyramidkv:decode_alloc=flat,window_size=8",
    "ada_h2o", "ada_h2o:floor_alpha=0.0,recent_ratio=0.25", "ada_h2o:decode_alloc=flat", "ada_h2o:rounding=released",
    "knorm", "keydiff:n_sink=2", "lagkv:lag_size=8", "chunkkv:chunk_length=4,window_size=8",
    "expected_attention:n_future_positions=16,rope_theta=10000",
    "ada(knorm)", "ada(keydiff:n_sink=2, floor_alpha=0.2)", "ada(lagkv:lag_size=8)",
    "decoding(knorm, every=4)", "decoding(chunkkv:chunk_length=4,window_size=8, every=3, target=12)",
]
BUDGETS = (8, 20, 40)
SYNTHETIC = [("mixed", 4, 2, 0), ("zipf", 4, 2, 1), ("sinks", 4, 2, 2), ("recall", 4, 2, 3), ("topic_shift", 2, 2, 4),
             ("local", 6, 3, 5)]


def synthetic_traces():
    from traces.synthetic import make_synthetic_trace

    for kind, hq, hkv, seed in SYNTHETIC:
        yield f"{kind}-{hq}x{hkv}", make_synthetic_trace(kind, n_layers=2, n_q_heads=hq, n_kv_heads=hkv, head_dim=16,
                                                         n_tokens=128, n_prompt=48, seed=seed)


def tiny_trace(tmp: Path):
    """A trace of the shipped tiny model (real attention), and the SHA-256 of its q/k/v."""
    from traces.format import load_trace
    from traces.model import record_default_trace

    trace = load_trace(record_default_trace(tmp / "tiny", n_prompt=96, n_decode=48, layers=(0, 1)))
    h = hashlib.sha256()
    for layer in range(trace.n_layers):
        la = trace.layer(layer)
        for a in (la.q, la.k, la.v):
            h.update(np.ascontiguousarray(a).tobytes())
    return trace, h.hexdigest()


def digest(trace, spec: str, budget: int) -> str | None:
    """SHA-256 of the kept positions at every step and the slots held (None: the policy refuses the budget)."""
    from policies import PolicyError
    from sim.replay.policy_replay import replay
    from sim.experiments.specs import parse_policy

    policy = parse_policy(spec)
    try:
        res = replay(trace, policy, budget, record_kept=(0, trace.meta.n_tokens), threads=1)
    except PolicyError:
        return None
    h = hashlib.sha256()
    for layer in range(res.kept.shape[0]):
        for step in res.kept[layer]:
            for row in step:
                h.update(np.sort(row[row >= 0]).astype(np.int64).tobytes())
                h.update(b"|")
    h.update(np.ascontiguousarray(res.slots, np.int64).tobytes())
    return h.hexdigest()


def digests(traces) -> dict[str, str | None]:
    return {f"{name}|{spec}|{b}": digest(trace, spec, b) for name, trace in traces for spec in SPECS for b in BUDGETS}


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("spec", SPECS)
def test_ported_kept_sets_equal_the_hand_written_kernels_on_synthetic_traces(golden, spec):
    got = {f"{name}|{spec}|{b}": digest(trace, spec, b) for name, trace in synthetic_traces() for b in BUDGETS}
    want = {k: golden["synthetic"][k] for k in got}
    assert got == want


def test_ported_kept_sets_equal_the_hand_written_kernels_on_a_real_model_trace(golden, tmp_path):
    trace, checksum = tiny_trace(tmp_path)
    if checksum != golden["tiny_checksum"]:
        pytest.skip("this machine records a different tiny-model trace than the one the golden digests came from")
    got = digests([("tiny", trace)])
    assert got == golden["tiny"]


if __name__ == "__main__":      # python tests/test_scorer_ports.py --write tests/data/kept_golden.json
    import tempfile

    assert sys.argv[1] == "--write"
    with tempfile.TemporaryDirectory() as tmp:
        tiny, checksum = tiny_trace(Path(tmp))
        payload = {"synthetic": digests(synthetic_traces()), "tiny_checksum": checksum, "tiny": digests([("tiny", tiny)])}
    Path(sys.argv[2]).write_text(json.dumps(payload, indent=0, sort_keys=True))
    print(f"wrote {sys.argv[2]}: {len(payload['synthetic']) + len(payload['tiny'])} digests")
