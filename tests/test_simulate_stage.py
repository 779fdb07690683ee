"""The simulate stage of a search (`gpu_validate.studies.fidelity.segments.simulated`): its rows are those of replaying every cell on
its own and measuring the error after W_O from its kept sets, bit for bit; it measures W_O only when asked; its
store gives back what was asked; its progress counts configurations."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from gpu_validate.validate_error import ValidateError
from gpu_validate.studies.fidelity.segments import ENGINE_LOSSES, cell_key, make_segments, simulated
from policies import get_policy
from sim.experiments.store import ResultStore
from tests.random_models import random_gemma3, random_llama

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 101, (60,), generator=torch.Generator().manual_seed(2)).tolist()


CONFIGS = [(get_policy("h2o"), 6), (get_policy("h2o"), 9), (get_policy("snapkv", window_size=4), 8),
           (get_policy("d2o"), 7), (get_policy("streaming_llm", n_sinks=2), 6), (get_policy("tova"), 10)]


def one_by_one(model, seg, configs, n_prompt, tmp_path):
    """What `simulated` computed before it replayed the cells in one pass: each cell replayed alone, its error after
    W_O from its own kept sets."""
    from sim.replay.layer_inputs import load_layers
    from sim.replay.projected_error import projected_errors
    from sim.replay.policy_replay import replay
    from traces.format import load_trace
    from traces.recorder import record_trace

    record_trace(model, list(seg.ids), tmp_path / "t", n_prompt=n_prompt, n_decode=len(seg.ids) - n_prompt,
                 teacher_forced=True, single_pass=True, progress=False, model_id="t")
    trace = load_trace(tmp_path / "t")
    inputs, wo = load_layers(trace), trace.wo()
    rows = []
    for pol, b in configs:
        res = replay(trace, pol, b, inputs=inputs, record_kept=(n_prompt, len(seg.ids) - n_prompt), threads=1)
        s = res.summary()
        idx = res.layer_index
        e = projected_errors([inputs[i] for i in idx], res.kept, [wo[i] for i in idx], n_prompt,
                             trace.meta.softmax_scale)
        rows.append({**{k: s[k] for k in ENGINE_LOSSES}, "err_by_layer": s["err_by_layer"],
                     "kv_bytes_mean": s["kv_bytes_mean"], "err_wo_mean": float(e.mean()),
                     "err_wo_by_layer": e.tolist()})
    return rows


@pytest.mark.parametrize("build", [random_llama, random_gemma3])
def test_rows_are_the_one_by_one_replays(build, ids, tmp_path):
    model = build()
    segs = make_segments({"a": ids}, 2, 30)
    rows = simulated(model, segs, CONFIGS, n_prompt=18, model_id="t", progress=False)
    assert [(r["segment"], r["label"], r["budget"]) for r in rows] == [
        (s.name, p.label(), b) for s in segs for p, b in CONFIGS]
    for k, seg in enumerate(segs):
        for got, want in zip(rows[k * len(CONFIGS):], one_by_one(model, seg, CONFIGS, 18, tmp_path / str(k))):
            assert {key: got[key] for key in want} == want


def test_wo_only_when_asked_and_the_store_gives_back_what_was_asked(ids, tmp_path):
    model = random_llama()
    segs = make_segments({"a": ids}, 2, 30)
    store = ResultStore(tmp_path / "sim")
    plain = simulated(model, segs, CONFIGS, n_prompt=18, model_id="t", store=store, progress=False,
                      losses=ENGINE_LOSSES)
    assert all("err_wo_mean" not in r for r in plain)
    assert len(store.parts()) == 2
    again = simulated(model, segs, CONFIGS, n_prompt=18, model_id="t", store=store, progress=False,
                      losses=["l1_mean"])
    assert len(store.parts()) == 2                           # read back, nothing replayed
    assert pd.DataFrame(again)[list(ENGINE_LOSSES)].equals(pd.DataFrame(plain)[list(ENGINE_LOSSES)])
    full = simulated(model, segs, CONFIGS, n_prompt=18, model_id="t", store=store, progress=False)
    assert len(store.parts()) == 4 and all(np.isfinite(r["err_wo_mean"]) for r in full)
    for losses in (None, ENGINE_LOSSES):                    # later reads prefer the rows that have W_O
        kw = {} if losses is None else {"losses": losses}
        back = simulated(model, segs, CONFIGS, n_prompt=18, model_id="t", store=store, progress=False, **kw)
        assert len(store.parts()) == 4
        assert [r["err_wo_mean"] for r in back] == [r["err_wo_mean"] for r in full]
    assert set(store.load().key) == {cell_key("t", s, 18, p, b) for s in segs for p, b in CONFIGS}
    with pytest.raises(ValidateError, match="unknown simulated loss"):
        simulated(model, segs, CONFIGS, n_prompt=18, model_id="t", progress=False, losses=["err_wo"])


def test_progress_counts_configurations(ids, capsys):
    segs = make_segments({"a": ids}, 2, 30)
    simulated(random_llama(), segs, CONFIGS, n_prompt=18, model_id="t", progress=True, losses=ENGINE_LOSSES)
    err = capsys.readouterr().err
    assert f"{2 * len(CONFIGS)}/{2 * len(CONFIGS)}" in err and "cfg" in err and "segment" in err
