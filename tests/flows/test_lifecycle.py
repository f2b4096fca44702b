"""Nothing outlives `cje`, and nothing it starts listens beyond 127.0.0.1.

A real `cje run` subprocess (embedded Prefect server, embedded local Ray) is interrupted in the
middle of its flow by SIGINT, SIGTERM or SIGKILL of the `cje` process alone (not its group).
While it runs, every listening socket of every descendant must be on 127.0.0.1; afterwards no
descendant may survive, nothing may listen on their ports, and the temporary homes are gone.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from flows.runtime.watchdog import _alive, _cmdline, _descendants, _table
from flows.storage.objects import Storage

from .conftest import REPO, write_simulated_logs

CJE = str(Path(sys.executable).with_name("cje"))
LOOPBACK = re.compile(r"^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]|\[::1\]):\d+$")


def _listeners(pids: set[int]) -> list[tuple[str, int, str]]:
    """``(local address, pid, process name)`` of the TCP listeners owned by ``pids``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        cols = line.split()
        for name, pid in re.findall(r'"([^"]+)",pid=(\d+)', line):
            if int(pid) in pids:
                found.append((cols[3], int(pid), name))
    return found


def _config(tmp_path: Path, n_bootstrap: int) -> Path:
    logs, labels = tmp_path / "logs", tmp_path / "labels"
    _, window = write_simulated_logs(Storage.for_uri(str(logs)), Storage.for_uri(str(labels)), 400, 2)
    config = tmp_path / "evaluations.yaml"
    config.write_text(json.dumps({"evaluations": [{
        "name": "lifecycle", "logs_uri": str(logs), "labels_uri": str(labels), "results_uri": str(tmp_path),
        "window": window, "options": {"n_bootstrap": n_bootstrap, "seed": 1}}]}))
    return config


def _env(tmpdir: str, state: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "RAY_ADDRESS"))}
    env.update(TMPDIR=tmpdir, CJE_STATE_DIR=str(state), PYTHONPATH=str(REPO), DO_NOT_TRACK="1",
               RAY_USAGE_STATS_ENABLED="0", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    return env


# Ray's two servers: the run is caught once both listen (a raylet process exists a while before it listens).
RAY_SERVERS = {"gcs_server", "raylet"}
# How long `cje run` may take to reach Ray: ~20 s alone; CI's service tier runs it beside the stack tests, the
# soak and the default tier's tail on two cores, where it took over 150 s (session 27's CI: the wait ended
# before the raylet listened, and the test failed on that, not on what it checks).
REACH_RAY_S = 600


def _run_and_interrupt(tmp_path: Path, sig: int) -> dict:
    """Start `cje run`, wait until Ray's servers listen among its descendants (the flow is running
    on Ray) and 4 s more, check the listeners, send ``sig`` to `cje` alone, and report."""
    tmpdir = tempfile.mkdtemp(prefix="cjt")  # short: Ray's socket paths have a length limit
    config = _config(tmp_path, n_bootstrap=20000)
    log = open(tmp_path / "cje.log", "wb")
    proc = subprocess.Popen([CJE, "run", "lifecycle", "--config", str(config)], env=_env(tmpdir, tmp_path / "state"),
                            cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen: dict[int, int] = {}
    listeners: list[tuple[str, int, str]] = []
    try:
        t0 = time.monotonic()
        ready = None
        while time.monotonic() - t0 < REACH_RAY_S and proc.poll() is None:
            seen.update(_descendants({proc.pid}, _table()))
            if ready is None and RAY_SERVERS <= {n for _, _, n in _listeners(set(seen))}:
                ready = time.monotonic()
            if ready is not None and time.monotonic() - ready > 4:  # workers and agents are up
                break
            time.sleep(0.5)
        assert proc.poll() is None, "cje ended before it could be interrupted:\n" + \
            (tmp_path / "cje.log").read_text()[-3000:]
        assert ready is not None, f"Ray's servers did not listen within {REACH_RAY_S} s of `cje run`:\n" + \
            (tmp_path / "cje.log").read_text()[-3000:]
        seen.update(_descendants({proc.pid}, _table()))
        listeners = _listeners(set(seen) | {proc.pid})
        os.kill(proc.pid, sig)
        proc.wait(timeout=90)
        def homes() -> list[str]:
            return sorted(p.name for p in Path(tmpdir).glob("*") if p.name.startswith(("cje-prefect-", "cjeray")))

        # the watchdog polls every second, allows 5 s of grace, kills, and only then removes the temporary homes
        # (Ray's takes a moment): wait for both, within the same 30 s
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (any(_alive(p, s) for p, s in seen.items()) or homes()):
            time.sleep(0.5)
        survivors = {p: s for p, s in seen.items() if _alive(p, s)}
        leftovers = homes()
        return {"listeners": listeners, "seen": seen, "survivors": survivors, "leftovers": leftovers,
                "returncode": proc.returncode, "log": (tmp_path / "cje.log").read_text()[-3000:],
                "ports": {a.rsplit(":", 1)[1] for a, _, _ in listeners}}
    finally:
        for pid, start in list(seen.items()) + [(proc.pid, None)]:
            if start is None or _alive(pid, start):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        shutil.rmtree(tmpdir, ignore_errors=True)


def _check(report: dict) -> None:
    assert report["listeners"], "no listener seen: the test did not catch the run in flight"
    outside = [l for l in report["listeners"] if not LOOPBACK.match(l[0])]
    assert not outside, f"listening beyond 127.0.0.1: {outside}"
    names = {n for _, _, n in report["listeners"]}
    assert RAY_SERVERS <= names, names  # Ray's servers were among those checked
    assert not report["survivors"], f"processes outlived cje: {report['survivors']}\n{report['log']}"
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
    listening = {line.split()[3].rsplit(":", 1)[1] for line in out.splitlines() if line.split()}
    assert not (report["ports"] & listening) or _ports_reused(report), "a port of the run still listens"
    assert not report["leftovers"], f"temporary homes left: {report['leftovers']}"


def _ports_reused(report: dict) -> bool:
    """True when every still-listening port of the run belongs to a process the run did not start."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        port = line.split()[3].rsplit(":", 1)[1]
        if port in report["ports"]:
            pids = {int(p) for p in re.findall(r"pid=(\d+)", line)}
            if not pids or pids & set(report["seen"]):
                return False
    return True


@pytest.mark.lifecycle
def test_kill_9_of_cje_run_leaves_nothing_running_and_nothing_listens(tmp_path):
    report = _run_and_interrupt(tmp_path, signal.SIGKILL)
    assert report["returncode"] == -signal.SIGKILL
    _check(report)


@pytest.mark.lifecycle
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_and_sigint_of_cje_run_stop_everything_in_order(tmp_path, sig, code):
    report = _run_and_interrupt(tmp_path, sig)
    assert report["returncode"] not in (0, None), report["log"]  # interrupted, not a clean success
    _check(report)


def test_a_stale_temporary_home_is_removed_by_the_next_start(tmp_path):
    from flows.runtime.prefect_server import HOME_PREFIX, OWNER_FILE, clean_stale_homes

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{HOME_PREFIX}stale"
    stale.mkdir()
    (stale / OWNER_FILE).write_text(json.dumps({"pid": dead.pid, "start": 1}))
    (stale / "prefect.db").write_bytes(b"x")
    mine = tmp_path / f"{HOME_PREFIX}live"
    mine.mkdir()
    from flows.runtime.watchdog import process_start_time

    (mine / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "start": process_start_time(os.getpid())}))
    foreign = tmp_path / f"{HOME_PREFIX}foreign"  # no owner file: not ours to judge
    foreign.mkdir()
    assert clean_stale_homes(tmp_path) == [stale]
    assert not stale.exists() and mine.exists() and foreign.exists()


def _sleeps(pid: int) -> int:
    """How many times ``pid`` has gone to sleep: its voluntary context switches (``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches in /proc/{pid}/status")


def test_the_watchdog_stops_the_orphans_of_a_killed_parent_and_removes_its_folders(tmp_path):
    """Fast twin of the kill -9 test: a parent registers a folder and starts a child in its own
    session (as the Prefect server is started) that starts a grandchild; kill -9 of the parent
    leaves both orphaned until the watchdog stops them and removes the folder."""
    folder = tmp_path / "home"
    script = f"""
import os, subprocess, sys, time
from flows.runtime.watchdog import register_cleanup
os.makedirs({str(folder)!r}, exist_ok=True)
register_cleanup({str(folder)!r})
child = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"],
    start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    seen: dict[int, int] = {}
    try:
        proc.stdout.readline()
        deadline = time.monotonic() + 120  # bounds a hang only (three Python starts on a loaded machine)
        while time.monotonic() < deadline and len(seen) < 3:  # watchdog, child, grandchild
            seen.update(_descendants({proc.pid}, _table()))
            time.sleep(0.2)
        assert len(seen) >= 3 and folder.exists()
        # The watchdog remembers what each of its polls finds (a scan of /proc, then a 1 s sleep): the grandchild,
        # which exists now, is remembered once a scan begun after now has ended, i.e. once the watchdog has gone
        # to sleep twice more (its sleeps are its only voluntary context switches; a third one for margin).
        # A fixed 1.5 s wait was not enough where the watchdog's start and scans take longer (a loaded machine).
        [dog] = [p for p in seen if "flows.runtime.watchdog" in _cmdline(p)]
        slept = _sleeps(dog)
        deadline = time.monotonic() + 120
        while _sleeps(dog) < slept + 3:
            assert time.monotonic() < deadline, "the watchdog did not poll in 120 s"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        # the watchdog notices within a poll, allows 5 s of grace, kills, removes: 120 s bounds a hang only
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (any(_alive(p, s) for p, s in seen.items()) or folder.exists()):
            time.sleep(0.2)
        assert not any(_alive(p, s) for p, s in seen.items()), "an orphan survived its parent"
        assert not folder.exists(), "the registered folder was not removed"
    finally:
        for pid, start in seen.items():
            if _alive(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


def test_the_embedded_local_ray_listens_on_127_0_0_1_only(tmp_path):
    """Every listener of the local Ray that `ray_session` starts (GCS, raylet, agents, driver,
    workers) is on 127.0.0.1 (Ray otherwise binds every interface and reports the machine's address)."""
    script = """
import json, os, sys, time
import ray
from flows.runtime.ray_fanout import ray_session, map_ordered
def pid():
    return os.getpid()
with ray_session(num_cpus=1) as kind:
    map_ordered(pid, [()])
    print(json.dumps({"kind": kind, "node_ip": ray.nodes()[0]["NodeManagerAddress"],
                      "temp": ray._private.worker._global_node.get_temp_dir_path()}), flush=True)
    sys.stdin.readline()
"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), TMPDIR=tempfile.mkdtemp(prefix="cjt"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    seen: dict[int, int] = {}
    try:
        info = json.loads(proc.stdout.readline())
        assert info["kind"] == "local" and info["node_ip"] == "127.0.0.1"
        seen = _descendants({proc.pid}, _table())
        listeners = _listeners(set(seen) | {proc.pid})
        names = {n for _, _, n in listeners}
        assert {"gcs_server", "raylet"} <= names, listeners
        outside = [l for l in listeners if not LOOPBACK.match(l[0])]
        assert not outside, f"listening beyond 127.0.0.1: {outside}"
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
        assert not Path(info["temp"]).exists()  # the session's temporary folder went with it
    finally:
        for pid, start in seen.items():
            if _alive(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        shutil.rmtree(env["TMPDIR"], ignore_errors=True)
