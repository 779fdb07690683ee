"""Needle-in-a-haystack retrieval closed loop on a real model: every prompt (`gpu_validate.studies.needle.prompts`) x
(policy, budget) run batched in the model (`gpu_validate.closedloop.runner.run_batch`) and scored by greedy decoding, each
finished batch stored in a resumable results store (`run_needle`); a configuration (prompt, policy, budget)
succeeds when the generation holds the answer.

The experiment around it (grid, gating on the full cache, report) is `gpu_validate.studies.needle.experiment`; the
simulator's prediction of each outcome is `gpu_validate.studies.needle.prediction`, and its scoring, the summaries and the
heatmaps are `gpu_validate.studies.needle.scores`.
"""
from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from gpu_validate.closedloop.jobs import BatchJob
from gpu_validate.closedloop.runner import run_batch
from gpu_validate.studies.needle.prompts import NeedlePrompt
from gpu_validate.validate_error import ValidateError
from policies.core.base import Policy
from traces.hf.geometry import ModelShape, model_shape


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
    """Closed-loop retrieval of every prompt × (policy, budget) not yet in ``store`` (a `sim.experiments.store.ResultStore`);
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
    done = store.keys()
    cells = [(p, pol, b) for p in prompts for pol, b in configs if fits(p, pol, b)]
    todo = [(p, pol, b) for p, pol, b in cells if config_key(p, pol, b, model_id, chunk) not in done]
    if len(todo) < len(cells):
        log(f"resuming: {len(cells) - len(todo)} cells already in {store.root}")
    full_done: dict[str, bool] = {}
    if solved_only:
        if not any(pol.name == "full" for pol, _ in configs):
            raise ValidateError("solved_only needs the full cache among the configurations")
        full_done = _stored_full_outcomes(store, cells, model_id, chunk)
    # one prompt at a time: its streamed and prefilled batches share the prompt's forward (`run_batch`'s memo),
    # and every batch is stored as soon as it finishes
    by_prompt: dict[str, list] = {}
    for c in todo:
        by_prompt.setdefault(c[0].prompt_id, []).append(c)
    with tqdm(total=len(todo), desc="needle", unit="cell", disable=not progress) as bar:
        runner = _PromptCells(model, store, model_id=model_id, backend=backend, max_rows=max_rows, chunk=int(chunk),
                              decode=decode, progress=progress, bar=bar, shape=model_shape(model))
        skipped = _run_prompts(runner, by_prompt, prompts, full_done, solved_only=solved_only,
                               min_full_accuracy=min_full_accuracy)
    if skipped:
        log(f"{skipped} cells not run: the full cache does not retrieve their prompt, or fails its (task, length) "
            "cell too often for it to be reported")
    return store.load()


def _stored_full_outcomes(store, cells: Sequence[tuple[NeedlePrompt, Policy, int]], model_id: str,
                          chunk: int) -> dict[str, bool]:
    """Prompt id -> whether its full-cache cell retrieved, for the full-cache cells of ``cells`` already stored."""
    known = store.load()
    if not len(known):
        return {}
    ok = dict(zip(known.key, known.success.astype(bool)))
    return {p.prompt_id: ok[k] for p, pol, b in cells if pol.name == "full"
            and (k := config_key(p, pol, b, model_id, chunk)) in ok}


@dataclass
class _PromptCells:
    """Runs one prompt's cells batched in the model, prefilled rows then streamed ones, and stores each batch as it
    finishes (one progress ``bar`` across prompts)."""

    model: Any
    store: Any
    model_id: str
    backend: str
    max_rows: int
    chunk: int
    decode: Callable[[list[int]], str] | None
    progress: bool
    bar: Any
    shape: ModelShape

    def run(self, cells: list, memo: dict) -> list[dict[str, Any]]:
        """The rows of ``cells`` (all of one prompt); ``memo`` shares the prompt's forward between its batches."""
        p = cells[0][0]
        out: list[dict[str, Any]] = []
        for streams in (False, True):
            part = [c for c in cells if BatchJob(c[1], c[2], p.ids).streams == streams]
            rows_cap = self._rows_cap(p, part, streams)
            for c in range(0, len(part), rows_cap):
                rows = self._run_batch(p, part[c:c + rows_cap], rows_cap, memo)
                self.store.add(rows)
                out += rows
                if self.progress:
                    acc = np.mean([r["success"] for r in rows])
                    self.bar.write(f"{p.prompt_id} ({'streamed' if streams else 'prefilled'}): {len(rows)} cells, "
                                   f"accuracy {acc:.2f}")
                    sys.stdout.flush()
        return out

    def _rows_cap(self, p: NeedlePrompt, part: list, streams: bool) -> int:
        """Rows per batch: ``max_rows``; a streamed row's cache holds its budget plus a prompt chunk, so those are
        capped at ~4 GB of cache."""
        if not streams:
            return self.max_rows
        slots = prompt_chunk(p, self.chunk) + max([b for _, _, b in part], default=0)
        row_bytes = slots * self.shape.n_layers * self.shape.n_kv_heads * self.shape.head_dim * 8
        return max(1, min(self.max_rows, int(4e9 // row_bytes)))

    def _run_batch(self, p: NeedlePrompt, cells: list, rows_cap: int, memo: dict) -> list[dict[str, Any]]:
        """One batch of ``p``'s cells in the model: a stored row per cell, in the order they finish."""
        jobs = [BatchJob(pol, b, p.ids, n_generate=p.n_generate or len(p.answer), chunk=prompt_chunk(p, self.chunk))
                for _, pol, b in cells]
        rows: list[dict[str, Any]] = []

        def finished(i: int, res) -> None:
            _, pol, b = cells[i]
            rows.append({"key": config_key(p, pol, b, self.model_id, self.chunk), "model": self.model_id,
                         "task": p.task, "prompt_id": p.prompt_id, "length": p.length, "depth": p.depth,
                         "seed": p.seed, "needle_key": p.key, "policy": pol.name, "label": pol.label(),
                         "params": pol.params, "budget": int(b), "chunk": int(self.chunk),
                         "success": p.success(res.generated, self.decode), "generated": json.dumps(res.generated)})
            self.bar.update(1)

        run_batch(self.model, jobs, backend=self.backend, max_rows=rows_cap, on_result=finished, prompt_memo=memo)
        return rows


def _run_prompts(runner: _PromptCells, by_prompt: dict[str, list], prompts: Sequence[NeedlePrompt],
                 full_done: dict[str, bool], *, solved_only: bool, min_full_accuracy: float) -> int:
    """Every prompt's cells (shortest prompts first); with ``solved_only`` a prompt's full-cache cell first and its
    other cells only where that retrieved and its (task, length) cell can still reach ``min_full_accuracy``
    (``full_done``: the full-cache outcomes already stored). Returns how many cells were not run."""

    def cell(p: NeedlePrompt) -> tuple[str, int]:
        return p.task, p.length

    size = Counter(cell(p) for p in prompts)
    allowed = {c: int(np.floor((1.0 - min_full_accuracy) * n + 1e-9)) for c, n in size.items()}
    failures = Counter(cell(p) for p in prompts if full_done.get(p.prompt_id) is False)
    skipped = 0
    for cells in sorted(by_prompt.values(), key=lambda cs: (cs[0][0].length, cs[0][0].task, cs[0][0].prompt_id)):
        memo: dict = {}
        if solved_only:
            p = cells[0][0]
            first = [c for c in cells if c[1].name == "full"]
            rest = [c for c in cells if c[1].name != "full"]
            got = runner.run(first, memo) if first else []
            ok = any(r["success"] for r in got) if got else full_done.get(p.prompt_id, False)
            failures[cell(p)] += bool(got) and not ok
            if not ok or failures[cell(p)] > allowed[cell(p)]:
                skipped += len(rest)
                runner.bar.update(len(rest))
                continue
            cells = rest
        if cells:
            runner.run(cells, memo)
    return skipped
