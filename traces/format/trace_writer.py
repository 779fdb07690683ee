"""Writing a trace: layer by layer into a temp directory beside the destination, renamed into place once the
manifest (written last) is complete, so a killed writer never leaves a half-valid trace."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from traces.format.file_io import atomic_save_npy, atomic_write_text, sha256_and_finite
from traces.format.trace_meta import (FORMAT_NAME, FORMAT_VERSION, RECON_H, WO, LayerArrays, TraceError, TraceMeta,
                                      array_path)
from traces.reference import full_attention_reference


class TraceWriter:
    """Writes a trace layer by layer into a temp directory and renames it into place on success.

    Use as a context manager; an exception (or a kill) leaves no directory at ``out_dir``.
    """

    def __init__(self, out_dir: str | os.PathLike, meta: TraceMeta, *, compute_reference: bool = True,
                 overwrite: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.meta = meta
        self.compute_reference = compute_reference
        if self.out_dir.exists() and not overwrite:
            raise FileExistsError(f"{self.out_dir} already exists (pass overwrite=True to replace it)")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self._tmp: Path | None = None
        self._entries: dict[str, dict[str, Any]] = {}
        self._n_layers_written = 0
        self._present: dict[str, bool] = {}   # optional array group -> present in the first layer
        self._tokens_written = False

    def __enter__(self) -> "TraceWriter":
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.tmp-", dir=self.out_dir.parent))
        return self

    def add_layer(self, arrays: LayerArrays) -> None:
        """Validate and write the next layer (in ``meta.model.layer_ids`` order)."""
        assert self._tmp is not None, "TraceWriter must be used as a context manager"
        i = self._n_layers_written
        if i >= len(self.meta.model.layer_ids):
            raise TraceError(f"too many layers: manifest declares {len(self.meta.model.layer_ids)}")
        lse, o = arrays.lse, arrays.o
        if (lse is None) != (o is None):
            raise TraceError(f"layer {i}: give both lse and o, or neither")
        if lse is None and self.compute_reference:
            attn = self.meta.attention(i)
            lse, o = full_attention_reference(arrays.q, arrays.k, arrays.v, attn.scale, window=attn.window)
        has_ref = self._same_in_every_layer("reference lse/o", lse is not None, i)
        has_wo = self._same_in_every_layer("the W_O array", arrays.wo is not None, i)
        if has_wo and self.meta.model.hidden_size < 1:
            raise TraceError(f"layer {i}: a W_O array needs model.hidden_size (its number of rows) in the manifest")
        has_recon = self.meta.reconstruction is not None
        if (arrays.recon_q is not None) != has_recon or (arrays.recon_k is not None) != has_recon:
            raise TraceError(f"layer {i}: recon_q and recon_k go together, in every layer of a trace whose "
                             "manifest has a reconstruction plan, and in no other")
        has_recon_h = self._same_in_every_layer("the reconstruction's hidden norms", arrays.recon_h is not None, i)
        if has_recon_h and not has_recon:
            raise TraceError(f"layer {i}: recon_h (the reconstruction pass's hidden norms) without a reconstruction "
                             "plan in the manifest")
        (self._tmp / f"layers/{i:03d}").mkdir(parents=True, exist_ok=True)
        named = {"q": arrays.q, "k": arrays.k, "v": arrays.v}
        if has_ref:
            named.update(lse=lse, o=o)
        if has_wo:
            named[WO] = arrays.wo
        if has_recon:
            named.update(recon_q=arrays.recon_q, recon_k=arrays.recon_k)
        if has_recon_h:
            named[RECON_H] = np.asarray(arrays.recon_h, np.float32)
        for name, arr in named.items():
            arr = np.asarray(arr)
            where = f"layer {i} array {name!r}"
            want = self.meta.expected_shape(name)
            if arr.shape != want:
                raise TraceError(f"{where}: shape {arr.shape}, expected {want}")
            if not np.issubdtype(arr.dtype, np.floating):
                raise TraceError(f"{where}: dtype {arr.dtype} is not floating point")
            arr = arr.astype(self.meta.expected_dtype(name), copy=False)
            rel = array_path(i, name)
            path = self._tmp / rel
            atomic_save_npy(path, arr)
            digest, finite = sha256_and_finite(path, arr)
            if not finite:
                raise TraceError(f"{where}: contains NaN or inf")
            self._entries[rel] = {"sha256": digest, "shape": list(arr.shape), "dtype": arr.dtype.str}
        self._n_layers_written += 1

    def _same_in_every_layer(self, what: str, present: bool, i: int) -> bool:
        """An optional array group is in every layer or in none; returns ``present``."""
        if self._present.setdefault(what, present) != present:
            raise TraceError(f"layer {i}: {what} must be present for all layers or none")
        return present

    def set_tokens(self, tokens: "Any") -> None:
        """Write tokens.parquet (a pandas DataFrame with one row per position)."""
        import pandas as pd   # only a trace with tokens needs it: pandas (0.6 s) would triple the import time

        assert self._tmp is not None, "TraceWriter must be used as a context manager"
        if not isinstance(tokens, pd.DataFrame):
            raise TraceError("tokens must be a pandas DataFrame")
        if len(tokens) != self.meta.n_tokens:
            raise TraceError(f"tokens.parquet: {len(tokens)} rows, expected n_tokens={self.meta.n_tokens}")
        path = self._tmp / "tokens.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        tokens.to_parquet(tmp, index=False)
        os.replace(tmp, path)
        self._entries["tokens.parquet"] = {"sha256": sha256_and_finite(path, np.zeros(0))[0]}
        self._tokens_written = True

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self._tmp is not None
        try:
            if exc_type is not None:
                return
            n = len(self.meta.model.layer_ids)
            if self._n_layers_written != n:
                raise TraceError(f"wrote {self._n_layers_written} layers, manifest declares {n}")
            manifest = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                **self.meta.to_json(),
                "has_reference": self._present.get("reference lse/o", False),
                "has_wo": self._present.get("the W_O array", False),
                "has_recon_h": self._present.get("the reconstruction's hidden norms", False),
                "arrays": self._entries,
            }
            atomic_write_text(self._tmp / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True))
            if self.out_dir.exists():
                old = self.out_dir.with_name(f".{self.out_dir.name}.old-{os.getpid()}")
                os.replace(self.out_dir, old)
                os.replace(self._tmp, self.out_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(self._tmp, self.out_dir)
            self._tmp = None
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)


def write_trace(out_dir: str | os.PathLike, meta: TraceMeta, layers: Iterable[LayerArrays], tokens: Any = None, *,
                compute_reference: bool = True, overwrite: bool = False) -> Path:
    """Write a whole trace atomically and return its directory."""
    with TraceWriter(out_dir, meta, compute_reference=compute_reference, overwrite=overwrite) as w:
        for arrays in layers:
            w.add_layer(arrays)
        if tokens is not None:
            w.set_tokens(tokens)
    return Path(out_dir)
