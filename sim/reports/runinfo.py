"""What was run, where and when: the facts a result's page header states (kvsim version, date, machine, and for
each trace its model, tokens, layers kept, attention and text).

A results store records the facts of every trace swept into it (``<store>/_traces/<trace_id>.json``; Parquet
readers skip names starting with ``_``, so the store still reads as one dataset), so that ``kvsim report`` can say
which model and text a table comes from long after the sweep, without the trace itself.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from sim.reports.plotting import current_umask
from traces.format import Trace, load_trace

FACTS_DIR = "_traces"
"""Sub-folder of a results store holding one JSON of facts per trace id (``_``: ignored by Parquet readers)."""


def kvsim_version() -> str:
    """The installed kvsim version, with the git commit when running from a checkout (``0.1.0 (git 950ac45)``)."""
    try:
        text = version("kvsim")
    except PackageNotFoundError:
        text = "unknown"
    root = Path(__file__).resolve().parents[1]
    if (root / ".git").exists():
        try:
            sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, timeout=5).stdout.strip()
            text += f" (git {sha})" if sha else ""
        except (OSError, subprocess.SubprocessError):
            pass
    return text


def now() -> str:
    """The current time, UTC, to the minute (``2025-01-31 14:05 UTC``)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """One line: OS, CPU, cores and Python (``Linux 6.1 x86_64, AMD EPYC 7B13, 2 cores, Python 3.12.3``)."""
    return (f"{platform.system()} {platform.release().split('-')[0]} {platform.machine()}, {cpu_name()}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}")


def _ranges(ids: list[int]) -> str:
    """``0, 10, 19, 29`` or ``0-29`` for a run."""
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(map(str, ids))


def trace_facts(trace: Trace) -> dict[str, Any]:
    """What a reader needs to know about a trace: its name and id, model, tokens, which of the model's layers it
    keeps and how they attend (global / sliding window), and the text it was recorded on."""
    from sim.experiments.specs import trace_id, trace_name   # the policy registry stays out of reading results

    meta, m = trace.meta, trace.meta.model
    src = meta.source or {}
    kinds = [meta.attention(i) for i in range(trace.n_layers)]
    n_glob = sum(not a.sliding for a in kinds)
    windows = sorted({a.window for a in kinds if a.sliding})
    attention = f"{n_glob} global" + (f" + {len(kinds) - n_glob} sliding-window ({'/'.join(map(str, windows))})"
                                      if windows else "")
    if meta.kind == "synthetic":
        text = f"synthetic ({src.get('kind', '?')}, seed {src.get('seed', '?')})"
    else:
        text = str(src.get("text_id") or src.get("text") or "not recorded")
    return {"name": trace_name(trace), "trace_id": trace_id(trace), "model": m.model_id,
            "n_tokens": int(meta.n_tokens), "n_prompt": int(meta.n_prompt),
            "n_decode": int(meta.n_tokens - meta.n_prompt), "layers": list(m.layer_ids), "n_model_layers": m.n_layers,
            "global_layers": [int(lid) for lid, a in zip(m.layer_ids, kinds) if not a.sliding],
            "attention": attention, "heads": f"{m.n_q_heads} query / {m.n_kv_heads} KV heads, d {m.head_dim}",
            "text": text, "decode": str(src.get("decode", meta.kind)), "dtype": meta.dtype}


def describe_tokens(facts: dict[str, Any]) -> str:
    """``1,024 (512 prompt + 512 decode)``."""
    return f"{facts['n_tokens']:,} ({facts['n_prompt']:,} prompt + {facts['n_decode']:,} decode)"


def describe_layers(facts: dict[str, Any]) -> str:
    """``0, 10, 19, 29 of 30 (4 global)``."""
    kept = len(facts["layers"])
    total = facts["n_model_layers"]
    which = "all" if kept == total and facts["layers"] == list(range(total)) else _ranges(facts["layers"])
    return f"{which} of {total} ({facts['attention']})"


def save_trace_facts(store_root: str | os.PathLike, trace: Trace) -> Path:
    """Write the trace's facts into a results store (atomically; an existing file is kept as is)."""
    facts = trace_facts(trace)
    folder = Path(store_root) / FACTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{facts['trace_id']}.json"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(prefix=".facts-", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(facts, f, indent=1)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    return path


def save_ref_facts(store_root: str | os.PathLike, ref) -> Path:
    """`save_trace_facts` of a `sim.experiments.executors.TraceRef`: a trace directory's manifest is read without
    verifying its arrays again (cheap); a synthetic trace is generated (or taken from this process's cache)."""
    spec = Path(ref.spec)
    trace = load_trace(spec, verify=False) if spec.is_dir() else ref.open()[0]
    return save_trace_facts(store_root, trace)


def load_trace_facts(store_root: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Every trace's facts recorded in a results store, by trace id (empty for a store written before)."""
    out = {}
    for path in sorted((Path(store_root) / FACTS_DIR).glob("*.json")):
        try:
            facts = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        out[facts.get("trace_id", path.stem)] = facts
    return out
