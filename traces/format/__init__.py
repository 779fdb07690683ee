"""On-disk trace format: a directory of memory-mappable .npy arrays plus a checksummed manifest.

Layout (format version 2)::

    manifest.json               format, version, model config (with each stored layer's attention: global or
                                sliding with its window, RoPE base, logit scale, soft-cap), dtype, token
                                counts, checksums
    layers/<i:03d>/q.npy        [T, Hq, d]   post-RoPE queries
    layers/<i:03d>/k.npy        [T, Hkv, d]  post-RoPE keys
    layers/<i:03d>/v.npy        [T, Hkv, d]  values
    layers/<i:03d>/lse.npy      [T, Hq]      float32 full causal attention log-sum-exp (optional)
    layers/<i:03d>/o.npy        [T, Hq, d]   float32 full causal attention output (optional)
    layers/<i:03d>/wo.npy       [hidden, Hq*d] float32 the layer's attention output projection W_O, as torch's
                                             Linear stores o_proj.weight (optional; for W_O-aware metrics/policies)
    layers/<i:03d>/recon_q.npy  [R, Hq, d]   post-RoPE queries of KVzip's context-reconstruction pass (optional;
    layers/<i:03d>/recon_k.npy  [R, Hkv, d]  its keys; both with the plan in the manifest, `traces.reconstruction`)
    layers/<i:03d>/recon_h.npy  [R]          the repeat tokens' hidden-state norms at the attention's input
                                             (optional, float32; "has_recon_h": KVzip+, policies/kvzip_plus.py)
    tokens.parquet              position, token_id, text, is_prompt, top1_id, nll (optional)

Writes are atomic: everything goes into a sibling temp directory that is renamed into place only
after the manifest (written last) is complete, so a killed writer never leaves a half-valid trace.

The package by job: ``trace_meta`` (the manifest's fields, array names and paths, ``TraceError``), ``file_io``
(atomic writes, checksums), ``trace_writer`` (``TraceWriter``, ``write_trace``) and ``trace_reader`` (``load_trace``,
``Trace``, ``InMemoryTrace``); every public name is importable from ``traces.format``.

Version 1 (before per-layer attention) still loads: its layers read as global attention at the trace's one
softmax scale, with the RoPE base unknown (``LayerAttention.rope_theta`` None) unless the trace has no RoPE.
"""
from __future__ import annotations

from traces.format.file_io import atomic_write_bytes, atomic_write_text
from traces.format.trace_meta import (ARRAY_NAMES, ATTENTION_KINDS, FORMAT_NAME, FORMAT_VERSION, READABLE_VERSIONS,
                                      RECON, RECON_H, STORAGE_DTYPES, WO, LayerArrays, LayerAttention, ModelInfo,
                                      TraceError, TraceMeta, array_path)
from traces.format.trace_reader import InMemoryTrace, Trace, load_trace
from traces.format.trace_writer import TraceWriter, write_trace

__all__ = ["ARRAY_NAMES", "ATTENTION_KINDS", "FORMAT_NAME", "FORMAT_VERSION", "READABLE_VERSIONS", "RECON", "RECON_H",
           "STORAGE_DTYPES", "WO", "InMemoryTrace", "LayerArrays", "LayerAttention", "ModelInfo", "Trace", "TraceError",
           "TraceMeta", "TraceWriter", "array_path", "atomic_write_bytes", "atomic_write_text", "load_trace",
           "write_trace"]
