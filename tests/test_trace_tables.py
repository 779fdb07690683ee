"""Trace-only tables on disk (``sim.replay.trace_tables``): a later process reads what an earlier replay computed, never
a stale or tampered table, and the replay's results do not depend on where the table came from."""
from __future__ import annotations

import numpy as np
import pytest

import policies.core.shared_kernels as kernels
from policies import get_policy
from sim.replay.layer_inputs import layer_memo, load_layers
from sim.replay.policy_replay import replay
from traces.format import load_trace
from traces.synthetic import make_synthetic_trace


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_TABLES", str(tmp_path / "tables"))
    trace = make_synthetic_trace("mixed", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=100,
                                 n_prompt=70, seed=5)
    return load_trace(trace.save(tmp_path / "trace")), tmp_path / "tables"


def _tables(folder):
    return sorted(p for p in folder.rglob("*.npy")) if folder.exists() else []


def _no_recompute(monkeypatch):
    def fail(*args):
        raise AssertionError("the prompt attention was recomputed")
    monkeypatch.setattr(kernels, "prompt_attention_into", fail)


@pytest.mark.parametrize("name", ["bumblebee", "buzz"])
def test_a_second_process_reads_the_table_and_gets_the_same_run(recorded, monkeypatch, name):
    trace, folder = recorded
    first = replay(trace, get_policy(name), 24, inputs=load_layers(trace), record_kept=(70, 30))
    assert len(_tables(folder)) == 2                      # one per layer
    _no_recompute(monkeypatch)                            # fresh inputs = a new process's memo
    again = replay(trace, get_policy(name), 24, inputs=load_layers(trace), record_kept=(70, 30))
    np.testing.assert_array_equal(first.kept, again.kept)
    np.testing.assert_array_equal(first.metrics, again.metrics)


@pytest.mark.parametrize("name", ["bumblebee", "buzz"])
def test_layer_threads_compute_their_tables_side_by_side_with_the_serial_numbers(monkeypatch, name):
    """Each layer thread of a replay computes its layer's table with the GIL released (``prompt_attention_into``);
    the layers' tables, kept sets and metrics are those of one thread."""
    monkeypatch.setenv("KVSIM_TABLES", "off")
    trace = make_synthetic_trace("mixed", n_layers=4, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=100,
                                 n_prompt=70, seed=6)
    one, two = (replay(trace, get_policy(name), 24, inputs=load_layers(trace), record_kept=(70, 30), threads=t)
                for t in (1, 2))
    np.testing.assert_array_equal(one.kept, two.kept)
    np.testing.assert_array_equal(one.metrics, two.metrics)


def test_bumblebee_and_buzz_share_one_table(recorded):
    trace, folder = recorded
    replay(trace, get_policy("bumblebee", group_reduce="sum"), 24, inputs=load_layers(trace))
    replay(trace, get_policy("buzz"), 24, inputs=load_layers(trace))        # BUZZ's default reduction is sum
    assert len(_tables(folder)) == 2


def test_tampered_or_torn_tables_are_recomputed(recorded):
    trace, folder = recorded
    inputs = load_layers(trace)
    pol = get_policy("buzz")
    want = pol.replay_head_state(2, 16, inputs[0], layer_memo(inputs, 0), n_prompt=70)
    table = next(p for p in _tables(folder))
    data = bytearray(table.read_bytes())
    data[-3] ^= 0xFF
    table.write_bytes(bytes(data))                        # tampered: its checksum no longer matches
    fresh = load_layers(trace)
    np.testing.assert_array_equal(pol.replay_head_state(2, 16, fresh[0], layer_memo(fresh, 0), n_prompt=70), want)
    table.write_bytes(table.read_bytes()[:40])            # torn
    table.with_suffix(".sha256").unlink()
    fresh = load_layers(trace)
    np.testing.assert_array_equal(pol.replay_head_state(2, 16, fresh[0], layer_memo(fresh, 0), n_prompt=70), want)
    assert table.with_suffix(".sha256").exists()         # replaced


def test_another_trace_or_parameter_is_another_file_and_off_keeps_none(recorded, tmp_path, monkeypatch):
    trace, folder = recorded
    replay(trace, get_policy("buzz"), 24, inputs=load_layers(trace))
    replay(trace, get_policy("buzz", group_reduce="max"), 24, inputs=load_layers(trace))
    assert len(_tables(folder)) == 4
    other = make_synthetic_trace("mixed", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=100,
                                 n_prompt=70, seed=6)
    other = load_trace(other.save(tmp_path / "other"))
    assert other.layer_digest(0) != trace.layer_digest(0)
    replay(other, get_policy("buzz"), 24, inputs=load_layers(other))
    assert len(_tables(folder)) == 6
    monkeypatch.setenv("KVSIM_TABLES", "off")
    replay(trace, get_policy("buzz", group_reduce="mean"), 24, inputs=load_layers(trace))
    assert len(_tables(folder)) == 6
    assert layer_memo(load_layers(make_synthetic_trace("mixed", n_layers=1)), 0).folder is None   # in memory


def test_prompt_statistics_of_several_layers_are_kept_too(recorded, monkeypatch):
    """``prompt_memo``'s tables (D2O's per-layer attention variances, KVzip's scores) are stored per set of
    layers and prompt length, and a later replay reads them."""
    import policies.d2o as d2o

    trace, folder = recorded
    first = replay(trace, get_policy("d2o"), 24, inputs=load_layers(trace))
    kvzip = replay(trace, get_policy("kvzip"), 24, inputs=load_layers(trace))
    stored = len(_tables(folder))
    assert stored >= 2
    monkeypatch.setattr(d2o, "layer_variances", lambda *a, **k: (_ for _ in ()).throw(AssertionError("recomputed")))
    import policies.kvzip as kvzip_mod
    monkeypatch.setattr(kvzip_mod, "reconstruction_scores",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("recomputed")))
    again = replay(trace, get_policy("d2o"), 24, inputs=load_layers(trace))
    np.testing.assert_array_equal(first.budgets, again.budgets)
    np.testing.assert_array_equal(first.metrics, again.metrics)
    again = replay(trace, get_policy("kvzip"), 24, inputs=load_layers(trace))
    np.testing.assert_array_equal(kvzip.metrics, again.metrics)
    assert len(_tables(folder)) == stored
