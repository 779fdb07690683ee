"""The machinery every policy stands on: the interface (``base``), the registry, the scorer base, the combinators
and their stages (``stage_*``: one stage's class, parameters and kernels each), shared numba kernels and the kvpress
counterpart. Nothing here imports a policy: the policies are the modules of ``policies/`` outside this package."""
