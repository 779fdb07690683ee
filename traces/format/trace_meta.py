"""A trace's metadata: the manifest's fields (model geometry, per-layer attention, token counts), its arrays'
names, shapes and paths, and the format's one error type. The layout is in ``traces.format``'s docstring."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from traces.reconstruction import ReconstructionError, ReconstructionPlan

FORMAT_NAME = "kvsim-trace"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
ATTENTION_KINDS = ("global", "sliding")
STORAGE_DTYPES = ("float16", "float32")
ARRAY_NAMES = ("q", "k", "v", "lse", "o")
WO = "wo"   # the optional output-projection array, present for all layers or none ("has_wo" in the manifest)
RECON = ("recon_q", "recon_k")   # the reconstruction pass's arrays, with ``TraceMeta.reconstruction`` (its plan)
RECON_H = "recon_h"   # its repeat tokens' hidden-state norms, optional ("has_recon_h" in the manifest)
_ARRAY_PATH = re.compile(r"^layers/\d{3}/(q|k|v|lse|o|wo|recon_q|recon_k|recon_h)\.npy$")


class TraceError(ValueError):
    """A trace directory is missing, malformed, tampered with, or inconsistent; the message names the file and field."""


@dataclass(frozen=True)
class LayerAttention:
    """One stored layer's attention as the model computes it: what "the full cache" means for that layer.

    ``kind`` is ``global`` (every earlier token) or ``sliding``: each query sees the last ``window`` tokens,
    itself included (Hugging Face's ``sliding_window``; Gemma-3: 512). ``rope_theta`` is the layer's RoPE base
    (Gemma-3: 1e6 on global, 1e4 on sliding layers); 0.0 means the layer has no RoPE, None that the trace does
    not say (version-1 traces). ``scale`` multiplies q.k before the softmax (Gemma-3:
    ``query_pre_attn_scalar ** -0.5``); ``softcap`` is a tanh soft-cap of the logits (Gemma-2) or None.
    """

    kind: str = "global"
    window: int | None = None
    rope_theta: float | None = None
    scale: float = 0.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise TraceError(f"attention.kind must be one of {ATTENTION_KINDS}, got {self.kind!r}")
        if self.kind == "sliding":
            if not isinstance(self.window, (int, np.integer)) or isinstance(self.window, bool) or self.window < 2:
                raise TraceError(f"a sliding layer needs an integer window >= 2, got {self.window!r}")
        elif self.window is not None:
            raise TraceError(f"a global layer has no window, got window={self.window!r}")
        if self.rope_theta is not None and (not np.isfinite(self.rope_theta) or self.rope_theta < 0):
            raise TraceError(f"attention.rope_theta must be a finite number >= 0 or null, got {self.rope_theta!r}")
        if not np.isfinite(self.scale) or self.scale < 0:
            raise TraceError(f"attention.scale must be a finite number >= 0, got {self.scale!r}")
        if self.softcap is not None and (not np.isfinite(self.softcap) or self.softcap <= 0):
            raise TraceError(f"attention.softcap must be a positive number or null, got {self.softcap!r}")

    @property
    def sliding(self) -> bool:
        return self.kind == "sliding"

    def describe(self) -> str:
        """``global`` / ``sliding 512``, with the RoPE base when known."""
        kind = f"sliding {self.window}" if self.sliding else "global"
        if self.rope_theta is None:
            return kind
        return kind + (", no RoPE" if self.rope_theta == 0 else f", RoPE {self.rope_theta:g}")


@dataclass(frozen=True)
class ModelInfo:
    """The attention geometry of the model a trace comes from (q/k are stored post-RoPE)."""

    model_id: str
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    rope: str = "rope"
    layer_ids: tuple[int, ...] = ()
    hidden_size: int = 0   # the residual width (W_O's rows); 0 when unknown (a trace without W_O arrays)
    #: per stored layer (aligned with ``layer_ids``); empty means every layer global, RoPE base unknown
    attention: tuple[LayerAttention, ...] = ()

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_q_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise TraceError(f"model.{name} must be a positive integer, got {value!r}")
        if self.n_q_heads % self.n_kv_heads:
            raise TraceError(
                f"model.n_q_heads ({self.n_q_heads}) must be a multiple of model.n_kv_heads ({self.n_kv_heads}) (GQA)"
            )
        if not isinstance(self.hidden_size, (int, np.integer)) or self.hidden_size < 0:
            raise TraceError(f"model.hidden_size must be a non-negative integer, got {self.hidden_size!r}")
        ids = tuple(int(i) for i in (self.layer_ids or range(self.n_layers)))
        if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
            raise TraceError(f"model.layer_ids must be distinct non-negative integers, got {ids}")
        object.__setattr__(self, "layer_ids", ids)
        attn = tuple(a if isinstance(a, LayerAttention) else LayerAttention(**a) for a in self.attention)
        if not attn:
            attn = (LayerAttention(rope_theta=0.0 if self.rope == "none" else None),) * len(ids)
        if len(attn) != len(ids):
            raise TraceError(f"model.attention has {len(attn)} entries for {len(ids)} stored layers")
        object.__setattr__(self, "attention", attn)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA)."""
        return self.n_q_heads // self.n_kv_heads

    @property
    def hybrid(self) -> bool:
        """True when some stored layer slides over a window (Gemma-2/3, Mistral-style local layers)."""
        return any(a.sliding for a in self.attention)


@dataclass(frozen=True)
class TraceMeta:
    """Everything about a trace except its arrays."""

    model: ModelInfo
    n_tokens: int
    n_prompt: int
    dtype: str = "float32"
    softmax_scale: float = 0.0
    kind: str = "qkv"
    source: dict[str, Any] = field(default_factory=dict)
    #: KVzip's context-reconstruction pass (``traces.reconstruction.ReconstructionPlan``) when the trace has it
    reconstruction: Any = None

    def __post_init__(self) -> None:
        if self.reconstruction is not None and self.reconstruction.n_prompt != self.n_prompt:
            raise TraceError(f"reconstruction covers {self.reconstruction.n_prompt} prompt tokens, the trace has "
                             f"{self.n_prompt}")
        if self.dtype not in STORAGE_DTYPES:
            raise TraceError(f"dtype must be one of {STORAGE_DTYPES}, got {self.dtype!r}")
        if not (1 <= self.n_tokens):
            raise TraceError(f"n_tokens must be >= 1, got {self.n_tokens}")
        if not (0 <= self.n_prompt <= self.n_tokens):
            raise TraceError(f"n_prompt must be in [0, n_tokens={self.n_tokens}], got {self.n_prompt}")
        if self.softmax_scale == 0.0:
            object.__setattr__(self, "softmax_scale", float(self.model.head_dim) ** -0.5)
        if not np.isfinite(self.softmax_scale) or self.softmax_scale <= 0:
            raise TraceError(f"softmax_scale must be a positive finite number, got {self.softmax_scale}")
        attn = tuple(a if a.scale > 0 else replace(a, scale=self.softmax_scale) for a in self.model.attention)
        object.__setattr__(self, "model", replace(self.model, attention=attn))

    def attention(self, i: int) -> LayerAttention:
        """The attention of the i-th stored layer (file order)."""
        return self.model.attention[i]

    def expected_shape(self, name: str) -> tuple[int, ...]:
        """Shape an array of this trace must have."""
        m, t = self.model, self.n_tokens
        r = self.reconstruction.n_tokens if self.reconstruction is not None else 0
        return {
            "recon_q": (r, m.n_q_heads, m.head_dim),
            "recon_k": (r, m.n_kv_heads, m.head_dim),
            RECON_H: (r,),
            "q": (t, m.n_q_heads, m.head_dim),
            "k": (t, m.n_kv_heads, m.head_dim),
            "v": (t, m.n_kv_heads, m.head_dim),
            "lse": (t, m.n_q_heads),
            "o": (t, m.n_q_heads, m.head_dim),
            WO: (m.hidden_size, m.n_q_heads * m.head_dim),
        }[name]

    def expected_dtype(self, name: str) -> np.dtype:
        return np.dtype("float32") if name in ("lse", "o", WO, RECON_H) else np.dtype(self.dtype)

    def to_json(self) -> dict[str, Any]:
        d = asdict(replace(self, reconstruction=None))
        d["reconstruction"] = None if self.reconstruction is None else self.reconstruction.to_json()
        d["model"]["layer_ids"] = list(self.model.layer_ids)
        d["model"]["attention"] = [asdict(a) for a in self.model.attention]
        return d

    @staticmethod
    def from_json(d: dict[str, Any], where: str = "manifest.json") -> "TraceMeta":
        try:
            attention = d["model"].get("attention", ())
            if not isinstance(attention, (list, tuple)) or not all(isinstance(a, dict) for a in attention):
                raise TraceError(f"{where}: field 'model.attention' must be a list of objects")
            model = ModelInfo(**{**d["model"], "layer_ids": tuple(d["model"].get("layer_ids", ())),
                                 "attention": tuple(LayerAttention(**a) for a in attention)})
            return TraceMeta(
                model=model,
                n_tokens=int(d["n_tokens"]),
                n_prompt=int(d["n_prompt"]),
                dtype=str(d["dtype"]),
                softmax_scale=float(d["softmax_scale"]),
                kind=str(d.get("kind", "qkv")),
                source=dict(d.get("source", {})),
                reconstruction=_plan(d.get("reconstruction")),
            )
        except KeyError as e:
            raise TraceError(f"{where}: missing field {e.args[0]!r}") from None
        except TypeError as e:
            raise TraceError(f"{where}: malformed field: {e}") from None
        except TraceError as e:
            raise TraceError(f"{where}: {e}") from None


def _plan(d: Any) -> Any:
    """The manifest's reconstruction plan, or None."""
    if d is None:
        return None
    try:
        return ReconstructionPlan.from_json(d)
    except ReconstructionError as e:
        raise TraceError(str(e)) from None


class LayerArrays(NamedTuple):
    """One layer's arrays; lse/o are the full-cache reference, wo the output projection and recon_q/recon_k
    KVzip's reconstruction pass (``traces.reconstruction``), each may be absent."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    lse: np.ndarray | None = None
    o: np.ndarray | None = None
    wo: np.ndarray | None = None
    recon_q: np.ndarray | None = None
    recon_k: np.ndarray | None = None
    recon_h: np.ndarray | None = None


def array_path(layer_index: int, name: str) -> str:
    """Relative path of an array inside a trace directory."""
    return f"layers/{layer_index:03d}/{name}.npy"


def is_array_path(rel: str) -> bool:
    """Whether ``rel`` names a trace array (``layers/<i:03d>/<name>.npy`` of a known array name)."""
    return _ARRAY_PATH.match(rel) is not None
