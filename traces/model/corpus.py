"""Offline training corpus for the shipped tiny model: CPython's pydoc topics plus Debian licence texts.

Both sources exist on any Debian/Ubuntu box with Python, so the model can be rebuilt without a download.
Held-out documents (validation and demo text) are whole pydoc topics from one chapter (execution model)
plus the pdb manual, chosen so that no held-out passage is duplicated inside a training document.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

LICENSE_DIR = Path("/usr/share/common-licenses")
# Distinct licence files (GPL, LGPL, GFDL are symlinks to GPL-3, LGPL-3, GFDL-1.3 and are skipped).
LICENSES = (
    "Apache-2.0", "Artistic", "BSD", "CC0-1.0", "GFDL-1.2", "GFDL-1.3", "GPL-1", "GPL-2", "GPL-3",
    "LGPL-2", "LGPL-2.1", "LGPL-3", "MPL-1.1", "MPL-2.0",
)
# Held-out pydoc topics: the whole "execution model" chapter (execmodel contains naming and exceptions)
# and the pdb manual, about 5% of all characters.
HELDOUT_TOPICS = ("debugger", "execmodel", "exceptions", "naming")


class CorpusError(ValueError):
    """The offline corpus sources are missing or unreadable."""


def load_documents() -> list[tuple[str, str]]:
    """Return (doc_id, text) for every document, pydoc topics (sorted) then licences, in fixed order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # pragma: no cover - CPython always ships it
        raise CorpusError("pydoc_data.topics is not importable in this Python") from exc
    docs = [(f"pydoc:{k}", topics[k].strip() + "\n") for k in sorted(topics)]
    for name in LICENSES:
        path = LICENSE_DIR / name
        if not path.is_file():
            raise CorpusError(f"licence text {path} not found (Debian package base-files provides it)")
        docs.append((f"license:{name}", path.read_text(encoding="utf-8", errors="replace").strip() + "\n"))
    return docs


def split_documents(docs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Split documents into (train, heldout) by HELDOUT_TOPICS."""
    held = {f"pydoc:{k}" for k in HELDOUT_TOPICS}
    train = [d for d in docs if d[0] not in held]
    heldout = [d for d in docs if d[0] in held]
    if len(heldout) != len(held):
        raise CorpusError(f"held-out topics missing from pydoc_data: {sorted(held - {d[0] for d in heldout})}")
    return train, heldout


def corpus_digest(docs: list[tuple[str, str]]) -> str:
    """SHA-256 over doc ids and texts, to record exactly which text a model saw."""
    h = hashlib.sha256()
    for doc_id, text in docs:
        h.update(doc_id.encode())
        h.update(b"\0")
        h.update(text.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


