"""TriAttention (Mao, Lin, Huang, Xie, Fu, Zhuang, Han, Chen, 2026, "TriAttention: Efficient Long Reasoning with
Trigonometric KV Compression", arXiv 2604.04921; released code github.com/WeianMao/triattention, its Hugging Face
path ``triattention/methods/triattention.py`` with the defaults its experiment runner ``scripts/cli.py`` sets).

Rule. Before RoPE, a head's queries concentrate around a fixed non-zero centre. Written per RoPE frequency f as
complex numbers (rotate-half layout: ``x[f] + i x[f + d/2]``, angular frequency ``w_f = theta^(-2f/d)``), the query
centre is ``Qbar_f`` (the mean of the pre-RoPE queries) and ``A_f`` the mean of their moduli. A key k cached at
position p (``K_f`` its pre-RoPE pair) then gets from a future query at distance D the logit
``sum_f |Qbar_f| |K_f| cos(w_f D + phi_f)`` with ``phi_f = arg(Qbar_f conj(K_f))`` -- a trigonometric series in D --
plus what the spread of the queries adds, ``sum_f (A_f - |Qbar_f|) |K_f|`` (the "MLR" term). A key's score at a
compression whose next query sits at position r is that sum at the distances ``D = r - p + delta`` for the geometric
offsets ``delta = 1, 2, 4, ..., offset_max_length``, averaged over the offsets (``offset_agg=max``: their maximum).
Per query head the scores are standardised over the candidate keys (``normalize``: z-scores, population standard
deviation floored at 1e-6), the query heads sharing a KV head are reduced by their maximum (``group_agg``), and each
KV head keeps the highest. Because ``K_f = Krot_f e^(-i w_f p)`` for the cached (post-RoPE) key ``Krot``, the series
is ``Re sum_f Qbar_f conj(Krot_f) e^(i w_f (r + delta))``: the cached keys are scored directly, and the mean over the
offsets is one complex factor per frequency (``mean_delta e^(i w_f delta)``), so scoring n keys is one pass of n x d
per query head -- the released code's un-rotation and offset grid give the same numbers (tests/test_triattention.py
checks both ways against a literal NumPy transcription of its formulas).

Schedule (the released code's "slack trigger"): nothing happens until the cache exceeds the budget; then it is
compressed to ``budget - divide_length + 1`` slots, so it grows back for ``divide_length - 1`` steps before the next
compression. kvsim's budget is the most slots a head holds after a step, so the released budget B with
``divide_length=128`` is kvsim's ``budget = B + 127`` (the released cache reaches B + 128 at the step that triggers,
whose attention has already run over them, as kvsim's step sees budget + 1 slots); the prompt counts towards it
(released ``count_prompt_tokens=True``). Compression only ever happens at or after a step, so a prompt shorter than
the budget is left whole until decoding fills the cache.

Prompt (released ``allow_prefill_compression=False``, here ``protect_prefill=True``): the prompt's tokens are not
candidates -- only generated tokens are scored and evicted. When the prompt alone exceeds the size kept, the
released code keeps the prompt's *first* tokens (its ``decode_budget == 0`` branch keeps cache rows 0..B-1) and
every generated token goes at the next compression; kvsim does the same (the newest prompt tokens go first). So at
the released defaults TriAttention is a decode-time method: on a long prompt with a small budget it is the prompt's
head. ``protect_prefill=false`` (the released ``allow_prefill_compression=True``) lets every token compete.

Differences from the released code, each forced or chosen and documented:
- calibration: the released code reads ``Qbar`` and ``A`` from a file computed offline by one forward pass over a
  plain calibration text (``scripts/calibrate.py``; the authors report the statistics domain-agnostic). A policy sees
  no such file, and a trace records no other text, so here they are computed from the *prompt's own queries* (all its
  rows, every query head, un-rotated at their positions) when the prompt goes in, and kept for the decode. With no
  prompt there are no statistics: every key scores 0 and the oldest candidates go first. kvsim's queries are those
  attention uses (after QK-norm on Gemma-3); the released ``calibrate.py`` hooks ``q_proj``'s output, which on
  QK-norm models (Qwen3) misses the norm.
- pruning mode: the released default (``per_head_pruning``) averages each layer's group-maximum score over all
  layers and keeps one set per KV-head index, the same in every layer. kvsim's policies decide per layer (the
  simulator replays one layer at a time, the closed loop steps the layers side by side), so this runs the released
  code's own per-layer option (``per_layer_perhead_pruning=True`` with ``layer_perhead_aggregation`` = ``group_agg``,
  default max). The cross-layer default is not expressible (benchmarks/results/kvpress_parity.json says so).
- a prompt longer than the budget: the released code holds all of it through the prefill and compresses at the first
  decode step (next query at P + 1, the first generated token among the candidates); kvsim holds the budget from the
  first step, so it compresses at the prefill (next query at P) and, from then on, one step earlier.
- ties: the released code adds 1e-6 x U(0, 1) noise from a seeded generator; kvsim breaks exact ties
  deterministically (the older token goes first).
- scaled RoPE (YaRN's attention factor, the released ``freq_scale_sq``) is not supported: the RoPE base is the only
  geometry a trace records (``rope_theta``; -1 reads each layer's own, 0 means no RoPE: every w_f = 0).
- ``n_recent`` (default 0, as the released Hugging Face path) protects the newest tokens; the released vLLM runtime
  protects ``window_size=128`` (scored and standardised with the others, then kept).

kvpress 0.5.5 ships no TriAttention press, so there is no counterpart to export or to check parity with.

State: head_state[h] = [prompt length, 1 once calibrated, then per query head g of the group (<= 8) three blocks of
``d/2 <= 128``: Re Qbar, Im Qbar, A]. No slot state.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from policies.core.base import (FROM_MODEL, PREFILL_SIG, STEP_SIG, Guarantees, Param, Policy, PolicyError, kernel,
                           param_indices)
from policies.core.shared_kernels import evict_lowest_sorted
from policies.core.kvpress_press import NoKvpressPress
from policies.core.registry import register

MAX_G, MAX_HALF = 8, 128
STATS = 2                    # head_state: [0] prompt length, [1] calibrated, then the statistics from here
BLOCK = 3 * MAX_HALF         # per query head: Re Qbar, Im Qbar, A

SCHEMA = (
    Param("divide_length", 128, "int", 1, 1 << 16, log=True,
          doc="a compression leaves room for this many tokens: it keeps budget - divide_length + 1 (released: 128)"),
    Param("offset_max_length", 65536, "int", 1, 1 << 24, log=True, searchable=False,
          doc="future distances scored: 1, 2, 4, ... up to this (released: 65536, 17 offsets)"),
    Param("offset_agg", "mean", "choice", choices=("mean", "max"),
          doc="how a key's scores at the offsets combine (released: mean)"),
    Param("normalize", True, "bool", doc="z-score each query head's scores over the candidates (released: true)"),
    Param("group_agg", "max", "choice", choices=("max", "mean"),
          doc="how the query heads of a KV head combine (released layer_perhead_aggregation: max)"),
    Param("protect_prefill", True, "bool",
          doc="prompt tokens are not candidates; a prompt over the size keeps its first tokens (released: true)"),
    Param("n_recent", 0, "int", 0, 1 << 16, searchable=False,
          doc="newest positions never evicted (released HF path: 0; its vLLM runtime: 128)"),
    Param("disable_mlr", False, "bool", searchable=False,
          doc="ablation: the extra term uses A_f |K_f| instead of (A_f - |Qbar_f|) |K_f|"),
    Param("disable_trig", False, "bool", searchable=False,
          doc="ablation: score by the position-free extra term alone"),
    Param("rope_theta", FROM_MODEL, "float", FROM_MODEL, 1e9, searchable=False, from_layer="rope_theta",
          doc="RoPE base; -1: each layer's own (from the trace or the model); 0: no RoPE"),
)
P = param_indices(SCHEMA)


@njit(cache=True)
def frequencies(d, theta):
    """The angular frequency w_f = theta^(-2f/d) of each rotate-half pair f < d/2 (all 0 without RoPE)."""
    half = d // 2
    w = np.zeros(half)
    if theta > 0.0:
        for f in range(half):
            w[f] = theta ** (-2.0 * f / d)
    return w


@njit(cache=True)
def offsets(max_length):
    """The geometric offsets 1, 2, 4, ... <= max_length (the released ``build_geometric_offsets``)."""
    n = 0
    v = 1
    while v <= max_length:
        n += 1
        v *= 2
    out = np.empty(n)
    v = 1
    for j in range(n):
        out[j] = v
        v *= 2
    return out


@njit(cache=True)
def calibrate(q, w, g_n, head_state):
    """Each query head's pre-RoPE centre (Re, Im of the mean pair) and mean pair modulus over the rows of q
    [n, Hq, d] (post-RoPE; row r at position r is un-rotated by -r w_f), written to every KV head's state."""
    n, hq_n, d = q.shape
    half = d // 2
    re = np.zeros((hq_n, half))
    im = np.zeros((hq_n, half))
    ab = np.zeros((hq_n, half))
    for r in range(n):
        for f in range(half):
            a = -1.0 * r * w[f]
            c = np.cos(a)
            s = np.sin(a)
            for hq in range(hq_n):
                x0 = np.float64(q[r, hq, f])
                x1 = np.float64(q[r, hq, f + half])
                re[hq, f] += c * x0 - s * x1
                im[hq, f] += s * x0 + c * x1
                ab[hq, f] += np.sqrt(x0 * x0 + x1 * x1)
    for hq in range(hq_n):
        h = hq // g_n
        base = STATS + (hq % g_n) * BLOCK
        for f in range(half):
            head_state[h, base + f] = re[hq, f] / n
            head_state[h, base + MAX_HALF + f] = im[hq, f] / n
            head_state[h, base + 2 * MAX_HALF + f] = ab[hq, f] / n
    for h in range(head_state.shape[0]):
        head_state[h, 0] = n
        head_state[h, 1] = 1.0


@njit(cache=True)
def raw_scores(params, w, r0, stats, g, keys, rows, out):
    """Query head g's score of the keys ``keys[rows[j]]`` ([*, d], post-RoPE) at a compression whose next query
    sits at position r0, into out[j] (see the module docstring; ``stats`` is the KV head's state row)."""
    d = keys.shape[1]
    half = d // 2
    base = STATS + g * BLOCK
    dl = offsets(int(params[P.offset_max_length]))
    n_off = dl.shape[0]
    use_max = params[P.offset_agg] == 1.0
    trig = params[P.disable_trig] == 0.0
    # the phase factors e^(i w_f (r0 + delta)): their mean over the offsets, or each one (max)
    cr = np.zeros((n_off, half))
    ci = np.zeros((n_off, half))
    mr = np.zeros(half)
    mi = np.zeros(half)
    coef = np.empty(half)
    for f in range(half):
        for j in range(n_off):
            a = w[f] * (r0 + dl[j])
            cr[j, f] = np.cos(a)
            ci[j, f] = np.sin(a)
            mr[f] += cr[j, f] / n_off
            mi[f] += ci[j, f] / n_off
        qr = stats[base + f]
        qi = stats[base + MAX_HALF + f]
        spread = stats[base + 2 * MAX_HALF + f]
        coef[f] = spread if params[P.disable_mlr] != 0.0 else spread - np.sqrt(qr * qr + qi * qi)
    zr = np.empty(half)
    zi = np.empty(half)
    for j in range(rows.shape[0]):
        key = keys[rows[j]]
        extra = 0.0
        for f in range(half):
            kr = np.float64(key[f])
            ki = np.float64(key[f + half])
            qr = stats[base + f]
            qi = stats[base + MAX_HALF + f]
            zr[f] = qr * kr + qi * ki            # Qbar_f conj(Krot_f)
            zi[f] = qi * kr - qr * ki
            extra += coef[f] * np.sqrt(kr * kr + ki * ki)
        series = 0.0
        if trig and use_max:
            series = -np.inf
            for o in range(n_off):
                acc = 0.0
                for f in range(half):
                    acc += zr[f] * cr[o, f] - zi[f] * ci[o, f]
                series = max(series, acc)
        elif trig:
            for f in range(half):
                series += zr[f] * mr[f] - zi[f] * mi[f]
        out[j] = series + extra


@njit(cache=True)
def head_scores(params, w, r0, stats, g_n, keys, rows, out):
    """The KV head's score of ``keys[rows[j]]``: each query head's raw score, z-scored over these rows
    (``normalize``), reduced over the group (``group_agg``)."""
    m = rows.shape[0]
    s = np.empty(m)
    use_max = params[P.group_agg] == 0.0
    for j in range(m):
        out[j] = -np.inf if use_max else 0.0
    for g in range(g_n):
        raw_scores(params, w, r0, stats, g, keys, rows, s)
        if params[P.normalize] != 0.0 and m > 0:
            mean = 0.0
            for j in range(m):
                mean += s[j]
            mean /= m
            var = 0.0
            for j in range(m):
                var += (s[j] - mean) * (s[j] - mean)
            std = max(np.sqrt(var / m), 1e-6)
            for j in range(m):
                s[j] = (s[j] - mean) / std
        for j in range(m):
            out[j] = max(out[j], s[j]) if use_max else out[j] + s[j] / g_n


@njit(cache=True)
def compress(params, w, r0, stats, g_n, keys, positions, n, size, hi, keep):
    """Evict one KV head's slots down to ``size``: candidates are the slots at positions below ``hi`` (the newest
    ``n_recent`` are kept) and, with ``protect_prefill``, from the prompt's end on; a prompt still over the size loses
    its newest tokens first."""
    n_prompt = int(stats[0]) if params[P.protect_prefill] != 0.0 else 0
    rows = np.empty(n, np.int64)
    m = 0
    for i in range(n):
        if positions[i] >= n_prompt:
            rows[m] = i
            m += 1
    cand = rows[:m]
    scored = np.empty(m)
    head_scores(params, w, r0, stats, g_n, keys, cand, scored)
    scores = np.zeros(n)
    for j in range(m):
        scores[cand[j]] = scored[j]
    n_evict = n - size
    done = evict_lowest_sorted(scores, positions, n, n_evict, n_prompt, hi, keep)
    i = n - 1
    while done < n_evict and i >= 0:            # the prompt itself is over the size: its newest tokens go
        if keep[i] != 0 and positions[i] < min(n_prompt, hi):
            keep[i] = 0
            done += 1
        i -= 1


@kernel(PREFILL_SIG)
def _prefill(params, layer, budget, q, k, v, scale, keep, slot_state, head_state):
    """Calibrate on the prompt's queries; a prompt over the budget is compressed at once (next query at P)."""
    n, hq_n, d = q.shape
    hkv = k.shape[1]
    g_n = hq_n // hkv
    if g_n > MAX_G or d // 2 > MAX_HALF:
        raise ValueError("triattention: at most 8 query heads per KV head and head_dim 256")
    w = frequencies(d, params[P.rope_theta])
    calibrate(q, w, g_n, head_state)
    pos = np.arange(n)
    dl = int(params[P.divide_length])
    hi = n - int(params[P.n_recent])
    for h in range(hkv):
        if n > budget[h]:
            compress(params, w, np.float64(n), head_state[h], g_n, np.ascontiguousarray(k[:, h, :]), pos, n,
                     budget[h] - dl + 1, hi, keep[h])


@kernel(STEP_SIG)
def _step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep, merge_to,
          merge_w):
    """A head over its budget is compressed to ``budget - divide_length + 1`` (next query at t + 1)."""
    hkv = lengths.shape[0]
    d = keys.shape[2]
    g_n = probs.shape[1]
    if g_n > MAX_G or d // 2 > MAX_HALF:
        raise ValueError("triattention: at most 8 query heads per KV head and head_dim 256")
    w = frequencies(d, params[P.rope_theta])
    dl = int(params[P.divide_length])
    hi = t - int(params[P.n_recent]) + 1
    for h in range(hkv):
        if lengths[h] > budget[h]:
            compress(params, w, np.float64(t + 1), head_state[h], g_n, keys[h], positions[h], lengths[h],
                     budget[h] - dl + 1, hi, keep[h])


@register
class TriAttention(Policy):
    """TriAttention: keys scored by the trigonometric series of the queries' pre-RoPE centre (module docstring)."""

    name = "triattention"
    summary = "trigonometric series of the pre-RoPE query centre, compressed every divide_length steps"
    schema = SCHEMA
    P = P
    head_fields = STATS + MAX_G * BLOCK
    reads_attention = False
    reads_values = False
    step_fn = _step
    prefill_fn = _prefill

    def validate(self) -> None:
        theta = self.params["rope_theta"]
        if theta != FROM_MODEL and theta < 0:
            raise PolicyError(f"{self.name}.rope_theta: {theta} is neither -1 (the layer's own) nor a base >= 0")

    def size_after_compression(self, budget: int) -> int:
        """Slots a head keeps after a compression: ``budget - divide_length + 1``."""
        return budget - self.params["divide_length"] + 1

    def min_budget(self) -> int:
        """The compressed size must hold the protected recent tokens (and at least one slot)."""
        return self.params["divide_length"] - 1 + max(1, self.params["n_recent"])

    def guarantees(self, budget: int) -> Guarantees:
        return Guarantees(sinks=0, recent=self.params["n_recent"])

    def kvpress_press(self, prompt_at_once: bool = False):
        raise NoKvpressPress(f"{self.name}: kvpress 0.5.5 ships no TriAttention press (the method's own code is "
                             f"github.com/WeianMao/triattention, for Hugging Face, vLLM and SGLang)")
