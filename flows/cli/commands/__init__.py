"""The command modules of `cje`: each exposes ``register(subparsers)`` (see `flows.cli.main.COMMAND_MODULES`)."""
