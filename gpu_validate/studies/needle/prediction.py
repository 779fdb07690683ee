"""The simulator's prediction of needle retrieval: per prompt, the same prompt plus the answer recorded as a
teacher-forced trace; each policy replayed on it and, at the answer steps, the share of the full-cache attention on
the key's tokens that falls on tokens the policy still holds, measured several ways (`FEATURES`: over all heads,
over the retrieval heads, at the first answer step, in the weakest layer, ...), with where the key is lost
(`DIAGNOSTICS`).

The features are kept in a resumable store of their own (`stored_features`), so a re-fit never re-records a trace.
The predictor and its threshold are chosen on some seeds and judged on the others (`gpu_validate.studies.needle.scores`:
`fit_threshold`, by balanced accuracy unless told otherwise, `prediction_report`, `binary_scores`): most cells fail,
so an agreement is reported next to its base rate, with balanced accuracy and Matthews correlation, which do not
reward calling the commoner outcome.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from gpu_validate.studies.needle.prompts import NeedlePrompt
from gpu_validate.studies.needle.runs import fits, prompt_chunk
from policies.core.base import Policy, reconstruction_chunk
from sim.replay.layer_inputs import load_layers
from sim.replay.policy_replay import replay
from traces.format import load_trace
from traces.recorder import record_trace

#: candidate predictors of retrieval, each a share in [0, 1] of the full-cache attention that the answer-step
#: queries put on the key's tokens and that falls on tokens the policy still holds; which one predicts is chosen
#: (with its threshold) on the training seeds only.
FEATURES = {
    "retained_share": "over all layers, query heads and answer steps",
    "retrieval_heads": "over the (layer, query head) pairs in the top 10% by attention on the key (retrieval heads)",
    "first_answer_step": "at the first answer token's step only",
    "weakest_layer": "the lowest per-layer share (of the layers whose answer steps attend the key at all)",
    "weakest_answer_step": "the lowest per-answer-step share (one lost digit breaks the answer, however well the "
                           "others are held)",
    "copy_target": "the lowest per-answer-step share on the evidence tokens that hold the token being written (the "
                   "copy an induction head reads), over the steps whose token occurs in the evidence",
}


#: where a replay loses the key, stored beside the features (not predictors): the model layer with the lowest
#: retained share among those that attend the key, and the answer step with the lowest share (0 = the first
#: answer token); `gpu_validate.studies.needle.scores.wrong_calls` names them for every wrong call
DIAGNOSTICS = ("weakest_layer_index", "weakest_step_index")


#: bumped when a feature's definition changes, so stored features computed the old way are recomputed (2: each
#: layer's own scale and window, a kept sliding window, the first answer step read from the prompt's own forward,
#: the weakest layer among those that attend the key; 3: the per-step features)
FEATURES_VERSION = 3


def needle_features(model, prompt: NeedlePrompt, configs: Sequence[tuple[Policy, int]], *,
                    model_id: str = "model", chunk: int = 1) -> list[dict[str, float]]:
    """Per (policy, budget): every `FEATURES` value, the `DIAGNOSTICS` and the K/V bytes held while answering
    (``kv_bytes_mean``), from a teacher-forced trace of prompt + answer replayed in the simulator (with the closed
    loop's prompt ``chunk``, `run_needle`)."""
    ids = list(prompt.ids) + list(prompt.answer)
    P, n_ans = len(prompt.ids), len(prompt.answer)
    with tempfile.TemporaryDirectory(prefix="kvsim-needle-") as tmp:
        record_trace(model, ids, Path(tmp) / "t", n_prompt=P, n_decode=n_ans, teacher_forced=True,
                     single_pass=True, progress=False, model_id=model_id, prompt_scores=False,
                     reconstruction_chunk=reconstruction_chunk([pol for pol, _ in configs]))
        trace = load_trace(Path(tmp) / "t")
        inputs = load_layers(trace)
        key_pos = np.asarray(prompt.key_positions)
        attn = _key_attention(inputs, P, n_ans, key_pos)
        targets = np.asarray(ids)[key_pos][None, :] == np.asarray(prompt.answer)[:, None]     # [A, n_key]
        windows = [li.attention.window for li in inputs]
        layer_ids = [int(x) for x in trace.meta.model.layer_ids]
        out = []
        for policy, budget in configs:
            C = prompt_chunk(prompt, chunk)
            res = replay(trace, policy, int(budget), inputs=inputs, record_kept=(P, n_ans), threads=1, chunk=C)
            first_full = policy.has_prefill or C >= P   # the first answer token comes from the prompt's own forward
            held = _held(res, key_pos, attn.shape, windows, P, first_full)
            out.append({**_features(attn, held, targets), **_diagnostics(attn, held, layer_ids),
                        "kv_bytes_mean": res.kv_bytes_mean})
    return out


def feature_key(prompt: NeedlePrompt, policy: Policy, budget: int, model_id: str, chunk: int = 1) -> str:
    """Stable key of one simulated (model, prompt, policy with its parameters, budget) cell in the feature store:
    the closed-loop cell's coordinates plus a digest of the prompt's token ids (another filler text makes another
    prompt under the same id) and the names of the `FEATURES` (a new candidate makes the stored rows stale)."""
    ids = hashlib.sha256(json.dumps(list(prompt.ids)).encode()).hexdigest()[:16]
    cell = [model_id, prompt.prompt_id, prompt.key, ids, policy.name, policy.params, int(budget), sorted(FEATURES),
            FEATURES_VERSION]
    payload = json.dumps(cell if chunk == 1 else cell + [int(chunk)], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def stored_features(model, prompts: Sequence[NeedlePrompt], configs: Sequence[tuple[Policy, int]], store, *,
                    model_id: str, chunk: int = 1, progress: bool = True,
                    log: Callable[[str], None] = print) -> "Any":
    """The `needle_features` of every prompt × (policy, budget), kept in ``store`` (a `sim.experiments.store.ResultStore`,
    beside the closed-loop one): cells already there are read back, and a prompt with missing cells is recorded
    and replayed for those only, then written as its own part file (atomic; an interrupted run resumes at the next
    prompt). Re-fitting the prediction (another ``--train-seeds`` or ``--fit-objective``) thus never re-records a
    trace. Returns one row per requested cell: prompt_id, label, budget and one column per feature."""
    known = store.load()
    done = set(known.key) if len(known) else set()
    todo = [(p, [(pol, b) for pol, b in configs if fits(p, pol, b)
                 and feature_key(p, pol, b, model_id, chunk) not in done]) for p in prompts]
    todo = [(p, cfgs) for p, cfgs in todo if cfgs]
    n_done = sum(fits(p, pol, b) for p in prompts for pol, b in configs) - sum(len(c) for _, c in todo)
    if n_done:
        log(f"simulator features: {n_done} cells already in {store.root}")
    for p, cfgs in tqdm(todo, desc="predict", unit="prompt", disable=not progress):
        feats = needle_features(model, p, cfgs, model_id=model_id, chunk=chunk)
        store.add([{"key": feature_key(p, pol, b, model_id, chunk), "model": model_id, "prompt_id": p.prompt_id,
                    "label": pol.label(), "policy": pol.name, "params": pol.params, "budget": int(b), **x}
                   for (pol, b), x in zip(cfgs, feats)])
    if todo:
        known = store.load()
    want = pd.DataFrame([{"key": feature_key(p, pol, b, model_id, chunk)} for p in prompts for pol, b in configs
                         if fits(p, pol, b)])
    rows = want.merge(known, on="key", how="left")
    extra = (*FEATURES, *DIAGNOSTICS, "kv_bytes_mean")      # the K/V bytes held while answering (not stored before)
    return rows[["prompt_id", "label", "budget", *[f for f in extra if f in rows.columns]]]


def prediction_table(df, features) -> "Any":
    """The lossy cells of a closed-loop table ``df`` with their simulator ``features`` (`stored_features`) and the
    full cache's outcome on the same prompt (``full_success``): what `gpu_validate.studies.needle.scores.prediction_report`
    fits and judges."""
    full_ok = df[df.policy == "full"].set_index("prompt_id").success.rename("full_success")
    merged = df[df.policy != "full"].merge(features, on=["prompt_id", "label", "budget"])
    return merged.join(full_ok, on="prompt_id")


def _key_attention(inputs, P: int, n_ans: int, key_pos: np.ndarray) -> np.ndarray:
    """Full-cache attention [L, n_ans, Hq, n_key] of the answer-step queries (positions P-1 .. P+n_ans-2,
    those that predict the answer's tokens) on the key's token positions, with each layer's own scale and window."""
    out = []
    for li in inputs:
        q = np.asarray(li.q[P - 1:P + n_ans - 1], np.float64)                 # [A, Hq, d]
        k = np.asarray(li.k[:P + n_ans - 1], np.float64)                      # [T, Hkv, d]
        g = q.shape[1] // k.shape[1]
        kk = np.repeat(k, g, axis=1)                                          # [T, Hq, d]
        logits = np.einsum("ahd,thd->aht", q, kk) * float(li.attention.scale)
        T = kk.shape[0]
        qpos = (P - 1 + np.arange(q.shape[0]))[:, None]
        seen = np.arange(T)[None, :] <= qpos
        if li.attention.window:
            seen &= np.arange(T)[None, :] > qpos - li.attention.window
        logits = np.where(seen[:, None, :], logits, -np.inf)
        logits -= logits.max(-1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(-1, keepdims=True)
        out.append(p[:, :, key_pos])
    return np.stack(out)


def _held(res, key_pos: np.ndarray, shape: tuple[int, ...], windows: Sequence[int | None], P: int,
          first_full: bool) -> np.ndarray:
    """[L, A, Hq, n_key] True where the replay ``res`` holds that key token for that answer-step query.
    ``res.kept`` [replayed layers, >= A-1, Hkv, W] are the positions cached after decode steps P, P+1, ...; the
    query at P-1 (first answer token) reads the whole prompt when ``first_full`` (a prefill selector, or the
    prompt as one chunk: the model's own prompt forward predicts it), else the cache the prompt left,
    approximated by the state after step P. A layer the replay left alone (a sliding layer kept) holds its
    window."""
    L, A, Hq, _ = shape
    kept = res.kept
    Hkv = kept.shape[2]
    g = Hq // Hkv
    held = np.zeros(shape, bool)
    replayed = {int(layer): j for j, layer in enumerate(res.layer_index)}
    for l in range(L):
        for a in range(A):
            if a == 0 and first_full:
                held[l, a] = True
            elif l not in replayed:
                held[l, a] = (key_pos > P - 1 + a - windows[l])[None, :] if windows[l] else True
            else:
                for h in range(Hkv):
                    held[l, a, h * g:(h + 1) * g] = np.isin(key_pos, kept[replayed[l], max(0, a - 1), h])[None, :]
    return held


def _share(attn: np.ndarray, held: np.ndarray) -> float:
    total = attn.sum()
    return float((attn * held).sum() / total) if total > 0 else 0.0


def _diagnostics(attn: np.ndarray, held: np.ndarray, layer_ids: Sequence[int]) -> dict[str, int]:
    """`DIAGNOSTICS` of one replay: the model layer and the answer step where the least of the key's attention is
    held (-1 when no layer or step attends the key)."""
    layers = [(_share(attn[l], held[l]), l) for l in range(attn.shape[0]) if attn[l].sum() > 0]
    steps = [(_share(attn[:, a], held[:, a]), a) for a in range(attn.shape[1]) if attn[:, a].sum() > 0]
    return {"weakest_layer_index": int(layer_ids[min(layers)[1]]) if layers else -1,
            "weakest_step_index": int(min(steps)[1]) if steps else -1}


def _features(attn: np.ndarray, held: np.ndarray, targets: np.ndarray | None = None) -> dict[str, float]:
    """Every `FEATURES` value of one replay (``attn`` [L, A, Hq, n_key] full-cache attention on the key, ``held``
    the same shape; ``targets`` [A, n_key] marks the evidence tokens equal to each answer step's token: without
    it, `copy_target` is the `weakest_answer_step`)."""
    per_head = attn.sum(axis=(1, 3))                                          # [L, Hq]
    top = per_head >= np.quantile(per_head, 0.9)
    per_layer = [_share(attn[l], held[l]) for l in range(attn.shape[0]) if attn[l].sum() > 0]
    steps = range(attn.shape[1])
    per_step = [_share(attn[:, a], held[:, a]) for a in steps if attn[:, a].sum() > 0]
    if targets is None:
        targets = np.ones(attn.shape[1::2], bool)
    on_target = [_share(attn[:, a] * targets[a], held[:, a]) for a in steps
                 if targets[a].any() and (attn[:, a] * targets[a]).sum() > 0]
    return {"retained_share": _share(attn, held),
            "retrieval_heads": _share(attn * top[:, None, :, None], held),
            "first_answer_step": _share(attn[:, :1], held[:, :1]),
            "weakest_layer": float(min(per_layer, default=0.0)),
            "weakest_answer_step": float(min(per_step, default=0.0)),
            "copy_target": float(min(on_target, default=min(per_step, default=0.0)))}
