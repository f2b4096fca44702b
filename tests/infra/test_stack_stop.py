"""infra/stack/stop.sh run while infra/stack/start.sh of the same folder is still starting leaves nothing of it.

stop.sh read the pid file as it was when it began; a service the start launched while stop.sh stopped the others
(PostgreSQL's fast shutdown, the Ray and Prefect sessions: seconds) was never recorded where stop.sh looked, and the
start itself went on (waiting up to minutes for a service stop.sh had ended). The start now records itself in the
folder (``start.pid``) and stop.sh ends it, and what it launched, before it reads the pid file.

The start runs the real script with real PostgreSQL (Debian's server binaries) and stand-ins for ``prefect``,
``ray`` and the Python whose ``ray.init`` says the head is up (`_fake_venv`): deterministic and cheap. Marked
``lifecycle`` (processes under real signals, ~20 s): CI's service tier runs it, not the default run.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STACK = REPO / "infra" / "stack"

#: Seconds the stand-in Prefect server takes to stop after SIGTERM: stop.sh is busy that long with its session,
#: the window in which a start still running launches the next service.
SLOW_STOP_S = 5


def _fake_venv(bin_dir: Path, gate: Path) -> Path:
    """Stand-ins in ``bin_dir``: ``ray`` (a node that never answers: a sleep), ``prefect`` (a server that never
    answers and takes `SLOW_STOP_S` s to stop after SIGTERM) and ``python`` (start.sh's ``ray_up``: the head is up
    once ``gate`` exists); the ``python`` path for ``CJE_PYTHON``."""
    bin_dir.mkdir(parents=True)
    scripts = {
        "ray": "exec sleep 1000\n",
        "prefect": f"trap 'sleep {SLOW_STOP_S}; exit 0' TERM\nwhile :; do sleep 1; done\n",
        "python": f'cat > /dev/null\n[[ -f "{gate}" ]]\n',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
    return bin_dir / "python"


def _processes() -> list[tuple[int, int, str, str]]:
    """``(pid, session id, state, command line)`` of every process (zombies included)."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out.append((int(entry.name), int(fields[3]), fields[0], cmdline))
    return out


def _pid_lines(path: Path) -> dict[str, int]:
    """The services of a stack's pid file (``name pid`` lines): name -> PID (empty when there is no file)."""
    with contextlib.suppress(OSError):
        return {line.split()[0]: int(line.split()[1]) for line in path.read_text().splitlines()
                if len(line.split()) == 2}
    return {}


def _left(folder: str, sessions: set[int], start_pid: int) -> list[str]:
    """The living processes of the stack: in a session of its pid file, or naming its folder, or the start."""
    return [f"{pid} (session {sid}): {cmd.strip()[:160]}" for pid, sid, state, cmd in _processes()
            if state != "Z" and (sid in sessions or folder in cmd or pid == start_pid)]


@pytest.mark.lifecycle
def test_stop_while_the_start_is_still_starting_leaves_no_process_of_the_folder():
    if not glob.glob("/usr/lib/postgresql/*/bin/postgres"):
        pytest.skip("PostgreSQL's server binaries are not installed (infra/packages.sh installs them)")
    for tool in ("psql", "setsid", "curl", "runuser"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    # under /tmp itself: PostgreSQL runs as its own user when the tests run as root, and must reach its folder
    folder = tempfile.mkdtemp(prefix="cje-stop-test-", dir="/tmp")
    os.chmod(folder, 0o755)
    stack, work = f"{folder}/stack", Path(folder) / "work"
    gate = work / "ray-head-up"
    python = _fake_venv(work / "bin", gate)
    env = {**os.environ, "CJE_STACK_DIR": stack, "CJE_STACK_ENV": f"{stack}/env", "CJE_PYTHON": str(python),
           "CJE_STACK_NO_RGW": "1", "CJE_STACK_RAY_WAIT": "120"}
    env.pop("CJE_STACK_KEEP_LOGS", None)
    pids_file = Path(stack) / "pids"
    # its own process group, in this test's session: stop.sh must end the start without touching its caller's
    start = subprocess.Popen(["bash", str(STACK / "start.sh")], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, process_group=0)
    stop = None
    seen: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 400  # a liveness bound: ~25 s in CI's loaded service tier
        while "ray-head" not in seen:  # PostgreSQL up, the Prefect server and the Ray head launched
            assert start.poll() is None, f"the start ended early: {start.communicate()[1][-3000:]}"
            assert time.monotonic() < deadline, "the start did not launch the Ray head in 400 s"
            seen.update(_pid_lines(pids_file))
            time.sleep(0.2)
        starter = Path(stack, "start.pid").read_text().split() if Path(stack, "start.pid").exists() else []
        # the start now waits for the head to answer; stop.sh runs meanwhile
        stop = subprocess.Popen(["bash", str(STACK / "stop.sh")], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        head = seen["ray-head"]
        while any(sid == head and state != "Z" for _, sid, state, _ in _processes()):  # stop.sh has read the file
            assert time.monotonic() < deadline + 60, "stop.sh did not stop the Ray head"
            seen.update(_pid_lines(pids_file))
            time.sleep(0.1)
        gate.touch()  # the head answers: a start still running launches the Ray worker node now
        while stop.poll() is None:
            seen.update(_pid_lines(pids_file))
            time.sleep(0.1)
        err = stop.communicate(timeout=10)[1]
        assert stop.returncode == 0, err
        with contextlib.suppress(subprocess.TimeoutExpired):
            start.wait(timeout=5)
        left = _left(stack, set(seen.values()), start.pid)
        assert not left, "left running after stop.sh:\n" + "\n".join(left) + f"\nstop.sh said:\n{err}"
        assert start.returncode == -signal.SIGKILL, start.returncode
        assert starter[:1] == [str(start.pid)], starter  # the start recorded itself before its services
        assert "a start of" in err and "ending it first" in err, err
        assert not Path(stack).exists()
    finally:
        if stop is not None and stop.poll() is None:
            stop.kill()
        subprocess.run(["bash", str(STACK / "stop.sh")], env=env, capture_output=True, timeout=120)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(start.pid, signal.SIGKILL)
        start.communicate()
        mine = os.getsid(0)
        for pid, sid, state, cmd in _processes():  # what a failed check left: each service is its session's leader
            if state != "Z" and sid != mine and (stack in cmd or sid in seen.values()):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(sid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
