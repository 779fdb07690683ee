"""Faithfulness of a recorded trace: attention recomputed from stored q/k/v vs the model's own output.

The recorder (`traces.recorder`) checks every layer with `layer_faithfulness` before writing it;
`verify_trace_against_model` re-runs a model over a written trace (capture: `traces.capture`, the forward:
`traces.hf.forward`). Nothing here imports the recorder.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from traces.capture import Capture, capturing
from traces.hf.forward import forward_in_chunks
from traces.reference import full_attention_reference


@dataclass(frozen=True)
class LayerFaithfulness:
    """Max abs error of recomputed vs model attention output, relative to the output's max magnitude."""
    layer: int
    max_abs_err: float
    rel_err: float

    def ok(self, tol: float) -> bool:
        return self.rel_err <= tol


class UnfaithfulTraceError(ValueError):
    """Attention recomputed from the stored q/k/v does not reproduce the model's attention output."""


def layer_faithfulness(layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, model_o: np.ndarray,
                       scale: float, *, window: int | None = None) -> tuple[LayerFaithfulness, np.ndarray, np.ndarray]:
    """Recompute the layer's causal attention (windowed on a sliding layer) from q/k/v; return the comparison
    and the reference (lse, o)."""
    lse, o = full_attention_reference(q, k, v, scale, window=window)
    err = float(np.max(np.abs(o - model_o))) if o.size else 0.0
    mag = float(np.max(np.abs(model_o))) if model_o.size else 0.0
    return LayerFaithfulness(layer, err, err / max(mag, 1e-30)), lse, o


def default_tolerance(dtype: str, compute_dtype: str = "float32") -> float:
    """Relative tolerance: fp32 storage of an fp32 model reproduces to rounding; fp16 storage, or a model
    running in half precision (its own output is rounded), loses ~3 decimal digits (bf16: ~2)."""
    if "bfloat16" in compute_dtype:
        return 5e-2
    return 1e-4 if dtype == "float32" and "float32" in compute_dtype else 2e-2


def assert_faithful(results: list[LayerFaithfulness], tol: float) -> None:
    """Raise UnfaithfulTraceError naming every layer whose relative error exceeds tol."""
    bad = [r for r in results if not r.ok(tol)]
    if bad:
        detail = ", ".join(f"layer {r.layer}: rel err {r.rel_err:.2e}" for r in bad)
        raise UnfaithfulTraceError(f"recomputed attention differs from the model's ({detail}; tolerance {tol:.0e})")


def verify_trace_against_model(trace, model, *, tol: float | None = None) -> list[LayerFaithfulness]:
    """Re-run the model teacher-forced on a trace's tokens and check every stored layer.

    Independent of the recording run: the model's attention outputs are captured afresh and compared with
    attention recomputed from the q/k/v stored on disk. Raises UnfaithfulTraceError when any layer fails.
    """
    import torch

    tokens = trace.tokens
    if tokens is None:
        raise UnfaithfulTraceError(f"{trace.path}: trace has no tokens.parquet; cannot replay it through the model")
    src = trace.meta.source
    kv_heads = tuple(src.get("kv_heads", range(trace.meta.model.n_kv_heads)))
    group = trace.meta.model.group_size
    ids = tokens["token_id"].to_numpy(np.int64).tolist()
    model.eval()
    out = []
    with tempfile.TemporaryDirectory(prefix="kvsim-verify-") as spill:
        cap = Capture(tuple(trace.meta.model.layer_ids), kv_heads, group, np.dtype(np.float32), len(ids), Path(spill))
        try:
            x = torch.tensor([ids], device=next(model.parameters()).device)
            with torch.no_grad(), capturing(model, cap):
                for _ in forward_in_chunks(model, x):
                    pass
            for i, layer in enumerate(trace.meta.model.layer_ids):
                la = trace.layer(i)
                attn = trace.meta.attention(i)
                res, _, _ = layer_faithfulness(layer, la.q, la.k, la.v, cap.arrays(layer)[3], attn.scale,
                                               window=attn.window)
                out.append(res)
        finally:
            cap.close()
    compute = str(next(model.parameters()).dtype)
    assert_faithful(out, default_tolerance(trace.meta.dtype, compute) if tol is None else tol)
    return out
