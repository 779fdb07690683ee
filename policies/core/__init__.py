"""The machinery every policy stands on: the interface, the registry, the scorer base, the combinator stages, shared numba kernels and the kvpress counterpart."""
