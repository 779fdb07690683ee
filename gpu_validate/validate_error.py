"""`ValidateError`, the error every closed-loop module raises on bad input, in a module that imports nothing, so that
argument parsing (``kvsim COMMAND --help``) can name it without loading torch."""


class ValidateError(ValueError):
    """Bad runner input (policy, budget, backend, model, token counts) or a policy that broke its contract."""
