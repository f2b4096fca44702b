"""Print a free TCP port for a service that binds it later, drawn from below the kernel's ephemeral range.

The start scripts (infra/stack, infra/radosgw, infra/labelstudio) choose their services' ports first and start
the services after; `flows.runtime.ports` explains why the port comes from below the ephemeral range, and is
what `cje`'s own local Prefect server uses too.

Usage: ``python3 infra/free_port.py`` (standard library only: it runs before any virtualenv exists; it imports
`flows.runtime.ports` from this checkout, which imports nothing outside the standard library).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.runtime.ports import free_port  # noqa: E402


def main() -> int:
    """Print the port."""
    print(free_port())
    return 0


if __name__ == "__main__":
    sys.exit(main())
