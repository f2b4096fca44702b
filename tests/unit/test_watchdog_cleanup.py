"""The watchdog's last step after a ``kill -9`` of `cje`: the registered temporary folders go, even when a
process the polls never saw (Ray starts workers between two looks; orphaned, they belong to init) still
writes into one. CI once found a ``cjeray*`` folder left after a SIGKILL of `cje run`
(tests/flows/test_lifecycle.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from flows.runtime import watchdog

WRITER = """
import os, sys, time
d = sys.argv[1]
i = 0
while True:
    os.makedirs(os.path.join(d, "logs"), exist_ok=True)
    with open(os.path.join(d, "logs", f"f{i % 50}"), "w") as f:
        f.write("x")
    i += 1
    time.sleep(0.001)
"""


def test_remove_registered_stops_an_unseen_writer_and_removes_its_folder(tmp_path):
    home = tmp_path / "cjerayX"
    home.mkdir()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(home)], start_new_session=True)
    try:
        deadline = time.monotonic() + 120  # bounds a hang only (a Python start on a loaded machine)
        while not (home / "logs").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (home / "logs").exists(), "the writer never started"
        registry = tmp_path / "reg.json"
        registry.write_text(json.dumps({"remove": [str(home)]}))
        watchdog._remove_registered(registry)
        assert not home.exists()
        assert not registry.exists()
        writer.wait(timeout=60)  # it was stopped (SIGTERM), not left running
        assert writer.returncode is not None
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


def test_users_of_finds_only_processes_naming_the_folder(tmp_path):
    home, other = tmp_path / "named", tmp_path / "named2"  # a prefix is not a match
    home.mkdir()
    other.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", str(d)]) for d in (home, other)]
    try:
        time.sleep(0.3)
        found = watchdog._users_of([str(home)])
        assert procs[0].pid in found and procs[1].pid not in found
    finally:
        for p in procs:
            p.kill()
            p.wait()
