"""Free TCP ports for services that bind them later, drawn from below the kernel's ephemeral range.

A service's port is chosen first and bound by the service seconds later (a Prefect server's imports, a Ray
head's start). A port from the ephemeral range (what binding port 0 hands out) can meanwhile become the local
port of any outgoing connection on the host, and the service then cannot bind it (seen in CI's layout, two
stacks starting at once: a Ray node's ``--node-manager-port`` taken, "No address added out of total 1
resolved", the stack down). So ports are drawn at random from ``[LOW, start of
/proc/sys/net/ipv4/ip_local_port_range)``, above Ray Client's per-connection servers (23000-23999), and one is
returned only if nothing on the host has it bound. A host whose ephemeral range leaves no such room gets port
0's answer.

Standard library only: ``infra/free_port.py`` prints `free_port` for the start scripts before any virtualenv
exists.
"""
from __future__ import annotations

import random
import socket
from collections.abc import Callable

#: Lowest port drawn: above Ray Client's specific servers (ray.util.client.server.proxier: 23000-23999).
LOW = 24000
#: Fewest ports between LOW and the ephemeral range for drawing from there at all.
MIN_ROOM = 1000
#: Draws before giving up on the room below the ephemeral range.
DRAWS = 200


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


def pick(low: int, high: int, free: Callable[[int], bool] = bindable, rng: random.Random | None = None) -> int | None:
    """A port in ``[low, high)`` for which ``free`` holds (``DRAWS`` random draws), or None (no room, or none free)."""
    if high - low < MIN_ROOM:
        return None
    rng = rng or random.SystemRandom()
    for _ in range(DRAWS):
        port = rng.randrange(low, high)
        if free(port):
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
