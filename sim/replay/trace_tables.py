"""Trace-only tables kept on disk between processes.

Some of a policy's replay work depends on the recorded trace alone: the attention every prompt key accumulates over
the prompt (BUZZ and BumbleBee, O(P^2 G d): at 32 k tokens most of a replay), CriticalKV's projected value norms.
Within a process ``sim.replay.layer_inputs.layer_memo`` already shares them across budgets and parameters; this module
keeps them across processes too, so that the second ``kvsim replay`` of a long trace, a sweep's workers and a
search's trials do not pay them again.

A table lives in ``$KVSIM_TABLES`` (default ``<kvsim cache>/tables``; ``off`` disables the disk tier) under a name
that hashes the content of the layers it derives from (the SHA-256 checksums the trace manifest holds for every
array of each, ``Trace.layer_digest``), the prompt length, and the table's key (its name and every parameter it
depends on): a re-recorded trace or another parameter is another file, never a stale one. Each file is written
atomically beside the SHA-256 of its bytes; a file that fails to load or to match is recomputed and replaced.
Plain ``.npy``, no pickle. Nothing prunes the folder: a table is a few MB (BUZZ's at 8 k tokens on SmolLM2: 30
layers x 3 heads x 7 936 float64, 5.7 MB); delete it at will.
"""
from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any, Hashable, Sequence

import numpy as np

from traces.format import atomic_write_bytes
from traces.models import cache_dir

#: environment variable naming the folder (``off``: keep tables in memory only)
ENV = "KVSIM_TABLES"


def tables_dir() -> Path | None:
    """``$KVSIM_TABLES``, else ``<kvsim cache>/tables`` (``traces.models.cache_dir``); None when set to ``off``."""
    env = os.environ.get(ENV)
    if env == "off":
        return None
    if env:
        return Path(env)
    return cache_dir() / "tables"


def table_memo(trace: Any, layers: Sequence[int], n_prompt: int) -> "TableMemo":
    """The memo of the tables derived from ``layers`` of ``trace`` (their first ``n_prompt`` tokens where a table
    reads the prompt): on disk for a recorded trace, in memory for one without checksums (synthetic, in memory)."""
    digests = [trace.layer_digest(i) for i in layers] if trace is not None else [None]
    if not digests or any(d is None for d in digests):
        return TableMemo(None, None)
    digest = hashlib.sha256(repr((digests, int(n_prompt))).encode()).hexdigest()
    return TableMemo(tables_dir(), digest)


class TableMemo(dict):
    """A memo of trace-only tables (``Policy.replay_head_state``'s per layer, ``policies.core.base.prompt_memo``'s per
    set of layers): a dict whose array values are also read from and written to ``folder`` (one ``.npy`` plus its
    ``.sha256`` per key, named by ``digest`` and the key), or a plain dict when ``folder`` is None."""

    def __init__(self, folder: Path | None, digest: str | None) -> None:
        super().__init__()
        self.folder = folder if digest else None
        self.digest = digest

    def _path(self, key: Hashable) -> Path:
        name = hashlib.sha256(f"{self.digest}|{key!r}".encode()).hexdigest()[:40]
        return self.folder / name[:2] / f"{name}.npy"

    def __contains__(self, key: object) -> bool:
        return self.get(key) is not None          # a table on disk counts (and is read into memory)

    def get(self, key: Hashable, default: Any = None) -> Any:
        if dict.__contains__(self, key):
            return self[key]
        table = self._load(key) if self.folder is not None else None
        if table is None:
            return default
        dict.__setitem__(self, key, table)
        return table

    def __setitem__(self, key: Hashable, value: Any) -> None:
        dict.__setitem__(self, key, value)
        if self.folder is not None and isinstance(value, np.ndarray):
            self._store(key, value)

    def _load(self, key: Hashable) -> np.ndarray | None:
        path = self._path(key)
        try:
            want = path.with_suffix(".sha256").read_text().strip()
            data = path.read_bytes()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != want:
            return None                       # torn or tampered: recomputed and replaced by the caller
        try:
            return np.load(io.BytesIO(data), allow_pickle=False)
        except (OSError, ValueError):
            return None

    def _store(self, key: Hashable, value: np.ndarray) -> None:
        """Atomic: the array, then its checksum. A folder that cannot be written (read-only cache, full disk)
        leaves the table in memory only."""
        path = self._path(key)
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(value), allow_pickle=False)
        data = buf.getvalue()
        try:
            atomic_write_bytes(path, data)
            atomic_write_bytes(path.with_suffix(".sha256"), hashlib.sha256(data).hexdigest().encode() + b"\n")
        except OSError:
            pass
