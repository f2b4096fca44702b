"""A real S3-protocol HTTP server for tests: moto's server mode in a subprocess on 127.0.0.1.

    server = start_s3_server()          # picks a free port, waits until it answers
    server.endpoint                     # "http://127.0.0.1:PORT"
    server.stop()                       # terminates exactly that process (by PID)

Data lives in the server's memory; use a fresh bucket per test.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from flows.runtime.ports import free_port

log = logging.getLogger(__name__)


@dataclass
class S3Server:
    """A running moto server process."""

    process: subprocess.Popen
    host: str
    port: int

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop this server process (and only it)."""
        if self.process.poll() is not None:
            return
        os.kill(self.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.process.wait(timeout=timeout)


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=1.0) as resp:
            return resp.status < 500
    except urllib.error.HTTPError as exc:  # any HTTP answer means the server is up
        return exc.code < 500
    except OSError:
        return False


def start_s3_server(host: str = "127.0.0.1", port: int | None = None, timeout: float = 180.0,
                    log_file: str | os.PathLike | None = None) -> S3Server:
    """Start moto's S3 server (``python -m atomic_moto``: conditional writes atomic, as on S3) on ``host`` and
    wait until it answers HTTP (``timeout`` bounds a hang only: moto's imports take seconds of CPU, which a
    loaded machine stretches tenfold; a start that ran out of time was retried on another port, from scratch)."""
    last_error = "did not answer"
    for _ in range(3):  # a port picked by free_port can be taken in between: retry
        chosen = port or free_port(host)
        out = open(log_file, "ab") if log_file else subprocess.DEVNULL
        env = dict(os.environ)
        proc = subprocess.Popen(
            [sys.executable, "-m", "atomic_moto", "-H", host, "-p", str(chosen)],  # moto, conditional PUTs atomic
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            cwd=str(Path(__file__).resolve().parent),
        )
        if log_file:
            out.close()
        server = S3Server(proc, host, chosen)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                last_error = f"exited with code {proc.returncode}"
                break
            if _answers(server.endpoint):
                log.info("moto S3 server pid %d at %s", server.pid, server.endpoint)
                return server
            time.sleep(0.05)
        else:
            server.stop()
            last_error = f"did not answer within {timeout:.0f}s"
        if port:
            break
    raise RuntimeError(f"moto S3 server could not be started: {last_error}")
