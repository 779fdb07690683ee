"""kvsim's shipped tiny Llama-style model (GQA, RoPE) and the real held-out text used by demos.

Everything is local: weights, tokenizer and text are committed under traces/model/. See MODEL_CARD.md.
"""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "kvsim-tiny-llama"
HELDOUT_TEXT = HERE / "data" / "heldout.txt"
DEFAULT_TEXT_ID = "kvsim-heldout:pydoc(debugger,exceptions,execmodel,naming)"


def default_model_path() -> Path:
    """Folder of the shipped model (config.json, model.safetensors, tokenizer.json)."""
    if not (MODEL_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(f"shipped model missing at {MODEL_DIR}; rebuild with python -m traces.model.train")
    return MODEL_DIR


def load_default_model(device: str = "cpu"):
    """(model, tokenizer) of the shipped model, from local files only, in float32 eval mode."""
    from traces.recorder import load_model

    model, tok = load_model(str(default_model_path()), device=device, torch_dtype="float32")
    model.eval()
    return model, tok


def default_text() -> str:
    """Real English text the model never trained on (held-out CPython pydoc topics)."""
    return HELDOUT_TEXT.read_text(encoding="utf-8")


def record_default_trace(out_dir: str | Path, n_prompt: int = 512, n_decode: int = 512, *,
                         layers: tuple[int, ...] | None = None, dtype: str = "float32", overwrite: bool = False,
                         progress: bool = False, single_pass: bool = True) -> Path:
    """Record a teacher-forced trace of the shipped model on the default text; returns the trace folder.

    single_pass (default) runs one causal forward over all tokens (about a second for 1k tokens on one
    CPU thread); False decodes token by token through the KV cache (same attention, slower)."""
    import torch

    from traces.recorder import record_trace

    torch.manual_seed(0)
    model, tok = load_default_model()
    ids = tok(default_text(), verbose=False)["input_ids"]
    res = record_trace(model, ids, out_dir, n_prompt=n_prompt, n_decode=n_decode, tokenizer=tok, layers=layers,
                       dtype=dtype, teacher_forced=True, model_id="kvsim-tiny-llama",
                       source={"text_id": DEFAULT_TEXT_ID}, progress=progress, overwrite=overwrite,
                       single_pass=single_pass)
    return res.path
