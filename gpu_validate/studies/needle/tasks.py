"""RULER-style retrieval tasks: what a prompt hides in its filler, what it asks, and what a right answer contains.

A task turns a seeded random generator and a depth into a `TaskSpec`: an instruction, the needle lines with the
relative depth each goes to in the filler text, the question, the canonical answer (the text the simulator's
prediction teacher-forces) and the values a correct generation must contain.
`gpu_validate.studies.needle.prompts.make_prompt` lays a spec into exactly ``length`` tokens of real filler text.

The four tasks follow RULER (Hsieh et al., 2024) in kind, written as completions ("... The pass key is"), which a
small base model continues with the answer far more reliably than it follows an instruction to answer:

- ``passkey``: one 5-digit pass key (the kvpress single-needle passkey);
- ``single``: the same single needle in RULER's words, "the special magic number" (see `single` for why);
- ``multikey``: four word -> 5-digit number lines; the question asks for one word's number, the other three are
  distractors at seed-drawn depths (RULER's multi-key needle);
- ``multivalue``: one word with three numbers at different depths, called its first, second and third; the
  answer must contain all three (RULER's multi-value needle, with ordinals);
- ``vartrack``: variable tracking, one chain ``VAR A = n``, ``VAR B = VAR A`` (one hop by default) in order; the
  question asks for the value of B, which is written nowhere next to B (RULER's variable tracking with one chain,
  asked the other way round).

The formats are the ones that worked best on this machine's small models among those tried with the full cache
(needle lines written twice; Gemma-3-270M / SmolLM2-135M). At 1 024 tokens, RULER's own multi-value question
without ordinals ("what are all the numbers for w") 0/5 and 0/5 at 2 048 tokens (both models repeat one number);
with ordinals 3/15 and 1/15; with two values instead of three 1/5 on Gemma-3 (it writes "n and n+1"). RULER's
variable-tracking question ("which variables hold n", every name asked) 0/5 and 0/5 (both write prose); the value
of the chain's end after two hops 8/15 and 1/15, after one hop 9/10 on Gemma-3. Worked examples of the task before
the haystack (few-shot) made the pass key worse on Gemma-3 at 1 024 tokens (3/6 against 13/15 without): the
example's question is the prompt's question word for word, and the model copies the example's answer. Cells where
the full cache cannot do the task are dropped from the policy grid (``kvsim needle --min-full-accuracy``), not
tuned.

``depth`` places the needle the question is about (passkey's line, multikey's queried line, one of multivalue's
values -- the three go in order, so the first is the shallowest --, vartrack's assignment of the number); the other
lines go to seed-drawn depths (vartrack's hops after the assignment, in order). ``repeats`` writes each needle line
that many times in a row: at 2 048 tokens (5 prompts) the passkey with one line retrieves 1/5 on Gemma-3-270M and
4/5 on SmolLM2-135M, with the line written twice 4/5 and 5/5; 1 keeps the original passkey prompt.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

#: words the key/value tasks draw their keys from (common, single-token-ish English nouns)
WORDS = ("apple", "river", "candle", "garden", "mirror", "pencil", "window", "forest", "castle", "rocket",
         "violin", "anchor", "basket", "dragon", "harbor", "island", "jacket", "ladder", "marble", "needle",
         "orange", "parrot", "quartz", "saddle", "tunnel", "valley", "wallet", "yogurt", "zipper", "bridge",
         "cactus", "dolphin", "engine", "falcon", "glacier", "hammer", "igloo", "jungle", "kettle", "lemon")


class TaskError(ValueError):
    """An unknown task or a task argument out of range."""


@dataclass(frozen=True)
class TaskSpec:
    """One prompt's content before it meets the filler: ``needles`` are (line, depth) pairs, ``evidence`` the
    substrings of the needle lines the answer is read from (the simulator's features weigh attention on their
    tokens), ``values`` the strings a right generation contains, ``answer`` the canonical completion."""

    task: str
    head: str
    needles: tuple[tuple[str, float], ...]
    question: str
    answer: str
    values: tuple[str, ...]
    evidence: tuple[str, ...]

    @property
    def key(self) -> str:
        """The value the prompt is about (stored as the cell's ``needle_key``)."""
        return self.values[0]


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(10000, 100000)))


def _distinct_numbers(rng: np.random.Generator, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        x = _number(rng)
        if x not in out:
            out.append(x)
    return out


def _lines(line: str, depth: float, repeats: int) -> tuple[tuple[str, float], ...]:
    return ((line * repeats, depth),)


def passkey(rng: np.random.Generator, depth: float, repeats: int = 1) -> TaskSpec:
    key = _number(rng)
    line = f" The pass key is {key}. Remember it. {key} is the pass key. "
    return TaskSpec("passkey",
                    "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
                    "I will quiz you about the pass key.\n",
                    _lines(line, depth, repeats), "\nWhat is the pass key? The pass key is", f" {key}", (key,), (key,))


def single(rng: np.random.Generator, depth: float, repeats: int = 1) -> TaskSpec:
    """RULER's single needle in its own words ("the special magic number"): the passkey task with another name for
    the key. The shipped filler is Python documentation, where "key" is everywhere (key bindings, dict keys): asked
    for "the pass key", Gemma-3-270M at 4 096 tokens continues with prose about keys in 3 of 10 prompts ("the key
    that is used to ..."); asked for "the special magic number", 10 of 10 answer (`benchmarks/ruler_probe.py`)."""
    key = _number(rng)
    line = f" The special magic number is {key}. Remember it. {key} is the special magic number. "
    return TaskSpec("single",
                    "There is a special magic number hidden inside a lot of irrelevant text. Find it and memorize "
                    "it. I will quiz you about the special magic number.\n",
                    _lines(line, depth, repeats), "\nWhat is the special magic number? The special magic number is",
                    f" {key}", (key,), (key,))


def multikey(rng: np.random.Generator, depth: float, repeats: int = 1, n_keys: int = 4) -> TaskSpec:
    words = [str(w) for w in rng.choice(WORDS, size=n_keys, replace=False)]
    numbers = _distinct_numbers(rng, n_keys)
    other_depths = rng.uniform(0.0, 1.0, size=n_keys - 1)
    needles: list[tuple[str, float]] = []
    for i, (w, n) in enumerate(zip(words, numbers)):
        needles += _lines(f" The special magic number for {w} is {n}. ", depth if i == 0 else float(other_depths[i - 1]),
                          repeats)
    return TaskSpec("multikey",
                    "Some special magic numbers are hidden inside a lot of irrelevant text. Find them and memorize "
                    "them. I will quiz you about one of them.\n",
                    tuple(needles), f"\nWhat is the special magic number for {words[0]}? The special magic number for "
                    f"{words[0]} is", f" {numbers[0]}", (numbers[0],), (numbers[0],))


ORDINALS = ("first", "second", "third", "fourth", "fifth")


def multivalue(rng: np.random.Generator, depth: float, repeats: int = 1, n_values: int = 3) -> TaskSpec:
    word = str(rng.choice(WORDS))
    numbers = _distinct_numbers(rng, n_values)
    depths = sorted([depth, *(float(d) for d in rng.uniform(0.0, 1.0, size=n_values - 1))])
    needles: list[tuple[str, float]] = []
    for i, (n, d) in enumerate(zip(numbers, depths)):
        needles += _lines(f" The {ORDINALS[i]} special magic number for {word} is {n}. ", d, repeats)
    names = ", ".join(ORDINALS[:n_values - 1]) + f" and {ORDINALS[n_values - 1]}"
    return TaskSpec("multivalue",
                    "Some special magic numbers are hidden inside a lot of irrelevant text. Find them and memorize "
                    "them. I will quiz you about them.\n",
                    tuple(needles), f"\nWhat are the {names} special magic numbers for {word}? The {names} special "
                    f"magic numbers for {word} are", " " + ", ".join(numbers[:-1]) + f" and {numbers[-1]}",
                    tuple(numbers), tuple(numbers))


def vartrack(rng: np.random.Generator, depth: float, repeats: int = 1, hops: int = 1) -> TaskSpec:
    letters = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(letters, size=5))
        if name not in names:
            names.append(name)
    value = _number(rng)
    depths = [depth, *sorted(float(d) for d in rng.uniform(depth, 1.0, size=hops))]
    needles = list(_lines(f" VAR {names[0]} = {value}. ", depths[0], repeats))
    for i in range(1, hops + 1):
        needles += _lines(f" VAR {names[i]} = VAR {names[i - 1]}. ", depths[i], repeats)
    return TaskSpec("vartrack",
                    "Memorize the variable assignments hidden in the following text. I will ask for the value of a "
                    "variable.\n", tuple(needles),
                    f"\nQuestion: what is the value of VAR {names[-1]}? Answer: the value of VAR {names[-1]} is",
                    f" {value}", (value,), (value, *names))


#: task name -> builder(rng, depth, repeats) -> TaskSpec
TASKS: dict[str, Callable[..., TaskSpec]] = {"passkey": passkey, "single": single, "multikey": multikey,
                                             "multivalue": multivalue, "vartrack": vartrack}


def build_task(task: str, rng: np.random.Generator, depth: float, repeats: int = 1) -> TaskSpec:
    """The `TaskSpec` of ``task`` at ``depth`` (in [0, 1]) with each needle line written ``repeats`` times."""
    if task not in TASKS:
        raise TaskError(f"unknown task {task!r} (expected one of {sorted(TASKS)})")
    if not 0.0 <= depth <= 1.0:
        raise TaskError(f"needle depth must lie in [0, 1], got {depth}")
    if repeats < 1:
        raise TaskError(f"needle repeats must be >= 1, got {repeats}")
    return TASKS[task](rng, float(depth), int(repeats))


def retrieved(text: str, values: tuple[str, ...]) -> bool:
    """True when every value occurs in ``text`` as a whole token run (not inside a longer number or name)."""
    return all(re.search(rf"(?<![0-9A-Za-z]){re.escape(v)}(?![0-9A-Za-z])", text) for v in values)
