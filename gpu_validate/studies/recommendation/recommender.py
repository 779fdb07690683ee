"""``kvsim recommend``'s library entry points: `recommend` (a recommendation on text segments, the method in
`gpu_validate.studies.recommendation.recommend_search`) and `recommend_texts`, which takes what the command takes
(names of a model, texts, a target) and sends a retrieval target to `gpu_validate.studies.recommendation.retrieval`
instead. This module sits above both, so that neither imports the other's caller."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from gpu_validate.kvcache.backends import pick_device
from gpu_validate.studies.fidelity.segments import RayTarget, Segment, make_segments
from gpu_validate.studies.recommendation.candidates import Candidate, Target, budget_ladder, candidates
from gpu_validate.studies.recommendation.recommend_search import (RACE, ExecutionSettings, GuaranteeSettings,
                                                                  Recommender, SearchSettings)
from gpu_validate.studies.recommendation.recommend_statistics import conformal_rank
from gpu_validate.studies.recommendation.retrieval import recommend_retrieval
from gpu_validate.validate_error import ValidateError
from sim.replay.threads import available_cores
from sim.replay.warmup import compiling_meanwhile
from traces.model import read_text
from traces.models import load_model, model_id

__all__ = ["Recommender", "recommend", "recommend_texts"]


def recommend(model, segments: Sequence[Segment], cands: Sequence[Candidate], budgets: Sequence[int],
              target: Target, **kwargs) -> dict[str, Any]:
    """Recommend a policy, its hyperparameters and the smallest budget meeting ``target`` on ``segments``
    (the method: `gpu_validate.studies.recommendation.recommend_search`); ``kwargs`` go to `Recommender`: ``n_prompt``,
    ``model_id``, ``out`` and its settings. Returns the JSON-ready report."""
    return Recommender(model, segments, cands, budgets, target, **kwargs).run()


def recommend_texts(model: str, texts: Sequence[str], target: str, *, out: str | Path, segments: int = 3,
                    prompt_tokens: int = 512, decode_tokens: int = 128, policies: str = "all",
                    budgets: str | Sequence[int] = "auto",
                    validate: int = 3, device: str | None = None, progress: bool = True,
                    ray_address: str | None = None, threads: int = 1, alpha: float | None = None,
                    race: int | None = None) -> dict[str, Any]:
    """`recommend` from names, as ``kvsim recommend`` takes them: a model (registry name, HF folder or .gguf),
    texts (shipped names or UTF-8 files; ``segments`` windows of each), a target (``dnll=0.05``, ``top1=0.95``;
    ``retrieval=0.9`` runs `gpu_validate.studies.recommendation.retrieval` on ``segments`` pass-key seeds per text
    instead), families or specs (``all``) and budgets (``auto`` or ``64,128``). On CUDA the closed loop uses the Triton
    cache, else the torch one. With ``ray_address`` the closed-loop batches run as Ray tasks (``threads`` each,
    one GPU each on CUDA) on workers that load ``model`` themselves. ``alpha``: the level of the distribution-free
    guarantee (default `default_alpha`; a retrieval target's: its Clopper-Pearson level, default 1 - Φ(`MARGIN_Z`)),
    refused before any model run when the units cannot certify it. ``race``: the candidates simulated on every
    segment, the ``race`` best at some budget on the first (None: `RACE`; 0: all). The report also names the texts,
    device, backend and ``model_spec``, the model as given here (what ``kvsim generate --model`` takes). On a machine
    with more than one core, the candidates' numba kernels are compiled in helper processes while the model loads and
    the first segment is simulated (`sim.replay.warmup.compiling_meanwhile`; a first run only)."""
    goal = Target.parse(target)
    cands = candidates(policies)
    ladder = budget_ladder(prompt_tokens, budgets)
    if race is not None and race < 0:
        raise ValidateError(f"--race must be >= 0 (0: every candidate on every segment), got {race}")
    if goal.name == "retrieval" and ray_address is not None:
        raise ValidateError("--ray confirms text segments; a retrieval target runs its needle prompts here")
    if goal.name != "retrieval" and alpha is not None:      # a level the segments cannot certify: refused now
        conformal_rank(len(texts) * segments, alpha)
    # a first run compiles every candidate's kernels (~400 s of one core): spare cores compile them meanwhile
    with compiling_meanwhile([c.policy.name for c in cands], available_cores() - 1):
        torch.set_grad_enabled(False)
        device, backend = pick_device(device)
        hf, tok = load_model(model, device=device, progress=progress)
        if goal.name == "retrieval":
            report = recommend_retrieval(hf, tok, {spec: read_text(spec)[0] for spec in texts}, cands, ladder, goal,
                                         prompt_tokens=prompt_tokens, per_text=segments, model_id=model_id(model),
                                         out=out, backend=backend, search=SearchSettings(validate=validate),
                                         progress=progress, alpha=alpha)
            report.update(texts=list(texts), device=device, backend=backend, model_spec=model)
            return report
        # a spec names its segments
        ids = {spec: tok(read_text(spec)[0], verbose=False)["input_ids"] for spec in texts}
        segs = make_segments(ids, segments, prompt_tokens + decode_tokens)
        ray = None if ray_address is None else RayTarget(ray_address, model, device, threads)
        search = SearchSettings(validate=validate, race=RACE if race is None else (race or None))
        report = recommend(hf, segs, cands, ladder, goal, n_prompt=prompt_tokens, model_id=model_id(model), out=out,
                           search=search, guarantee=GuaranteeSettings(alpha=alpha),
                           execution=ExecutionSettings(backend=backend, progress=progress, ray=ray))
        report.update(texts=list(texts), device=device, backend=backend, model_spec=model)
        return report
