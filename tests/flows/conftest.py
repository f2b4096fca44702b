"""Real parts for the flow tests: a Prefect API server process, a two-node Ray cluster,
the moto S3 server, and a TCP fault proxy in front of it.

Nothing is mocked.  Every process started here is stopped here, by PID / process group
(never `ray stop` or a name-based kill).

Ray 2.60 turns token authentication on by default for new local clusters (and writes a
token to ~/.ray/auth_token if none exists).  The cluster here runs with
``RAY_AUTH_MODE=token`` and a random per-session ``RAY_AUTH_TOKEN`` in the environment of
both ``ray start`` processes and of every driver (this process and the subprocesses the
tests start), so nothing is written to the home directory.  These variables must be set
before Ray is first imported (it caches its auth mode), hence at import time below.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402

from flows.runtime.ports import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

#: Moto accepts any credentials; these are what the tests use (and check never leak).
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "cjetestaccesskey",
    "AWS_SECRET_ACCESS_KEY": "cje-test-secret-never-printed",
    "AWS_REGION": "us-east-1",
    # Fail fast so fault tests exercise the flow's retries, not minutes of client retries.
    "CJE_S3_MAX_ATTEMPTS": "2",
    "CJE_S3_CONNECT_TIMEOUT": "2",
    "CJE_S3_READ_TIMEOUT": "5",
}


def _stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group we started with ``start_new_session``, then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    # children may outlive the leader: the whole group goes
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


# ------------------------------------------------------------------------------ Prefect


@pytest.fixture(scope="session", autouse=True)
def _prefect_boot():
    """Launch the session's Prefect server at once; it boots while Ray and S3 start."""
    from flows.runtime.prefect_server import launch_server, stop_server

    server = launch_server(extra_env={"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1"})
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def prefect_server(_prefect_boot):
    """One real Prefect API server process for the session; this process uses it.

    The scheduler loop is 1 s (default 60 s) so that a new deployment's interval schedule
    produces runs within seconds.
    """
    from flows.runtime.prefect_server import use_api, wait_healthy

    server = wait_healthy(_prefect_boot, timeout=600)  # bounds a hang only: ~10 s of CPU, minutes at load 10
    with use_api(server.url):  # drains this process's log/event workers on exit (before the stop)
        yield server


# ------------------------------------------------------------------------------ Ray


@dataclass
class RayCluster:
    address: str
    head: subprocess.Popen
    worker: subprocess.Popen
    temp_dir: str
    env: dict = field(default_factory=dict)

    @property
    def groups(self) -> set[int]:
        return {self.head.pid, self.worker.pid}

    def owns(self, pid: int) -> bool:
        """True when ``pid`` descends from (or is) a process this fixture started."""
        seen = 0
        while pid > 1 and seen < 64:
            if pid in self.groups:
                return True
            try:
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4: ppid
            except (OSError, ValueError, IndexError):
                return False
            seen += 1
        return False


def _ray_env() -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster of two node processes with one CPU each.

    ``ray start --head`` plus ``ray start --address=...`` as a second node, both with
    ``--block`` in their own process group so that teardown stops exactly them.  This test
    process connects as a driver for the whole session (flows run in-process reuse it).
    """
    import ray

    from flows.runtime import ray_fanout as ray_runtime

    temp_dir = tempfile.mkdtemp(prefix="cjeray")  # short: Ray's socket paths have a length limit
    port = free_port()
    env = _ray_env()
    ray_bin = str(BIN / "ray")
    common = ["--num-cpus=1", "--disable-usage-stats", "--node-ip-address=127.0.0.1", "--block"]
    head = subprocess.Popen(
        [ray_bin, "start", "--head", f"--port={port}", "--include-dashboard=false",
         f"--temp-dir={temp_dir}", *common],
        env=env, cwd=str(REPO), stdout=open(Path(temp_dir) / "head.out", "wb"), stderr=subprocess.STDOUT,
        start_new_session=True)
    address = f"127.0.0.1:{port}"
    worker = None
    try:
        deadline = time.monotonic() + 400  # bounds a hang only, as infra/stack's: the head and the node's join
        while time.monotonic() < deadline:
            r = subprocess.run([ray_bin, "status", f"--address={address}"], env=env, capture_output=True)
            if r.returncode == 0:
                break
            assert head.poll() is None, (Path(temp_dir) / "head.out").read_text()[-2000:]
            time.sleep(0.5)
        worker = subprocess.Popen(
            [ray_bin, "start", f"--address={address}", *common],
            env=env, cwd=str(REPO), stdout=open(Path(temp_dir) / "worker.out", "wb"),
            stderr=subprocess.STDOUT, start_new_session=True)
        cluster = RayCluster(address, head, worker, temp_dir, env)
        with ray_runtime.ray_session(address=address):
            while time.monotonic() < deadline:
                if sum(1 for n in ray.nodes() if n["Alive"]) == 2:
                    break
                time.sleep(0.3)
            assert sum(1 for n in ray.nodes() if n["Alive"]) == 2, "second Ray node did not join"
            yield cluster
    finally:
        for proc in (worker, head):
            if proc is not None:
                _stop_group(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


# ------------------------------------------------------------------------------ S3


@pytest.fixture(scope="session")
def s3_server():
    from tests.s3server import start_s3_server

    server = start_s3_server()
    yield server
    server.stop()


class FaultProxy:
    """A TCP proxy in front of the S3 server that can break on a chosen request.

    Modes: ``pass`` (forward), ``down`` (close every connection: storage unreachable),
    ``hang`` (accept, never answer: storage stalled).  `trip` arms a switch: the first
    time ``count`` requests whose request line matches ``pattern`` were seen, the proxy
    switches to ``mode`` *before* forwarding that request, and `tripped` is set.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.mode = "pass"
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.tripped = threading.Event()
        self.requests: list[bytes] = []
        self._trip: tuple[re.Pattern, int, str] | None = None
        self._seen = 0
        self._lock = threading.Lock()
        self._closing = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def trip(self, pattern: bytes, mode: str, count: int = 1) -> None:
        with self._lock:
            self._trip = (re.compile(pattern), count, mode)
            self._seen = 0
            self.tripped.clear()

    def reset(self) -> None:
        with self._lock:
            self._trip = None
            self.mode = "pass"
            for c in self._conns:  # drop hung connections
                with contextlib.suppress(OSError):
                    c.close()
            self._conns.clear()

    def close(self) -> None:
        self._closing = True
        self.reset()
        with contextlib.suppress(OSError):
            self.sock.close()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            if self.mode == "down":
                client.close()
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            self._conns.append(client)
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                for line in re.findall(rb"(?:^|\r\n)((?:GET|PUT|POST|HEAD|DELETE) [^\r\n]*)", data):
                    self._on_request(line)
                if self.mode == "down":
                    break
                if self.mode == "hang":
                    while self.mode == "hang" and not self._closing:
                        time.sleep(0.05)
                    break
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.close()

    def _on_request(self, line: bytes) -> None:
        with self._lock:
            self.requests.append(line)
            if self._trip is None:
                return
            pattern, count, mode = self._trip
            if pattern.search(line):
                self._seen += 1
                if self._seen >= count:
                    self.mode = mode
                    self._trip = None
                    self.tripped.set()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()


@pytest.fixture
def fault_proxy(s3_server):
    proxy = FaultProxy(s3_server.port)
    yield proxy
    proxy.close()


@pytest.fixture
def s3_faults(s3_server):
    """A fault-injecting HTTP proxy (`tests.s3proxy.S3FaultProxy`) in front of the S3 server."""
    from tests.s3proxy import start_fault_proxy

    proxy = start_fault_proxy(s3_server.endpoint)
    yield proxy
    proxy.stop()


@pytest.fixture
def s3_faults_env(s3_faults, monkeypatch):
    """Storage settings of this process (the flow driver) pointing at the HTTP fault proxy."""
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CJE_S3_ENDPOINT", s3_faults.endpoint)
    return {**S3_ENV, "CJE_S3_ENDPOINT": s3_faults.endpoint}


@pytest.fixture
def s3_env(fault_proxy, monkeypatch):
    """Storage settings of this process (the flow driver) pointing at the proxy."""
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CJE_S3_ENDPOINT", fault_proxy.endpoint)
    return {**S3_ENV, "CJE_S3_ENDPOINT": fault_proxy.endpoint}


@pytest.fixture
def bucket(s3_server, request):
    """A fresh bucket on the moto server (created directly, not through the proxy)."""
    import boto3

    name = "cje-" + re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + secrets.token_hex(3)
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1",
                      aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"])
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def direct_storage(s3_server):
    """Storage roots read directly from moto (bypassing the proxy), for checking results."""
    from flows.storage.objects import Storage, StorageConfig

    cfg = StorageConfig(endpoint_url=s3_server.endpoint, region="us-east-1",
                        access_key=S3_ENV["AWS_ACCESS_KEY_ID"], secret_key=S3_ENV["AWS_SECRET_ACCESS_KEY"])
    return lambda uri: Storage.for_uri(uri, cfg)


# ------------------------------------------------------------------------------ data

FIRST_DAY = "2025-03-01"


def write_simulated_logs(st_logs, st_labels, n_prompts: int, days: int, seed: int = 0):
    """Simulated logs over ``days`` days from FIRST_DAY into ``st_logs`` and their labels into
    the label store at ``st_labels``.

    Returns the frame the flow should hand to the engine: rows grouped by day in file
    order (as the partitions are read), labels joined on response_id.
    """
    from datetime import date, datetime, timedelta, timezone

    import numpy as np
    import pyarrow as pa

    from cje_engine.simulate.direct import simulate
    from flows.storage.labels import LabelStore
    from flows.storage.logs import write_logs

    sim = simulate(n_prompts, label_design="calibration_policy", oracle_fraction=0.25, audit_labels=120,
                   seed=seed)
    frame = sim.frame.copy()
    day = frame["prompt_id"].astype("category").cat.codes.to_numpy() % days
    start = datetime.combine(date.fromisoformat(FIRST_DAY), datetime.min.time(), tzinfo=timezone.utc)
    rng = np.random.default_rng(seed)
    frame["ts"] = [start + timedelta(days=int(d), seconds=float(s))
                   for d, s in zip(day, rng.uniform(0, 86399, len(frame)))]
    labels = frame.loc[frame["oracle_label"].notna(), ["response_id", "oracle_label", "label_probability"]]
    write_logs(st_logs, pa.Table.from_pandas(frame.drop(columns=["oracle_label", "label_probability"]),
                                             preserve_index=False), basename="sim")
    LabelStore(st_labels).append(pa.Table.from_pandas(labels.reset_index(drop=True), preserve_index=False),
                                 "oracle")
    order = np.argsort(day, kind="stable")
    expected = frame.iloc[order].drop(columns=["ts"]).reset_index(drop=True)
    window = f"{FIRST_DAY}..{(date.fromisoformat(FIRST_DAY) + timedelta(days=days - 1)).isoformat()}"
    return expected, window
