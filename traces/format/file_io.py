"""kvsim's atomic file writers (a reader never sees a partial file) and the one-pass checksum of a trace's files."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

_CHUNK_BYTES = 1 << 24


def sha256_and_finite(path: Path, arr: np.ndarray) -> tuple[str, bool]:
    """One streaming pass: SHA-256 of the file bytes and whether the array holds only finite values."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK_BYTES), b""):
            h.update(chunk)
    flat = arr.reshape(-1)
    step = max(1, _CHUNK_BYTES // max(1, flat.itemsize))
    finite = all(bool(np.isfinite(flat[i : i + step]).all()) for i in range(0, flat.size, step))
    return h.hexdigest(), finite


def atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    """Save ``arr`` as a .npy file (no pickle) through a temp file beside it, synced, then renamed into place."""
    tmp = path.with_suffix(".npy.tmp")
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a binary file via a temp file in the same folder (created if missing) and os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write a text file via temp file + rename so readers never see a partial file: kvsim's one atomic text (and
    JSON) writer. The file gets the permissions a plain ``open(path, "w")`` would give it (mkstemp's are 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
