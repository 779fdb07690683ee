"""Helpers shared by benchmarks: timing, machine description, JSON output."""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """The machine and the thread environment a result was measured in (pools as this process has them)."""
    from sim.replay.threads import environment_record

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "load_avg_1min": os.getloadavg()[0],
            "threads": environment_record()}


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a plain user shell for a ``kvsim`` subprocess: this one without any thread variable
    (so the CLI's own thread budgeting is what gets measured), plus ``extra``."""
    from sim.replay.threads import KVSIM_THREADS, THREAD_ENV_VARS

    drop = {*THREAD_ENV_VARS, "NUMBA_NUM_THREADS", KVSIM_THREADS}
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return {**env, **extra}


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write benchmarks/results/<name>.json atomically (`traces.format.atomic_write_text`)."""
    from traces.format import atomic_write_text

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    atomic_write_text(path, json.dumps(payload, indent=1, default=float))
    return path


def add_real_trace_args(ap: Any, *, layers: str = "0,10,20,29") -> None:
    """``--trace DIR`` (a recorded real-model trace) and ``--layers`` (the subset of its layers to evaluate)."""
    ap.add_argument("--trace", default=None,
                    help="a recorded real-model trace directory (default: record SmolLM2-135M through the model "
                         "registry, 512 prompt + 512 teacher-forced tokens of the shipped held-out text)")
    ap.add_argument("--layers", default=layers,
                    help=f"comma-separated layers of the real trace to evaluate, or 'all' (default {layers})")
    ap.add_argument("--real-only", action="store_true",
                    help="evaluate the real trace alone (no synthetic traces) and name the result after it: "
                         "<name>_<model>_<context>k.json (a long trace's run beside the default one)")


def model_name(trace: Any) -> str:
    """The registry name of a trace's model (``smollm2-135m``), else its recorded model id."""
    from traces.models import MODELS

    mid = trace.meta.model.model_id
    return next((m.name for m in MODELS.values() if mid in (m.name, m.title)), mid)


def trace_fields(trace: Any) -> dict[str, Any]:
    """Top-level fields of a result measured on ``trace``: model, context tokens, its prompt/decode split and the
    layers evaluated."""
    meta = trace.meta
    return {"model": model_name(trace), "context_tokens": int(meta.n_tokens), "n_prompt": int(meta.n_prompt),
            "n_decode": int(meta.n_tokens - meta.n_prompt), "layers": [int(x) for x in meta.model.layer_ids]}


def length_result_name(base: str, model: str, n_tokens: int) -> str:
    """``base_<model>_<context>k`` (eval_d2o_smollm2-135m_8k): the name of a result measured at one context length."""
    return f"{base}_{model}_{max(1, round(n_tokens / 1024))}k"


def result_name(base: str, trace: Any, real_only: bool) -> str:
    """``base``, or with ``--real-only`` `length_result_name` of the trace, so a run on a long trace never overwrites
    the default one."""
    return length_result_name(base, model_name(trace), trace.meta.n_tokens) if real_only else base


def real_model_trace(args: Any, tmp: Path, *, n_prompt: int = 512, n_decode: int = 512):
    """The real-model trace the evaluations use: ``args.trace`` (restricted to ``args.layers`` by
    `traces.layer_subset.select_layers`), or SmolLM2-135M recorded through the model registry (fetched and converted
    on first use) on the shipped held-out text."""
    from traces.format import load_trace
    from traces.layer_subset import select_layers

    if args.trace is None:
        from traces.model import record_default_trace

        layers = None if args.layers == "all" else tuple(int(x) for x in args.layers.split(","))
        return load_trace(record_default_trace(tmp / "real", n_prompt=n_prompt, n_decode=n_decode, layers=layers,
                                               model="smollm2-135m"))
    trace = load_trace(args.trace)
    if args.layers == "all":
        return trace
    return select_layers(trace, [int(x) for x in args.layers.split(",")])


def kvsim_command() -> list[str]:
    """How a user starts kvsim: the installed ``kvsim`` script beside this interpreter (else ``-m sim.cli``)."""
    script = Path(sys.executable).with_name("kvsim")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "sim.cli"]


def timed(args: list[str], env: dict[str, str] | None = None, timeout: float = 7200) -> dict:
    """Run ``kvsim ARGS`` under /usr/bin/time in ``env`` (default: a plain user shell, ``user_env()``): wall seconds,
    peak RSS in GB and stdout; a failed run raises with its stderr's tail."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        cmd = ["/usr/bin/time", "-f", "%e %M", "-o", tf.name, *kvsim_command(), *args]
        proc = subprocess.run(cmd, env=env or user_env(), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"kvsim {' '.join(args)} failed: {proc.stderr[-3000:]}")
        secs, kb = tf.read().split()[-2:]
    return {"seconds": float(secs), "peak_rss_gb": int(kb) / 1e6, "stdout": proc.stdout}


def cli_seconds(args: list[str], env: dict[str, str] | None = None) -> float:
    """Wall seconds of one ``kvsim ARGS`` run in ``env`` (default: a plain user shell, ``user_env()``)."""
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.run([*kvsim_command(), *args], env=env or user_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"kvsim {' '.join(args)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return wall
