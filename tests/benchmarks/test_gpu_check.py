"""benchmarks/gpu_check.py: its dry run (the GPU check's steps on the CPU at toy sizes) passes and writes one JSON,
so the prepared GPU check cannot rot; without a GPU the real run refuses."""
import json
import os
from pathlib import Path

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
    assert {(r["model"], r["dtype"], r["prompt_tokens"]) for r in runs} == {
        (m, d, p) for m, d in gpu_check.RUNS for p in gpu_check.DRY.prompts}
    for r in runs:      # Triton (interpreted) and torch backends: the same tokens, kept sets and bytes
        assert r["tokens_equal_prefix"] == r["new_tokens"] and r["kept_agreement"] == 1.0
        assert 0 < r["kv_bytes_held"] == r["kv_bytes_held_torch_backend"] < r["kv_bytes_full_cache"]
        # in bf16, as on the GPU: the two backends' logits agree to about bf16's resolution (2^-8 relative)
        assert r["logit_max_abs_diff"] <= 0.02 * r["logit_max_abs"] and r["tokens_per_s_transformers_sdpa"] > 0
        assert r["ratio_full_vs_transformers"] > 0 and r["ratio_policy_vs_transformers_full"] > 0
        # every configuration says how it ran: one round trip per step (the path before: per layer), and on the
        # CPU no CUDA graph, with the reason
        assert r["info_policy"]["host_round_trips"] == "per step"
        if (r["model"], r["dtype"]) in gpu_check.PER_LAYER_RUNS:      # the path before, timed where it is asked
            assert r["info_policy_per_layer"]["host_round_trips"] == "per layer"
        else:
            assert r["tokens_per_s_policy_per_layer"] is None
        assert r["info_policy"]["cuda_graph"] is False and "CUDA" in r["info_policy"]["cuda_graph_fallback"]
    loop = report["steps"]["closed_loop"]
    assert loop["rows_1"]["rows"] == 1 and len(loop["rows_1"]["each"]) == len(gpu_check.BATCH_POLICIES)
    assert loop["rows_16"]["rows"] == 16 and loop["ratio_rows_vs_one"] > 0
    assert set(report["goals"]) == set(gpu_check.GOALS)
    assert "transformers" in gpu_check.table(report)


def test_the_test_files_it_runs_on_the_device_exist():
    """The real run's kernel tests are named by path: a moved test file must not silently drop out of it."""
    root = Path(gpu_check.__file__).resolve().parents[1]
    missing = [t for t in (*gpu_check.KERNEL_TESTS, *gpu_check.DRY.kernel_tests) if not (root / t).is_file()]
    assert not missing


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_resume_keeps_what_a_previous_run_did(tmp_path):
    """--resume reruns nothing a previous run of the same JSON finished: its steps and generate rows are kept."""
    out = tmp_path / "gpu_check.json"
    # the kept step is the slower one (a pytest run), the rerun one the kernel benchmark's interpreted smoke run
    done = {"steps": {"kernel_tests": {"ok": True, "marker": 1}, "kernel_benchmark": {"ok": False}}}
    out.write_text(json.dumps(done))
    assert gpu_check.main(["--dry-run", "--out", str(out), "--steps", "kernel_tests", "kernel_benchmark",
                           "--resume"]) == 0
    report = json.loads(out.read_text())
    assert report["steps"]["kernel_tests"]["marker"] == 1              # kept
    assert report["steps"]["kernel_benchmark"]["ok"]                   # the failed one rerun


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_real_run_refuses_without_a_gpu(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
