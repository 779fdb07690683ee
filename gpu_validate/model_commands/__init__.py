"""kvsim subcommands that run a real model (validate, fidelity, needle): registered with the CLI through the
``kvsim.commands`` entry-point group in pyproject.toml, so that nothing in ``sim`` imports ``gpu_validate``."""
