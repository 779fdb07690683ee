"""What a closed-loop run is given and gives back: `BatchJob` (a policy at a budget on a prompt), `RunResult`
(its predictions, memory and speed) and `check_run_args` (what cannot run closed-loop, refused up front). No model:
the bottom layer of the closed loop's modules (of the cache it knows only the backends' names), so the entry points
(`gpu_validate.closedloop.runner`) and the modules under them share one vocabulary."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from gpu_validate.kvcache.backends import BACKENDS
from gpu_validate.validate_error import ValidateError
from policies.core.base import Policy, PolicyError
from sim.replay.plan import effective_chunk


@dataclass
class RunResult:
    """One run: per prediction of a decoded position, its NLL (teacher-forced) and argmax; memory and speed.

    Prediction r is made by the query at position ``positions[r]`` (the first by the prompt's last token).
    """

    positions: np.ndarray
    top1: np.ndarray
    nll: np.ndarray | None
    generated: list[int]
    kv_bytes: np.ndarray           # K+V bytes held over all layers after each decode step
    decode_seconds: float
    n_decode_steps: int
    budgets: np.ndarray
    kept: np.ndarray | None = None  # [L, n_rec, Hkv, width] positions kept after steps kept_steps (-1 padded)
    kept_steps: np.ndarray | None = None
    logits: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.n_decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def check_run_args(policy: Policy, budget: int, backend: str) -> None:
    """Reject what cannot run closed-loop, with a message naming the problem."""
    if backend not in BACKENDS:
        raise ValidateError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if policy.is_oracle:
        raise ValidateError(f"policy {policy.label()} is the future-attention oracle: it needs attention rows of "
                            "tokens not generated yet and cannot run closed-loop (use the simulator for it)")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
        raise ValidateError(f"budget must be an integer >= 1 (slots per KV head and layer), got {budget!r}")
    try:
        policy.check_budget(int(budget))
    except PolicyError as exc:
        raise ValidateError(str(exc)) from None


@dataclass
class BatchJob:
    """One closed-loop configuration of a batch: a policy at a budget on a prompt, then either teacher-forced
    ``continuation`` (NLL of each token) or ``n_generate`` greedy tokens."""

    policy: Policy
    budget: int
    prompt: Sequence[int]
    continuation: Sequence[int] | None = None
    n_generate: int = 0
    chunk: int = 1      # chunked prefill of a streamed prompt (``sim.replay.policy_replay.replay_step``)

    @property
    def n_pred(self) -> int:
        return len(self.continuation) if self.continuation is not None else int(self.n_generate)

    @property
    def streams(self) -> bool:
        """True when the prompt is streamed token by token through the compressed cache (no prefill selector,
        and not an unscaled full cache, which keeps the prompt exactly as the model computed it)."""
        p = self.policy
        return not (p.has_prefill or (p.unbounded and p.logit_scale_fn is None))

    @property
    def prompt_chunk(self) -> int:
        """Prompt tokens per policy step: ``chunk`` for a streamed prompt of a policy that can take several new
        tokens per step, else 1 (as the simulator's ``sim.replay.plan.effective_chunk``)."""
        return effective_chunk(self.policy, self.chunk) if self.streams else 1

    @property
    def batch_key(self) -> tuple:
        """Jobs with equal keys go through the model together."""
        return self.streams, len(self.prompt), self.n_pred, self.prompt_chunk
