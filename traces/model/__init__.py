"""kvsim's shipped tiny Llama-style model (GQA, RoPE) and the real held-out text used by demos.

Everything here is local: weights, tokenizer and text are committed under traces/model/ (see MODEL_CARD.md).
Models are resolved by traces.models (the registry); this module only adds the shipped text and a one-call
recorder of a teacher-forced trace of any registered model on it.
"""
from __future__ import annotations

from pathlib import Path

from traces.models import SHIPPED_DIR, ModelError, load_model, model_id
from traces.recorder import record_trace
from traces.texts import DEFAULT_TEXT_ID, HELDOUT_TEXT, SHIPPED_TEXTS

HERE = Path(__file__).resolve().parent
MODEL_DIR = SHIPPED_DIR


class TextError(ValueError):
    """A --text that is neither a shipped text's name nor a readable file."""


def read_text(spec: str | None) -> tuple[str, str]:
    """(text, text id) of a shipped text's name (None = 'default'; see SHIPPED_TEXTS) or of a UTF-8 file; names
    joined by '+' (``default+idle``) give the texts one after the other (a longer real filler)."""
    spec = spec or "default"
    if "+" in spec and all(part in SHIPPED_TEXTS for part in spec.split("+")):
        parts = [read_text(part) for part in spec.split("+")]
        return "\n\n".join(t for t, _ in parts), "+".join(i for _, i in parts)
    if spec in SHIPPED_TEXTS:
        path, text_id = SHIPPED_TEXTS[spec]
        return path.read_text(encoding="utf-8"), text_id
    path = Path(spec)
    if not path.is_file():
        raise TextError(f"--text {spec!r}: not a shipped text ({', '.join(SHIPPED_TEXTS)}) and no such file")
    return path.read_text(encoding="utf-8", errors="replace"), path.name


def default_model_path() -> Path:
    """Folder of the shipped model (config.json, model.safetensors, tokenizer.json)."""
    if not (MODEL_DIR / "model.safetensors").is_file():
        raise ModelError(f"shipped model missing at {MODEL_DIR}; rebuild with python -m traces.model.train")
    return MODEL_DIR


def load_default_model(device: str = "cpu", model: str = "tiny"):
    """(model, tokenizer) of a registered model (the shipped one by default), in float32 eval mode."""
    return load_model(model, device=device, torch_dtype="float32")


def default_text() -> str:
    """Real English text none of kvsim's models trained on (held-out CPython pydoc topics)."""
    return read_text("default")[0]


def record_default_trace(out_dir: str | Path, n_prompt: int = 512, n_decode: int = 512, *,
                         layers: tuple[int, ...] | None = None, dtype: str = "float32", overwrite: bool = False,
                         progress: bool = False, single_pass: bool = True, model: str = "tiny",
                         reconstruction_chunk: int | None = None) -> Path:
    """Record a teacher-forced trace of ``model`` (any spec traces.models resolves) on the default text.

    single_pass (default) runs one causal forward over all tokens (seconds for 1k tokens on a CPU); False
    decodes token by token through the KV cache (same attention, slower). ``reconstruction_chunk``: also record
    KVzip's context-reconstruction pass (``traces.recorder.record_trace``)."""
    import torch

    torch.manual_seed(0)
    net, tok = load_default_model(model=model)
    ids = tok(default_text(), verbose=False)["input_ids"]
    res = record_trace(net, ids, out_dir, n_prompt=n_prompt, n_decode=n_decode, tokenizer=tok, layers=layers,
                       dtype=dtype, teacher_forced=True, model_id=model_id(model),
                       source={"text_id": DEFAULT_TEXT_ID}, progress=progress, overwrite=overwrite,
                       single_pass=single_pass, reconstruction_chunk=reconstruction_chunk)
    return res.path

