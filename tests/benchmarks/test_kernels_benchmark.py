"""benchmarks/kernels.py: refuses without a GPU, and its measurement plumbing runs on CPU (fake timer, no numbers)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from benchmarks import kernels as bk  # noqa: E402

GPU_RUN = os.environ["TRITON_INTERPRET"] == "0" and torch.cuda.is_available()


@pytest.mark.skipif(GPU_RUN, reason="a real GPU run would benchmark instead of refusing")
def test_refuses_without_cuda(capsys):
    assert bk.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_peak_table_lookup():
    assert bk.peak_for("NVIDIA H100 80GB HBM3")[0] == 3.35e12
    assert bk.peak_for("NVIDIA H100 PCIe")[0] == 2.0e12
    assert bk.peak_for("NVIDIA H200")[0] == 4.8e12
    assert bk.peak_for("some new card")[0] is None


@pytest.mark.skipif(GPU_RUN, reason="CPU plumbing check only")
def test_measurement_plumbing_on_cpu():
    def fake_bench(fn):
        fn()
        return 1e-3

    body = bk.measure("cpu", bench=fake_bench, bench_graph=fake_bench, budgets=[32], batches=[2], configs=[(16, 4)],
                      n_q=4, n_kv=2, head_dim=16, copy_bytes=1 << 12, peak=1e12)
    (row,) = body["attention"]
    assert row["max_abs_err_vs_sdpa"] < 2e-3  # same retained cache, two implementations
    assert row["bytes_no_scores"] == 2 * (2 * 2 * 32) * 16 * 2
    assert row["bytes_scores"] == row["bytes_no_scores"] + 2 * 2 * 32 * (12 * 2 + 16)
    (comp,) = body["compaction"]
    assert set(comp) >= {"t_evict1_append1_s", "t_evict1_merge1_append1_s"}


@pytest.mark.skipif(GPU_RUN, reason="the smoke mode interprets on CPU; kernels here are compiled")
def test_interpret_smoke_passes():
    assert bk.interpret_smoke() == 0
