"""A fault-injecting S3 proxy that speaks HTTP, for tests (stdlib only).

A threaded HTTP/1.1 reverse proxy on 127.0.0.1 in front of the moto server (`tests.s3server`).
Every request is forwarded unchanged unless a programmable `Rule` matches it; a matching rule
makes the proxy misbehave the way a real S3 endpoint or the network between does::

    proxy = start_fault_proxy(moto.endpoint)           # proxy.endpoint -> "http://127.0.0.1:PORT"
    proxy.add("GET", r"/logs/dt=.*\\.parquet$", "error", status=503, code="SlowDown", times=2)
    proxy.add("PUT", r"/result\\.json$", "drop")         # stored, but the response is lost
    proxy.add("GET", r"\\.parquet$", "truncate", nth=2)  # 2nd matching GET: half the body, then close
    proxy.add("GET", r"\\.json$", "hang", seconds=30)     # no answer for 30 s (then close)
    ...
    proxy.fired("PUT", r"result\\.json$")               # how many times rules fired on such requests
    proxy.stop()

Actions
-------
``error``
    Answer ``status`` with an S3 XML error body (``<Error><Code>code</Code>...``) without
    forwarding: 500 ``InternalError``, 503 ``SlowDown``, 503 ``ServiceUnavailable``, 429
    ``TooManyRequests``, 400 ``RequestTimeout``... (HEAD answers carry no body, as S3's).
``truncate``
    Forward, then send the upstream status and headers (``Content-Length`` kept) but only
    ``fraction`` of the body, then close the connection.
``drop``
    Forward (the write happens upstream), read the answer, then close the client's connection
    without a byte of it: a lost response after the write happened.
``hang``
    Hold the request ``seconds`` without answering (never forwarded), then close.
``reset``
    Close the client's connection at once, nothing forwarded.
``corrupt``
    Forward, then answer with the body's middle byte flipped (length and headers unchanged): a
    store handing back other bytes than were written, for checksum checks.

A lost acknowledgement of a create-only write (the object stored, the client retries and gets
412) is ``add("PUT", r"/manifest\.json$", "drop")``.

A rule matches a request by method (``None``: any) and a regular expression searched in the
URL-decoded path (``/bucket/key``, query string excluded); it fires from its ``nth`` matching
request on, ``times`` times (``None``: on every later match, a persistent fault).  The first
rule (in the order added) that fires wins.  Every request is recorded in `requests` as
``(method, path, action)``.
"""
from __future__ import annotations

import http.client
import logging
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

log = logging.getLogger(__name__)

ACTIONS = ("error", "truncate", "drop", "hang", "reset", "corrupt")
#: Headers that belong to one connection, never forwarded (RFC 9110 7.6.1) - plus ``Expect``:
#: the proxy itself answers ``100 Continue``.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "expect", "proxy-connection"}
_DEFAULT_CODES = {500: "InternalError", 503: "SlowDown", 429: "TooManyRequests", 400: "RequestTimeout",
                  403: "AccessDenied", 404: "NoSuchKey", 412: "PreconditionFailed"}


@dataclass
class Rule:
    """One programmed fault (see the module docstring)."""

    method: str | None
    pattern: str
    action: str
    status: int = 503
    code: str | None = None
    nth: int = 1
    times: int | None = 1
    fraction: float = 0.5
    seconds: float = 30.0
    seen: int = 0
    fired: int = 0
    _regex: re.Pattern = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; expected one of {ACTIONS}")
        if self.nth < 1 or (self.times is not None and self.times < 1):
            raise ValueError("nth and times start at 1")
        self.method = self.method.upper() if self.method else None
        self._regex = re.compile(self.pattern)
        self.code = self.code or _DEFAULT_CODES.get(self.status, "InternalError")

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and bool(self._regex.search(path))

    def take(self) -> bool:
        """Count one matching request; True when the rule fires on it."""
        self.seen += 1
        if self.seen < self.nth or (self.times is not None and self.fired >= self.times):
            return False
        self.fired += 1
        return True


def s3_error_body(code: str, message: str, resource: str) -> bytes:
    """An S3 error document as AWS sends it."""
    rid = uuid.uuid4().hex[:16].upper()
    return ('<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message><Resource>{resource}</Resource>"
            f"<RequestId>{rid}</RequestId><HostId>cje-fault-proxy</HostId></Error>").encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like S3 (and ``Expect: 100-continue`` answered)
    server: "_Server"
    _head_length: str | None = None

    def log_message(self, fmt: str, *args) -> None:  # noqa: D401 - quiet: the tests read `requests`
        log.debug("s3proxy: " + fmt, *args)

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _handle(self) -> None:
        body = self._body()
        path = unquote(urlsplit(self.path).path)
        rule = self.server.proxy.decide(self.command, path)
        action = rule.action if rule else "pass"
        self.server.proxy.record(self.command, path, action)
        if action == "reset":
            return self._abort()
        if action == "hang":
            self.server.proxy.sleep(rule.seconds)
            return self._abort()
        if action == "error":
            return self._error(rule, path)
        status, reason, headers, data = self._forward(body)
        if action == "drop":
            return self._abort()
        if action == "corrupt" and data:
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
        self.send_response(status, reason)
        for k, v in headers:
            self.send_header(k, v)
        length = self._head_length if self._head_length is not None else str(len(data))
        if action == "truncate":
            self.send_header("Content-Length", length)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data[:int(len(data) * rule.fraction)] if self.command != "HEAD" else b"")
            self.wfile.flush()
            return self._abort()
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.server.proxy.upstream, timeout=60)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                    conn.putheader(k, v)
            if body or self.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            resp = conn.getresponse()
            data = resp.read()
            headers = [(k, v) for k, v in resp.getheaders()
                       if k.lower() not in HOP_BY_HOP and k.lower() != "content-length"]
            self._head_length = resp.getheader("Content-Length") if self.command == "HEAD" else None
            return resp.status, resp.reason, headers, data
        finally:
            conn.close()

    def _error(self, rule: Rule, path: str) -> None:
        data = s3_error_body(rule.code or "InternalError", f"injected by the fault proxy ({rule.status})", path)
        self.send_response(rule.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("x-amz-request-id", "CJEFAULTPROXY")
        if rule.status in (429, 503):
            self.send_header("Retry-After", "0")
        self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _abort(self) -> None:
        """Close this connection now (no more requests on it, nothing more sent)."""
        self.close_connection = True
        try:
            self.wfile.flush()
        except OSError:
            pass
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: "S3FaultProxy"


class S3FaultProxy:
    """The running proxy: program it with `add`, read what happened in `requests`."""

    def __init__(self, upstream_endpoint: str) -> None:
        p = urlsplit(upstream_endpoint)
        self.upstream = (p.hostname or "127.0.0.1", int(p.port or 80))
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="s3-fault-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, method: str | None, pattern: str, action: str, **kwargs) -> Rule:
        """Program a fault (see `Rule` and the module docstring); returns the rule (its counters)."""
        rule = Rule(method, pattern, action, **kwargs)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Forget every rule (requests already held by ``hang`` are released)."""
        with self._lock:
            self.rules.clear()
        self._stopping.set()
        self._stopping = threading.Event()

    def decide(self, method: str, path: str) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.matches(method, path) and rule.take():
                    return rule
        return None

    def record(self, method: str, path: str, action: str) -> None:
        with self._lock:
            self.requests.append((method, path, action))

    def sleep(self, seconds: float) -> None:
        self._stopping.wait(seconds)

    def fired(self, method: str | None = None, pattern: str = "", action: str | None = None) -> int:
        """How many recorded requests matching ``method``/``pattern`` a rule acted on."""
        rx = re.compile(pattern)
        return sum(1 for m, p, a in list(self.requests)
                   if a != "pass" and (method is None or m == method) and rx.search(p)
                   and (action is None or a == action))

    def count(self, method: str | None = None, pattern: str = "") -> int:
        """How many requests matching ``method``/``pattern`` reached the proxy."""
        rx = re.compile(pattern)
        return sum(1 for m, p, _ in list(self.requests) if (method is None or m == method) and rx.search(p))

    def stop(self) -> None:
        """Stop serving and release held requests (this proxy's threads only)."""
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_fault_proxy(upstream_endpoint: str) -> S3FaultProxy:
    """A `S3FaultProxy` on 127.0.0.1 (a free port) forwarding to ``upstream_endpoint``."""
    proxy = S3FaultProxy(upstream_endpoint)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", proxy.port), timeout=0.5).close()
            return proxy
        except OSError:
            time.sleep(0.02)
    proxy.stop()
    raise RuntimeError("the S3 fault proxy did not start listening")
