"""Fixtures for the storage tests: a moto S3 server (session), a fresh bucket per test, a local root."""
from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.storage.local import LocalStorage
from flows.storage.objects import Storage, StorageConfig
from flows.storage.s3 import S3Storage
from tests.s3server import start_s3_server

#: Distinctive credentials so that tests can assert they never leak into messages or logs.
ACCESS_KEY = "AKIATESTLEAKCHECK0001"
SECRET_KEY = "s3cr3t-Never-Print-Me-7f9c2e"


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory):
    """Endpoint URL of a moto S3 server process on 127.0.0.1 (stopped by PID at the end)."""
    log_file = tmp_path_factory.mktemp("moto") / "moto.log"
    server = start_s3_server(log_file=log_file)
    try:
        yield server.endpoint
    finally:
        server.stop()


def make_s3_config(endpoint: str, **overrides) -> StorageConfig:
    base = dict(endpoint_url=endpoint, region="us-east-1", access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                max_attempts=3, connect_timeout=2.0, read_timeout=10.0)
    base.update(overrides)
    return StorageConfig(**base)


def new_bucket(endpoint: str, config: StorageConfig | None = None) -> str:
    config = config or make_s3_config(endpoint)
    name = f"t-{uuid.uuid4().hex[:20]}"
    S3Storage(name, "", config).client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_config(s3_endpoint: str) -> StorageConfig:
    return make_s3_config(s3_endpoint)


@pytest.fixture
def s3_storage(s3_endpoint: str, s3_config: StorageConfig) -> S3Storage:
    """A fresh bucket on the moto server, rooted at a prefix (keys live under ``root/``)."""
    bucket = new_bucket(s3_endpoint, s3_config)
    st = Storage.for_uri(f"s3://{bucket}/root", s3_config)
    assert isinstance(st, S3Storage)
    return st


@pytest.fixture
def local_storage(tmp_path: Path) -> LocalStorage:
    st = Storage.for_uri(str(tmp_path / "store"))
    assert isinstance(st, LocalStorage)
    return st


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest) -> Storage:
    """Every test using this runs once on a local folder and once on the moto S3 server."""
    return request.getfixturevalue(f"{request.param}_storage")


# --------------------------------------------------------------------------- network faults

import socket  # noqa: E402
import threading  # noqa: E402


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of a real server that can misbehave on purpose.

    ``drop_next(n)`` makes the next ``n`` connections close immediately without a reply (a
    transient outage); ``down = True`` drops every connection until set back to False.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.to_drop = 0
        self.down = False
        self.dropped = 0
        self.accepted = 0
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def drop_next(self, n: int) -> None:
        with self._lock:
            self.to_drop = n

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                drop = self.down or self.to_drop > 0
                if drop:
                    self.to_drop = max(0, self.to_drop - 1)
                    self.dropped += 1
            if drop:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()  # RST: connection reset by peer
                continue
            threading.Thread(target=self._pipe_pair, args=(conn,), daemon=True).start()

    def _pipe_pair(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            conn.close()
            return

        def pipe(a: socket.socket, b: socket.socket) -> None:
            try:
                while True:
                    data = a.recv(65536)
                    if not data:
                        break
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        t = threading.Thread(target=pipe, args=(upstream, conn), daemon=True)
        t.start()
        pipe(conn, upstream)
        t.join(timeout=10)
        conn.close()
        upstream.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()


class BlackHole:
    """Accepts TCP connections and never answers (a storage endpoint that hangs)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def fault_proxy(s3_endpoint: str):
    from urllib.parse import urlparse

    p = urlparse(s3_endpoint)
    proxy = FaultProxy(p.hostname, p.port)
    yield proxy
    proxy.close()


@pytest.fixture
def black_hole():
    hole = BlackHole()
    yield hole
    hole.close()


@contextlib.contextmanager
def closed_port_endpoint() -> Iterator[str]:
    """An endpoint where nothing listens (connection refused) until the block ends (`tests.ports.refused_port`:
    the port is held, so that no other process can start listening there meanwhile)."""
    from tests.ports import refused_port

    with refused_port() as port:
        yield f"http://127.0.0.1:{port}"


# --------------------------------------------------------------------------- HTTP-level faults


@pytest.fixture
def s3_faults(s3_endpoint: str):
    """A fault-injecting HTTP proxy (`tests.s3proxy.S3FaultProxy`) in front of the moto server.

    Program it with ``s3_faults.add(method, key_pattern, action, ...)``; a storage reaching it
    is ``make_s3_config(s3_faults.endpoint)``.  Stopped (by its own threads) at the end.
    """
    from tests.s3proxy import start_fault_proxy

    proxy = start_fault_proxy(s3_endpoint)
    yield proxy
    proxy.stop()
