"""CPU time of a test tier (or any command), with every process it starts counted.

`/usr/bin/time` and pytest's ``--durations`` miss most of a flow test's work: the Prefect server, the Ray
node processes and the ``cje`` subprocesses the tests start are re-parented to init when their parent
is stopped, and their CPU time is never reported. This script runs the command as a *child subreaper*
(``prctl(PR_SET_CHILD_SUBREAPER)``), so every orphaned descendant is re-parented to it and reaped here,
and prints one line: exit code, wall time, CPU time (user + system) of the whole process tree, and the
load average at start and end. On a shared machine quote the CPU time; an idle machine's wall time is
about CPU / cores used (docs/testing.md, "Time budget").

Usage::

    .venv/bin/python benchmarks/bench_test_tiers.py .venv/bin/python -m pytest tests/stats -q
    .venv/bin/python benchmarks/bench_test_tiers.py --json out.json .venv/bin/python -m pytest -n 2 --dist loadfile
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

PR_SET_CHILD_SUBREAPER = 36
#: Seconds to wait for orphaned descendants (stopped servers, Ray workers) after the command exits.
STRAGGLER_WAIT = 30.0


@dataclass
class TierTime:
    """What one command cost: exit code, wall and CPU seconds of its whole process tree, load averages."""

    command: list[str]
    returncode: int
    wall_s: float
    cpu_s: float
    user_s: float
    system_s: float
    load_start: float
    load_end: float
    max_rss_mb: int


def _reap_stragglers(timeout: float) -> None:
    """Reap orphaned descendants until none is left or ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.2)


def measure(command: list[str]) -> TierTime:
    """Run ``command`` as a child subreaper and account the CPU time of every descendant.

    Parameters
    ----------
    command : list of str
        The command line (e.g. a pytest call).

    Returns
    -------
    TierTime
        Exit code, wall time, CPU time of the whole process tree, load averages at start and end.
    """
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    load0, t0 = os.getloadavg()[0], time.monotonic()
    proc = subprocess.Popen(command)
    returncode = proc.wait()
    wall, load1 = time.monotonic() - t0, os.getloadavg()[0]
    _reap_stragglers(STRAGGLER_WAIT)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return TierTime(command, returncode, round(wall, 1), round(ru.ru_utime + ru.ru_stime, 1), round(ru.ru_utime, 1),
                    round(ru.ru_stime, 1), round(load0, 2), round(load1, 2), ru.ru_maxrss // 1024)


def main(argv: list[str] | None = None) -> int:
    """Command line: measure the command, print the line, optionally write JSON; exit with its code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    args = ap.parse_args(argv)
    if not args.command:
        ap.error("no command given")
    t = measure(args.command)
    sys.stderr.write(f"[tier-time] rc={t.returncode} wall={t.wall_s}s cpu={t.cpu_s}s (user {t.user_s} sys "
                     f"{t.system_s}) load {t.load_start} -> {t.load_end} maxrss={t.max_rss_mb}MB\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(t), f, indent=1)
    return t.returncode


if __name__ == "__main__":
    sys.exit(main())
