"""Results store: one Parquet dataset (a directory of part files), one row per configuration with a stable key.

Every finished configuration is written at once as its own atomically renamed part file, so an interrupted
sweep (Ctrl-C, kill -9) loses nothing finished and resumes by skipping keys already present. A writer killed
between its temporary file and the rename leaves that hidden file behind (never read as a part); opening the store
removes such leftovers of writers on this host that are no longer running (the file name says whose it is).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterable

import pandas as pd


def config_key(trace_id: str, policy: str, params: dict[str, Any], budget: int, sliding: str = "keep",
               chunk: int = 1) -> str:
    """Stable key of a (trace, policy, params, budget) configuration; ``sliding`` and the prompt ``chunk`` join
    the key only when they are not the defaults, so stores written before they existed keep their keys."""
    fields: list[Any] = [trace_id, policy, params, int(budget)] + ([sliding] if sliding != "keep" else [])
    fields += [f"chunk={int(chunk)}"] if int(chunk) != 1 else []
    payload = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


class ResultStore:
    """A directory of ``part-*.parquet`` files read as one table."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"{self.root}: results store must be a directory")
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_dead_writers_files()

    def _temp_prefix(self, pid: int | None = None) -> str:
        return f".part-{socket.gethostname()}-{os.getpid() if pid is None else pid}-"

    def _remove_dead_writers_files(self) -> None:
        """Delete the temporary files of this host's writers that were killed before their rename."""
        host = f".part-{socket.gethostname()}-"
        for tmp in self.root.glob(f"{host}*.tmp"):
            pid = tmp.name[len(host):].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                tmp.unlink(missing_ok=True)

    def parts(self) -> list[Path]:
        return sorted(self.root.glob("part-*.parquet"))

    def load(self, dedupe: bool = True) -> pd.DataFrame:
        """All rows, one per key (the first part file in name order wins if a key was ever written twice), or with
        ``dedupe=False`` every row as written (a caller that prefers one of a key's rows picks it)."""
        frames = [pd.read_parquet(p) for p in self.parts()]
        if not frames:
            return pd.DataFrame()
        df = pd.concat(frames, ignore_index=True)
        return df.drop_duplicates("key", keep="first").reset_index(drop=True) if dedupe else df

    def keys(self) -> set[str]:
        return set(self.load().get("key", pd.Series(dtype=str)).tolist())

    def add(self, rows: Iterable[dict[str, Any]]) -> Path | None:
        """Append rows as one new part file (temp file + rename: all or nothing)."""
        rows = list(rows)
        if not rows:
            return None
        df = pd.DataFrame(rows)
        if "params" in df:
            df["params"] = df["params"].map(lambda p: p if isinstance(p, str) else json.dumps(p, sort_keys=True))
        final = self.root / f"part-{uuid.uuid4().hex}.parquet"
        fd, tmp = tempfile.mkstemp(prefix=self._temp_prefix(), suffix=".tmp", dir=self.root)
        os.close(fd)
        try:
            df.to_parquet(tmp, index=False)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return final


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a process of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
