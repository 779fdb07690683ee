"""On-disk trace format: a directory of memory-mappable .npy arrays plus a checksummed manifest.

Layout (format version 2)::

    manifest.json               format, version, model config (with each stored layer's attention: global or
                                sliding with its window, RoPE base, logit scale, soft-cap), dtype, token
                                counts, checksums
    layers/<i:03d>/q.npy        [T, Hq, d]   post-RoPE queries
    layers/<i:03d>/k.npy        [T, Hkv, d]  post-RoPE keys
    layers/<i:03d>/v.npy        [T, Hkv, d]  values
    layers/<i:03d>/lse.npy      [T, Hq]      float32 full causal attention log-sum-exp (optional)
    layers/<i:03d>/o.npy        [T, Hq, d]   float32 full causal attention output (optional)
    layers/<i:03d>/wo.npy       [hidden, Hq*d] float32 the layer's attention output projection W_O, as torch's
                                             Linear stores o_proj.weight (optional; for W_O-aware metrics/policies)
    layers/<i:03d>/recon_q.npy  [R, Hq, d]   post-RoPE queries of KVzip's context-reconstruction pass (optional;
    layers/<i:03d>/recon_k.npy  [R, Hkv, d]  its keys; both with the plan in the manifest, `traces.reconstruction`)
    layers/<i:03d>/recon_h.npy  [R]          the repeat tokens' hidden-state norms at the attention's input
                                             (optional, float32; "has_recon_h": KVzip+, policies/kvzip_plus.py)
    tokens.parquet              position, token_id, text, is_prompt, top1_id, nll (optional)

Writes are atomic: everything goes into a sibling temp directory that is renamed into place only
after the manifest (written last) is complete, so a killed writer never leaves a half-valid trace.

Version 1 (before per-layer attention) still loads: its layers read as global attention at the trace's one
softmax scale, with the RoPE base unknown (``LayerAttention.rope_theta`` None) unless the trace has no RoPE.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import numpy as np

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
_CHUNK_BYTES = 1 << 24


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
    from traces.reconstruction import ReconstructionError, ReconstructionPlan

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


def _sha256_and_finite(path: Path, arr: np.ndarray) -> tuple[str, bool]:
    """One streaming pass: SHA-256 of the file bytes and whether the array holds only finite values."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK_BYTES), b""):
            h.update(chunk)
    flat = arr.reshape(-1)
    step = max(1, _CHUNK_BYTES // max(1, flat.itemsize))
    finite = all(bool(np.isfinite(flat[i : i + step]).all()) for i in range(0, flat.size, step))
    return h.hexdigest(), finite


def _atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_suffix(".npy.tmp")
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a binary file via a temp file in the same folder (created if missing) and os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write a text file via temp file + rename so readers never see a partial file: kvsim's one atomic text (and
    JSON) writer. The file gets the permissions a plain ``open(path, "w")`` would give it (mkstemp's are 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class TraceWriter:
    """Writes a trace layer by layer into a temp directory and renames it into place on success.

    Use as a context manager; an exception (or a kill) leaves no directory at ``out_dir``.
    """

    def __init__(self, out_dir: str | os.PathLike, meta: TraceMeta, *, compute_reference: bool = True,
                 overwrite: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.meta = meta
        self.compute_reference = compute_reference
        if self.out_dir.exists() and not overwrite:
            raise FileExistsError(f"{self.out_dir} already exists (pass overwrite=True to replace it)")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self._tmp: Path | None = None
        self._entries: dict[str, dict[str, Any]] = {}
        self._n_layers_written = 0
        self._present: dict[str, bool] = {}   # optional array group -> present in the first layer
        self._tokens_written = False

    def __enter__(self) -> "TraceWriter":
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.tmp-", dir=self.out_dir.parent))
        return self

    def add_layer(self, arrays: LayerArrays) -> None:
        """Validate and write the next layer (in ``meta.model.layer_ids`` order)."""
        from traces.reference import full_attention_reference

        assert self._tmp is not None, "TraceWriter must be used as a context manager"
        i = self._n_layers_written
        if i >= len(self.meta.model.layer_ids):
            raise TraceError(f"too many layers: manifest declares {len(self.meta.model.layer_ids)}")
        lse, o = arrays.lse, arrays.o
        if (lse is None) != (o is None):
            raise TraceError(f"layer {i}: give both lse and o, or neither")
        if lse is None and self.compute_reference:
            attn = self.meta.attention(i)
            lse, o = full_attention_reference(arrays.q, arrays.k, arrays.v, attn.scale, window=attn.window)
        has_ref = self._same_in_every_layer("reference lse/o", lse is not None, i)
        has_wo = self._same_in_every_layer("the W_O array", arrays.wo is not None, i)
        if has_wo and self.meta.model.hidden_size < 1:
            raise TraceError(f"layer {i}: a W_O array needs model.hidden_size (its number of rows) in the manifest")
        has_recon = self.meta.reconstruction is not None
        if (arrays.recon_q is not None) != has_recon or (arrays.recon_k is not None) != has_recon:
            raise TraceError(f"layer {i}: recon_q and recon_k go together, in every layer of a trace whose "
                             "manifest has a reconstruction plan, and in no other")
        has_recon_h = self._same_in_every_layer("the reconstruction's hidden norms", arrays.recon_h is not None, i)
        if has_recon_h and not has_recon:
            raise TraceError(f"layer {i}: recon_h (the reconstruction pass's hidden norms) without a reconstruction "
                             "plan in the manifest")
        (self._tmp / f"layers/{i:03d}").mkdir(parents=True, exist_ok=True)
        named = {"q": arrays.q, "k": arrays.k, "v": arrays.v}
        if has_ref:
            named.update(lse=lse, o=o)
        if has_wo:
            named[WO] = arrays.wo
        if has_recon:
            named.update(recon_q=arrays.recon_q, recon_k=arrays.recon_k)
        if has_recon_h:
            named[RECON_H] = np.asarray(arrays.recon_h, np.float32)
        for name, arr in named.items():
            arr = np.asarray(arr)
            where = f"layer {i} array {name!r}"
            want = self.meta.expected_shape(name)
            if arr.shape != want:
                raise TraceError(f"{where}: shape {arr.shape}, expected {want}")
            if not np.issubdtype(arr.dtype, np.floating):
                raise TraceError(f"{where}: dtype {arr.dtype} is not floating point")
            arr = arr.astype(self.meta.expected_dtype(name), copy=False)
            rel = array_path(i, name)
            path = self._tmp / rel
            _atomic_save_npy(path, arr)
            digest, finite = _sha256_and_finite(path, arr)
            if not finite:
                raise TraceError(f"{where}: contains NaN or inf")
            self._entries[rel] = {"sha256": digest, "shape": list(arr.shape), "dtype": arr.dtype.str}
        self._n_layers_written += 1

    def _same_in_every_layer(self, what: str, present: bool, i: int) -> bool:
        """An optional array group is in every layer or in none; returns ``present``."""
        if self._present.setdefault(what, present) != present:
            raise TraceError(f"layer {i}: {what} must be present for all layers or none")
        return present

    def set_tokens(self, tokens: "Any") -> None:
        """Write tokens.parquet (a pandas DataFrame with one row per position)."""
        import pandas as pd

        assert self._tmp is not None, "TraceWriter must be used as a context manager"
        if not isinstance(tokens, pd.DataFrame):
            raise TraceError("tokens must be a pandas DataFrame")
        if len(tokens) != self.meta.n_tokens:
            raise TraceError(f"tokens.parquet: {len(tokens)} rows, expected n_tokens={self.meta.n_tokens}")
        path = self._tmp / "tokens.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        tokens.to_parquet(tmp, index=False)
        os.replace(tmp, path)
        self._entries["tokens.parquet"] = {"sha256": _sha256_and_finite(path, np.zeros(0))[0]}
        self._tokens_written = True

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self._tmp is not None
        try:
            if exc_type is not None:
                return
            n = len(self.meta.model.layer_ids)
            if self._n_layers_written != n:
                raise TraceError(f"wrote {self._n_layers_written} layers, manifest declares {n}")
            manifest = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                **self.meta.to_json(),
                "has_reference": self._present.get("reference lse/o", False),
                "has_wo": self._present.get("the W_O array", False),
                "has_recon_h": self._present.get("the reconstruction's hidden norms", False),
                "arrays": self._entries,
            }
            atomic_write_text(self._tmp / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True))
            if self.out_dir.exists():
                old = self.out_dir.with_name(f".{self.out_dir.name}.old-{os.getpid()}")
                os.replace(self.out_dir, old)
                os.replace(self._tmp, self.out_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(self._tmp, self.out_dir)
            self._tmp = None
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)


def write_trace(out_dir: str | os.PathLike, meta: TraceMeta, layers: Iterable[LayerArrays], tokens: Any = None, *,
                compute_reference: bool = True, overwrite: bool = False) -> Path:
    """Write a whole trace atomically and return its directory."""
    with TraceWriter(out_dir, meta, compute_reference=compute_reference, overwrite=overwrite) as w:
        for arrays in layers:
            w.add_layer(arrays)
        if tokens is not None:
            w.set_tokens(tokens)
    return Path(out_dir)


class Trace:
    """A loaded trace: metadata plus lazily memory-mapped layer arrays."""

    def __init__(self, path: Path, meta: TraceMeta, has_reference: bool, entries: dict[str, dict[str, Any]],
                 has_wo: bool = False, has_recon_h: bool = False):
        self.path = path
        self.meta = meta
        self.has_reference = has_reference
        self.has_wo = has_wo
        self.has_recon_h = has_recon_h
        self._entries = entries

    @property
    def n_layers(self) -> int:
        return len(self.meta.model.layer_ids)

    @property
    def has_reconstruction(self) -> bool:
        """Whether ``reconstruction`` can answer: the trace recorded the pass, or is synthetic (derives one)."""
        return self.meta.reconstruction is not None or self.meta.kind == "synthetic"

    def layer_digest(self, i: int) -> str | None:
        """A SHA-256 over the manifest's checksums of every array of the i-th stored layer: names the layer's
        content (tables derived from it are cached under it, ``sim.replay.trace_tables``); None for a trace in memory."""
        prefix = array_path(i, "")[:-len(".npy")]
        digests = sorted((rel, e["sha256"]) for rel, e in self._entries.items() if rel.startswith(prefix))
        if not digests:
            return None
        return hashlib.sha256(repr((self.meta.n_tokens, self.meta.n_prompt, digests)).encode()).hexdigest()

    def layer(self, i: int) -> LayerArrays:
        """Memory-mapped arrays of the i-th stored layer (file order, not model layer id)."""
        if not 0 <= i < self.n_layers:
            raise IndexError(f"layer {i} out of range: trace has {self.n_layers} layers")
        load = lambda name: np.load(self.path / array_path(i, name), mmap_mode="r", allow_pickle=False)
        ref = (load("lse"), load("o")) if self.has_reference else (None, None)
        recon = (load("recon_q"), load("recon_k")) if self.meta.reconstruction is not None else (None, None)
        return LayerArrays(load("q"), load("k"), load("v"), *ref, load(WO) if self.has_wo else None, *recon,
                           load(RECON_H) if self.has_recon_h else None)

    def reconstruction(self, i: int, chunk_size: int | None = None) -> tuple[Any, np.ndarray, np.ndarray]:
        """KVzip's context-reconstruction pass of the i-th stored layer: (plan, recon_q [R, Hq, d],
        recon_k [R, Hkv, d]). A synthetic trace derives one from its prompt (each chunk reread verbatim,
        ``traces.reconstruction.synthetic_reconstruction``); a recorded trace without it is an error naming the
        option that records it. ``chunk_size``: the synthetic pass's chunks (default kvpress's)."""
        plan = self.meta.reconstruction
        if plan is not None:
            la = self.layer(i)
            return plan, la.recon_q, la.recon_k
        if self.meta.kind == "synthetic":
            from traces.reconstruction import DEFAULT_CHUNK, synthetic_reconstruction

            la = self.layer(i)
            return synthetic_reconstruction(la.q, la.k, self.meta.n_prompt, chunk_size or DEFAULT_CHUNK)
        raise TraceError(f"trace {self.path} has no context-reconstruction pass (KVzip's scores come from it); "
                         "record it again with `kvsim record --kvzip`")


    def reconstruction_hidden_norms(self, i: int) -> np.ndarray:
        """The i-th stored layer's hidden-state norms of the reconstruction pass's repeat tokens [R] (KVzip+), or
        TraceError naming how to record them."""
        if self.meta.reconstruction is None or not self.has_recon_h:
            raise TraceError(f"{self.path}: no hidden-state norms of KVzip's reconstruction pass (KVzip+ needs them): "
                             "record the trace again with `kvsim record --kvzip` (kvsim records them since its "
                             "KVzip+ support)")
        return self.layer(i).recon_h
    def wo(self) -> list[np.ndarray]:
        """Every layer's output projection W_O [hidden, Hq*d]; a clear error when the trace was recorded without."""
        if not self.has_wo:
            raise TraceError(f"trace {self.path} has no W_O (o_proj) arrays; record it again with `kvsim record` "
                             "(which stores them) to use W_O-aware metrics or policies")
        return [np.asarray(self.layer(i).wo) for i in range(self.n_layers)]

    @property
    def tokens(self) -> Any:
        """tokens.parquet as a DataFrame, or None when the trace has none."""
        if "tokens.parquet" not in self._entries:
            return None
        import pandas as pd

        return pd.read_parquet(self.path / "tokens.parquet")

    def __repr__(self) -> str:
        m = self.meta.model
        return (f"Trace({str(self.path)!r}, kind={self.meta.kind}, layers={self.n_layers}, T={self.meta.n_tokens}, "
                f"P={self.meta.n_prompt}, Hq={m.n_q_heads}, Hkv={m.n_kv_heads}, d={m.head_dim})")


def _check_npy_header(path: Path, rel: str, entry: dict[str, Any], meta: TraceMeta, name: str) -> np.ndarray:
    """Open one array without pickle and check it against the manifest and the model geometry."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        if "pickle" in str(e).lower() or "object" in str(e).lower():
            raise TraceError(f"{rel}: holds Python objects (pickle), which kvsim never loads") from None
        raise TraceError(f"{rel}: not a valid .npy file ({e})") from None
    except OSError as e:
        raise TraceError(f"{rel}: unreadable or truncated .npy file ({e})") from None
    want_shape = meta.expected_shape(name)
    if tuple(arr.shape) != want_shape or list(arr.shape) != list(entry.get("shape", [])):
        raise TraceError(f"{rel}: shape {tuple(arr.shape)}, expected {want_shape} (manifest says {entry.get('shape')})")
    want_dtype = meta.expected_dtype(name)
    if arr.dtype != want_dtype:
        raise TraceError(f"{rel}: dtype {arr.dtype}, expected {want_dtype}")
    return arr


def load_trace(path: str | os.PathLike, *, verify: bool = True) -> Trace:
    """Open and validate a trace directory.

    Always checks the manifest, every array's presence, header, shape and dtype. With ``verify`` (the
    default) also checks every SHA-256 checksum and that q/k/v/lse/o are finite (one streaming pass).
    """
    root = Path(path)
    mpath = root / "manifest.json"
    if not root.is_dir():
        raise TraceError(f"{root}: not a trace directory")
    if not mpath.is_file():
        raise TraceError(f"{mpath}: missing (incomplete or not a kvsim trace)")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{mpath}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise TraceError(f"{mpath}: top level must be an object")
    for key in ("format", "version", "model", "n_tokens", "n_prompt", "dtype", "softmax_scale", "arrays"):
        if key not in manifest:
            raise TraceError(f"{mpath}: missing field {key!r}")
    if manifest["format"] != FORMAT_NAME:
        raise TraceError(f"{mpath}: field 'format' is {manifest['format']!r}, expected {FORMAT_NAME!r}")
    if manifest["version"] not in READABLE_VERSIONS:
        raise TraceError(f"{mpath}: field 'version' is {manifest['version']!r}; this kvsim reads versions "
                         f"{', '.join(map(str, READABLE_VERSIONS))}")
    meta = TraceMeta.from_json(manifest, where=str(mpath))
    entries = manifest["arrays"]
    if not isinstance(entries, dict):
        raise TraceError(f"{mpath}: field 'arrays' must be an object")
    for rel in entries:
        if rel != "tokens.parquet" and not _ARRAY_PATH.match(rel):
            raise TraceError(f"{mpath}: field 'arrays' names {rel!r}, which is not a trace array path")
    has_ref = bool(manifest.get("has_reference", False))
    has_wo = bool(manifest.get("has_wo", False))
    if has_wo and meta.model.hidden_size < 1:
        raise TraceError(f"{mpath}: has_wo is set but model.hidden_size is missing")
    has_recon_h = bool(manifest.get("has_recon_h", False)) and meta.reconstruction is not None
    names = ((ARRAY_NAMES if has_ref else ARRAY_NAMES[:3]) + ((WO,) if has_wo else ())
             + (RECON if meta.reconstruction is not None else ()) + ((RECON_H,) if has_recon_h else ()))
    for i in range(len(meta.model.layer_ids)):
        for name in names:
            rel = array_path(i, name)
            entry = entries.get(rel)
            if entry is None:
                raise TraceError(f"{mpath}: field 'arrays' lacks {rel!r}")
            fpath = root / rel
            if not fpath.is_file():
                raise TraceError(f"{rel}: file missing")
            arr = _check_npy_header(fpath, rel, entry, meta, name)
            if verify:
                digest, finite = _sha256_and_finite(fpath, arr)
                if digest != entry.get("sha256"):
                    raise TraceError(f"{rel}: checksum mismatch (sha256 {digest[:12]}… vs manifest "
                                     f"{str(entry.get('sha256'))[:12]}…): the file was modified or corrupted")
                if not finite:
                    raise TraceError(f"{rel}: contains NaN or inf")
    if "tokens.parquet" in entries:
        tpath = root / "tokens.parquet"
        if not tpath.is_file():
            raise TraceError("tokens.parquet: file missing")
        if verify and _sha256_and_finite(tpath, np.zeros(0))[0] != entries["tokens.parquet"].get("sha256"):
            raise TraceError("tokens.parquet: checksum mismatch: the file was modified or corrupted")
    return Trace(root, meta, has_ref, entries, has_wo, has_recon_h)


class InMemoryTrace(Trace):
    """A trace held in memory (synthetic generators, tests); same reading interface as a loaded trace."""

    def __init__(self, meta: TraceMeta, layers: list[LayerArrays], tokens: Any = None):
        has_ref = all(la.lse is not None for la in layers)
        super().__init__(Path("<memory>"), meta, has_ref, {}, bool(layers) and all(la.wo is not None for la in layers),
                         bool(layers) and all(la.recon_h is not None for la in layers))
        if len(layers) != len(meta.model.layer_ids):
            raise TraceError(f"{len(layers)} layers given, model.layer_ids declares {len(meta.model.layer_ids)}")
        for i, la in enumerate(layers):
            for name, arr in la._asdict().items():
                if arr is not None and tuple(arr.shape) != meta.expected_shape(name):
                    raise TraceError(f"layer {i} array {name!r}: shape {tuple(arr.shape)}, "
                                     f"expected {meta.expected_shape(name)}")
        self._layers = layers
        self._tokens = tokens

    def layer(self, i: int) -> LayerArrays:
        if not 0 <= i < self.n_layers:
            raise IndexError(f"layer {i} out of range: trace has {self.n_layers} layers")
        return self._layers[i]

    @property
    def tokens(self) -> Any:
        return self._tokens

    def save(self, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write this trace to disk in the standard format."""
        return write_trace(out_dir, self.meta, self._layers, self._tokens, overwrite=overwrite)
