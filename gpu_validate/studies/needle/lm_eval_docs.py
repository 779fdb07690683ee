"""lm-evaluation-harness's retrieval documents (its RULER tasks) as needle prompts for the simulator's prediction.

A doc lm-eval builds for a RULER task (``niah_single_1``, ``ruler_vt``, ...) carries its prompt (``context``) and the
values a right answer contains (``outputs``). `needle_prompt_from_doc` turns one into a `NeedlePrompt` on lm-eval's
own token ids, so the needle prediction (`gpu_validate.studies.needle.prediction.stored_features`: the share of the
full-cache attention on the evidence a policy still holds while the answer is written) runs on exactly the prompt
lm-eval scored closed loop (`gpu_validate.lm_eval_model.KVSimLM`). Needs no lm-eval import: the model is read
through the two things of lm-eval's ``hf`` model it uses (``tokenizer``, ``tok_batch_encode``).
benchmarks/ruler_lm_eval.py runs it on lm-eval's offline RULER tasks.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from gpu_validate.studies.needle.prompts import NeedlePrompt


def needle_prompt_from_doc(lm: Any, doc: Mapping[str, Any], length: int) -> NeedlePrompt:
    """The doc ``{"task", "doc" (its index), "context", "outputs"}`` as a `NeedlePrompt`: lm-eval's prompt ids
    (``lm.tok_batch_encode``, as the ``hf`` model encodes it), the expected answer's ids (its values joined by spaces,
    after a space), and as evidence every prompt position whose token overlaps an occurrence of an expected value in
    the prompt. ``length`` is the task's nominal context length (the prompt's id carries it); the doc index is the
    seed. A `ValueError` when the prompt ids are not the tokenizer's (with or without special tokens): their
    character offsets, and so the evidence, would be unknown."""
    text = doc["context"]
    ids = lm.tok_batch_encode([text])[0][0].tolist()
    tok = lm.tokenizer
    for special in (False, True):
        enc = tok(text, add_special_tokens=special, return_offsets_mapping=True, verbose=False)
        if enc["input_ids"] == ids:
            break
    else:
        raise ValueError(f"{doc['task']} doc {doc['doc']}: cannot map lm-eval's prompt ids to character offsets")
    spans = [(m.start(), m.end()) for v in doc["outputs"] for m in re.finditer(re.escape(v), text)]
    key = sorted({i for i, (a, b) in enumerate(enc["offset_mapping"]) for s, e in spans if a < e and b > s})
    answer = tok(" " + " ".join(doc["outputs"]), add_special_tokens=False)["input_ids"]
    return NeedlePrompt(length=length, depth=0.0, seed=int(doc["doc"]), key=doc["task"], ids=tuple(ids),
                        answer=tuple(answer), key_positions=tuple(key), task=doc["task"],
                        values=tuple(doc["outputs"]), n_generate=len(answer))
