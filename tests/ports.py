"""A loopback port where connections are refused, held for as long as a test needs it refused."""
from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port on ``host`` that refuses connections until the block ends: bound, never listening.

    A port bound and closed at once ("nothing listens there") is free for any other process to take before
    the test connects to it (a server of the other pytest-xdist worker, a service CI starts beside the tests,
    the local port of an outgoing connection); while this socket holds it, none can, and the kernel answers
    every connection to it with a reset (ECONNREFUSED).
    """
    with socket.socket() as s:
        s.bind((host, 0))
        yield int(s.getsockname()[1])
