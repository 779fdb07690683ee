"""KVzip+ (kvpress ``KVzipPress(kvzip_plus_normalization=True)``; the normalisation of Kim et al.'s KVzip released
in kvpress with its RestoreKV work, arXiv 2608.01247, which builds on it): KVzip's context-reconstruction score with
each attention weight rescaled by how much the pair can write into the residual stream.

Score: as KVzip (policies/kvzip.py), the largest attention a prompt token receives from the repeat tokens of its
chunk over the query heads of its group, but each repeat query t's probabilities are first divided by the L2 norm of
its hidden state at the attention's input ``||h_t||`` (after the layer's input norm: what the attention module is
handed), and each query head g's column for token i multiplied by ``||W_O^(g) v_i||``, the L2 norm of the token's
value projected by that head's block of the output projection: score_i = max over (g, t) of
p[g, t, i] * ||W_O^(g) v_i|| / ||h_t|| (kvpress's ``score_kvzip``: the row division, the column product, then the
maximum over the group and the repeat queries). Everything else -- the pass, the sinks kept, the budget of every
layer and head ranked together (``layerwise``), the decode rule -- is KVzip's, with its parameters and kvpress's
defaults.

What a trace must hold: the reconstruction pass (``kvsim record --kvzip``, as KVzip) with the repeat tokens'
hidden-state norms (``recon_h``, recorded with the pass since KVzip+ was added; an older trace is an error saying to
record again) and W_O (recorded for Llama-family and Gemma-3 models). The closed loop reads the same from the model
(``traces.hf.reconstruction_pass``: a forward pre-hook on each attention module). On a synthetic trace (no model, no
hidden states, no W_O) the norms are taken as 1 and W_O as the identity: KVzip's score times ``||v_i||``, so the
property tests exercise the rule.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from policies.core.errors import PolicyError
from policies.core.kvpress_press import KvpressPress, protected_extra
from policies.kvzip import KVzip
from policies.core.registry import register


def value_output_norms(v: np.ndarray, wo: np.ndarray | None, n_q_heads: int) -> np.ndarray:
    """[Hq, P] ``||W_O^(g) v_i||`` of each query head g over the prompt values ``v`` [P, Hkv, d] of its KV head
    (``wo`` [hidden, Hq * d], torch's Linear layout; None: the identity, ``||v_i||``), via the d x d Gram matrix of
    each head's block (float64)."""
    P, hkv, d = v.shape
    g_n = n_q_heads // hkv
    v64 = np.asarray(v, np.float64)
    out = np.empty((n_q_heads, P))
    for hq in range(n_q_heads):
        x = v64[:, hq // g_n, :]
        if wo is None:
            out[hq] = np.sqrt((x * x).sum(axis=1))
            continue
        block = np.asarray(wo[:, hq * d:(hq + 1) * d], np.float64)
        gram = block.T @ block
        out[hq] = np.sqrt(np.maximum(np.einsum("pi,ij,pj->p", x, gram, x), 0.0))
    return out


@register
class KVzipPlus(KVzip):
    """KVzip's reconstruction score with KVzip+'s normalisation: each repeat query's attention divided by its
    hidden-state norm, each token's column multiplied by its W_O-projected value norm (module docstring)."""

    #: the normalisation reads the prompt's values (``||W_O^(g) v_i||``), which KVzip's score does not
    reads_values = True

    name = "kvzip_plus"
    summary = "KVzip's reread attention x ||W_O v|| / ||h|| (KVzip+)"

    def reconstruction_weights(self, prompt_layers: Any, j: int, chunk_size: int) -> tuple:
        """1 / ||h_t|| of the repeat tokens [R] and ``||W_O^(g) v_i||`` [Hq, P] of compressed layer j, from the
        prompt view (the trace's arrays, or the model's in the closed loop)."""
        read = getattr(prompt_layers, "reconstruction_extras", None)
        trace = getattr(prompt_layers, "trace", None)
        if read is None:
            raise self._no_extras("this prompt view")
        plan, recon_q, _, k, _ = prompt_layers.reconstruction(j, chunk_size)
        if trace is not None and trace.meta.kind == "synthetic":       # no model: norms 1, W_O the identity
            P = k.shape[0]
            v = np.asarray(prompt_layers.trace.layer(prompt_layers.layers[j]).v[:P], np.float32)
            return np.ones(recon_q.shape[0], np.float32), value_output_norms(v, None, recon_q.shape[1])
        norms, v, wo = read(j, chunk_size)
        norms = np.asarray(norms, np.float64)
        if norms.shape != (recon_q.shape[0],) or not np.isfinite(norms).all() or (norms < 0).any():
            raise self._no_extras("the recorded pass (its hidden-state norms are missing or not finite)")
        if (norms == 0).any():
            t = int(np.flatnonzero(norms == 0)[0])
            raise PolicyError(f"{self.label()}: repeat token {t} of KVzip's pass reaches compressed layer {j}'s "
                              f"attention with a zero hidden state (a token whose embedding is zero, such as a "
                              f"padding token), so KVzip+'s division by ||h_t|| is undefined; leave such tokens out "
                              f"of the prompt")
        return (1.0 / norms).astype(np.float32), value_output_norms(np.asarray(v), wo, recon_q.shape[1])

    def _no_extras(self, where: str) -> Exception:
        return PolicyError(f"{self.label()}: {where} has no hidden-state norms of KVzip's reconstruction pass; "
                           "record the trace again with `kvsim record --kvzip`")

    def kvpress_press(self, prompt_at_once: bool = False) -> KvpressPress:
        """kvpress's ``KVzipPress`` with ``kvzip_plus_normalization=True``."""
        p = self.params
        return KvpressPress({"cls": "KVzipPress", "n_sink": p["n_sink"], "layerwise": p["layerwise"],
                             "chunk_size": p["chunk_size"], "kvzip_plus_normalization": True},
                            differs_by=protected_extra(self, n_sink=p["n_sink"]),
                            note="kvsim's pass rereads the prompt without a chat template: give KVzipPress a "
                                 "tokenizer without one (tokenizer.chat_template = None) for the same scores")
