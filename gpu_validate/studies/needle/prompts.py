"""Needle-in-a-haystack prompts: an exact-length prompt per (task, length, depth, seed) cell of a grid, with the
positions of the evidence the answer is read from and the test of a generation (`NeedlePrompt.success`).

Prompts (RULER / kvpress "passkey" style): an instruction, real filler text (a seed-dependent window of the
shipped held-out text, so every prompt's haystack differs), the needle line "The pass key is NNNNN. Remember
it. NNNNN is the pass key." at a relative depth, and the question "What is the pass key? The pass key is".
Every prompt has exactly ``length`` tokens, so prompts of one length batch together. The other tasks' lines and
questions are `gpu_validate.studies.needle.tasks`'. The closed loop that runs them is `gpu_validate.studies.needle.runs`; the simulator's
prediction, `gpu_validate.studies.needle.prediction`.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from gpu_validate.validate_error import ValidateError
from gpu_validate.studies.needle.tasks import TaskError, build_task, retrieved


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

    @property
    def name(self) -> str:
        """The prompt's name where a recommendation names its units (a text segment's ``name``)."""
        return self.prompt_id

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
    """The ``task`` prompt (`gpu_validate.studies.needle.tasks`) of exactly ``length`` tokens for (depth, seed): the task's values
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
