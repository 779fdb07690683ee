"""Needle-in-a-haystack retrieval, closed loop on a real model, and the simulator's prediction of it.

Prompts (RULER / kvpress "passkey" style): an instruction, real filler text (a seed-dependent window of the
shipped held-out text, so every prompt's haystack differs), the needle line "The pass key is NNNNN. Remember
it. NNNNN is the pass key." at a relative depth, and the question "What is the pass key? The pass key is".
Every prompt has exactly ``length`` tokens, so prompts of one length batch together. A configuration
(prompt, policy, budget) succeeds when greedy decoding reproduces the key's tokens exactly.

The simulator's prediction (`needle_features`): the same prompt plus the answer is recorded as a
teacher-forced trace; each policy is replayed on it and, at the answer steps, the share of the full-cache
attention on the key's tokens that falls on tokens the policy still holds is measured several ways
(`FEATURES`: over all heads, over the retrieval heads, at the first answer step, in the weakest layer); the
features are kept in a resumable store of their own (`stored_features`), so a re-fit never re-records a trace. The
predictor and its threshold are chosen on some seeds and judged on the others (`gpu_validate.needle_report`:
`fit_threshold`, by balanced accuracy unless told otherwise, `prediction_report`, `binary_scores`): most cells fail,
so an agreement is reported next to its base rate, with balanced accuracy and Matthews correlation, which do not
reward calling the commoner outcome.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from gpu_validate.jobs import BatchJob, ValidateError
from gpu_validate.runner import run_batch
from gpu_validate.tasks import TaskError, build_task, retrieved
from policies.base import Policy
from sim.metrics import Column
from traces.hf.geometry import model_shape

@dataclass(frozen=True)
class NeedlePrompt:
    """One haystack: its grid coordinates, token ids, the answer's ids, the token positions of the evidence the
    answer is read from (``key_positions``), the values a right generation contains and how many tokens are
    generated."""

    length: int
    depth: float
    seed: int
    key: str
    ids: tuple[int, ...]
    answer: tuple[int, ...]
    key_positions: tuple[int, ...]
    task: str = "passkey"
    values: tuple[str, ...] = ()
    n_generate: int = 0
    repeats: int = 1

    @property
    def prompt_id(self) -> str:
        base = f"L{self.length}-d{self.depth:g}-s{self.seed}"
        if self.task == "passkey" and self.repeats == 1:
            return base                      # the original needle grid's ids (stores written before the tasks)
        return f"{self.task}{'' if self.repeats == 1 else f'x{self.repeats}'}-{base}"

    def success(self, generated: Sequence[int], decode: Callable[[list[int]], str] | None = None) -> bool:
        """Whether greedy decoding retrieved: every value in the decoded generation (``decode``), or, without a
        decoder, the answer's tokens reproduced exactly."""
        if decode is None or not self.values:
            return tuple(generated[:len(self.answer)]) == self.answer
        return retrieved(decode(list(generated[:self.n_generate or len(self.answer)])), self.values)


def _encode(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [int(x) for x in enc["input_ids"]], [tuple(o) for o in enc["offset_mapping"]]


def _bos(tokenizer) -> list[int]:
    """The BOS token where the tokenizer itself starts a text with one (Gemma), else nothing (SmolLM2)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    return [int(bos)] if bos is not None and len(full) > len(plain) and full[0] == bos else []


def make_prompt(tokenizer, filler_ids: Sequence[int], length: int, depth: float, seed: int, *,
                task: str = "passkey", repeats: int = 1) -> NeedlePrompt:
    """The ``task`` prompt (`gpu_validate.tasks`) of exactly ``length`` tokens for (depth, seed): the task's values
    and the filler window are drawn from ``seed`` (and the length, depth and task, so every grid cell has its own).
    The filler window wraps around the end of the text when the prompt needs more filler than the text has.
    The generation runs ``ANSWER_SLACK`` tokens past the canonical answer (a model that writes " a 12345" still
    answers), except in the original pass-key grid (one needle line), whose stored cells were scored without."""
    try:
        seed_text = f"{length}/{depth:g}/{seed}" if task == "passkey" else f"{task}/{length}/{depth:g}/{seed}"
        h = int(hashlib.sha256(seed_text.encode()).hexdigest()[:8], 16)
        spec = build_task(task, np.random.default_rng([seed, h]), depth, repeats)
    except TaskError as exc:
        raise ValidateError(str(exc)) from None
    rng = np.random.default_rng([seed, h, 1]) if task != "passkey" else None
    head = _bos(tokenizer) + _encode(tokenizer, spec.head)[0]
    question = _encode(tokenizer, spec.question)[0]
    answer = _encode(tokenizer, spec.answer)[0]
    lines = [(_encode(tokenizer, text), d, text) for text, d in spec.needles]
    n_fill = length - len(head) - sum(len(ids) for (ids, _), _, _ in lines) - len(question)
    if n_fill < 1:
        raise ValidateError(f"{task} length {length} leaves no room for filler (needs > {length - n_fill + 1} tokens)")
    if not len(filler_ids):
        raise ValidateError("the filler text is empty")
    if task == "passkey":     # the original grid's draw, kept so its stored cells stay valid
        if len(filler_ids) < n_fill:
            filler_ids = list(filler_ids) * (n_fill // len(filler_ids) + 1)
        off = _passkey_offset(seed, h, len(filler_ids), n_fill)
    else:
        off = int(rng.integers(0, len(filler_ids)))
    reps = -(-(off + n_fill) // len(filler_ids))
    fill = [int(x) for x in (list(filler_ids) * reps)[off:off + n_fill]]
    ids, evidence = list(head), []
    placed = sorted(range(len(lines)), key=lambda i: (lines[i][1], i))
    prev = 0
    for i in placed:
        (line_ids, offsets), d, text = lines[i]
        cut = int(round(d * n_fill))
        ids += fill[prev:cut]
        prev = cut
        spans = [(m.start(), m.end()) for v in spec.evidence for m in re.finditer(re.escape(v), text)]
        evidence += [len(ids) + j for j, (a, b) in enumerate(offsets) if any(a < e and b > s for s, e in spans)]
        ids += line_ids
    ids += fill[prev:] + question
    if len(ids) != length or not evidence:
        raise ValidateError(f"{task} prompt construction failed (got {len(ids)} tokens, {len(evidence)} evidence "
                            "tokens)")
    legacy = task == "passkey" and repeats == 1
    n_gen = len(answer) + (0 if legacy else ANSWER_SLACK)
    return NeedlePrompt(length, float(depth), int(seed), spec.key, tuple(ids), tuple(answer), tuple(sorted(evidence)),
                        task, spec.values, n_gen, int(repeats))


#: tokens generated past the canonical answer (the answer may be written a little differently: " a 12345", a list
#: with other separators); the generation succeeds when it contains every value
ANSWER_SLACK = 4


def _passkey_offset(seed: int, h: int, n_filler: int, n_fill: int) -> int:
    """The original needle grid's filler offset: the second draw of its generator (the first drew the key)."""
    rng = np.random.default_rng([seed, h])
    rng.integers(10000, 100000)
    return int(rng.integers(0, n_filler - n_fill + 1))


def make_grid(tokenizer, filler_text: str, lengths: Sequence[int], depths: Sequence[float],
              seeds: Sequence[int], *, tasks: Sequence[str] = ("passkey",), repeats: int = 1) -> list[NeedlePrompt]:
    """Every (task, length, depth, seed) prompt of the grid."""
    filler = tokenizer(filler_text, add_special_tokens=False, verbose=False)["input_ids"]
    return [make_prompt(tokenizer, filler, L, d, s, task=t, repeats=repeats)
            for t in tasks for L in lengths for d in depths for s in seeds]


def config_key(prompt: NeedlePrompt, policy: Policy, budget: int, model_id: str, chunk: int = 1) -> str:
    """Stable store key of a (model, prompt, policy with its parameters, budget, prompt chunk) cell (``chunk`` 0:
    the whole prompt in one step; 1, token by token, is left out of the key so the cells stored before chunking
    keep theirs)."""
    cell = [model_id, prompt.prompt_id, prompt.key, policy.name, policy.params, int(budget)]
    cell = cell if chunk == 1 else cell + [int(chunk)]
    if prompt.n_generate and prompt.n_generate != len(prompt.answer):    # stores before the slack keep their keys
        cell.append({"generate": int(prompt.n_generate)})
    payload = json.dumps(cell, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def fits(prompt: NeedlePrompt, policy: Policy, budget: int) -> bool:
    """Whether a (prompt, policy, budget) cell is run: a lossy policy's budget must be below the prompt's length (at
    or above it nothing is ever evicted and the cell is the full cache's), so one budget list serves several
    context lengths."""
    return policy.unbounded or int(budget) < len(prompt.ids)


def prompt_chunk(prompt: NeedlePrompt, chunk: int) -> int:
    """The prompt chunk a streamed policy takes ``prompt`` with: ``chunk`` tokens per step, 0 = all of it."""
    return len(prompt.ids) if chunk == 0 else int(chunk)


def run_needle(model, prompts: Sequence[NeedlePrompt], configs: Sequence[tuple[Policy, int]], store, *,
               model_id: str, backend: str = "torch", max_rows: int = 48, progress: bool = True,
               decode: Callable[[list[int]], str] | None = None, chunk: int = 1, solved_only: bool = False,
               min_full_accuracy: float = 0.0, log: Callable[[str], None] = print) -> "Any":
    """Closed-loop retrieval of every prompt × (policy, budget) not yet in ``store`` (a `sim.store.ResultStore`);
    each finished batch is written as its own part file (resumable). Returns the store's table.

    ``decode`` (the tokenizer's) scores a generation by the values it contains (`NeedlePrompt.success`); without
    it the answer's tokens must come back exactly. ``chunk``: prompt tokens per policy step for a policy without a
    prefill selector (chunked prefill, `BatchJob.chunk`; 0 = the whole prompt in one step, which compresses once
    after the prompt as a prefill selector does -- the setting of SnapKV's and Ada-KV's needle tests -- and lets
    the batch take the prompt from the model's own forward instead of streaming it). ``solved_only``: a prompt's
    lossy cells run only when its full-cache cell (a ``full`` policy among ``configs``) retrieves; that cell goes
    first and its prompt forward serves the others, so a prompt goes through the model once either way. With
    ``min_full_accuracy`` as well, a (task, length) cell's policies stop once its full-cache failures put that
    accuracy out of reach (the cell will be dropped); its full-cache cells still run, for the report."""
    from tqdm.auto import tqdm

    chunk_arg = int(chunk)
    done = store.keys()
    cells = [(p, pol, b) for p in prompts for pol, b in configs if fits(p, pol, b)]
    todo = [(p, pol, b) for p, pol, b in cells if config_key(p, pol, b, model_id, chunk) not in done]
    if len(todo) < len(cells):
        log(f"resuming: {len(cells) - len(todo)} cells already in {store.root}")
    full_done: dict[str, bool] = {}
    if solved_only:
        if not any(pol.name == "full" for pol, _ in configs):
            raise ValidateError("solved_only needs the full cache among the configurations")
        known = store.load()
        if len(known):
            ok = dict(zip(known.key, known.success.astype(bool)))
            full_done = {p.prompt_id: ok[k] for p, pol, b in cells if pol.name == "full"
                         and (k := config_key(p, pol, b, model_id, chunk)) in ok}
    # one prompt at a time: its streamed and prefilled batches share the prompt's forward (`run_batch`'s memo),
    # and every batch is stored as soon as it finishes
    by_prompt: dict[str, list] = {}
    for c in todo:
        by_prompt.setdefault(c[0].prompt_id, []).append(c)
    shape = model_shape(model)
    skipped = 0
    with tqdm(total=len(todo), desc="needle", unit="cell", disable=not progress) as bar:

        def run_cells(cells: list, memo: dict) -> list[dict[str, Any]]:
            """The cells of one prompt, prefilled rows then streamed ones, stored batch by batch."""
            p = cells[0][0]
            out: list[dict[str, Any]] = []
            for streams in (False, True):
                part = [c for c in cells if BatchJob(c[1], c[2], p.ids).streams == streams]
                # a streamed row's cache holds its budget plus a prompt chunk: cap the rows at ~4 GB of cache
                slots = prompt_chunk(p, chunk_arg) + max([b for _, _, b in part], default=0)
                row_bytes = slots * shape.n_layers * shape.n_kv_heads * shape.head_dim * 8
                rows_cap = max_rows if not streams else max(1, min(max_rows, int(4e9 // row_bytes)))
                for c in range(0, len(part), rows_cap):
                    cells_ = part[c:c + rows_cap]
                    jobs = [BatchJob(pol, b, p.ids, n_generate=p.n_generate or len(p.answer),
                                     chunk=prompt_chunk(p, chunk_arg)) for _, pol, b in cells_]
                    rows: list[dict[str, Any]] = []

                    def finished(i: int, res, cells_=cells_, rows=rows) -> None:
                        _, pol, b = cells_[i]
                        rows.append({"key": config_key(p, pol, b, model_id, chunk_arg), "model": model_id,
                                     "task": p.task, "prompt_id": p.prompt_id, "length": p.length, "depth": p.depth,
                                     "seed": p.seed, "needle_key": p.key, "policy": pol.name, "label": pol.label(),
                                     "params": pol.params, "budget": int(b), "chunk": int(chunk_arg),
                                     "success": p.success(res.generated, decode),
                                     "generated": json.dumps(res.generated)})
                        bar.update(1)

                    run_batch(model, jobs, backend=backend, max_rows=rows_cap, on_result=finished, prompt_memo=memo)
                    store.add(rows)
                    out += rows
                    acc = np.mean([r["success"] for r in rows])
                    bar.write(f"{p.prompt_id} ({'streamed' if streams else 'prefilled'}): {len(rows)} cells, "
                              f"accuracy {acc:.2f}")
                    sys.stdout.flush()
            return out

        def cell(p: NeedlePrompt) -> tuple[str, int]:
            return p.task, p.length

        size = Counter(cell(p) for p in prompts)
        allowed = {c: int(np.floor((1.0 - min_full_accuracy) * n + 1e-9)) for c, n in size.items()}
        failures = Counter(cell(p) for p in prompts if full_done.get(p.prompt_id) is False)
        for cells in sorted(by_prompt.values(), key=lambda cs: (cs[0][0].length, cs[0][0].task, cs[0][0].prompt_id)):
            memo: dict = {}
            if solved_only:
                p = cells[0][0]
                first = [c for c in cells if c[1].name == "full"]
                rest = [c for c in cells if c[1].name != "full"]
                got = run_cells(first, memo) if first else []
                ok = any(r["success"] for r in got) if got else full_done.get(p.prompt_id, False)
                failures[cell(p)] += bool(got) and not ok
                if not ok or failures[cell(p)] > allowed[cell(p)]:
                    skipped += len(rest)
                    bar.update(len(rest))
                    continue
                cells = rest
            if cells:
                run_cells(cells, memo)
    if skipped:
        log(f"{skipped} cells not run: the full cache does not retrieve their prompt, or fails its (task, length) "
            "cell too often for it to be reported")
    return store.load()


# ----- the simulator's prediction -----

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
#: answer token); `gpu_validate.needle_report.wrong_calls` names them for every wrong call
DIAGNOSTICS = ("weakest_layer_index", "weakest_step_index")


#: bumped when a feature's definition changes, so stored features computed the old way are recomputed (2: each
#: layer's own scale and window, a kept sliding window, the first answer step read from the prompt's own forward,
#: the weakest layer among those that attend the key; 3: the per-step features)
FEATURES_VERSION = 3


#: the retrieval columns of a needle result (header, label, direction, doc) for the page's tables and legend
ACCURACY = Column("accuracy", "accuracy", "retrieval accuracy", "higher",
                  "share of the prompts whose pass key greedy decoding reproduces exactly, closed loop in the model")
PREDICTED_ACCURACY = Column("predicted_accuracy", "predicted", "the simulator's predicted accuracy", "higher",
                            "share of the held-out prompts the simulator predicts retrieved (the predictor at or above "
                            "its threshold)")
AGREEMENT = Column("agreement", "agreement", "agreement of the prediction with the model", "higher",
                   "share of the held-out prompts where the simulator's call (retrieved or not) is the model's outcome")


def needle_features(model, prompt: NeedlePrompt, configs: Sequence[tuple[Policy, int]], *,
                    model_id: str = "model", chunk: int = 1) -> list[dict[str, float]]:
    """Per (policy, budget): every `FEATURES` value, from a teacher-forced trace of prompt + answer replayed in
    the simulator (with the closed loop's prompt ``chunk``, `run_needle`)."""
    from sim.replay import load_layers, replay
    from traces.format import load_trace
    from traces.recorder import record_trace

    ids = list(prompt.ids) + list(prompt.answer)
    P, n_ans = len(prompt.ids), len(prompt.answer)
    with tempfile.TemporaryDirectory(prefix="kvsim-needle-") as tmp:
        record_trace(model, ids, Path(tmp) / "t", n_prompt=P, n_decode=n_ans, teacher_forced=True,
                     single_pass=True, progress=False, model_id=model_id, prompt_scores=False)
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
            out.append({**_features(attn, held, targets), **_diagnostics(attn, held, layer_ids)})
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
    """The `needle_features` of every prompt × (policy, budget), kept in ``store`` (a `sim.store.ResultStore`,
    beside the closed-loop one): cells already there are read back, and a prompt with missing cells is recorded
    and replayed for those only, then written as its own part file (atomic; an interrupted run resumes at the next
    prompt). Re-fitting the prediction (another ``--train-seeds`` or ``--fit-objective``) thus never re-records a
    trace. Returns one row per requested cell: prompt_id, label, budget and one column per feature."""
    import pandas as pd
    from tqdm.auto import tqdm

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
    return rows[["prompt_id", "label", "budget", *[f for f in (*FEATURES, *DIAGNOSTICS) if f in rows.columns]]]


def prediction_table(df, features) -> "Any":
    """The lossy cells of a closed-loop table ``df`` with their simulator ``features`` (`stored_features`) and the
    full cache's outcome on the same prompt (``full_success``): what `gpu_validate.needle_report.prediction_report`
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
