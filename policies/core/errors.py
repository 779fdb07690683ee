"""The error every policy module raises, importable without numba (the CLI names it before it imports a policy)."""


class PolicyError(ValueError):
    """Unknown policy or parameter, a value out of range, or a broken policy contract."""
