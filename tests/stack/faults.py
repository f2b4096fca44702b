"""Faults on the loopback stack and the invariants every fault must keep (tests/stack/test_stack_faults.py
and benchmarks/chaos_soak.py share them).

Faults stop single services by the sessions start.sh recorded (`Stack.kill`) and relaunch them from its
launch scripts (`Stack.launch`); `restore` brings every service back and waits until the stack answers
again, so a fault test leaves the stack healthy for the next one.  `check_integrity` reads what the runs
left in the bucket: published runs and their artifacts (sha256 of the manifest), ``latest.json``, attempt
folders no manifest commits, the label requests and the budget ledger, the label store.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .conftest import Stack, read_run, session_pids

log = logging.getLogger(__name__)

FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
#: The services `restore` checks, in the order it relaunches them.
SERVICES = ("postgres", "prefect-server", "ray-head", "ray-worker", "prefect-worker")

#: The chaos soak's fault kinds and their weights (benchmarks/chaos_soak.py; the Ray head costs a cluster
#: restart, so it is drawn less often). Here, so that the soak's test reads them without importing benchmarks.
SOAK_FAULTS = {"none": 3, "flow_kill": 2, "ray_node": 2, "api_crash": 2, "pg_kill": 2, "double_fire": 2, "ray_head": 1}

# ------------------------------------------------------------------------------------------- processes


def alive(stack: Stack, name: str) -> bool:
    """Whether the service's session still has a process."""
    return bool(session_pids(stack.pids()[name]))


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP: state ``T``)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def signal_session(stack: Stack, name: str, sig: int) -> list[int]:
    """Send ``sig`` to every process of the service's session; returns the pids signalled."""
    pids = session_pids(stack.pids()[name])
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def flow_run_pid(stack: Stack, run_id: str) -> int | None:
    """The flow-run subprocess of a run (the process worker records it as ``host:pid``)."""
    infra = read_run(stack, run_id).infrastructure_pid
    return int(str(infra).rsplit(":", 1)[-1]) if infra else None


def _pg_port(stack: Stack) -> int:
    return int(stack.env["CJE_STACK_PG_URL"].rsplit(":", 1)[1].split("/", 1)[0])


def postgres_ready(stack: Stack) -> bool:
    """PostgreSQL answers ``pg_isready``."""
    bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_isready"))
    if not bins:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", _pg_port(stack)), timeout=2):
            return True
        return False
    return subprocess.run([str(bins[-1]), "-q", "-h", "127.0.0.1", "-p", str(_pg_port(stack))],
                          timeout=10).returncode == 0


def api_ready(stack: Stack) -> bool:
    """The Prefect API answers and reaches its database (``/ready``)."""
    import urllib.request

    try:
        with urllib.request.urlopen(stack.api.rstrip("/") + "/ready", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def ray_nodes_alive(stack: Stack) -> int:
    """Alive nodes of the stack's Ray cluster (asked through its GCS in a subprocess)."""
    code = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False); "
            "print(sum(1 for n in ray.nodes() if n['Alive']))")
    env = stack.command_env()
    env.pop("RAY_ADDRESS", None)
    try:
        out = subprocess.run([str(Path(os.sys.executable)), "-c", code, stack.env["CJE_STACK_RAY_GCS"]], env=env,
                             capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return 0
    try:
        return int(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def gcs_port_open(stack: Stack, tries: int = 3, pause: float = 2.0) -> bool:
    """Whether the head's GCS port accepts a TCP connection (what the worker node's supervisor waits for),
    asked ``tries`` times ``pause`` s apart before answering no."""
    host, _, port = stack.env["CJE_STACK_RAY_GCS"].rpartition(":")
    for k in range(tries):
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=3):
            return True
        if k + 1 < tries:
            time.sleep(pause)
    return False


def _session_left(stack: Stack, name: str) -> str:
    """The processes left in a service's session: pid, state and command, for the log."""
    out = []
    for pid in session_pids(stack.pids()[name]):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        out.append(f"{pid} {state} {cmd}")
    return "; ".join(out) or "none"


def ray_client_ready(stack: Stack, timeout: float = 120.0) -> tuple[bool, str]:
    """Whether a real Ray Client handshake on the stack's ``ray://`` address (what a flow run does) works: a
    fresh process connects, reads the cluster's CPUs and disconnects within ``timeout`` s; (ok, what it said)."""
    code = ("import ray, os; ray.init(os.environ['RAY_ADDRESS'], logging_level='ERROR', log_to_driver=False); "
            "print(ray.cluster_resources().get('CPU', 0)); ray.shutdown()")
    try:
        out = subprocess.run([str(Path(os.sys.executable)), "-c", code], env=stack.command_env(), capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"no answer within {timeout:.0f} s"
    said = (out.stdout + out.stderr).strip().splitlines()
    return out.returncode == 0, said[-1][:300] if said else f"exit {out.returncode}"


def stack_cpu_seconds(stack: Stack) -> float:
    """CPU seconds (user + system) used so far by the stack's services and their processes: every live process
    of their sessions, with the children each has reaped (the worker's finished flow runs, Ray's workers).
    Processes killed by a fault take theirs with them, so across faults this undercounts."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for sid in stack.pids().values():
        for pid in session_pids(sid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / tick


def _wait(what: str, ok, timeout: float, pause: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not back after {timeout:.0f} s")
        time.sleep(pause)


def restart_postgres(stack: Stack) -> None:
    """Relaunch PostgreSQL (crash recovery after a SIGKILL) and wait until it and the API's database answer."""
    stack.launch("postgres")
    _wait("PostgreSQL", lambda: postgres_ready(stack), 60)
    _wait("the Prefect API's database", lambda: api_ready(stack), 90, pause=1.0)


def restart_ray(stack: Stack, head: bool, timeout: float = 240.0) -> None:
    """Relaunch the Ray head (when ``head``) and wait for two alive nodes.

    The worker node is supervised by its launch script (infra/stack/start.sh): it leaves a lost head's
    cluster and rejoins the relaunched head by itself, as a real deployment's node must; it is relaunched
    here only if its supervisor itself is gone.
    """
    if head:
        if alive(stack, "ray-head"):
            stack.kill("ray-head")
        stack.launch("ray-head")
        _wait("the Ray head", lambda: ray_nodes_alive(stack) >= 1, timeout, pause=2.0)
    if not alive(stack, "ray-worker"):
        stack.launch("ray-worker")
    _wait("the Ray worker node (rejoining by itself)", lambda: ray_nodes_alive(stack) >= 2, timeout, pause=2.0)
    if head:
        for relaunch in range(2):
            try:
                wait_ray_client(stack, timeout=120.0)
                return
            except AssertionError as exc:
                if relaunch:  # relaunched once already: reported (the soak counts it as a problem)
                    raise
                # what a readiness probe does to a head whose client port is dead: a new head
                log.error("%s: relaunching the Ray head again", exc)
                stack.kill("ray-head")
                stack.launch("ray-head")
                _wait("the Ray head", lambda: ray_nodes_alive(stack) >= 2, timeout, pause=2.0)


def wait_ray_client(stack: Stack, timeout: float = 240.0) -> float:
    """Until the relaunched head's Ray Client server completes a real ``ray://`` handshake (the GCS answering
    is not enough: the client port is a separate server process of the head); returns the seconds waited."""
    t0, last = time.monotonic(), ""

    def ok() -> bool:
        nonlocal last
        good, last = ray_client_ready(stack, timeout=min(120.0, timeout))
        if not good:
            log.warning("the Ray Client at %s does not answer yet: %s", stack.env.get("RAY_ADDRESS"), last)
        return good

    try:
        _wait("the Ray Client server of the relaunched head", ok, timeout, pause=2.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last: {last}") from None
    waited = time.monotonic() - t0
    log.info("the Ray Client at %s answered a handshake %.1f s after both nodes were alive",
             stack.env.get("RAY_ADDRESS"), waited)
    return waited


def restore(stack: Stack) -> list[str]:
    """Bring every stack service back (resume stopped ones, relaunch dead ones) and wait until it answers.

    Returns the names of the services it had to resume or relaunch.
    """
    fixed = []
    for name in SERVICES:
        for pid in session_pids(stack.pids()[name]):
            if stopped(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                fixed.append(f"{name} (resumed)")
    if not alive(stack, "postgres"):
        fixed.append("postgres")
        restart_postgres(stack)
    if not alive(stack, "prefect-server"):
        fixed.append("prefect-server")
        stack.launch("prefect-server")
    stack.wait_api(timeout=180)
    _wait("the Prefect API's database", lambda: api_ready(stack), 90, pause=1.0)
    head_dead = not alive(stack, "ray-head")
    if not head_dead and not gcs_port_open(stack):
        # what a liveness probe does to a head whose GCS port refuses connections: a new head (seen in the soak:
        # after a Ray head kill and a node kill in one round the head's session still had a process, the
        # head was not relaunched and the relaunched node waited for its GCS port for 240 s)
        log.error("the Ray head's GCS port refuses connections but its session has processes (%s): relaunching it",
                  _session_left(stack, "ray-head"))
        stack.kill("ray-head")
        head_dead = True
    if head_dead or not alive(stack, "ray-worker"):
        fixed.append("ray-head" if head_dead else "ray-worker")
        restart_ray(stack, head=head_dead)
    if not alive(stack, "prefect-worker"):
        fixed.append("prefect-worker")
        stack.launch("prefect-worker")
    return fixed


def set_crash_timeout(stack: Stack, seconds: float) -> None:
    """Replace the heartbeat automation (`cje deploy` makes one for all deployments) with ``seconds``."""
    from flows.runtime.deploy import ensure_zombie_automation

    with stack.client() as c:
        ensure_zombie_automation(c, seconds)


# ------------------------------------------------------------------------------------------- runs

def wait_final(stack: Stack, run_id: str, timeout: float = 300.0):
    """The run once it is in a final state (whatever it is); AssertionError naming the last state if not."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            run = read_run(stack, run_id)
        except Exception:  # noqa: BLE001 - the API or its database may be down
            time.sleep(1.0)
            continue
        last = run.state.type.value if run.state else None
        if last in FINAL:
            return run
        time.sleep(1.0)
    raise AssertionError(f"flow run {run_id} not in a final state after {timeout:.0f} s (last: {last}): hung")


def wait_running(stack: Stack, run_id: str, timeout: float = 120.0) -> None:
    """Until the run's state is Running (its flow-run process started)."""
    deadline = time.monotonic() + timeout
    while True:
        run = read_run(stack, run_id)
        state = run.state.type.value if run.state else None
        if state == "RUNNING" and run.infrastructure_pid:
            return
        assert state not in FINAL, f"run {run_id} ended {state} before running: {run.state.message}"
        assert time.monotonic() < deadline, f"run {run_id} not running after {timeout:.0f} s (state {state})"
        time.sleep(0.3)


def wait_process_gone(pid: int | None, timeout: float = 120.0) -> bool:
    """Whether process ``pid`` ended within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while pid and Path(f"/proc/{pid}").exists():
        if stopped(pid) or time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


# ------------------------------------------------------------------------------------------- invariants

@dataclass
class Integrity:
    """What the runs of one bucket left behind (every list names the offending object or evaluation)."""

    published: dict[str, int] = field(default_factory=dict)
    dangling_pointers: list[str] = field(default_factory=list)
    bad_artifacts: list[str] = field(default_factory=list)
    duplicated_results: list[str] = field(default_factory=list)
    uncommitted_attempts: list[str] = field(default_factory=list)
    requests: int = 0
    duplicated_requests: list[str] = field(default_factory=list)
    ledger_labels: int = 0
    requested_labels: int = 0
    ledger_mismatch: list[str] = field(default_factory=list)
    labels_stored: int = 0

    def problems(self) -> list[str]:
        """Every broken invariant, one line each (empty: all held)."""
        out = [f"dangling latest.json: {p}" for p in self.dangling_pointers]
        out += [f"bad artifact: {p}" for p in self.bad_artifacts]
        out += [f"more than one published run: {p}" for p in self.duplicated_results]
        out += [f"duplicated label request: {p}" for p in self.duplicated_requests]
        out += [f"budget ledger != stored requests: {p}" for p in self.ledger_mismatch]
        return out

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def storage(stack: Stack, bucket: str):
    """The `Storage` of ``s3://bucket`` on the stack's radosgw."""
    from flows.storage.objects import Storage

    return Storage.for_uri(f"s3://{bucket}", stack.storage_config())


_storage = storage


def list_runs(st: Any, evaluation: str) -> list[dict]:
    """Published runs of ``evaluation`` (`flows.storage.publish.list_runs`: oldest ``published_at`` first)."""
    from flows.storage.publish import list_runs as listed

    return listed(st, evaluation)


def check_integrity(stack: Stack, bucket: str, evaluations: list[str]) -> Integrity:
    """Read the bucket's results, label requests and budget ledger; see `Integrity`."""
    from flows.label_requests.budget import LabelBudget
    from flows.label_requests.manifests import list_requests
    from flows.storage.publish import list_runs, read_run as read_published

    st = _storage(stack, bucket)
    out = Integrity()
    for ev in evaluations:
        runs = list_runs(st, ev)
        out.published[ev] = len(runs)
        by_window: dict[str, int] = {}
        committed = set()
        for r in runs:
            by_window[r["window"]] = by_window.get(r["window"], 0) + 1
            run = f"results/{ev}/{r['window']}/{r['run_key']}"
            committed.add((run, r["manifest"].get("attempt")))
            try:
                read_published(st, ev, r["window"], r["run_key"])  # result.json against its sha256
                for name, entry in (r["manifest"].get("artifacts") or {}).items():
                    import hashlib

                    raw = st.read_bytes(f"{run}/{entry['key']}")
                    if hashlib.sha256(raw).hexdigest() != entry.get("sha256"):
                        out.bad_artifacts.append(f"{run}/{entry['key']}")
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                out.bad_artifacts.append(f"{run}: {type(exc).__name__}: {exc}")
        out.duplicated_results += [f"{ev}/{w}: {n}" for w, n in by_window.items() if n > 1]
        raw = None
        with contextlib.suppress(Exception):
            raw = st.read_bytes(f"results/{ev}/latest.json")
        if raw is not None:
            p = json.loads(raw)
            if read_published(st, ev, str(p.get("window")), str(p.get("run_key"))) is None:
                out.dangling_pointers.append(f"results/{ev}/latest.json -> {p.get('window')}/{p.get('run_key')}")
        elif runs:
            out.dangling_pointers.append(f"results/{ev}/latest.json missing with {len(runs)} published run(s)")
        for info in st.list(f"results/{ev}/"):
            parts = info.key.split("/")
            if len(parts) >= 6 and ("/".join(parts[:4]), parts[4]) not in committed:
                out.uncommitted_attempts.append(info.key)
    stored = list_requests(st)
    out.requests = len(stored)
    seen: dict[str, str] = {}
    for m in stored:
        for row in m.get("rows") or []:
            rid = row["response_id"]
            if rid in seen and m.get("evaluation") == seen[rid].split(":")[0]:
                out.duplicated_requests.append(f"{rid} in {seen[rid]} and {m['request_id']}")
            seen[rid] = f"{m.get('evaluation')}:{m['request_id']}"
    codes: dict[tuple, str] = {}
    for m in stored:
        for r in m.get("reasons") or []:
            code = (m.get("evaluation"), m.get("window"), m.get("scope"), r.get("trigger"), r.get("policy"))
            if codes.get(code, m["request_id"]) != m["request_id"]:
                out.duplicated_requests.append(f"{code} in {codes[code]} and {m['request_id']}")
            codes[code] = m["request_id"]
    for period in sorted({m.get("period") for m in stored} | _ledger_periods(st)):
        entries = LabelBudget(st, period).entries()
        ledger = {str(k): int(v) for e in entries for k, v in (e.get("per_request") or {}).items()}
        mine = {m["request_id"]: int(m["n_labels"]) for m in stored if m.get("period") == period}
        out.ledger_labels += sum(int(e.get("labels", 0)) for e in entries)
        out.requested_labels += sum(mine.values())
        if ledger != mine:
            out.ledger_mismatch.append(f"{period}: ledger {sorted(ledger.items())} stored {sorted(mine.items())}")
    out.labels_stored = labels_stored(stack, bucket)
    return out


def _ledger_periods(st: Any) -> set[str]:
    return {info.key.split("/")[2] for info in st.list("label_requests/_budget/") if len(info.key.split("/")) == 4}


def labels_stored(stack: Stack, bucket: str) -> int:
    """Rows of the bucket's label store (its current version)."""
    from flows.storage.labels import LabelStore

    return int(LabelStore(_storage(stack, bucket)).read().num_rows)
