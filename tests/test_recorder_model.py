"""The shipped tiny model and `kvsim record`: offline loading, faithful default traces, CLI arguments."""
from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
import torch

from sim.commands import record_cmd
from traces.faithful import verify_trace_against_model
from traces.format import load_trace
from traces.model import (MODEL_DIR, TextError, default_model_path, default_text, load_default_model,
                          record_default_trace)
from traces.models import ModelError
from traces.recorder import RecordError

torch.set_num_threads(1)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvsim")
    record_cmd.register(ap.add_subparsers(dest="command"))
    return ap


def _cli(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


def test_shipped_model_is_small_gqa_rope_with_long_context():
    from safetensors import safe_open

    path = default_model_path()
    weights = path / "model.safetensors"
    assert weights.stat().st_size <= 25 * 2**20
    with safe_open(str(weights), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
    model, tok = load_default_model()
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.max_position_embeddings >= 2048 and len(tok) == cfg.vocab_size


def test_default_trace_is_faithful_real_text(tmp_path):
    path = record_default_trace(tmp_path / "t", n_prompt=48, n_decode=16)
    tr = load_trace(path)
    assert tr.meta.n_tokens == 64 and tr.meta.n_prompt == 48 and tr.meta.source["decode"] == "teacher_forced"
    assert default_text().startswith("".join(tr.tokens["text"]))
    model, _ = load_default_model()
    verify_trace_against_model(tr, model)
    # a trained model: far better than a uniform guess over its vocabulary on text it never saw
    assert float(np.nanmean(tr.tokens["nll"])) < 0.75 * math.log(model.config.vocab_size)


def test_cli_records_subset_fp16_from_file(tmp_path):
    text = tmp_path / "in.txt"
    text.write_text(default_text()[:4000], encoding="utf-8")
    out = tmp_path / "t"
    assert _cli(["record", "--model", "default", "--text", str(text), "--prompt-tokens", "20", "--decode-tokens",
                 "6", "--out", str(out), "--keep-layers", "0,2", "--keep-kv-heads", "1", "--dtype", "float16",
                 "--no-progress"]) == 0
    tr = load_trace(out)
    assert tr.meta.model.layer_ids == (0, 2) and tr.meta.model.n_kv_heads == 1 and tr.meta.dtype == "float16"
    assert tr.meta.source["text_id"] == "in.txt" and tr.meta.source["decode"] == "greedy"
    with pytest.raises(FileExistsError):
        _cli(["record", "--model", "default", "--prompt-tokens", "4", "--decode-tokens", "1", "--out", str(out)])
    assert _cli(["record", "--model", str(MODEL_DIR), "--prompt-tokens", "4", "--decode-tokens", "1", "--out",
                 str(out), "--overwrite", "--no-progress", "--teacher-forced"]) == 0
    assert load_trace(out).meta.n_tokens == 5


@pytest.mark.parametrize("argv", [
    ["--keep-layers", "a,b"], ["--keep-layers", ","], ["--prompt-tokens", "-3"], ["--prompt-tokens", "0"],
    ["--dtype", "int8"], ["--decode-tokens", "x"],
])
def test_cli_rejects_malformed_arguments(tmp_path, argv, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["record", "--model", "default", "--out", str(tmp_path / "t"), *argv])
    assert e.value.code == 2


@pytest.mark.parametrize("argv, match", [
    (["--model", "/nonexistent/model"], "not a model name"),
    (["--model", "default", "--text", "/nonexistent.txt"], "not a shipped text .* no such file"),
    (["--model", "default", "--device", "tpu"], "--device"),
    (["--model", "default", "--keep-layers", "9"], r"layers \[9\] out of range"),
    (["--model", "default", "--prompt-tokens", "2000", "--decode-tokens", "100"], "context of 2048"),
])
def test_cli_reports_bad_values(tmp_path, argv, match):
    with pytest.raises((RecordError, ModelError, TextError), match=match):
        _cli(["record", "--out", str(tmp_path / "t"), "--no-progress", *argv])
    assert not (tmp_path / "t").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when CUDA is absent")
def test_cli_cuda_without_gpu_is_a_clear_error(tmp_path):
    with pytest.raises((RecordError, ModelError), match="CUDA is not available"):
        _cli(["record", "--model", "default", "--device", "cuda", "--out", str(tmp_path / "t")])
