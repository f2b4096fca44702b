"""`cje ui`: a persistent Prefect server with its UI; later `cje` commands use it while it runs,
so their flow runs persist (also across restarts of `cje ui`, the database being under the data folder)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flows.runtime.ports import free_port
from flows.storage.objects import Storage

from .conftest import REPO, _stop_group, write_simulated_logs

CJE = str(Path(sys.executable).with_name("cje"))


def _env(state: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "RAY_ADDRESS"))}
    env.update(CJE_STATE_DIR=str(state), PYTHONPATH=str(REPO))
    return env


def _start_ui(tmp_path: Path, port: int) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([CJE, "ui", "--data", str(tmp_path / "data"), "--port", str(port)], env=_env(tmp_path / "state"),
                            stdout=open(tmp_path / "ui.out", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    state_file = tmp_path / "state" / "ui.json"
    deadline = time.monotonic() + 600  # a liveness bound, not a timing: CI's service tier runs on a loaded machine
    while time.monotonic() < deadline and not state_file.exists():
        assert proc.poll() is None, (tmp_path / "ui.out").read_text()
        time.sleep(0.5)
    assert state_file.exists(), "cje ui did not come up"
    return proc, json.loads(state_file.read_text())


def _flow_runs(api_url: str) -> list[dict]:
    req = urllib.request.Request(api_url.rstrip("/") + "/flow_runs/filter", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_running_ui_forgets_a_stale_state_file(tmp_path, monkeypatch):
    from flows.runtime.prefect_server import running_ui, ui_state_file

    monkeypatch.setenv("CJE_STATE_DIR", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ui_state_file().write_text(json.dumps({"api_url": "http://127.0.0.1:9/api", "pid": dead.pid, "start": 1}))
    assert running_ui() is None and not ui_state_file().exists()


@pytest.mark.lifecycle
def test_cje_ui_is_used_by_later_commands_and_keeps_their_runs(tmp_path):
    port = free_port()
    proc, state = _start_ui(tmp_path, port)
    try:
        assert state["api_url"] == f"http://127.0.0.1:{port}/api" and state["pid"] != proc.pid
        with urllib.request.urlopen(state["ui_url"], timeout=10) as resp:  # the UI is on
            assert resp.status == 200 and b"<html" in resp.read(2000).lower()
        logs, labels = tmp_path / "logs", tmp_path / "labels"
        _, window = write_simulated_logs(Storage.for_uri(str(logs)), Storage.for_uri(str(labels)), 200, 2)
        config = tmp_path / "evaluations.yaml"
        config.write_text(json.dumps({"evaluations": [{"name": "with-ui", "logs_uri": str(logs),
                                                        "labels_uri": str(labels), "results_uri": str(tmp_path),
                                                        "window": window, "options": {"n_bootstrap": 100}}]}))
        # --exit-zero: this test is about the UI, not about the simulated adversarial policy's audit (exit 1)
        r = subprocess.run([CJE, "run", "with-ui", "--config", str(config), "--exit-zero"],
                           env=_env(tmp_path / "state"), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "using the Prefect server of `cje ui`" in r.stderr and "starting a local Prefect" not in r.stderr
        assert f"127.0.0.1:{port}/runs/flow-run/" in r.stderr  # the links point at the persistent UI
        names = {run["name"] for run in _flow_runs(state["api_url"])}
        assert len(names) >= 2  # evaluate_and_audit and its evaluate subflow, still there after `cje run` ended
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        _stop_group(proc)
    assert proc.returncode == 0 and not (tmp_path / "state" / "ui.json").exists()
    assert (tmp_path / "data" / "prefect" / "prefect.db").exists()
    # a restarted `cje ui` shows the same runs (its database lives under the data folder)
    proc, state = _start_ui(tmp_path, port)
    try:
        assert {run["name"] for run in _flow_runs(state["api_url"])} == names
    finally:
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        _stop_group(proc)
