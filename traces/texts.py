"""The real texts kvsim ships (under traces/model/data), by name: importable without numpy or torch, since the
CLI lists them in its help."""
from __future__ import annotations

from pathlib import Path

_DATA = Path(__file__).resolve().parent / "model" / "data"
HELDOUT_TEXT = _DATA / "heldout.txt"
DEFAULT_TEXT_ID = "kvsim-heldout:pydoc(debugger,exceptions,execmodel,naming)"
#: shipped texts by name: (file, text id). 'default' is the held-out pydoc chapters; 'idle' is a second,
#: independent real text (the IDLE chapter of the Python 3.12 library reference, PSF licence, as plain text)
#: so that anything fitted on one text can be judged on another.
SHIPPED_TEXTS = {
    "default": (HELDOUT_TEXT, DEFAULT_TEXT_ID),
    "idle": (_DATA / "idle_help.txt", "python-docs-3.12:library/idle"),
}
