"""One module per kvsim subcommand, each exposing ``register(subparsers)``."""
