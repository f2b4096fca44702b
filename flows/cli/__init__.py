"""The `cje` command line and the demo."""


def main(argv=None) -> int:
    """Entry point of the `cje` console script (`flows.cli.main.main`)."""
    # Imported on call so that `python -m flows.cli.main` does not import the module twice.
    from flows.cli.main import main as _main

    return _main(argv)


__all__ = ["main"]
