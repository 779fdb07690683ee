"""Reading a trace: ``load_trace`` validates a directory (manifest, every array's header, shape and dtype, and by
default its checksum and finiteness) and returns a ``Trace`` whose layers are memory-mapped on demand;
``InMemoryTrace`` gives arrays held in memory the same reading interface."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from traces.format.file_io import sha256_and_finite
from traces.format.trace_meta import (ARRAY_NAMES, FORMAT_NAME, READABLE_VERSIONS, RECON, RECON_H, WO, LayerArrays,
                                      TraceError, TraceMeta, array_path, is_array_path)
from traces.format.trace_writer import write_trace
from traces.reconstruction import DEFAULT_CHUNK, synthetic_reconstruction


class Trace:
    """A loaded trace: metadata plus lazily memory-mapped layer arrays."""

    def __init__(self, path: Path, meta: TraceMeta, has_reference: bool, entries: dict[str, dict[str, Any]],
                 has_wo: bool = False, has_recon_h: bool = False):
        self.path = path
        self.meta = meta
        self.has_reference = has_reference
        self.has_wo = has_wo
        self.has_recon_h = has_recon_h
        self._entries = entries

    @property
    def n_layers(self) -> int:
        return len(self.meta.model.layer_ids)

    @property
    def has_reconstruction(self) -> bool:
        """Whether ``reconstruction`` can answer: the trace recorded the pass, or is synthetic (derives one)."""
        return self.meta.reconstruction is not None or self.meta.kind == "synthetic"

    def layer_digest(self, i: int) -> str | None:
        """A SHA-256 over the manifest's checksums of every array of the i-th stored layer: names the layer's
        content (tables derived from it are cached under it, ``sim.replay.trace_tables``); None for a trace in memory."""
        prefix = array_path(i, "")[:-len(".npy")]
        digests = sorted((rel, e["sha256"]) for rel, e in self._entries.items() if rel.startswith(prefix))
        if not digests:
            return None
        return hashlib.sha256(repr((self.meta.n_tokens, self.meta.n_prompt, digests)).encode()).hexdigest()

    def layer(self, i: int) -> LayerArrays:
        """Memory-mapped arrays of the i-th stored layer (file order, not model layer id)."""
        if not 0 <= i < self.n_layers:
            raise IndexError(f"layer {i} out of range: trace has {self.n_layers} layers")
        load = lambda name: np.load(self.path / array_path(i, name), mmap_mode="r", allow_pickle=False)
        ref = (load("lse"), load("o")) if self.has_reference else (None, None)
        recon = (load("recon_q"), load("recon_k")) if self.meta.reconstruction is not None else (None, None)
        return LayerArrays(load("q"), load("k"), load("v"), *ref, load(WO) if self.has_wo else None, *recon,
                           load(RECON_H) if self.has_recon_h else None)

    def reconstruction(self, i: int, chunk_size: int | None = None) -> tuple[Any, np.ndarray, np.ndarray]:
        """KVzip's context-reconstruction pass of the i-th stored layer: (plan, recon_q [R, Hq, d],
        recon_k [R, Hkv, d]). A synthetic trace derives one from its prompt (each chunk reread verbatim,
        ``traces.reconstruction.synthetic_reconstruction``); a recorded trace without it is an error naming the
        option that records it. ``chunk_size``: the synthetic pass's chunks (default kvpress's)."""
        plan = self.meta.reconstruction
        if plan is not None:
            la = self.layer(i)
            return plan, la.recon_q, la.recon_k
        if self.meta.kind == "synthetic":
            la = self.layer(i)
            return synthetic_reconstruction(la.q, la.k, self.meta.n_prompt, chunk_size or DEFAULT_CHUNK)
        raise TraceError(f"trace {self.path} has no context-reconstruction pass (KVzip's scores come from it); "
                         "record it again with `kvsim record --kvzip`")


    def reconstruction_hidden_norms(self, i: int) -> np.ndarray:
        """The i-th stored layer's hidden-state norms of the reconstruction pass's repeat tokens [R] (KVzip+), or
        TraceError naming how to record them."""
        if self.meta.reconstruction is None or not self.has_recon_h:
            raise TraceError(f"{self.path}: no hidden-state norms of KVzip's reconstruction pass (KVzip+ needs them): "
                             "record the trace again with `kvsim record --kvzip` (kvsim records them since its "
                             "KVzip+ support)")
        return self.layer(i).recon_h
    def wo(self) -> list[np.ndarray]:
        """Every layer's output projection W_O [hidden, Hq*d]; a clear error when the trace was recorded without."""
        if not self.has_wo:
            raise TraceError(f"trace {self.path} has no W_O (o_proj) arrays; record it again with `kvsim record` "
                             "(which stores them) to use W_O-aware metrics or policies")
        return [np.asarray(self.layer(i).wo) for i in range(self.n_layers)]

    @property
    def tokens(self) -> Any:
        """tokens.parquet as a DataFrame, or None when the trace has none."""
        if "tokens.parquet" not in self._entries:
            return None
        import pandas as pd   # only a trace with tokens needs it (see ``TraceWriter.set_tokens``)

        return pd.read_parquet(self.path / "tokens.parquet")

    def __repr__(self) -> str:
        m = self.meta.model
        return (f"Trace({str(self.path)!r}, kind={self.meta.kind}, layers={self.n_layers}, T={self.meta.n_tokens}, "
                f"P={self.meta.n_prompt}, Hq={m.n_q_heads}, Hkv={m.n_kv_heads}, d={m.head_dim})")


def _check_npy_header(path: Path, rel: str, entry: dict[str, Any], meta: TraceMeta, name: str) -> np.ndarray:
    """Open one array without pickle and check it against the manifest and the model geometry."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        if "pickle" in str(e).lower() or "object" in str(e).lower():
            raise TraceError(f"{rel}: holds Python objects (pickle), which kvsim never loads") from None
        raise TraceError(f"{rel}: not a valid .npy file ({e})") from None
    except OSError as e:
        raise TraceError(f"{rel}: unreadable or truncated .npy file ({e})") from None
    want_shape = meta.expected_shape(name)
    if tuple(arr.shape) != want_shape or list(arr.shape) != list(entry.get("shape", [])):
        raise TraceError(f"{rel}: shape {tuple(arr.shape)}, expected {want_shape} (manifest says {entry.get('shape')})")
    want_dtype = meta.expected_dtype(name)
    if arr.dtype != want_dtype:
        raise TraceError(f"{rel}: dtype {arr.dtype}, expected {want_dtype}")
    return arr


def load_trace(path: str | os.PathLike, *, verify: bool = True) -> Trace:
    """Open and validate a trace directory.

    Always checks the manifest, every array's presence, header, shape and dtype. With ``verify`` (the
    default) also checks every SHA-256 checksum and that q/k/v/lse/o are finite (one streaming pass).
    """
    root = Path(path)
    mpath = root / "manifest.json"
    if not root.is_dir():
        raise TraceError(f"{root}: not a trace directory")
    if not mpath.is_file():
        raise TraceError(f"{mpath}: missing (incomplete or not a kvsim trace)")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{mpath}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise TraceError(f"{mpath}: top level must be an object")
    for key in ("format", "version", "model", "n_tokens", "n_prompt", "dtype", "softmax_scale", "arrays"):
        if key not in manifest:
            raise TraceError(f"{mpath}: missing field {key!r}")
    if manifest["format"] != FORMAT_NAME:
        raise TraceError(f"{mpath}: field 'format' is {manifest['format']!r}, expected {FORMAT_NAME!r}")
    if manifest["version"] not in READABLE_VERSIONS:
        raise TraceError(f"{mpath}: field 'version' is {manifest['version']!r}; this kvsim reads versions "
                         f"{', '.join(map(str, READABLE_VERSIONS))}")
    meta = TraceMeta.from_json(manifest, where=str(mpath))
    entries = manifest["arrays"]
    if not isinstance(entries, dict):
        raise TraceError(f"{mpath}: field 'arrays' must be an object")
    for rel in entries:
        if rel != "tokens.parquet" and not is_array_path(rel):
            raise TraceError(f"{mpath}: field 'arrays' names {rel!r}, which is not a trace array path")
    has_ref = bool(manifest.get("has_reference", False))
    has_wo = bool(manifest.get("has_wo", False))
    if has_wo and meta.model.hidden_size < 1:
        raise TraceError(f"{mpath}: has_wo is set but model.hidden_size is missing")
    has_recon_h = bool(manifest.get("has_recon_h", False)) and meta.reconstruction is not None
    names = ((ARRAY_NAMES if has_ref else ARRAY_NAMES[:3]) + ((WO,) if has_wo else ())
             + (RECON if meta.reconstruction is not None else ()) + ((RECON_H,) if has_recon_h else ()))
    for i in range(len(meta.model.layer_ids)):
        for name in names:
            rel = array_path(i, name)
            entry = entries.get(rel)
            if entry is None:
                raise TraceError(f"{mpath}: field 'arrays' lacks {rel!r}")
            fpath = root / rel
            if not fpath.is_file():
                raise TraceError(f"{rel}: file missing")
            arr = _check_npy_header(fpath, rel, entry, meta, name)
            if verify:
                digest, finite = sha256_and_finite(fpath, arr)
                if digest != entry.get("sha256"):
                    raise TraceError(f"{rel}: checksum mismatch (sha256 {digest[:12]}… vs manifest "
                                     f"{str(entry.get('sha256'))[:12]}…): the file was modified or corrupted")
                if not finite:
                    raise TraceError(f"{rel}: contains NaN or inf")
    if "tokens.parquet" in entries:
        tpath = root / "tokens.parquet"
        if not tpath.is_file():
            raise TraceError("tokens.parquet: file missing")
        if verify and sha256_and_finite(tpath, np.zeros(0))[0] != entries["tokens.parquet"].get("sha256"):
            raise TraceError("tokens.parquet: checksum mismatch: the file was modified or corrupted")
    return Trace(root, meta, has_ref, entries, has_wo, has_recon_h)


class InMemoryTrace(Trace):
    """A trace held in memory (synthetic generators, tests); same reading interface as a loaded trace."""

    def __init__(self, meta: TraceMeta, layers: list[LayerArrays], tokens: Any = None):
        has_ref = all(la.lse is not None for la in layers)
        super().__init__(Path("<memory>"), meta, has_ref, {}, bool(layers) and all(la.wo is not None for la in layers),
                         bool(layers) and all(la.recon_h is not None for la in layers))
        if len(layers) != len(meta.model.layer_ids):
            raise TraceError(f"{len(layers)} layers given, model.layer_ids declares {len(meta.model.layer_ids)}")
        for i, la in enumerate(layers):
            for name, arr in la._asdict().items():
                if arr is not None and tuple(arr.shape) != meta.expected_shape(name):
                    raise TraceError(f"layer {i} array {name!r}: shape {tuple(arr.shape)}, "
                                     f"expected {meta.expected_shape(name)}")
        self._layers = layers
        self._tokens = tokens

    def layer(self, i: int) -> LayerArrays:
        if not 0 <= i < self.n_layers:
            raise IndexError(f"layer {i} out of range: trace has {self.n_layers} layers")
        return self._layers[i]

    @property
    def tokens(self) -> Any:
        return self._tokens

    def save(self, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write this trace to disk in the standard format."""
        return write_trace(out_dir, self.meta, self._layers, self._tokens, overwrite=overwrite)
