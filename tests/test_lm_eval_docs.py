"""`gpu_validate.studies.needle.lm_eval_docs`: an lm-eval RULER doc turned into the simulator's needle prompt
(lm-eval's prompt ids, the answer's ids, the evidence positions of every expected value), and a doc whose prompt
ids cannot be mapped to character offsets refused."""
from __future__ import annotations

import pytest

from gpu_validate.studies.needle.lm_eval_docs import needle_prompt_from_doc


class _LM:
    """The two things `needle_prompt_from_doc` reads of lm-eval's ``hf`` model: its tokenizer and its batch encoding."""

    def __init__(self, tok):
        self.tokenizer = tok

    def tok_batch_encode(self, texts):
        import torch

        return torch.tensor([self.tokenizer(texts[0], add_special_tokens=False)["input_ids"]]), None


def test_a_doc_becomes_a_needle_prompt():
    from traces.models import load_model

    _, tok = load_model("tiny", progress=False)
    text = ("Some special magic numbers are hidden. One of the special magic numbers for quiet-fox is: 4817263. "
            "The grass is green. What is the special magic number for quiet-fox mentioned in the provided text? "
            "The special magic number for quiet-fox mentioned in the provided text is")
    row = {"task": "niah_single_1", "doc": 3, "context": text, "outputs": ["4817263"]}
    p = needle_prompt_from_doc(_LM(tok), row, 4096)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert list(p.ids) == ids and p.seed == 3 and p.task == "niah_single_1"
    assert p.prompt_id.startswith("niah_single_1-L4096") and p.prompt_id.endswith("-s3")
    evidence = tok.decode([ids[i] for i in p.key_positions]).replace(" ", "")
    assert "4817263" in evidence and len(p.key_positions) <= 8
    assert tok.decode(list(p.answer)).strip() == "4817263"


def test_a_doc_whose_prompt_ids_cannot_be_mapped_is_refused():
    from traces.models import load_model

    _, tok = load_model("tiny", progress=False)

    class Shifted(_LM):
        def tok_batch_encode(self, texts):
            ids, _ = super().tok_batch_encode(texts)
            return ids[:, 1:], None                     # not what the tokenizer gives: offsets unknown

    with pytest.raises(ValueError, match="cannot map"):
        needle_prompt_from_doc(Shifted(tok), {"task": "ruler_vt", "doc": 0, "context": "VAR X = 1",
                                              "outputs": ["X"]}, 4096)
