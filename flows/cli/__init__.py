"""The `cje` command line and the demo."""
from flows.cli.main import main

__all__ = ["main"]
