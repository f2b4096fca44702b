"""Lifecycle of the embedded local Prefect API server.

With no configuration, `cje` starts ONE `prefect server start` subprocess for the whole
command (127.0.0.1, a free port, a temporary PREFECT_HOME with its own SQLite database,
analytics and UI off) and points itself and every child (Ray workers, flow-run
subprocesses of `cje serve`) at it through ``PREFECT_API_URL``.  The alternative,
Prefect's per-process ephemeral server, would be started again by every process that
touches the API (about 8 s each) and cannot run schedules.

When ``PREFECT_API_URL`` is already set, nothing is started: that server is used as is.
When ``cje ui`` runs (its state file `ui_state_file` names a live, healthy server), that
persistent server is used, so flow runs, logs and artifacts outlive the command.

Lifecycle: the server binds 127.0.0.1 only.  It dies with `cje` however `cje` ends (see
`flows.runtime.watchdog`: the context manager on exit, SIGINT and SIGTERM; a watchdog process
after ``kill -9``), and a temporary home left behind by a `cje` that could not clean up is
removed by the next start (`clean_stale_homes`).

Shutdown order matters: Prefect's log and event workers are drained first, then the
server is stopped.  Stopping the server first leaves those workers retrying against a
dead API and the process hangs for about 70 s at exit.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from flows.runtime.ports import free_port
from flows.runtime.watchdog import process_start_time, ensure_watchdog, graceful_sigterm, register_cleanup

log = logging.getLogger(__name__)

#: Prefix of the temporary homes of embedded servers (``<tmp>/cje-prefect-*``).
HOME_PREFIX = "cje-prefect-"
#: File in a home naming the `cje` process that owns it.
OWNER_FILE = "owner.json"

#: Environment that keeps a local Prefect quiet and offline.
QUIET_ENV: dict[str, str] = {
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_UI_ENABLED": "false",
    "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
}


@dataclass
class PrefectServer:
    """A running local Prefect API server subprocess.

    Attributes
    ----------
    url : str
        API URL (``http://127.0.0.1:PORT/api``) to use as ``PREFECT_API_URL``.
    process : subprocess.Popen
        The ``prefect server start`` process (its own process group).
    home : Path
        PREFECT_HOME of the server (holds the SQLite database and the server log).
    owns_home : bool
        Whether `stop` removes ``home``.
    """

    url: str
    process: subprocess.Popen
    home: Path
    owns_home: bool = True
    log_path: Path = field(default=Path())
    started: float = 0.0

    @property
    def pid(self) -> int:
        """PID of the server process."""
        return self.process.pid


def healthy(url: str, timeout: float = 2.0) -> bool:
    """True when the Prefect API at ``url`` answers its health check."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _owner_alive(home: Path) -> bool:
    try:
        owner = json.loads((home / OWNER_FILE).read_text())
        return process_start_time(int(owner["pid"])) == int(owner["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def clean_stale_homes(root: Path | None = None) -> list[Path]:
    """Remove temporary server homes whose owning `cje` process is gone; returns them."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    for home in root.glob(HOME_PREFIX + "*"):
        if home.is_dir() and (home / OWNER_FILE).exists() and not _owner_alive(home):
            shutil.rmtree(home, ignore_errors=True)
            removed.append(home)
    if removed:
        log.info("removed %d stale Prefect home(s) of earlier cje runs", len(removed))
    return removed


def launch_server(
    home: Path | None = None,
    port: int | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> PrefectServer:
    """Start ``prefect server start`` on 127.0.0.1 without waiting (see `wait_healthy`).

    Booting takes seconds (imports, database migrations); callers can do other work
    meanwhile (``cje demo`` writes its data and starts Ray).

    Parameters
    ----------
    home : Path, optional
        PREFECT_HOME for the server; a fresh temporary directory (removed by `stop_server`)
        when omitted.
    port : int, optional
        Port to listen on; a free one when omitted (`flows.runtime.ports.free_port`: below the ephemeral range,
        so that no outgoing connection takes it while the server starts).
    extra_env : mapping, optional
        More environment for the server (e.g. a short scheduler loop).
    """
    owns = home is None
    ensure_watchdog()  # stops the server if this process is killed without cleaning up
    if owns:
        clean_stale_homes()
    home = Path(tempfile.mkdtemp(prefix=HOME_PREFIX)) if home is None else Path(home)
    home.mkdir(parents=True, exist_ok=True)
    if owns:
        (home / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "start": process_start_time(os.getpid())}))
        register_cleanup(home)
    port = port or free_port()
    env = dict(os.environ)
    # The server must not itself try to talk to another API.
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_API_KEY", None)
    env.update(QUIET_ENV)
    env.update(
        {
            "PREFECT_HOME": str(home),
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(port),
            "PREFECT_LOGGING_LEVEL": env.get("PREFECT_LOGGING_LEVEL", "WARNING"),
        }
    )
    if extra_env:
        env.update(extra_env)
    log_path = home / "server.log"
    prefect_bin = Path(sys.executable).with_name("prefect")
    cmd = [str(prefect_bin)] if prefect_bin.exists() else [sys.executable, "-m", "prefect"]
    cmd += ["server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/api"
    log.info("starting a local Prefect API server at %s (pid %d)", url, proc.pid)
    return PrefectServer(url=url, process=proc, home=home, owns_home=owns, log_path=log_path,
                         started=time.monotonic())


def wait_healthy(server: PrefectServer, timeout: float = 120.0) -> PrefectServer:
    """Wait until ``server`` answers its health check.

    Raises
    ------
    RuntimeError
        If the server exits or is not healthy in time (the server is stopped and the message
        carries the tail of its log).
    """
    proc = server.process
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            tail = _tail(server.log_path)
            stop_server(server)
            raise RuntimeError(f"Prefect server exited with code {proc.returncode} during start:\n{tail}")
        if healthy(server.url, timeout=1.0):
            log.info("Prefect API server ready at %s (%.1f s after launch)", server.url,
                     time.monotonic() - server.started)
            return server
        time.sleep(0.2)
    tail = _tail(server.log_path)
    stop_server(server)
    raise RuntimeError(f"Prefect server at {server.url} not healthy after {timeout:.0f} s:\n{tail}")


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def drain_workers(timeout: float = 15.0) -> None:
    """Flush Prefect's background log and event workers of this process.

    Must run before the API server goes away; afterwards they would retry against a dead
    server and delay interpreter exit by about 70 s.
    """
    try:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker
    except ImportError:  # pragma: no cover - prefect always present in this package
        return
    for worker in (APILogWorker, EventsWorker):
        try:
            result = worker.drain_all(timeout=timeout)
            if inspect.isawaitable(result):  # pragma: no cover - only in async contexts
                from prefect.utilities.asyncutils import run_coro_as_sync

                run_coro_as_sync(result)
        except Exception as exc:  # noqa: BLE001 - draining is best effort at shutdown
            log.debug("draining %s failed: %s", worker.__name__, exc)


def stop_server(server: PrefectServer, timeout: float = 15.0) -> None:
    """Stop the server (SIGTERM to its process group, SIGKILL after ``timeout``) and
    remove its temporary home."""
    proc = server.process
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
    if server.owns_home:
        shutil.rmtree(server.home, ignore_errors=True)


@contextlib.contextmanager
def use_api(url: str) -> Iterator[str]:
    """Point this process (Prefect settings) and its children (environment) at ``url``."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    old = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                drain_workers()
    finally:
        if old is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old


@contextlib.contextmanager
def prefect_api(extra_env: Mapping[str, str] | None = None,
                launched: PrefectServer | None = None) -> Iterator[str]:
    """The Prefect API for this command: the configured one, or an embedded server.

    If ``PREFECT_API_URL`` is set it is used unchanged (nothing is started or stopped).
    Otherwise one local server is started for the duration of the block, this process
    and its children are pointed at it, and on exit the log/event workers are drained
    before the server is stopped and its temporary home removed.

    ``launched`` is a server already started with `launch_server` (booting while the
    caller did other work); it is waited for, used and stopped like an own one.

    Yields
    ------
    str
        The API URL in use.
    """
    configured = os.environ.get("PREFECT_API_URL")
    persistent = None if configured or launched is not None else running_ui()
    if persistent is not None:
        configured = persistent["api_url"]
        log.info("using the Prefect server of `cje ui` at %s (UI: %s)", configured, persistent.get("ui_url"))
    if configured and launched is None:
        if persistent is None:
            log.info("using the Prefect API at %s", configured)
        with graceful_sigterm(), use_api(configured) as url:
            yield url
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    with graceful_sigterm():
        server = launched or launch_server(extra_env=extra_env)
        try:
            wait_healthy(server)
        except BaseException:
            stop_server(server)
            raise
        try:
            with use_api(server.url) as url:  # drains workers on exit, before the stop below
                yield url
        finally:
            stop_server(server)
            log.info("local Prefect API server stopped (pid %d)", server.pid)


# --------------------------------------------------------------------------------------
# the persistent server of `cje ui`


def ui_state_file() -> Path:
    """Where `cje ui` records its running server: ``$CJE_STATE_DIR/ui.json`` (default
    ``~/.local/state/cje/ui.json``)."""
    root = os.environ.get("CJE_STATE_DIR") or os.path.join(os.path.expanduser("~"), ".local", "state", "cje")
    return Path(root) / "ui.json"


def write_ui_state(server: PrefectServer, ui_url: str, data: Path) -> Path:
    """Record a running `cje ui` server (URL, PID, start time, home) for later commands."""
    path = ui_state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"api_url": server.url, "ui_url": ui_url, "pid": server.pid, "start": process_start_time(server.pid),
             "owner_pid": os.getpid(), "home": str(server.home), "data": str(data)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)
    return path


def clear_ui_state(pid: int | None = None) -> None:
    """Remove the state file (only if it names ``pid``, when given)."""
    path = ui_state_file()
    with contextlib.suppress(OSError, ValueError):
        if pid is None or json.loads(path.read_text()).get("pid") == pid:
            path.unlink()


def running_ui() -> dict[str, Any] | None:
    """The state of a live, healthy `cje ui` server, or None (a stale state file is removed)."""
    path = ui_state_file()
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    try:
        alive = process_start_time(int(state["pid"])) == int(state["start"])
    except (KeyError, TypeError, ValueError):
        alive = False
    if alive and healthy(str(state.get("api_url", "")), timeout=2.0):
        return state
    if not alive:
        clear_ui_state()
    return None
