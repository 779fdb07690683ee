"""Closed-loop metrics of a policy on a real model: perplexity delta and top-1 agreement against the full cache,
passkey retrieval at several depths, KV memory held and decode tokens/s; plus open-loop kept-set agreement
with the simulator on a trace recorded from the same model and text."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from gpu_validate.closedloop.chunked_forward import full_model_logits
from gpu_validate.closedloop.jobs import BatchJob, RunResult
from gpu_validate.validate_error import ValidateError
from gpu_validate.closedloop.runner import CompressedRunner, run_batch
from policies.core.base import Policy
from sim.replay.kept_sets import compare_kept
from traces.hf.geometry import model_shape
from sim.replay.policy_replay import replay


def text_metrics(model, ids: Sequence[int], n_prompt: int, policy: Policy, budget: int, *,
                 backend: str = "torch", full_logits: np.ndarray | None = None, sliding: str = "keep",
                 chunk: int = 1) -> dict[str, Any]:
    """Teacher-forced run over ``ids`` (prompt = first n_prompt): ΔPPL and top-1 agreement vs the full cache.

    Scored predictions are those made by decode positions n_prompt .. len(ids)-2 (the steps where the
    compressed cache is read, as the simulator's measured steps), of tokens n_prompt+1 .. len(ids)-1.
    ``full_logits`` ([len(ids) - n_prompt, V] from ``full_model_logits(model, ids, start=n_prompt)``) saves the
    reference forward across calls.
    """
    ids = [int(x) for x in ids]
    if not 1 <= n_prompt <= len(ids) - 2:
        raise ValidateError(f"need 1 <= n_prompt <= {len(ids) - 2} for {len(ids)} tokens, got {n_prompt}")
    res = CompressedRunner(model, policy, budget, backend=backend, sliding=sliding, chunk=chunk).run(ids[:n_prompt],
                                                                                       continuation=ids[n_prompt:])
    full = full_model_logits(model, ids, start=n_prompt) if full_logits is None else full_logits
    return metrics_of_run(res, model, ids, n_prompt, full)


def metrics_of_run(res: RunResult, model, ids: Sequence[int], n_prompt: int, full_logits: np.ndarray) -> dict[str, Any]:
    """`text_metrics` of a finished teacher-forced run (e.g. one row of `run_batch`) against the full cache's
    logits at positions n_prompt .. len(ids)-1 (``full_model_logits(model, ids, start=n_prompt)``)."""
    if full_logits.shape[0] != len(ids) - n_prompt:
        raise ValidateError(f"full-cache logits cover {full_logits.shape[0]} positions; expected the "
                            f"{len(ids) - n_prompt} from the prompt's last token on (start=n_prompt)")
    full = full_logits[:-1]
    logp = full - np.logaddexp.reduce(full.astype(np.float64), axis=1, keepdims=True)
    tgt = np.asarray(ids[n_prompt + 1:])
    nll_full = -logp[np.arange(len(tgt)), tgt]
    nll_pol = res.nll[1:]
    ppl_full, ppl_pol = math.exp(float(nll_full.mean())), math.exp(float(nll_pol.mean()))
    full_bytes = full_cache_bytes(res, model, n_prompt)
    return {
        "ppl_full": ppl_full, "ppl": ppl_pol, "delta_ppl": ppl_pol - ppl_full,
        "delta_nll": float(nll_pol.mean() - nll_full.mean()),
        "top1_agreement": float((res.top1[1:] == full.argmax(1)).mean()),
        "kv_bytes_mean": float(res.kv_bytes.mean()), "kv_bytes_peak": float(res.kv_bytes.max()),
        "kv_bytes_full_mean": full_bytes, "tokens_per_s": res.tokens_per_s, "n_scored": int(len(tgt)),
        "nll_per_token": (nll_pol - nll_full).tolist(),
    }


def full_cache_bytes(res: RunResult, model, n_prompt: int) -> float:
    """Mean K+V bytes a full cache would hold over the same decode steps (same dtype and geometry)."""
    if res.n_decode_steps == 0 or res.kv_bytes.size == 0:
        return float("nan")
    shape = model_shape(model)
    elem = res.extra["cache_elem_bytes"]
    seen = np.arange(n_prompt + 1, n_prompt + 1 + res.n_decode_steps)
    return float((seen * shape.n_layers * shape.n_kv_heads * 2 * shape.head_dim * elem).mean())


def passkey_prompt(tokenizer, filler_ids: Sequence[int], depth: float, n_context: int,
                   key: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): a pass-key sentence hidden at relative ``depth`` of ~n_context filler tokens,
    then the question; the answer is the key's tokens."""
    needle = tokenizer.encode(f" The pass key is {key}. Remember it. The pass key is {key}. ")
    question = tokenizer.encode(" What is the pass key? The pass key is")
    answer = tokenizer.encode(f" {key}")
    n_fill = n_context - len(needle) - len(question)
    if n_fill < 1 or len(filler_ids) < n_fill:
        raise ValidateError(f"passkey context {n_context} too short for the needle or longer than the filler text")
    cut = int(round(depth * n_fill))
    fill = [int(x) for x in filler_ids[:n_fill]]
    return fill[:cut] + needle + fill[cut:] + question, answer


def passkey_accuracy(model, tokenizer, filler_ids: Sequence[int], policy: Policy, budget: int, *,
                     depths: Sequence[float] = (0.1, 0.5, 0.9), n_context: int = 256, n_keys: int = 2,
                     backend: str = "torch", seed: int = 0, on_result=None, sliding: str = "keep",
                     chunk: int = 1) -> dict[str, float]:
    """Exact-match retrieval of a random 5-digit key by greedy decoding, per depth (mean over n_keys keys).
    All depth × key prompts run as one batch; ``on_result(label, hit)`` is called per finished prompt."""
    rng = np.random.default_rng(seed)
    keys = [str(int(x)) for x in rng.integers(10000, 99999, size=n_keys)]
    cells = [(depth, passkey_prompt(tokenizer, filler_ids, depth, n_context, key)) for depth in depths
             for key in keys]
    jobs = [BatchJob(policy, budget, prompt, n_generate=len(answer), chunk=chunk) for _, (prompt, answer) in cells]
    hits = {f"{depth:g}": 0 for depth in depths}

    def done(i: int, res: RunResult) -> None:
        depth, (_, answer) = cells[i]
        hit = res.generated[: len(answer)] == answer
        hits[f"{depth:g}"] += int(hit)
        if on_result is not None:
            on_result(f"{policy.label()} @ {budget} passkey depth {depth:g}", hit)

    run_batch(model, jobs, backend=backend, on_result=done, sliding=sliding)
    return {d: h / len(keys) for d, h in hits.items()}


def kept_set_agreement(model, trace, policy: Policy, budget: int, n_steps: int, *,
                       backend: str = "torch", sliding: str = "keep", chunk: int = 1) -> dict[str, Any]:
    """Open loop on the trace's own tokens: share of (layer, KV head, step) whose kept position sets are equal in the
    runner (kernel probabilities) and in the simulator (``sim.replay.policy_replay.replay``), over the first n_steps
    decode steps, on the layers the policy compresses; also the mean Jaccard overlap. The trace must come from the same
    model and text."""
    meta = trace.meta
    if trace.tokens is None:
        raise ValidateError(f"trace {trace.path} has no tokens.parquet; record it with traces.recorder")
    ids = trace.tokens["token_id"].to_numpy().tolist()
    P = meta.n_prompt
    n_steps = int(min(n_steps, meta.n_tokens - P))
    if n_steps < 1:
        raise ValidateError(f"trace {trace.path} has no decode steps to compare")
    if list(meta.model.layer_ids) != list(range(meta.model.n_layers)) or \
            meta.source.get("kv_heads", list(range(meta.model.n_kv_heads))) != list(range(meta.model.n_kv_heads)):
        raise ValidateError("kept-set agreement needs a trace of every layer and KV head of the model")
    runner = CompressedRunner(model, policy, budget, backend=backend, open_loop=True, record_kept=(P, n_steps),
                              sliding=sliding, chunk=chunk)
    gpu = runner.run(ids[:P], continuation=ids[P:P + n_steps + 1]).kept
    sim = replay(trace, policy, budget, record_kept=(P, n_steps), threads=1, sliding=sliding, chunk=chunk)
    return compare_kept(gpu[sim.layer_index], sim.kept, n_steps)
