"""Do kvsim's policies keep exactly the tokens NVIDIA kvpress's presses keep? Parity of kept sets, press by press.

Setting (kvpress's): one prompt of 1 024 tokens of kvsim's shipped held-out text (``traces/texts.py``,
'default'), tokenized with SmolLM2-135M-Instruct's tokenizer without special tokens, compressed once after
prefill at compression ratio 0.5 (kvpress keeps ``int(1024 * (1 - 0.5)) = 512`` tokens per KV head and layer).

- kvpress side: kvpress 0.5.5 runs in its own virtual environment, ``benchmarks/.kvpress-env`` (created with
  ``python -m venv`` and pip on first use, reused after; kvpress is never a dependency of kvsim), in a subprocess
  that runs this same file with ``--worker``. It loads the converted HF folder kvsim keeps for ``smollm2-135m``
  (``traces.models.resolve_model``: fetched and converted the kvsim way when missing) in float32, and for each
  press does the prefill exactly as kvpress's pipeline does (``with press(model): model.model(ids, cache)``). The
  press's forward hook is wrapped: per layer, the kept positions are the cached keys after the hook matched row by
  row to the keys before it (presses that prune) less ``module.masked_key_indices`` (presses that mask: AdaKV,
  CriticalAdaKV, DuoAttention, DMS). The innermost scorer's ``score()`` output is saved too, for diagnostics.
  Presses that need what this machine cannot fetch get kvsim's own numbers instead (DuoAttention's head scores,
  Q-Filters' filters): the loader is monkeypatched, so what is compared is the selection logic.
- kvsim side: the same token ids recorded as a kvsim trace (``traces.recorder.record_trace``, the API behind
  ``kvsim record``; 1 024 prompt + 1 teacher-forced token, the prompt in one forward as kvpress does, with KVzip's
  context-reconstruction pass, ``--kvzip``). A policy
  with a prefill selector runs its prefill kernel on each layer's prompt, as the engine does before decode
  (``sim.replay.engine.replay_layer``); one that streams its prompt (StreamingLLM, plain TOVA) is replayed with the
  whole prompt as one chunk (``--prefill-chunk P``, "compress once after prefill") and its kept set read after
  the prompt's last step.
- Budgets: by default kvsim gets, per (layer, KV head), the count kvpress kept there (512 for most presses;
  PyramidKV's per-layer schedule and ChunkKV's whole chunks keep other counts), so that the comparison is of
  the selections; where kvsim's own allocation at budget 512 gives other counts, the Jaccard at kvsim's own
  budgets is reported beside it (``own_budget``). Ada-KV presses are given the uniform base (512) and allocate
  across heads themselves, on both sides. Presses that decide their own sizes (DuoAttention's head split, DMS's
  threshold: minus the median key norm, fixed from the trace before either side runs) are compared with kvsim
  at a budget of the whole prompt, where its own rule decides.
- Data cross the process boundary as JSON and .npz files (no pickle) under ``benchmarks/.kvpress-work``.

Reported per press (``benchmarks/results/kvpress_parity.json``): the Jaccard index |A ∩ B| / |A ∪ B| of the
kept sets over all 30 layers x 3 KV heads (min and mean), the press and its constructor arguments, the kvsim
spec, the shared hyperparameters, and a note saying why any (layer, head) differs. Presses whose kvsim policy is
not in the registry are listed as "not available". The cases are one table (``CASES``): name -> press spec,
kvsim spec, parameters.

Ties. kvsim evicts the older token among equal scores (keeps the newer). kvpress takes ``torch.topk`` of the
scores, which leaves the order among equal scores unspecified; the worker records what it did on this machine
(``tie_breaking`` in the JSON). Exact ties arise where a press's scores are constants or ranks (the window
padding of SnapKV/PyramidKV/TOVA/ExpectedAttention, StreamingLLM's 0/1, LagKV's per-partition ranks, CURPress's
sinks) and where kvpress's float32 scores coincide although kvsim's float64 ones do not (Knorm). LagKV's
remaining differences in kvpress's mode are exact ties of per-partition ranks at the cut (a gap once put down to
float32 rounding was torch's sample standard deviation, now lagkv's ``std_ddof``). The keys are bit-identical on both sides
(``keys_max_rel_diff``), so these are the only numerical differences. Each row's ``diagnosis`` shows them: how
far, in kvpress's score ranks, the differing tokens lie from the cut, and how many score exactly as a token on
the other side of it.

Run (on this project's 2-core machine, shared: 64 s with the environment in place, the trace recorded and numba's
kernels cached, of which ~45 s is the kvpress worker, 19 prefills of 1 024 tokens; 144 s from an empty
benchmarks/.kvpress-work, which records the trace (~7-17 s) and, with kernels recompiled, a slower kvsim side;
253 s with the same work cached while other jobs held the machine at a load of 3.3; creating the environment
the first time, about 1.4 GB installed with torch, takes a few minutes more):

    python -m benchmarks.kvpress_parity [--ratio 0.5] [--only SnapKV,TOVA] [--rebuild-env]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# pure Python and numpy: the worker, in kvpress's environment, imports them too
from policies.core.kvpress_press import NoKvpressPress, export, export_holds, n_kept, press_repr
from sim.replay.kept_sets import jaccard, kept_mask

ROOT = Path(__file__).resolve().parents[1]
ENV = ROOT / "benchmarks" / ".kvpress-env"
WORK = ROOT / "benchmarks" / ".kvpress-work"
KVPRESS_VERSION = "0.5.5"
#: what the kvpress environment holds: kvpress 0.5.5 asks for transformers>=4.56,<5.3 and torch>=2.3.1,<3; the
#: newest transformers it accepts, and the CPU torch the project pins
ENV_REQUIREMENTS = (f"kvpress=={KVPRESS_VERSION}", "transformers==5.2.0", "torch==2.13.0")
MODEL = "smollm2-135m"
TEXT = "default"
PROMPT_TOKENS = 1024
RATIO = 0.5


# ---------------------------------------------------------------- the table

@dataclass(frozen=True)
class Case:
    """One press and kvsim's policy for it.

    kvsim: policy spec (None: none exists). press: kvpress constructor spec, JSON: ``{"cls": NAME, **kwargs}``, a
    nested dict with "cls" is a press argument; None (most rows): the press the kvsim policy declares
    (``Policy.kvpress_press``, what ``kvsim export --kvpress`` prints), with its ``attn`` and ``sets_ratio``; an
    explicit press is for rows that show a *difference* (kvsim's defaults against kvpress's, a rule kvsim's
    declaration refuses). The compression ratio is set on the built press (``press.compression_ratio = ratio``)
    unless ``sets_ratio`` is False (DuoAttention, DMS decide their own).
    params: the hyperparameters both sides use, as stated in the result. budgets: "kvpress" (kvsim keeps, per
    layer and head, kvpress's count), "base" (kvsim gets the uniform ``int(P * (1 - ratio))`` and allocates
    itself: Ada-KV) or "prompt" (kvsim's own allocation at a budget of the whole prompt: the presses that decide
    their own sizes, DuoAttention's head split and DMS's threshold). attn: the attention kvpress's model runs
    ("eager" when the press reads the weights). inject: what kvsim computes and kvpress's press is handed (its
    loader monkeypatched). requires: kvsim policies or combinators that must exist for the case to run. note:
    why the sets differ, where they do (found by the investigation this benchmark was written for;
    ``diagnosis`` adds the run's own evidence). diagnostics:
    (label, kvsim spec) pairs run at kvpress's per-head counts to test a stated cause (their Jaccard is reported
    beside the row's, never instead of it). fill: a ``FILLS`` function giving run-time values for "{name}"
    placeholders in the press spec, the kvsim spec and the params (DMS's threshold, from the trace). why_not: why the
    row cannot run (no kvsim spec: the rule cannot be expressed from a trace; a kvsim spec: kvpress has no press).
    """

    kvsim: str | None
    params: dict
    press: dict | None = None
    budgets: str = "kvpress"
    attn: str | None = None
    sets_ratio: bool | None = None
    inject: str | None = None
    requires: tuple[str, ...] = ()
    note: str = ""
    diagnostics: tuple[tuple[str, str], ...] = ()
    fill: str | None = None
    why_not: str = ""


SNAP = {"window_size": 64, "kernel_size": 5}
SNAP_KVSIM = "window_size=64,kernel_size=5,pooling=avg,group_reduce=mean"
EA_NOVNORM = "expected_attention:n_sink=4,n_recent=0,use_vnorm=false"
CRIT = "critical_epsilon=0.0001, first_stage_ratio"

CASES: dict[str, Case] = {
    "SnapKV": Case(f"snapkv:{SNAP_KVSIM}", {**SNAP, "pooling": "avg (kvpress)"}),
    "StreamingLLM": Case("streaming_llm:n_sinks=4", {"n_sink": 4}),
    "Knorm": Case("knorm:n_sink=0,n_recent=0", {"protected": "none (kvpress)"}, note="Same rule; a difference can only come from ties in kvpress's float32 norms, which kvsim resolves in "
             "float64. In the recorded run one (layer 0, KV head 1) differs by one token: tokens 406, 799 and 733 "
             "have norms 14.38504599, 14.38504610, 14.38504618 in float64 (kvsim keeps the lowest two) and the "
             "same float32 norm 14.385046 in kvpress, a three-way tie at the cut from which torch.topk kept 799 "
             "and 733."),
    "KeyDiff": Case("keydiff:n_sink=0,n_recent=0", {"protected": "none (kvpress)"}),
    "ExpectedAttention": Case("expected_attention:n_sink=4,n_recent=0,n_future_positions=512,use_covariance=true,use_vnorm=true", {"n_future_positions": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.0,
         "rope_theta": "the model's, 1e5 (both read it from the model / trace)"}),
    "LagKV": Case("lagkv:n_sink=4,n_recent=0,lag_size=128", {"n_sink": 4, "lag_size": 128, "cross_scoring": "False (kvpress's default)"}, press={"cls": "LagKVPress", "n_sink": 4, "lag_size": 128}, note="kvsim's lagkv at its own defaults, which are not kvpress's (nor the paper's, nor the authors' code's): "
             "three differences of rule, each a lagkv parameter (the row 'LagKV (kvpress defaults)' sets all "
             "three). (1) kvpress's default cross_scoring=False replaces each scored token's score by its rank "
             "within its partition / lag_size, so every scored partition keeps the same number of tokens; kvsim's "
             "default cross_scoring=true ranks the raw scores across partitions. (2) The partial last partition: "
             "1024 = 4 + 7 x 128 + 124, and kvpress leaves the last full partition and the remainder unscored "
             "(positions 772-1023, score 1 like the sinks: 256 kept outright), while kvsim's default "
             "partial_reference=true scores partition 772-899 against the 124-token remainder and leaves only "
             "900-1023 unscored. (3) kvpress's standard deviation over the channels is torch.std's, with Bessel's "
             "correction (std_ddof=1); kvsim's default is the population std (std_ddof=0)."),
    "LagKV (kvpress defaults)": Case("lagkv:n_sink=4,n_recent=0,lag_size=128,cross_scoring=false,partial_reference=false,std_ddof=1", {"n_sink": 4, "lag_size": 128, "cross_scoring": False, "partial_reference": False, "std_ddof": 1}, note="kvpress's rule (policies/lagkv.py, parameters cross_scoring, partial_reference, std_ddof). What "
             "differs is an exact tie at the cut that torch.topk breaks in an unspecified order: the 4 sinks and "
             "the 252 unscored positions 772-1023 are kept, which leaves 256 slots for the 6 scored partitions of "
             "128 (positions 4-771); 256 = 6 x 42 + 4, so every partition keeps its tokens of rank 86-127 and 4 of "
             "the 6 tokens of rank 85 (score 85/128 in all six partitions) are kept. kvsim keeps those of the 4 "
             "newest partitions (ties evict the older token); torch.topk keeps some 4, differing by head (it "
             "agrees in the rows_identical heads). The diagnosis confirms it: every differing token scores "
             "exactly as a token on the other side of kvpress's cut (tied_with_cut_score = differing_tokens). At "
             "most 2 of a head's 512 tokens swap, Jaccard >= 510 / 514 = 0.9922."),
    "LagKV (cross-scored lag 102)": Case("lagkv:n_sink=4,n_recent=0,lag_size=102,std_ddof=1", {"n_sink": 4, "lag_size": 102, "cross_scoring": True, "std_ddof": 1}, press={"cls": "LagKVPress", "n_sink": 4, "lag_size": 102, "cross_scoring": True}, diagnostics=(("std_ddof=0 (kvsim's default)", "lagkv:n_sink=4,n_recent=0,lag_size=102"),), note="kvpress's cross-partition mode with no partial partition (1020 = 10 x 102), where kvsim's defaults "
             "for cross_scoring and partial_reference are kvpress's rule, and std_ddof=1 (torch.std's Bessel "
             "correction, as kvpress). kvsim adds 1e-6 to the reference's min-max range, kvpress does not; it "
             "changes no decision here. With kvsim's default std_ddof=0 (diagnostics) two (layer, KV head) rows "
             "differ by one token each (layer 1 head 2: 641 / 828; layer 2 head 0: 594 / 904): the population "
             "std scales every token's key and value statistics by sqrt(63 / 64) before the softmax, which moves "
             "these near ties across the cut. (An earlier version of this note put them down to float32 "
             "rounding in kvpress; recomputed in float64 with std_ddof=1 the kept sets are identical.)"),
    "ChunkKV(SnapKV)": Case("chunkkv:n_sink=0,n_recent=0,chunk_length=20,window_size=64", {"chunk_length": 20, **SNAP}, press={"cls": "ChunkKVPress", "press": {"cls": "SnapKVPress", **SNAP}, "chunk_length": 20}, note="kvsim's chunkkv at its own defaults, which differ from kvpress's ChunkKVPress (submitted to kvpress as "
             "the paper's implementation, kvpress PR #51) in four rules, each a chunkkv parameter (the row 'ChunkKV(SnapKV) (kvpress "
             "reading)' sets them). The main one: kvpress sums the inner press's scores over the KV heads and "
             "keeps the same chunks in every head of a layer (scope=layer); kvsim's default scope=head ranks the "
             "chunks of each KV head by that head's scores. The others: kvsim's default token score is the window "
             "attention without SnapKV's avg pooling (kernel_size=5, pooling=avg) and without its max+1 window "
             "padding (window_pad=true, which makes kvpress keep the chunks covering the last 64 tokens), and "
             "chunks rank by sum (kvpress: by mean, chunk_reduce=mean, which differs for the 4-token remainder "
             "chunk only). kvpress keeps int(52 chunks x 0.5) = 26 chunks = 504 tokens here (25 chunks + the "
             "remainder); kvsim is given 504 (own_budget: at 512)."),
    "ChunkKV(SnapKV) (kvpress reading)": Case("chunkkv:n_sink=0,n_recent=0,chunk_length=20,window_size=64,scope=layer,chunk_reduce=mean,kernel_size=5,"
        "pooling=avg,window_pad=true", {"chunk_length": 20, **SNAP, "scope": "layer", "chunk_reduce": "mean", "pooling": "avg",
         "window_pad": True}, diagnostics=(("scope=layer alone (no pooling, no window padding, chunk sums)",
                      "chunkkv:n_sink=0,n_recent=0,chunk_length=20,window_size=64,scope=layer"),), note="kvpress's rule (policies/chunkkv.py, parameters scope, chunk_reduce, kernel_size, pooling, "
             "window_pad): SnapKV's window scores avg-pooled over 5 positions, the 64-token window padded to the "
             "layer's best + 1 (kvsim: + window_size, on its scale of window sums), summed over the layer's KV "
             "heads, chunks ranked by their mean. kvpress keeps 26 of 52 chunks (504 tokens); kvsim is given "
             "kvpress's count (own_budget: at 512 kvsim also keeps 8 tokens of the 27th chunk, 504 / 512). "
             "scope=layer alone (diagnostics) is not enough; leaving out one parameter at a time "
             "(checked while adding them): without scope=layer Jaccard min 0.474, without the pooling 0.787, "
             "without window_pad 0.984, without chunk_reduce=mean 1.0 (the 4-token remainder chunk, the only "
             "partial one, lies in the padded window and is kept either way)."),
    "TOVA": Case("tova", {"scope": "layer"}, press={"cls": "TOVAPress"}, note="Not the same setting in kvsim: the plain tova streams its prompt, so compressed once after the "
             "prompt (the engine's chunked prefill with one 1024-token chunk) its step sees the attention summed "
             "over all the chunk's queries, H2O's column sums (README, 'Chunked prefill'); TOVAPress scores by the "
             "last query's attention only. kvsim's TOVA has that rule as its prompt score, which ada(tova) uses: "
             "next row."),
    "TOVA (prompt score)": Case("ada(tova, floor_alpha=1)", {"scope": "layer", "floor_alpha": 1}, note="ada(x, floor_alpha=1) is x with its prompt selected at once by x's prompt score and uniform head "
             "budgets (README identity): TOVA's last-query attention, summed over the layer's heads."),
    "PyramidKV": Case(f"pyramidkv:{SNAP_KVSIM},beta=20,window_only=true", {**SNAP, "pooling": "avg (kvpress)", "beta": 20, "window_only": True}, press={"cls": "PyramidKVPress", **SNAP, "beta": 20}, diagnostics=(("window_only=false (kvsim's default)", f"pyramidkv:{SNAP_KVSIM},beta=20"),), note="Compared at kvpress's per-layer counts (960 at layer 0 down to 64 at layer 29), with window_only=true: "
             "at a budget equal to the window kvsim then keeps the window alone, as kvpress does (its window "
             "scores are max+1); with kvsim's default window_only=false layer 29 keeps 63 window tokens and the "
             "best candidate (diagnostics). The counts themselves differ by design: kvpress's get_layer_budget "
             "builds KVCache-Factory's pyramid on max_capacity_prompt = window + 512 but uses each value as the "
             "layer's total, window included; kvsim's pyramid_layer_budgets (KVCache-Factory's and Ada-KV's rule) "
             "adds the window on top of the pyramid of the budget's non-window part: 938 down to 86 "
             "(own_budget)."),
    "AdaKV(SnapKV)": Case(f"ada(snapkv:{SNAP_KVSIM}, floor_alpha=0.2)", {**SNAP, "pooling": "avg (kvpress)", "alpha_safeguard": 0.2}, press={"cls": "AdaKVPress", "press": {"cls": "SnapKVPress", **SNAP}, "alpha_safeguard": 0.2}, budgets="base", diagnostics=(("snapkv at kvpress's per-head counts", f"snapkv:{SNAP_KVSIM}"),), note="The heads' budgets differ, the selection within a head does not (diagnostics: plain snapkv at "
             "kvpress's per-head counts is identical). kvpress's AdaKVPress guarantees each head its top "
             "int(0.2 x 512) = 102 tokens (SnapKV's 64 window tokens, padded to max+1, among them) and hands out "
             "the rest of the layer's 3 x 512 by a top-k over the flattened scores; kvsim's ada is the Ada-KV "
             "authors' safeguard: every head keeps the 64-token window and its candidate budget is the mixture "
             "0.8 n_h + 0.2 x 448, n_h its count in the flattened top 3 x 448 of the non-window candidates "
             "(policies/core/stage_ada.py ada_allocate, ada_prompt). Head sizes: kvpress 148-929, kvsim 221-846."),
    "CriticalKV(ExpectedAttention)": Case(f"critical({EA_NOVNORM}, {CRIT}=0.5)", {"epsilon": 1e-4, "first_stage_ratio": 0.5, "n_sink": 4, "use_vnorm": False}, diagnostics=(("first stage of 252 candidates (first_stage_ratio=252.5/508)",
                      f"critical({EA_NOVNORM}, {CRIT}={252.5 / 508!r})"),), note="Stage 1's size differs by two tokens: kvpress keeps int(0.5 x 512) = 256 tokens by score, the 4 sinks "
             "(padded to max+1 by ExpectedAttentionPress) among them, so 252 candidates; kvsim's first_stage_ratio "
             "is a share of the slots left for candidates, int((512 - 4) x 0.5) = 254 (policies/core/stage_critical.py "
             "critical_stages). With 252 candidates in stage 1 kvsim's sets are identical (diagnostics)."),
    "CriticalAdaKV(ExpectedAttention)": Case(f"critical(ada({EA_NOVNORM}, floor_alpha=0.2), {CRIT}=0.5)", {"alpha_safeguard": 0.2, "epsilon": 1e-4, "first_stage_ratio": 0.5, "n_sink": 4, "use_vnorm": False}, press={"cls": "CriticalAdaKVPress", "press": {"cls": "ExpectedAttentionPress", "n_sink": 4, "use_vnorm": False},
         "alpha_safeguard": 0.2, "epsilon": 1e-4, "first_stage_ratio": 0.5}, budgets="base", diagnostics=(("critical without ada at kvpress's per-head counts", f"critical({EA_NOVNORM}, {CRIT}=0.5)"),), note="Three differences. (1) The head budgets, as for AdaKV(SnapKV) (kvpress 102-1011 tokens per head, "
             "kvsim 126-911). (2) kvpress's CriticalAdaKVPress sets the safeguard tokens' scores to float max in "
             "place (criticalkv_press.py, `scores.scatter_(-1, top_indices, finfo.max)`, before the budget step, "
             "whose next line scatters the same again into a copy), so every head's top 102 tokens by score also "
             "skip the W_O rescoring of stage 2: a head allotted at most 204 tokens keeps only its top tokens by "
             "score (layer 3, KV head 0: 102 tokens, all by score); kvsim's critical(ada(...)) runs both stages "
             "within each head's allocation. (3) Stage 1 counts the sinks, as for CriticalKV. With kvpress's "
             "per-head counts, kvsim's critical (diagnostics) still differs where (2) applies."),
    "ObservedAttention": Case("observed_attention:n_sink=0,n_recent=0", {"protected": "none (kvpress)"}, requires=("observed_attention",)),
    "CUR": Case("cur:num_sinks=4,n_recent=0,leverage_type=kv_product,use_local_approximation=true,"
                "local_window_size=16", {"num_sinks": 4, "leverage_type": "kv_product", "use_local_approximation": True,
                 "local_window_size": 16}, requires=("cur",)),
    "QFilter": Case("qfilter:n_sink=0,n_recent=0", {"protected": "none (kvpress)"}, inject="q_filters", requires=("qfilter",), note="kvpress loads each model's filters from the Hugging Face hub, which this machine cannot reach (and has "
             "none for SmolLM2); kvsim calibrates them on the prompt's own queries. kvpress's press is handed "
             "kvsim's filters (QFilterPress.load_q_filters monkeypatched), so what is compared is the scoring "
             "-<k, f> and the selection."),
    "DuoAttention (on the fly)": Case("duo_attention:head_compression_ratio=0.5,sink_size=128,recent_size=256,pattern_len=500", {"head_compression_ratio": 0.5, "sink_size": 128, "recent_size": 256, "pattern_len": 500}, budgets="prompt", inject="duo_head_scores", requires=("duo_attention",), note="kvpress's on-the-fly head scores average 50 BookSum samples from the Hugging Face hub, unreachable "
             "here; its duo_attention_on_the_fly is monkeypatched to return kvsim's head scores (computed on the "
             "prompt, policies/duo_attention.py), so what is compared is the split (the round(0.5 x 90) = 45 "
             "lowest-scored KV heads stream) and the masks (a streaming head keeps its first 128 and last 256 "
             "tokens, a retrieval head all). kvsim runs at a budget of the whole prompt, its own allocation "
             "making the split. kvpress's resulting compression ratio is 0.5 x (1 - 384 / 1024) = 0.3125, not "
             "the benchmark's ratio."),
    "KVzip": Case("kvzip:n_sink=4,n_recent=0,layerwise=false,chunk_size=2048", {"n_sink": 4, "layerwise": False, "chunk_size": 2048, "instruction": "kvpress's, no chat template"}, requires=("kvzip",), note="kvpress's KVzipPress rereads the prompt after the prefill ('Repeat the previous context exactly.', "
             "a suffix, the prompt) and prunes the lowest scores of all layers and heads ranked together; kvsim's "
             "trace is recorded with the same pass (`kvsim record --kvzip`, traces/hf/reconstruction_pass.py). kvpress "
             "writes the suffix from the tokenizer's chat template; the prompts here are plain text, so the "
             "worker hands KVzipPress the tokenizer without its template (suffix '\\n', kvpress's choice for a "
             "tokenizer without one, and kvsim's). Compared at kvpress's per-head counts (the selection); "
             "own_budget: kvsim's own global allocation at 512 per head."),
    "DMS(Knorm)": Case("threshold(knorm:n_sink=0,n_recent=0, tau={tau}, sliding_window_size=128)", {"threshold": "{tau}", "sliding_window_size": 128, "scorer": "Knorm"}, budgets="prompt", fill="knorm_median_tau", requires=("threshold", "knorm"), note="DMSPress masks the prompt tokens older than the 128 newest whose inner score is below the "
             "threshold; kvsim's threshold(...) evicts the same at prefill, at a budget of the whole prompt so "
             "that the threshold alone decides. The threshold is minus the median key norm of the judged tokens "
             "(3 significant digits), fixed from the trace before either side runs; Knorm's score of a token "
             "does not depend on the others, so kvpress's 'score when appended' and kvsim's 'score when judged' "
             "agree."),
    "KVzip+": Case("kvzip_plus:n_sink=4,n_recent=0,layerwise=false,chunk_size=2048",
                   {"n_sink": 4, "layerwise": False, "chunk_size": 2048, "kvzip_plus_normalization": True,
                    "instruction": "kvpress's, no chat template"}, requires=("kvzip_plus",),
                   note="KVzip's pass and ranking, each repeat query's attention divided by its hidden-state norm "
                        "at the attention's input and each token's column multiplied by ||W_O^(g) v|| "
                        "(policies/kvzip_plus.py); the trace records the norms with the pass (recon_h). Compared "
                        "at kvpress's per-head counts; own_budget: kvsim's own global allocation at 512 per head."),
    "FastKVzip": Case(None, {}, press={"cls": "FastKVzipPress"},
                      why_not="FastKVzip scores each token with a small gate network trained per model (kvpress "
                              "downloads its weights from the Hugging Face hub, for Qwen3, Llama-3.1 and Gemma-3 "
                              "12 B-class models); a trace records no such weights and none exist for SmolLM2 or "
                              "Gemma-3-270M, so the rule cannot be expressed from what a trace records"),
    "RestoreKV": Case(None, {}, press={"cls": "RestoreKVPress"},
                      why_not="RestoreKV adds n restore tokens produced by a LoRA-adapted pass with trained "
                              "embeddings (published for Llama-3.1-8B-Instruct and Qwen3-8B only) and keeps their "
                              "new K/V beside KVzip's selection: its cache holds pairs no prompt token produced, "
                              "which a kept-set policy over a trace cannot express; its selection is KVzip's "
                              "(kvzip / kvzip_plus here)"),
    "TriAttention": Case(
        "triattention", {"divide_length": 128, "offset_max_length": 65536, "offset_agg": "mean", "normalize": True,
                         "group_agg": "max", "protect_prefill": True, "n_recent": 0},
        why_not="kvpress 0.5.5 ships no TriAttention press: nothing to compare kept sets with",
        note="kvsim's triattention follows the method's released code (github.com/WeianMao/triattention, its Hugging "
             "Face path at the experiment runner's defaults); tests/test_triattention.py checks its scores, "
             "statistics, selection and whole decode against a NumPy transcription of that code's formulas and "
             "schedule. Two parts of the released defaults a trace cannot express: (1) the default pruning mode "
             "(per_head_pruning) averages each layer's group-maximum score over all layers and keeps one set per "
             "KV-head index, the same in every layer, while a kvsim policy decides per layer (the simulator replays "
             "one layer at a time, the closed loop steps the layers side by side), so kvsim runs the code's "
             "per-layer option (per_layer_perhead_pruning=True, layer_perhead_aggregation=max); (2) the query "
             "statistics come from a file calibrated offline on another text, which neither a policy nor a trace "
             "holds, so kvsim calibrates them on the prompt's own queries."),
    "KVgrad": Case(None, {}, press={"cls": "KVgradPress"},
                   why_not="KVgrad scores each KV pair by input x gradient of the final hidden states through a "
                           "backward pass over KVzip's reconstruction; a trace records forward activations only "
                           "(no gradients), so the score cannot be computed from it (recording the gradient score "
                           "itself would make it a per-token table, not a rule kvsim replays)"),
}


# ---------------------------------------------------------------- the report of a comparison (no kvpress, no torch)

def summarize(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Jaccard min/mean over all (layer, head) rows of masks [L, H, n], and where they differ."""
    j = jaccard(a, b)
    worst = np.unravel_index(int(np.argmin(j)), j.shape)
    return {"jaccard_min": float(j.min()), "jaccard_mean": float(j.mean()),
            "rows_identical": int((j == 1.0).sum()), "rows": int(j.size),
            "rows_differing": [[int(x) for x in r] for r in np.argwhere(j < 1.0)[:20]],
            "worst": {"layer": int(worst[0]), "kv_head": int(worst[1]), "jaccard": float(j[worst]),
                      "kvpress_only": np.flatnonzero(a[worst] & ~b[worst]).tolist()[:16],
                      "kvsim_only": np.flatnonzero(b[worst] & ~a[worst]).tolist()[:16]}}


def diagnosis(scores: np.ndarray, a: np.ndarray, b: np.ndarray) -> dict[str, Any] | None:
    """Where masks a (kvpress) and b (kvsim) [L, H, n] differ, judged by kvpress's own scores [L, H, n]: how many
    tokens differ, how far from the cut they lie in kvpress's score ranks (descending; the cut of a row is after
    its a-count; 0 = right at the cut) and how many of them score exactly as a token on the other side of
    kvpress's cut (an exact tie in kvpress). Small distances mean near ties; large ones a difference in what is
    ranked. None if the masks agree. Meaningful where kvpress keeps the top of these scores (a plain ScorerPress)."""
    n_diff, far, tied = 0, 0, 0
    for idx in zip(*np.nonzero((a != b).any(-1))):
        row = scores[idx]
        order = np.argsort(-row, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        cut = int(a[idx].sum())
        diff = np.flatnonzero(a[idx] != b[idx])
        n_diff += diff.size
        far = max(far, int((np.abs(rank[diff] - (cut - 0.5)) - 0.5).max()))
        keep = a[idx]
        if keep.any() and (~keep).any():        # scored exactly as a token on the other side of kvpress's cut
            in_a = keep[diff]
            tied += int((row[diff][in_a] == row[~keep].max()).sum() + (row[diff][~in_a] == row[keep].min()).sum())
    if n_diff == 0:
        return None
    return {"differing_tokens": n_diff, "max_rank_from_cut": far, "tied_with_cut_score": tied}


# ---------------------------------------------------------------- the kvpress worker (runs in the kvpress env)

def _build_press(spec: dict, kvpress: Any) -> Any:
    kwargs = {k: _build_press(v, kvpress) if isinstance(v, dict) and "cls" in v else v
              for k, v in spec.items() if k != "cls"}
    return getattr(kvpress, spec["cls"])(**kwargs)


def _innermost_scorer(press: Any) -> Any:
    while hasattr(press, "press") and press.press is not None:
        press = press.press
    return press if hasattr(press, "score") else None


def _rows_kept(before: Any, after: Any) -> np.ndarray:
    """[H, P] bool: which rows of ``before`` [H, P, d] survive in ``after`` [H, n, d] (exact matches)."""
    b = before.float().numpy()
    a = after.float().numpy()
    out = np.zeros(b.shape[:2], bool)
    for h in range(b.shape[0]):
        where: dict[bytes, int] = {}
        dup = set()
        for i, row in enumerate(b[h]):
            key = row.tobytes()
            if key in where:
                dup.add(key)
            where[key] = i
        for row in a[h]:
            key = row.tobytes()
            if key not in where or key in dup:
                raise RuntimeError("a kept key matches no prompt key, or several: cannot tell its position")
            out[h, where[key]] = True
    return out


def worker(request_path: str) -> None:
    """The kvpress side: for each press of the request, prefill the prompt under it and save the kept masks."""
    import importlib.metadata as md

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    import kvpress
    from kvpress.presses import duo_attention_press

    req = json.loads(Path(request_path).read_text())
    torch.set_num_threads(int(req.get("threads", 2)))
    out_dir = Path(req["out_dir"])
    ids = torch.tensor([req["token_ids"]])
    P = ids.shape[1]
    models: dict[str, Any] = {}
    info: dict[str, Any] = {"kvpress": md.version("kvpress"), "transformers": md.version("transformers"),
                            "torch": torch.__version__, "presses": {}}
    # what torch.topk does with equal scores on this machine (kvpress's eviction among ties)
    tie = torch.topk(torch.ones(P), P // 2).indices.sort().values
    info["topk_ties"] = ("lowest indices" if bool((tie == torch.arange(P // 2)).all()) else
                         "highest indices" if bool((tie == torch.arange(P - P // 2, P)).all()) else
                         f"mixed (first {tie[:4].tolist()} ...)")

    for case in req["cases"]:
        name, spec = case["name"], case["press"]
        t0 = time.perf_counter()
        try:
            attn = case["attn"]
            if attn not in models:
                m = AutoModelForCausalLM.from_pretrained(req["model"], dtype=torch.float32, local_files_only=True,
                                                         attn_implementation=attn)
                models[attn] = m.eval()
            model = models[attn]
            L = model.config.num_hidden_layers
            H = model.config.num_key_value_heads
            inject = case.get("inject")
            if inject == "duo_head_scores":
                scores = np.load(out_dir / f"inject_{case['file']}.npz")["head_scores"]
                duo_attention_press.duo_attention_on_the_fly = lambda *a, **k: scores
            if inject == "q_filters":
                filt = torch.from_numpy(np.load(out_dir / f"inject_{case['file']}.npz")["q_filters"])
                kvpress.QFilterPress.load_q_filters = staticmethod(lambda *a, **k: filt)
            rereads = spec["cls"] == "KVzipPress"
            if rereads:     # plain-text prompts: KVzipPress's tokenizer without a chat template (Case note)
                from kvpress.presses import kvzip_press
                from transformers import AutoTokenizer

                def plain_tokenizer(*a, **k):
                    tok = AutoTokenizer.from_pretrained(*a, **k)
                    tok.chat_template = None
                    return tok

                kvzip_press.AutoTokenizer = type("PlainTokenizer", (), {"from_pretrained": staticmethod(
                    plain_tokenizer)})
            press = _build_press(spec, kvpress)
            if case["sets_ratio"]:
                press.compression_ratio = case["ratio"]
            kept = np.zeros((L, H, P), bool)
            raw = np.full((L, H, P), np.nan, np.float32)
            keys = np.zeros((L, H, P, model.config.head_dim), np.float32) if case.get("save_keys") else None
            scorer = _innermost_scorer(press)
            if scorer is not None:
                score_fn = scorer.score

                def score(module, *args, _f=score_fn, **kwargs):
                    s = _f(module, *args, **kwargs)
                    if s.shape[-1] == P:
                        raw[module.layer_idx] = s[0].detach().float().numpy()
                    return s

                scorer.score = score
            hook_fn = press.forward_hook

            def hook(module, args, kwargs, output, _f=hook_fn):
                i = module.layer_idx
                layer = kwargs["past_key_values"].layers[i]
                before = layer.keys.detach().clone()
                result = _f(module, args, kwargs, output)
                if before.shape[2] != P:
                    return result
                if keys is not None:
                    keys[i] = before[0].float().numpy()
                after = layer.keys
                mask = _rows_kept(before[0], after[0])
                masked = getattr(module, "masked_key_indices", None)
                if masked is not None:
                    if after.shape != before.shape:
                        raise RuntimeError("a press both pruned and masked: positions unknown")
                    _, h_idx, s_idx = (t.cpu().numpy() for t in masked)
                    mask[h_idx, s_idx] = False
                kept[i] = mask
                return result

            press.forward_hook = hook
            with torch.no_grad(), press(model):
                model.model(input_ids=ids, past_key_values=DynamicCache(config=model.config))
            if rereads:     # KVzip masks after its reconstruction pass, once the block ends
                kept[:] = True
                for layer in model.model.layers:
                    _, h_idx, s_idx = (t.cpu().numpy() for t in layer.self_attn.masked_key_indices)
                    kept[layer.self_attn.layer_idx, h_idx, s_idx] = False
                    layer.self_attn.masked_key_indices = None
            arrays = {"kept": kept, "scores": raw}
            if keys is not None:
                arrays["keys"] = keys
            np.savez(out_dir / f"kvpress_{case['file']}.npz", **arrays)
            info["presses"][name] = {"ok": True, "seconds": time.perf_counter() - t0, "repr": repr(press)[:400]}
        except Exception as e:  # noqa: BLE001 -- one failing press must not hide the others' results
            import traceback

            info["presses"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                     "traceback": traceback.format_exc()[-3000:]}
    (out_dir / "kvpress_info.json").write_text(json.dumps(info, indent=1))


# ---------------------------------------------------------------- the kvsim side

def ensure_env(rebuild: bool = False) -> Path:
    """The kvpress environment's python (created with ``python -m venv`` + pip when missing or wrong)."""
    py = ENV / "bin" / "python"
    probe = ("import importlib.metadata as m; print(m.version('kvpress'), m.version('transformers'), "
             "m.version('torch').split('+')[0])")
    want = " ".join(r.split("==")[1] for r in ENV_REQUIREMENTS)
    if py.is_file() and not rebuild:
        got = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
        if got.returncode == 0 and got.stdout.strip() == want:
            return py
    print(f"creating {ENV} with {' '.join(ENV_REQUIREMENTS)} (about 1 GB of wheels) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(ENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *ENV_REQUIREMENTS],
                   check=True)
    return py


def record(ids: list[int], text_id: str, path: Path) -> Any:
    """The kvsim trace of the prompt (reused when it holds these token ids)."""
    from traces.format import load_trace
    from traces.models import load_model, model_id
    from traces.recorder import record_trace

    stamp = path.with_name(path.name + ".ids.json")
    if path.is_dir() and stamp.is_file() and json.loads(stamp.read_text()) == ids:
        trace = load_trace(path)
        if trace.meta.reconstruction is not None and trace.has_recon_h:      # KVzip+ reads the pass's norms
            return trace
    model, tok = load_model(MODEL, progress=True)
    record_trace(model, ids, path, n_prompt=len(ids) - 1, n_decode=1, tokenizer=tok, teacher_forced=True,
                 single_pass=True, chunk=len(ids) - 1, model_id=model_id(MODEL), source={"text_id": text_id},
                 progress=False, overwrite=True, reconstruction_chunk=2048)
    stamp.write_text(json.dumps(ids))
    return load_trace(path)


def kvsim_prefill(trace: Any, inputs: Any, policy: Any, budgets: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """The prompt compressed once by a policy with a prefill selector, as the engine does before decode: its
    prefill kernel on each layer's prompt with head (l, h) at budgets[l, h] slots (an Ada-KV policy takes them as
    its base sizes and allocates within the layer). Returns the kept mask [L, H, P] and each layer's head state
    after the prefill (where a policy keeps what it calibrated on the prompt: Q-Filters' filters)."""
    from sim.replay.layer_inputs import layer_memo
    from sim.replay.step_plan import initial_head_state

    P = trace.meta.n_prompt
    L, H = len(inputs), trace.meta.model.n_kv_heads
    out = np.zeros((L, H, P), bool)
    heads = []
    kernel = policy.kernels()[1]
    prompt = prompt_layers(trace, inputs)
    for layer, li in enumerate(inputs):
        keep = np.ones((H, P), np.uint8)
        head = np.ascontiguousarray(initial_head_state(policy, li, layer_memo(inputs, layer), prompt, layer),
                                    np.float64)
        kernel(policy.param_vector(li.attention), layer, np.ascontiguousarray(budgets[layer], np.int64),
               li.q[:P], li.k[:P], li.v[:P], float(li.attention.scale), keep,
               np.zeros((H, P, policy.slot_fields)), head)
        out[layer] = keep.astype(bool)
        heads.append(head)
    return out, heads


def kvsim_kept(trace: Any, inputs: Any, policy: Any, budgets: np.ndarray) -> np.ndarray:
    """[L, H, P] kept mask of ``policy`` after compressing the trace's prompt once, head (l, h) to budgets[l, h]
    slots: ``kvsim_prefill`` for a policy with a prefill selector; one that streams its prompt is replayed with
    the whole prompt as one chunk and its set read after the prompt's last step (uniform budgets only)."""
    from sim.replay.policy_replay import replay

    P = trace.meta.n_prompt
    if policy.has_prefill:
        return kvsim_prefill(trace, inputs, policy, budgets)[0]
    b = int(budgets.max())
    if (budgets != b).any():
        raise ValueError(f"{policy.label()} streams its prompt: one budget for all heads, not {budgets}")
    res = replay(trace, policy, b, inputs=inputs, record_kept=(P - 1, 1), chunk=P)
    return kept_mask(res.kept[:, 0], P)


def prompt_layers(trace: Any, inputs: Any) -> Any:
    """What a policy's allocator reads of the prompt (every layer's q[:P], k[:P], with the trace's RoPE bases)."""
    from sim.replay.layer_inputs import PromptLayers

    return PromptLayers(trace, inputs, list(range(len(inputs))), trace.meta.n_prompt)


#: kvsim -> kvpress hand-overs (Case.inject): name -> function(trace, inputs, policy) -> {array name: array}
def _inject_duo(trace: Any, inputs: Any, policy: Any) -> dict[str, np.ndarray]:
    """kvsim's on-the-fly DuoAttention head scores [L, Hkv] (what kvpress's ``duo_attention_on_the_fly`` gives)."""
    return {"head_scores": np.asarray(policy.head_scores(prompt_layers(trace, inputs)), np.float64)}


def _inject_qfilters(trace: Any, inputs: Any, policy: Any) -> dict[str, np.ndarray]:
    """kvsim's Q-Filters [L, Hkv, d], calibrated on the prompt by the prefill (head state [1 : 1 + d],
    policies/qfilter.py), for kvpress's ``QFilterPress.load_q_filters``."""
    d = trace.meta.model.head_dim
    budgets = np.full((len(inputs), trace.meta.model.n_kv_heads), trace.meta.n_prompt, np.int64)
    _, heads = kvsim_prefill(trace, inputs, policy, budgets)
    return {"q_filters": np.stack([h[:, 1:1 + d] for h in heads]).astype(np.float32)}


INJECTIONS = {"duo_head_scores": _inject_duo, "q_filters": _inject_qfilters}


def _knorm_median_tau(trace: Any, inputs: Any) -> dict[str, float]:
    """A DMS threshold on Knorm's score -||k||: minus the median key norm of the prompt's tokens that the threshold
    judges (all but the last 128) over every layer and head, to 3 significant digits, so that about half of them
    go (the scale of a threshold is the scorer's; this one is chosen before either side runs)."""
    P = trace.meta.n_prompt
    norms = np.concatenate([np.linalg.norm(np.asarray(li.k[:P - 128], np.float64), axis=-1).ravel()
                            for li in inputs])
    return {"tau": -float(f"{np.median(norms):.3g}")}


#: run-time values of a case (Case.fill): name -> function(trace, inputs) -> {placeholder: value}
FILLS = {"knorm_median_tau": _knorm_median_tau}


def fill(spec: Any, values: dict[str, Any]) -> Any:
    """``spec`` with every "{name}" placeholder (a whole string value, or inside a kvsim spec) replaced."""
    if isinstance(spec, dict):
        return {k: fill(v, values) for k, v in spec.items()}
    if isinstance(spec, str):
        if spec.startswith("{") and spec.endswith("}") and spec[1:-1] in values:
            return values[spec[1:-1]]
        return spec.format(**values) if values else spec
    return spec


def declared_press(policy: Any, prompt_tokens: int, budget: int) -> dict[str, Any]:
    """What ``kvsim export --kvpress`` gives for ``policy`` at ``budget`` on this prompt: the counterpart (None when
    refused) and, for the JSON, the press and the least Jaccard index it promises, or the refusal's reason."""
    try:
        cp = policy.kvpress_press()
    except NoKvpressPress as e:
        return {"counterpart": None, "export": {"refused": str(e)}}
    try:
        ex = export(policy, budget, prompt_tokens)
    except NoKvpressPress as e:
        return {"counterpart": cp, "export": {"press": press_repr(cp.press), "refused": str(e)}}
    return {"counterpart": cp, "export": {"press": press_repr(cp.press), "jaccard_floor": ex.jaccard_floor}}


def available(case: Case) -> str | None:
    """None if kvsim has what the case needs, else why not (the policies and combinators it names)."""
    from policies.core.combinators import STAGES
    from policies.core.registry import list_policies

    names = set(list_policies()) | set(STAGES)
    missing = [r for r in case.requires if r not in names]
    if missing:
        return f"not available: kvsim has no {', '.join(missing)} policy in its registry"
    if case.kvsim is None or case.why_not:
        return f"not available: {case.why_not or 'no kvsim spec for this press'}"
    return None


def file_tag(name: str) -> str:
    """A file-name part for a case name, one-to-one for the table's names ("KVzip+" is not "KVzip")."""
    return "".join(c if c.isalnum() else "_" for c in name.replace("+", "_plus")).strip("_")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratio", type=float, default=RATIO, help="kvpress compression ratio (default 0.5)")
    ap.add_argument("--only", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--rebuild-env", action="store_true", help="recreate benchmarks/.kvpress-env")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return

    from benchmarks._util import RESULTS, machine
    from sim.replay.layer_inputs import layer_inputs
    from sim.replay.plan import allocation, compressed_layers
    from sim.experiments.specs import parse_policy
    from sim.replay.threads import limit_threads
    from traces.format import atomic_write_text
    from traces.model import read_text
    from traces.models import resolve_model

    t_start = time.perf_counter()
    limit_threads(2)
    WORK.mkdir(parents=True, exist_ok=True)
    folder = resolve_model(MODEL)                           # converted the kvsim way on first use
    text, text_id = read_text(TEXT)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids_all = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
    P = PROMPT_TOKENS
    ids = [int(t) for t in ids_all[:P + 1]]
    t0 = time.perf_counter()
    trace = record(ids, text_id, WORK / "trace")
    t_record = time.perf_counter() - t0
    inputs = layer_inputs(trace)
    assert len(compressed_layers(trace)) == len(inputs)
    L, H = len(inputs), trace.meta.model.n_kv_heads
    base = n_kept(P, args.ratio)

    wanted = list(CASES) if args.only is None else [n.strip() for n in args.only.split(",")]
    results: dict[str, dict[str, Any]] = {}
    runnable: list[str] = []
    policies: dict[str, Any] = {}
    presses: dict[str, dict] = {}
    settings: dict[str, dict] = {}
    for name in wanted:
        case = CASES[name]
        values = FILLS[case.fill](trace, inputs) if case.fill else {}
        spec = fill(case.kvsim, values)
        entry = {"params": fill(case.params, values), "kvsim_spec": spec, "note": case.note}
        why = available(case)
        if why is None:
            try:
                policies[name] = parse_policy(spec)
            except Exception as e:  # noqa: BLE001 -- a spec the registry refuses is reported, not fatal
                why = f"not available: kvsim refuses {spec!r}: {e}"
        declared = declared_press(policies[name], P, base) if why is None else None
        if why is None:
            entry["export"] = declared["export"]
        elif case.kvsim is not None and case.why_not:      # kvsim has the method, kvpress has no press: say so
            entry["export"] = declared_press(parse_policy(spec), P, base)["export"]
        if case.press is None and why is None and declared["counterpart"] is None:
            why = f"not available: kvsim's declaration refuses it: {declared['export']['refused']}"
        cp = declared["counterpart"] if declared else None
        presses[name] = fill(case.press, values) if case.press is not None else (cp.press if cp else None)
        settings[name] = {"attn": case.attn or (cp.attn if cp else "sdpa"),
                          "sets_ratio": case.sets_ratio if case.sets_ratio is not None else
                          (cp.sets_ratio if cp else True),
                          "budgets": "prompt" if case.press is None and cp and cp.budgets == "prompt" else case.budgets}
        if presses[name] is not None:
            entry["press"] = press_repr(presses[name])
            entry["press_from"] = "the kvsim policy's declaration" if case.press is None else "this row (a difference)"
        if why is None and case.inject:
            arrays = INJECTIONS[case.inject](trace, inputs, policies[name])
            np.savez(WORK / f"inject_{file_tag(name)}.npz", **arrays)
        if why is not None:
            entry.update(status="not available", note=f"{why}. {entry['note']}" if entry["note"] else why)
        else:
            runnable.append(name)
        results[name] = entry

    path = RESULTS / "kvpress_parity.json"
    if not runnable:          # only rows kvpress has no press for: nothing to run there, the rest of the file stays
        if not path.is_file():
            raise SystemExit(f"none of {wanted} runs in kvpress and there is no {path} to add them to")
        old = json.loads(path.read_text())
        old["policies"] = {**old["policies"], **results}
        atomic_write_text(path, json.dumps(old, indent=1, default=float) + "\n")
        print(f"updated {', '.join(results)} in {path}")
        return

    # kvpress side, one subprocess for all presses
    env_py = ensure_env(args.rebuild_env)
    request = {"model": str(folder), "token_ids": ids[:P], "out_dir": str(WORK), "threads": 2,
               "cases": [{"name": n, "file": file_tag(n), "press": presses[n], "attn": settings[n]["attn"],
                          "sets_ratio": settings[n]["sets_ratio"], "ratio": args.ratio, "inject": CASES[n].inject,
                          "save_keys": i == 0} for i, n in enumerate(runnable)]}
    req_path = WORK / "request.json"
    req_path.write_text(json.dumps(request))
    (WORK / "kvpress_info.json").unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run([str(env_py), "-m", "benchmarks.kvpress_parity", "--worker", str(req_path)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                         "TRANSFORMERS_OFFLINE": "1"})
    t_kvpress = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"kvpress worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    info = json.loads((WORK / "kvpress_info.json").read_text())

    key_diff = None
    t0 = time.perf_counter()
    for n in runnable:
        case, entry = CASES[n], results[n]
        got = info["presses"][n]
        if not got["ok"]:
            entry.update(status="kvpress failed", note=f"{got['error']} {entry['note']}".strip(),
                         traceback=got["traceback"])
            continue
        data = np.load(WORK / f"kvpress_{file_tag(n)}.npz")
        a = data["kept"]
        if "keys" in data and key_diff is None:
            ref = np.stack([li.k[:P].transpose(1, 0, 2) for li in inputs])
            key_diff = float(np.abs(data["keys"] - ref).max() / np.abs(ref).max())
        counts = a.sum(-1)
        pol = policies[n]
        mode = settings[n]["budgets"]
        if mode == "base":
            budgets = np.full((L, H), base, np.int64)
        elif mode == "prompt":
            budgets = allocation(trace, pol, P, inputs, list(range(L)))
        else:
            budgets = counts.astype(np.int64)
        b = kvsim_kept(trace, inputs, pol, budgets)
        entry.update(summarize(a, b))
        entry["status"] = "ok"
        entry["kvsim_setting"] = ("the policy's prefill selector on the prompt" if pol.has_prefill else
                                  f"the prompt streamed as one {P}-token chunk, the set after its last step")
        entry["kvsim_budgets"] = {"kvpress": "kvpress's count per (layer, KV head)",
                                  "base": f"{base} per KV head, allocated by the policy",
                                  "prompt": f"the policy's own allocation at a budget of {P}"}[mode]
        entry["kept_per_head"] = {"kvpress": _count_summary(counts), "kvsim": _count_summary(b.sum(-1))}
        scores = data["scores"]
        plain = not any(isinstance(v, dict) for v in presses[n].values())   # kvpress keeps the top of score()
        if plain and not np.isnan(scores).any():
            entry["diagnosis"] = diagnosis(scores, a, b)
        for label, spec in case.diagnostics:
            s = summarize(a, kvsim_kept(trace, inputs, parse_policy(spec), counts.astype(np.int64)))
            entry.setdefault("diagnostics", []).append({"label": label, "kvsim_spec": spec,
                                                        "jaccard_min": s["jaccard_min"],
                                                        "jaccard_mean": s["jaccard_mean"]})
        if mode == "kvpress":
            own = allocation(trace, pol, base, inputs, list(range(L)))
            entry["own_budget_same_counts"] = bool(np.array_equal(own, budgets))
            if not np.array_equal(own, budgets):
                b_own = kvsim_kept(trace, inputs, pol, own)
                s = summarize(a, b_own)
                entry["own_budget"] = {"jaccard_min": s["jaccard_min"], "jaccard_mean": s["jaccard_mean"],
                                       "kept_per_head": _count_summary(own)}
        ex = entry.get("export", {})
        if "jaccard_floor" in ex and case.press is None:
            own_j = entry.get("own_budget", {}).get("jaccard_min", entry["jaccard_min"])
            ex["jaccard_at_own_budget"] = own_j
            ex["holds"] = export_holds(ex["jaccard_floor"], own_j)
        entry["kvpress_compression"] = round(1 - float(counts.mean()) / P, 4)
        entry["kvpress_seconds"] = round(got["seconds"], 2)
    t_kvsim = time.perf_counter() - t0

    payload = {
        "policies": results, "prompt_tokens": P, "model": f"{MODEL} (SmolLM2-135M-Instruct, float32, {folder})",
        "text": text_id, "kvpress_version": info.get("kvpress"), "kvpress_env": {
            "transformers": info.get("transformers"), "torch": info.get("torch"),
            "requirements": list(ENV_REQUIREMENTS)},
        "compression_ratio": args.ratio, "kept_per_head_at_ratio": base,
        "tie_breaking": ("kvsim: among equal scores the older token is evicted (the newer kept); kvpress: "
                         f"torch.topk, unspecified among equal scores (on this machine, of {P} equal scores "
                         f"topk({P // 2}) kept the {info.get('topk_ties')})"),
        "keys_max_rel_diff": key_diff,
        "seconds": {"record_trace": round(t_record, 2), "kvpress_worker": round(t_kvpress, 2),
                    "kvsim_and_compare": round(t_kvsim, 2), "total": round(time.perf_counter() - t_start, 2)},
        "machine": machine(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.only and path.is_file():       # a partial run updates its rows, the others stay as they were
        payload["policies"] = {**json.loads(path.read_text())["policies"], **results}
    atomic_write_text(path, json.dumps(payload, indent=1, default=float) + "\n")
    print(f"wrote {path}")
    w = max(len(n) for n in results)
    for n, e in results.items():
        j = (f"{e['jaccard_min']:.4f} {e['jaccard_mean']:.4f}" if e.get("status") == "ok" else e.get("status"))
        print(f"{n:<{w}}  {j}")


def _count_summary(counts: np.ndarray) -> dict[str, Any]:
    c = np.asarray(counts)
    return {"min": int(c.min()), "max": int(c.max()), "mean": float(c.mean())}


if __name__ == "__main__":
    main()
