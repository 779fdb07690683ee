"""Future-attention oracle: at every step holds the budget's worth of past tokens the current query
attends to most (it may recall tokens evicted earlier), an upper bound on retained attention mass."""
from policies.core.base import Param, Policy
from policies.core.registry import register


@register
class Oracle(Policy):
    """Knows each step's full attention row and keeps the top-``budget`` past tokens of every KV head by the
    summed probability of its query heads (plus the newest token). This maximises the retained attention
    mass of every step, so no policy holding at most ``budget`` past tokens per head retains more; with
    ``scope='layer'`` the top ``budget * Hkv`` are chosen across the heads of a layer, the bound for
    head-adaptive policies (Ada-KV). It is not realisable online and is replayed by its own exact path,
    which also yields every budget from one pass.
    """

    name = "oracle"
    summary = "top-k of the true attention row (upper bound)"
    schema = (Param("scope", "head", "choice", choices=("head", "layer"), doc="budget per head or per layer"),)
    is_oracle = True
    replay_strategy = "oracle"     # sim.replay.policy_replay's exact one-pass path; it has no step kernel

    def validate(self) -> None:
        # with scope='layer' the budget is shared by the heads of a layer, like Ada-KV's
        self.head_adaptive = self.params["scope"] == "layer"
