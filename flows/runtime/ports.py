"""Free TCP ports for services that bind them later, drawn from below the kernel's ephemeral range.

A service's port is chosen first and bound by the service seconds later (a Prefect server's imports, a Ray
head's start). A port from the ephemeral range (what binding port 0 hands out) can meanwhile become the local
port of any outgoing connection on the host, and the service then cannot bind it (seen in CI's layout, two
stacks starting at once: a Ray node's ``--node-manager-port`` taken, "No address added out of total 1
resolved", the stack down). So ports are drawn at random from ``[LOW, start of
/proc/sys/net/ipv4/ip_local_port_range)``, above Ray Client's per-connection servers (23000-23999), and one is
returned only if nothing on the host has it bound. A host whose ephemeral range leaves no such room gets port
0's answer.

A port drawn is also *leased* until its service has had time to bind it: a file named after it in a folder of
the host's temporary directory (`lease`, created exclusively), which every other draw on the host skips for
``LEASE_S`` seconds. Without it two start scripts running at once (CI starts two stacks together, beside the
tests' own servers), or one script drawing its ~20 ports one after another, could each be handed the same free
port before either had bound it (about 20 x 20 / 8,768 = 4.5% of two stacks' starts).

Standard library only: ``infra/free_port.py`` prints `free_port` for the start scripts before any virtualenv
exists.
"""
from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

#: Lowest port drawn: above Ray Client's specific servers (ray.util.client.server.proxier: 23000-23999).
LOW = 24000
#: Fewest ports between LOW and the ephemeral range for drawing from there at all.
MIN_ROOM = 1000
#: Draws before giving up on the room below the ephemeral range.
DRAWS = 200
#: Seconds a drawn port stays leased: longer than any service takes to bind its port (a stack's Ray worker node
#: binds its ports up to ~250 s after they are drawn, under the tiers' load).
LEASE_S = 900
#: Where the leases are, unless ``CJE_PORT_LEASES`` names another folder.
LEASE_DIR = "cje-port-leases"


def ephemeral_start(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """First port of the kernel's ephemeral range (32768, Linux's default, when it cannot be read)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bindable(port: int) -> bool:
    """Whether ``port`` can be bound on every address now (nothing on the host holds it, not even in TIME_WAIT)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def lease_dir() -> Path:
    """The host's folder of port leases (``CJE_PORT_LEASES``, else a folder of the temporary directory)."""
    return Path(os.environ.get("CJE_PORT_LEASES") or Path(tempfile.gettempdir()) / LEASE_DIR)


def lease(port: int, folder: Path | None = None, now: float | None = None) -> bool:
    """Lease ``port`` for at least ``LEASE_S`` seconds: False if another draw holds it leased.

    A lease is the file ``<port>.<window>`` (windows of ``LEASE_S`` seconds since the epoch), created exclusively:
    of two draws of one port in one window one gets it; a draw also skips the port if the previous window's file
    exists (a lease holds to the end of the window after its own: ``LEASE_S`` to twice that). Files of older
    windows (any port's) are removed by the first lease of each window. A folder that cannot be written leases
    nothing (True).
    """
    folder = lease_dir() if folder is None else folder
    window = int((time.time() if now is None else now) // LEASE_S)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if (folder / f"{port}.{window - 1}").exists():
            return False
        os.close(os.open(folder / f"{port}.{window}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    except OSError:
        return True
    try:  # the first lease of a window on the host sweeps the folder (not every draw: the tests make thousands)
        os.close(os.open(folder / f".swept.{window}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except OSError:
        return True
    with os.scandir(folder) as entries:
        for entry in entries:
            stamp = entry.name.rpartition(".")[2]
            if stamp.isdigit() and int(stamp) < window - 1:
                Path(entry.path).unlink(missing_ok=True)
    return True


def pick(low: int, high: int, free: Callable[[int], bool] = bindable, rng: random.Random | None = None,
         leases: Path | None = None) -> int | None:
    """A port in ``[low, high)`` for which ``free`` holds and that no other draw holds leased (``DRAWS``
    random draws), leased to the caller; or None (no room, or none free)."""
    if high - low < MIN_ROOM:
        return None
    rng = rng or random.SystemRandom()
    for _ in range(DRAWS):
        port = rng.randrange(low, high)
        if free(port) and lease(port, leases):
            return port
    return None


def any_port(host: str = "127.0.0.1") -> int:
    """The kernel's choice (port 0): from the ephemeral range."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on the host now, from below the ephemeral range where there is room (else the kernel's)."""
    port = pick(LOW, ephemeral_start())
    return port if port is not None else any_port(host)
