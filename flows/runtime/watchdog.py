"""Nothing `cje` starts outlives it.

`cje` starts processes that do not die with it by themselves: the embedded Prefect server (its
own session, so that a terminal's Ctrl-C reaches `cje` first and `cje` stops it in order), the
local Ray's GCS, raylet, agents and workers, and `cje serve`'s flow-run subprocesses.  Three
mechanisms together cover every way `cje` can end:

* normal exit, an exception, SIGINT: the context managers stop what they started
  (`flows.runtime.prefect_server.prefect_api`, `flows.runtime.ray_fanout.ray_session`);
* SIGTERM: `graceful_sigterm` turns it into `SystemExit` in the main thread, so the same
  context managers run (Python's default SIGTERM action ends the process without them);
* SIGKILL (``kill -9``), or a crash: a watchdog process (`ensure_watchdog`, this module run
  as ``python -m flows.runtime.watchdog``) polls the parent once a second, remembering its
  descendants (PID and start time, so a reused PID is never hit); when the parent is gone it
  sends SIGTERM to every remembered process still alive and to their children, SIGKILL
  after `GRACE_SECONDS`, then removes the temporary folders the parent registered (stopping first
  any process whose command line names one of them: one started between two polls, and retrying
  while something still writes into them).

The watchdog itself holds no secret and starts nothing; it exits when its work is done.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

#: Seconds between two looks at the parent.
POLL_SECONDS = 1.0
#: Seconds between SIGTERM and SIGKILL of the orphans.
GRACE_SECONDS = 5.0

_lock = threading.Lock()
_registry: Path | None = None
_proc: subprocess.Popen | None = None


# --------------------------------------------------------------------------------------
# the parent's side


def ensure_watchdog() -> Path:
    """Start this process's watchdog once; returns its registry file (see `register_cleanup`)."""
    global _registry, _proc
    with _lock:
        if _registry is not None and _proc is not None and _proc.poll() is None:
            return _registry
        fd, name = tempfile.mkstemp(prefix=f"cje-watch-{os.getpid()}-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"remove": []}, f)
        _registry = Path(name)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PREFECT_API_KEY"))}
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2])]
                                            + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        _proc = subprocess.Popen(
            [sys.executable, "-m", "flows.runtime.watchdog", str(os.getpid()), str(process_start_time(os.getpid())),
             str(_registry)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True,  # a terminal's Ctrl-C must not stop the watchdog before cje
        )
        return _registry


def register_cleanup(path: str | os.PathLike) -> None:
    """Have the watchdog remove ``path`` if this process dies without removing it itself."""
    reg = ensure_watchdog()
    with _lock:
        data = json.loads(reg.read_text() or '{"remove": []}')
        if str(path) not in data["remove"]:
            data["remove"].append(str(path))
        tmp = reg.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, reg)


def _raise_exit(signum: int, frame) -> None:  # noqa: ARG001 - signal handler signature
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def graceful_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM raises ``SystemExit(143)`` in the main thread (so ``finally``
    blocks and context managers run) instead of ending the process on the spot, and SIGINT raises
    ``KeyboardInterrupt`` even when this process was started with SIGINT ignored (a background job
    of a non-interactive shell inherits that, and Python then installs no handler: Ctrl-C or
    ``kill -INT`` would do nothing).  Outside the main thread, or when a SIGTERM handler is already
    installed, nothing changes."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        yield
        return
    old_int = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGTERM, _raise_exit)
    if old_int is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if old_int is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


# --------------------------------------------------------------------------------------
# /proc


def _stat(pid: int) -> tuple[int, int] | None:
    """``(ppid, start time in clock ticks)`` of ``pid``, or None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == b"Z":
        return None
    return int(fields[1]), int(fields[19])


def process_start_time(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks since boot (0 when it is gone): with the pid it names
    one process, so a recycled pid is not taken for the one recorded."""
    st = _stat(pid)
    return st[1] if st else 0


def _table() -> dict[int, tuple[int, int]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def _descendants(roots: set[int], table: dict[int, tuple[int, int]]) -> dict[int, int]:
    """``{pid: start time}`` of every live process below ``roots`` (roots excluded)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, int] = {}
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out[child] = table[child][1]
                todo.append(child)
    return out


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == start


def _kill_all(known: dict[int, int]) -> None:
    table = _table()
    live = {p: s for p, s in known.items() if table.get(p, (0, -1))[1] == s}
    live.update(_descendants(set(live), table))
    live.pop(os.getpid(), None)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, start in live.items():
            if _alive(pid, start):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + (GRACE_SECONDS if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline and any(_alive(p, s) for p, s in live.items()):
            time.sleep(0.1)


#: Attempts (REMOVE_PAUSE s apart) at removing a registered folder that something still writes into.
REMOVE_ATTEMPTS, REMOVE_PAUSE = 20, 0.5


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _users_of(paths: list[str]) -> dict[int, int]:
    """``{pid: start time}`` of this user's live processes whose command line names one of ``paths``.

    A process the polls never saw (Ray starts workers between two looks; once the raylet is gone they
    belong to init, not to anything remembered) still names its session folder in its arguments."""
    me, uid, found = os.getpid(), os.getuid(), {}
    for pid, (_, start) in _table().items():
        if pid == me:
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue
        line = _cmdline(pid) + " "
        if any(f"{p}/" in line or f"{p} " in line or f"{p}=" in line for p in paths):
            found[pid] = start
    return found


def stop_users_of(path: str | os.PathLike) -> int:
    """Stop (SIGTERM, then SIGKILL) this user's processes whose command line names ``path``, and their
    descendants; returns how many there were.  What a failed start of a local Ray leaves in its folder."""
    users = _users_of([str(path)])
    if users:
        _kill_all(users)
    return len(users)


def _remove_registered(registry: Path) -> None:
    """Remove the registered folders: first stop any process still naming one, then retry the removal
    while something still writes into it (``rmtree`` fails on a folder that gains a file meanwhile)."""
    try:
        paths = [str(p) for p in json.loads(registry.read_text()).get("remove", [])]
    except (OSError, ValueError):
        paths = []
    for _ in range(REMOVE_ATTEMPTS):
        users = _users_of(paths) if paths else {}
        if users:
            _kill_all(users)
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
        paths = [p for p in paths if os.path.lexists(p)]
        if not paths:
            break
        time.sleep(REMOVE_PAUSE)
    with contextlib.suppress(OSError):
        registry.unlink()
    with contextlib.suppress(OSError):
        registry.with_suffix(".tmp").unlink()


def watch(parent: int, parent_start: int, registry: Path) -> None:
    """Poll ``parent``; once it is gone, stop its remembered descendants and clean up."""
    me = os.getpid()
    known: dict[int, int] = {}
    while _alive(parent, parent_start):
        table = _table()
        found = _descendants({parent}, table)
        found.pop(me, None)
        known = {p: s for p, s in known.items() if table.get(p, (0, -1))[1] == s}
        known.update(found)
        time.sleep(POLL_SECONDS)
    _kill_all(known)
    _remove_registered(registry)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
