"""benchmarks/gpu_check.py: its dry run (the GPU check's steps on the CPU at toy sizes) passes and writes one JSON,
so the prepared GPU check cannot rot; without a GPU the real run refuses."""
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from benchmarks import gpu_check  # noqa: E402


def test_dry_run_runs_every_step_and_writes_one_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["dry_run"]
    assert set(report["steps"]) == set(gpu_check.STEPS)
    rec = report["steps"]["recommend"]    # one CPU run compared with itself: the plumbing, an answer, no difference
    assert rec["answer_device"] == rec["answer_cpu"] and rec["confirmed_both"] > 0
    assert rec["measured_max_abs_diff"] == 0.0
    runs = report["steps"]["generate"]["runs"]
    assert {(r["model"], r["prompt_tokens"]) for r in runs} == {(m, p) for m in gpu_check.MODELS
                                                                for p in gpu_check.DRY.prompts}
    for r in runs:      # Triton (interpreted) and torch backends: the same tokens, kept sets and bytes
        assert r["tokens_equal_prefix"] == r["new_tokens"] and r["kept_agreement"] == 1.0
        assert 0 < r["kv_bytes_held"] == r["kv_bytes_held_torch_backend"] < r["kv_bytes_full_cache"]
        # in bf16, as on the GPU: the two backends' logits agree to about bf16's resolution (2^-8 relative)
        assert r["logit_max_abs_diff"] <= 0.02 * r["logit_max_abs"] and r["tokens_per_s_transformers_sdpa"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_real_run_refuses_without_a_gpu(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
