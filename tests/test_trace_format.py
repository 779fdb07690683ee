"""Trace format: round trips, atomic writes, and a clear error for every kind of bad file."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from traces.format import (FORMAT_VERSION, LayerArrays, ModelInfo, TraceError, TraceMeta, TraceWriter, load_trace,
                           write_trace)
from traces.reference import full_attention_reference
from traces.synthetic import make_synthetic_trace


@pytest.fixture(scope="module")
def small():
    return make_synthetic_trace("mixed", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_tokens=40,
                                n_prompt=8, seed=3)


@pytest.fixture()
def saved(tmp_path, small):
    return small.save(tmp_path / "trace")


def test_round_trip_is_exact_and_memory_mapped(saved, small):
    tr = load_trace(saved)
    assert tr.meta == small.meta
    for i in range(small.n_layers):
        a, b = tr.layer(i), small.layer(i)
        assert isinstance(a.q, np.memmap)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(np.asarray(x), y)


def test_fp16_storage_round_trip(tmp_path):
    tr = make_synthetic_trace("zipf", n_layers=1, n_tokens=24, n_prompt=4, head_dim=16, dtype="float16")
    out = load_trace(tr.save(tmp_path / "t16"))
    assert out.layer(0).q.dtype == np.float16 and out.layer(0).lse.dtype == np.float32
    np.testing.assert_array_equal(out.layer(0).k, tr.layer(0).k)


def test_tokens_parquet_round_trip(tmp_path, small):
    tokens = pd.DataFrame({"position": np.arange(40), "token_id": np.arange(40) % 7, "text": ["x"] * 40,
                           "is_prompt": np.arange(40) < 8, "top1_id": np.full(40, -1), "nll": np.full(40, np.nan)})
    path = write_trace(tmp_path / "tok", small.meta, [small.layer(i) for i in range(2)], tokens)
    pd.testing.assert_frame_equal(load_trace(path).tokens, tokens)


def test_reference_matches_direct_softmax():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((9, 4, 8)), rng.standard_normal((9, 2, 8)), rng.standard_normal((9, 2, 8))
    lse, o = full_attention_reference(q, k, v, 0.3)
    t, hq = 6, 3
    logits = 0.3 * k[: t + 1, hq // 2] @ q[t, hq]
    p = np.exp(logits - logits.max())
    np.testing.assert_allclose(lse[t, hq], np.log(np.exp(logits).sum()), rtol=1e-6)
    np.testing.assert_allclose(o[t, hq], (p / p.sum()) @ v[: t + 1, hq // 2], rtol=1e-5, atol=1e-6)


def test_failed_write_leaves_nothing(tmp_path, small):
    with pytest.raises(RuntimeError):
        with TraceWriter(tmp_path / "x", small.meta) as w:
            w.add_layer(small.layer(0))
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_bad_arrays(tmp_path, small):
    la = small.layer(0)
    with pytest.raises(TraceError, match="layer 0 array 'k': shape"):
        write_trace(tmp_path / "a", small.meta, [la._replace(k=la.k[:, :1]), la])
    bad = np.array(la.q)
    bad[3, 0, 0] = np.nan
    with pytest.raises(TraceError, match="NaN or inf"):
        write_trace(tmp_path / "b", small.meta, [la._replace(q=bad, lse=None, o=None), la],
                    compute_reference=False)
    with pytest.raises(TraceError, match="manifest declares 2"):
        write_trace(tmp_path / "c", small.meta, [la])
    assert not any(p.name in ("a", "b", "c") for p in tmp_path.iterdir())


def test_existing_output_is_not_clobbered(tmp_path, saved, small):
    with pytest.raises(FileExistsError):
        small.save(saved)


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path: Path, m: dict) -> None:
    (path / "manifest.json").write_text(json.dumps(m))


def test_missing_manifest(saved):
    (saved / "manifest.json").unlink()
    with pytest.raises(TraceError, match="manifest.json: missing"):
        load_trace(saved)


@pytest.mark.parametrize("field", ["model", "n_tokens", "arrays", "version"])
def test_manifest_missing_field(saved, field):
    m = _manifest(saved)
    del m[field]
    _write_manifest(saved, m)
    with pytest.raises(TraceError, match=f"missing field '{field}'"):
        load_trace(saved)


def test_unknown_version(saved):
    m = _manifest(saved)
    m["version"] = FORMAT_VERSION + 1
    _write_manifest(saved, m)
    with pytest.raises(TraceError, match="'version'"):
        load_trace(saved)


def test_path_traversal_in_manifest(saved):
    m = _manifest(saved)
    m["arrays"]["../../etc/passwd"] = {"sha256": "0", "shape": [1], "dtype": "<f4"}
    _write_manifest(saved, m)
    with pytest.raises(TraceError, match="not a trace array path"):
        load_trace(saved)


def test_checksum_mismatch_names_file(saved):
    path = saved / "layers/001/v.npy"
    arr = np.load(path)
    arr[0, 0, 0] += 1.0
    np.save(path, arr)
    with pytest.raises(TraceError, match=r"layers/001/v.npy: checksum mismatch"):
        load_trace(saved)
    load_trace(saved, verify=False)  # header checks still pass; the tamper is only visible to checksums


def test_truncated_npy(saved):
    path = saved / "layers/000/k.npy"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="layers/000/k.npy"):
        load_trace(saved)


def test_wrong_dtype_and_shape(saved):
    path = saved / "layers/000/q.npy"
    np.save(path, np.load(path).astype(np.float64))
    with pytest.raises(TraceError, match="layers/000/q.npy: dtype float64"):
        load_trace(saved, verify=False)
    np.save(path, np.zeros((3, 4, 16), np.float32))
    with pytest.raises(TraceError, match="layers/000/q.npy: shape"):
        load_trace(saved, verify=False)


def test_nan_in_array_is_rejected(saved):
    path = saved / "layers/000/o.npy"
    arr = np.load(path)
    arr[1, 1, 1] = np.inf
    np.save(path, arr)
    m = _manifest(saved)
    import hashlib
    m["arrays"]["layers/000/o.npy"]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    _write_manifest(saved, m)
    with pytest.raises(TraceError, match="layers/000/o.npy: contains NaN or inf"):
        load_trace(saved)


def test_pickle_inside_npy_is_rejected(saved):
    path = saved / "layers/000/v.npy"
    np.save(path, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(TraceError, match="pickle"):
        load_trace(saved, verify=False)


def test_missing_array_file(saved):
    (saved / "layers/001/lse.npy").unlink()
    with pytest.raises(TraceError, match="layers/001/lse.npy: file missing"):
        load_trace(saved)


def test_model_geometry_is_validated():
    with pytest.raises(TraceError, match="multiple of model.n_kv_heads"):
        ModelInfo("m", 1, 6, 4, 16)
    with pytest.raises(TraceError, match="n_prompt"):
        TraceMeta(ModelInfo("m", 1, 4, 2, 16), n_tokens=5, n_prompt=9)
    with pytest.raises(TraceError, match="dtype"):
        TraceMeta(ModelInfo("m", 1, 4, 2, 16), n_tokens=5, n_prompt=1, dtype="int8")


def test_optional_wo_round_trip_missing_and_tampered(tmp_path, small):
    from dataclasses import replace

    rng = np.random.default_rng(0)
    meta = replace(small.meta, model=replace(small.meta.model, hidden_size=12))
    wos = [rng.normal(size=(12, 4 * 16)).astype(np.float32) for _ in range(2)]
    path = write_trace(tmp_path / "wo", meta, [small.layer(i)._replace(wo=wos[i]) for i in range(2)])
    tr = load_trace(path)
    assert tr.has_wo and tr.meta.model.hidden_size == 12
    for got, want in zip(tr.wo(), wos):
        np.testing.assert_array_equal(got, want)
    # a trace without W_O loads as before, and asking for W_O names the problem and the fix
    plain = write_trace(tmp_path / "plain", small.meta, [small.layer(i)._replace(wo=None) for i in range(2)])
    assert not load_trace(plain).has_wo
    with pytest.raises(TraceError, match="no W_O .*kvsim record"):
        load_trace(plain).wo()
    # all layers or none; the width must be Hq*d; hidden_size must be known
    with pytest.raises(TraceError, match="all layers or none"):
        write_trace(tmp_path / "a", meta, [small.layer(0)._replace(wo=wos[0]), small.layer(1)._replace(wo=None)])
    with pytest.raises(TraceError, match="array 'wo': shape"):
        write_trace(tmp_path / "b", meta, [small.layer(i)._replace(wo=wos[i][:, :8]) for i in range(2)])
    no_hidden = replace(small.meta, model=replace(small.meta.model, hidden_size=0))
    with pytest.raises(TraceError, match="hidden_size"):
        write_trace(tmp_path / "c", no_hidden, [small.layer(i)._replace(wo=wos[i]) for i in range(2)])
    # a modified W_O file fails its checksum
    f = path / "layers/001/wo.npy"
    arr = np.load(f)
    arr[0, 0] += 1.0
    np.save(f, arr)
    with pytest.raises(TraceError, match="layers/001/wo.npy: checksum mismatch"):
        load_trace(path)
