"""The statistics a recommendation decides and states its answer with (`gpu_validate.studies.recommendation
.recommend_search`): the level of the upper bound a configuration must meet the target by (`MARGIN_Z`, over
blocks of `SE_BLOCK` tokens), the distribution-free guarantee's conformal rank (`conformal_rank`, `ALPHA`), the
answer's confidence levels (`CONFIDENCE`, chosen on one model's held-out outcomes in ``benchmarks/recommend.py``)
and the power law that turns simulated losses into predicted model losses (`fit_calibration`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from gpu_validate.validate_error import ValidateError

#: a configuration meets the target when its upper bound does: its mean loss plus MARGIN_Z standard errors over
#: token blocks, or plus the one-sided t margin of the same level over segments, whichever is larger (one-sided 95%)
MARGIN_Z = 1.645
#: consecutive scored tokens per block of the standard error (neighbouring tokens' losses are correlated)
SE_BLOCK = 8
#: the smallest model loss the calibration's logarithm sees (a ΔNLL at or below zero is "as good as full")
LOSS_FLOOR = 1e-3
#: the level of the distribution-free guarantee when the user names none: this, where the units can certify it
#: (nine or more), else the smallest level they can, 1 / (n + 1) (every unit must meet the target)
ALPHA = 0.1


#: the answer's margin (`Recommender._margin`: standard errors over segments between its measured loss and the
#: target) from which the confidence is high / medium (below: low); chosen on SmolLM2's held-out outcomes and judged
#: on Gemma-3's (benchmarks/recommend.py, ``confidence_calibration``). The margin alone is not the level: see
#: `confidence_level` for what the distribution-free certificate adds
CONFIDENCE = {"high": 4.0, "medium": 2.0}
CONFIDENCE_ADVICE = {
    "high": "Answers with this margin, certified at their own budget, held on the benchmark's held-out text",
    "medium": "Answers with this margin usually held on the benchmark's held-out text; the guaranteed budget is "
              "the safer choice",
    "low": "Answers with this margin failed on held-out text more often than others: measure more of your text "
           "(--segments) or take the guaranteed budget",
    "uncertified": "No budget tried was certified (too many of your segments missed the target even at the "
                   "largest): answers like this failed on held-out text about half the time; measure more of your "
                   "text (--segments) or give larger budgets (--budgets)",
}


def margin_level(margin_t: float) -> str:
    """The level `CONFIDENCE` gives a margin of ``margin_t`` standard errors, before the certificate's cap."""
    return next((lvl for lvl, lo in CONFIDENCE.items() if margin_t >= lo), "low")


def confidence_level(met: bool, margin_t: float, certified: int | None, budget: int) -> str:
    """The confidence level of an answer at ``budget`` (``met``: it claims the target) whose margin is ``margin_t``
    (`margin_level`) and whose distribution-free guarantee certified budget ``certified`` (None: no budget tried).
    An answer that does not claim the target is "low". The certificate caps the margin's level: no certified budget
    is "low" (some measured segments miss the target even at the largest budget: the segments' spread is not the
    whole story), and "high" needs the answer's own budget certified (otherwise "medium"). Fixed on SmolLM2 (where
    every answer was certified, every "high" one at its own budget) and judged on Gemma-3
    (benchmarks/recommend.py: there the uncertified answers held in 45%)."""
    if not met or certified is None:
        return "low"
    level = margin_level(margin_t)
    return "medium" if level == "high" and certified > budget else level


def conformal_rank(n: int, alpha: float) -> int:
    """How many of ``n`` exchangeable units must meet the target for a new one to meet it with probability at least
    ``1 - alpha``: ``ceil((n + 1)(1 - alpha))`` (the new unit's loss is equally likely to take any of the n + 1
    ranks). Refuses a level ``n`` units cannot certify."""
    if not 0 < alpha < 1:
        raise ValidateError(f"--alpha must be in (0, 1), got {alpha}")
    k = int(np.ceil((n + 1) * (1 - alpha) - 1e-9))
    if k > n:
        raise ValidateError(f"{n} calibration unit(s) certify no level below alpha = 1/(n+1) = {1 / (n + 1):.3g} "
                            f"(every unit meeting the target gives probability {n}/{n + 1}); asked for alpha = "
                            f"{alpha:g}: give more units (--segments, or more texts; {int(np.ceil(1 / alpha)) - 1} "
                            "certify it) or a larger --alpha")
    return k


def default_alpha(n: int) -> float:
    """`ALPHA` where ``n`` units can certify it, else the smallest level they can, ``1 / (n + 1)``."""
    return max(ALPHA, 1.0 / (n + 1))


@dataclass(frozen=True)
class Calibration:
    """``model loss ≈ exp(a) · sim^b`` fitted on confirmed runs (least squares in log-log); ``rms_log`` is the
    root-mean-square residual in log units (0.1 ≈ predictions within ±10%)."""

    a: float
    b: float
    n: int
    rms_log: float

    def predict(self, sim: np.ndarray | float) -> np.ndarray:
        return np.exp(self.a) * np.power(np.maximum(np.asarray(sim, float), 1e-12), self.b)


def fit_calibration(sim: Sequence[float], model: Sequence[float]) -> Calibration:
    """The power law through (simulated loss, model loss) points; the exponent is held ≥ 0 (more simulated
    loss never predicts less model loss), and with one point it is 1 (a pure scale)."""
    x = np.log(np.maximum(np.asarray(sim, float), 1e-12))
    y = np.log(np.maximum(np.asarray(model, float), LOSS_FLOOR))
    if len(x) == 0:
        raise ValidateError("calibration needs at least one confirmed run")
    b = 1.0
    if len(x) >= 2 and np.ptp(x) > 0:
        b = max(0.0, float(np.polyfit(x, y, 1)[0]))
    a = float(np.mean(y - b * x))
    rms = float(np.sqrt(np.mean((y - a - b * x) ** 2)))
    return Calibration(a, b, int(len(x)), rms)
