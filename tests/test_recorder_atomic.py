"""A recording killed with SIGKILL leaves no half-valid trace: the output is absent or the old trace intact."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from traces.format import TraceError, load_trace

SCRIPT = textwrap.dedent("""
    import sys, time, torch
    torch.set_num_threads(1)
    import traces.capture as C, traces.format.trace_writer as W
    from transformers import LlamaConfig, LlamaForCausalLM
    from traces.recorder import record_trace
    out, stage, overwrite = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    def announce(name, fn):
        def wrapped(*a, **k):
            r = fn(*a, **k)
            if stage == name:
                print("reached", flush=True)
                time.sleep(60)
            return r
        return wrapped
    W.atomic_save_npy = announce("write", W.atomic_save_npy)
    C.Capture.add = announce("decode", C.Capture.add)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    record_trace(model, list(range(40)), out, n_prompt=20, n_decode=10, teacher_forced=True, progress=False,
                 overwrite=overwrite)
    print("finished", flush=True)
""")


def _run(out: Path, stage: str, overwrite: bool, kill: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(out), stage, "1" if overwrite else "0"],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().strip()
        if kill:
            assert line == "reached", f"subprocess did not reach stage {stage!r}: {line!r}"
            os.kill(proc.pid, signal.SIGKILL)
        else:
            assert line == "finished"
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize("stage", ["decode", "write"])
def test_killed_recording_leaves_no_trace(tmp_path, stage):
    out = tmp_path / "trace"
    _run(out, stage, overwrite=False, kill=True)
    assert not out.exists()
    with pytest.raises(TraceError):
        load_trace(out)


def test_killed_overwrite_keeps_previous_trace_valid(tmp_path):
    out = tmp_path / "trace"
    _run(out, "none", overwrite=False, kill=False)
    before = (out / "manifest.json").read_bytes()
    _run(out, "write", overwrite=True, kill=True)
    tr = load_trace(out)          # verifies every checksum
    assert (out / "manifest.json").read_bytes() == before and tr.meta.n_tokens == 30
