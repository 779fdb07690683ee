"""kvsim as an lm-evaluation-harness model type: any policy, lm-eval's own tasks.

``KVSimLM`` (registered as ``kvsim``) is lm-eval's ``hf`` model (``HFLM``: its tokenization, request handling,
truncation, stop sequences and answer extraction, unchanged) with the model's forward replaced where it matters:

- generation tasks (``generate_until``) run through `gpu_validate.generation.generate`: the prompt compressed by the
  policy (its prefill selector, or streamed through its step), then greedy decoding with the policy evicting at every
  step, memory really held in kvsim's varlen cache;
- log-likelihood tasks (``loglikelihood``, and ``loglikelihood_rolling`` through it) score the continuation after the
  context was compressed: the closed loop's teacher forcing (`gpu_validate.closedloop.runner.run_batch` with a
  continuation), each continuation token predicted over the policy's cache as it evicts, so a policy's loss shows in the
  score.

``policy=full`` is the uncompressed reference and reproduces ``hf``'s numbers (tests/test_lm_eval_model.py).

Model arguments (``--model_args``): ``model`` (a kvsim model name, a local HF folder or a ``.gguf``: resolved as
every kvsim command does), ``policy`` (a spec, ``full`` by default; commas inside a spec are written ``;`` because
lm-eval splits its model arguments on commas: ``policy=snapkv:window_size=8;kernel_size=5``), ``budget`` (slots per KV
head and layer; none for ``full``), ``prefill_chunk`` (prompt tokens per step of a policy that streams its prompt;
0: the whole prompt as one chunk, "compress once after the prompt"), ``sliding`` (``keep``/``compress``), ``backend``
(``torch``/``triton``), ``device``, ``dtype``, and HFLM's own (``batch_size``, ``max_length``, ...).

lm-eval 0.4.13 finds models only in its own registry (``lm_eval.api.registry.register_model``; no entry-point group
for models), so this module must be imported before lm-eval looks the name up:

    python -m gpu_validate.lm_eval_model --model kvsim --model_args model=smollm2-135m,policy=snapkv,budget=256 \\
        --tasks niah_single_1 --limit 10

runs lm-eval's own command line after that import (every lm-eval option works), and Python users
``import gpu_validate.lm_eval_model`` before ``lm_eval.simple_evaluate(model="kvsim", ...)``. lm-eval's RULER tasks
build their prompts with the tokenizer named in the model arguments: the module adds ``tokenizer=<the resolved
model folder>`` when none is given, so ``model=smollm2-135m`` is enough. Install with ``pip install 'kvsim[eval]'``.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from gpu_validate.closedloop.jobs import BatchJob
from gpu_validate.closedloop.runner import run_batch
from gpu_validate.generation import generate
from gpu_validate.validate_error import ValidateError
from sim.experiments.specs import parse_policy
from traces.models import load_model, resolve_model

NAME = "kvsim"


@register_model(NAME)
class KVSimLM(HFLM):
    """lm-eval's ``hf`` model whose log-likelihoods and generations run through a kvsim policy's cache."""

    def __init__(self, model: str, policy: str = "full", budget: int | None = None, *, tokenizer: str | None = None,
                 prefill_chunk: int = 1, sliding: str = "keep", backend: str | None = None, device: str = "cpu",
                 dtype: str | None = None, **kwargs: Any) -> None:
        spec = policy.replace(";", ",")
        self.kvsim_policy = parse_policy(spec)
        self.kvsim_spec = spec
        self.kvsim_budget = None if budget in (None, "", "none") else int(budget)
        if self.kvsim_budget is None and not self.kvsim_policy.unbounded:
            raise ValidateError(f"policy {spec!r} needs budget=B (slots per KV head and layer) in --model_args")
        self.kvsim_options = {"prefill_chunk": int(prefill_chunk), "sliding": sliding}
        if backend is not None:
            self.kvsim_options["backend"] = backend
        hf_model, tok = load_model(model, device=device, torch_dtype=dtype, progress=False)
        if tokenizer is not None and tokenizer != str(getattr(tok, "name_or_path", "")):
            tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        super().__init__(pretrained=hf_model, tokenizer=tok, **kwargs)
        self.kvsim_model = model

    # ---------------------------------------------------------------- log-likelihoods: teacher forcing
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """(sum of log-probabilities of the continuation, whether greedy decoding gives it) for each request
        ``((context, continuation), context_enc, continuation_enc)``, the context truncated on the left to
        ``max_length`` as ``hf`` does, scored closed loop over the policy's cache."""
        jobs, budget = [], self._budget_for
        for _, context_enc, continuation_enc in requests:
            if not continuation_enc or not context_enc:
                raise ValidateError("a log-likelihood request needs a context and a continuation of >= 1 token")
            whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1):]
            prompt = whole[:len(whole) - len(continuation_enc)]
            if not prompt:      # a continuation as long as max_length: hf scores its last max_length tokens
                prompt, cont = whole[:1], whole[1:]
            else:
                cont = list(continuation_enc)
            jobs.append(BatchJob(self.kvsim_policy, budget(len(prompt) + len(cont)), prompt, cont,
                                 chunk=self.kvsim_options["prefill_chunk"] or len(prompt)))
        bar = tqdm(total=len(jobs), desc=f"kvsim {self.kvsim_spec} log-likelihoods", disable=disable_tqdm)
        results = run_batch(self.model, jobs, backend=self._backend, sliding=self.kvsim_options["sliding"],
                            max_rows=max(1, int(self.batch_size) if str(self.batch_size).isdigit() else 1),
                            on_result=lambda i, r: bar.update(1))
        bar.close()
        out = []
        for (key, _, continuation_enc), job, r in zip(requests, jobs, results):
            n = len(continuation_enc)
            nll = r.nll[-n:] if len(job.continuation) > n else r.nll
            top1 = r.top1[-n:] if len(job.continuation) > n else r.top1
            answer = (-float(sum(float(x) for x in nll)), bool(all(int(a) == int(b)
                                                                 for a, b in zip(top1, continuation_enc))))
            out.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    # ---------------------------------------------------------------- generation: the policy's cache
    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        """``hf``'s generate call (a left-padded batch, up to ``max_length`` tokens in all) through kvsim's cache:
        greedy unless the task asks for sampling; stop sequences are cut by ``generate_until`` as for ``hf``."""
        mask = generation_kwargs.pop("attention_mask", None)
        if mask is None:
            mask = torch.ones_like(context)
        prompts = [row[m.bool()].tolist() for row, m in zip(context, mask)]
        n_new = max(1, int(max_length) - context.shape[1])
        sample = bool(generation_kwargs.get("do_sample")) and float(generation_kwargs.get("temperature") or 0) > 0
        options = {**self.kvsim_options, "prefill_chunk": self.kvsim_options["prefill_chunk"] or context.shape[1]}
        res = generate(self.model, prompts, self.kvsim_policy, self._budget_for(context.shape[1] + n_new),
                       max_new_tokens=n_new, temperature=float(generation_kwargs["temperature"]) if sample else 0.0,
                       **options)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        new = torch.full((context.shape[0], n_new), pad, dtype=context.dtype)
        for b, row in enumerate(res.rows):
            new[b, :len(row.new_tokens)] = torch.tensor(row.new_tokens, dtype=context.dtype)
        return torch.cat([context.cpu(), new], dim=1)

    # ---------------------------------------------------------------- helpers
    def _budget_for(self, n_tokens: int) -> int:
        """The policy's budget; the full cache's is every token of the run (``n_tokens``)."""
        return self.kvsim_budget if self.kvsim_budget is not None else int(n_tokens)

    @property
    def _backend(self) -> str:
        return self.kvsim_options.get("backend") or ("triton" if self.device.type == "cuda" else "torch")

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        return {**info, "kvsim_model": self.kvsim_model, "kvsim_policy": self.kvsim_spec,
                "kvsim_budget": self.kvsim_budget}


def _with_tokenizer(argv: list[str]) -> list[str]:
    """``argv`` with ``tokenizer=<model folder>`` added to ``--model_args`` of a ``--model kvsim`` run that names a
    kvsim model but no tokenizer (lm-eval's RULER tasks load the tokenizer named in the model arguments)."""
    args = list(argv)
    if NAME not in [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--model"]:
        return args
    for i, a in enumerate(args[:-1]):
        if a == "--model_args":
            parts = dict(p.split("=", 1) for p in args[i + 1].split(",") if "=" in p)
            if "model" in parts and "tokenizer" not in parts:
                args[i + 1] += f",tokenizer={resolve_model(parts['model'], progress=False)}"
    return args


def main(argv: list[str] | None = None) -> None:
    """lm-eval's own command line with the ``kvsim`` model type registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *_with_tokenizer(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
