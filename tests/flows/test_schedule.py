"""A served deployment fires on its own schedule (real Prefect server, `cje serve`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest

from flows.storage.publish import read_latest
from flows.storage.objects import Storage

from .conftest import REPO, _stop_group, write_simulated_logs


def test_cje_serve_runs_the_declared_evaluation_on_its_interval(prefect_server, ray_cluster, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    logs, labels = tmp_path / "logs", tmp_path / "labels"
    _, window = write_simulated_logs(Storage.for_uri(str(logs)), Storage.for_uri(str(labels)), 300, 2)
    config = tmp_path / "evaluations.yaml"
    anchor = (datetime.now(timezone.utc) - timedelta(seconds=30)).isoformat()
    config.write_text(json.dumps({"evaluations": [{
        "name": "every-few-seconds", "logs_uri": "logs", "labels_uri": "labels", "results_uri": ".",
        # The shortest interval allowed (60 s), anchored 30 s ago: the first run is due ~30 s from now.
        # `cje serve` deploys within that on a quiet machine (~6 s of CPU: 25.6 and 28.7 s of wall at load
        # 12 and 9 on 2 cores, the second one a moment too late for the first slot);
        # Prefect's scheduler never creates a slot already past, so the old anchor (55 s ago, first slot
        # 5 s out) was always missed and the test idled a minute for the next one. A start slower than
        # 30 s catches the next slot, 90 s out, which the deadline below leaves room to finish.
        "window": window, "interval": 60, "anchor": anchor, "options": {"n_bootstrap": 100, "seed": 1}}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RAY_ADDRESS"))}
    env.update(PREFECT_API_URL=prefect_server.url, RAY_ADDRESS=ray_cluster.address, PYTHONPATH=str(REPO),
               PREFECT_RUNNER_POLL_FREQUENCY="1")
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli.main", "serve", "--config", str(config), "--limit", "1"],
                            env=env, cwd=str(tmp_path), stdout=open(tmp_path / "serve.log", "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    completed = []
    try:
        # a bound on a hang only (the loop ends at the first completed run): a quiet machine finishes one run after
        # the first slot (~30 s out); a loaded one that misses it catches a later slot, 60 s apart (600 s: room
        # for several slots missed, where 240 s left about two)
        deadline = time.monotonic() + 600
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline and not completed:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                runs = client.read_flow_runs(deployment_filter=DeploymentFilter(
                    name=DeploymentFilterName(any_=["every-few-seconds"])))
                completed = [r for r in runs if r.state and r.state.is_completed()]
                failed = [r for r in runs if r.state and (r.state.is_failed() or r.state.is_crashed())]
                assert not failed, (tmp_path / "serve.log").read_text()[-3000:]
                time.sleep(1)
    finally:
        _stop_group(proc, grace=10)
    assert completed, "no scheduled run completed:\n" + (tmp_path / "serve.log").read_text()[-3000:]
    run = completed[0]
    assert run.auto_scheduled  # created by the schedule, not by us
    assert run.parameters["evaluation"] == "every-few-seconds"
    latest = read_latest(Storage.for_uri(str(tmp_path)), "every-few-seconds")
    assert latest is not None and latest["window"] == window.replace("..", "_")


def test_cje_serve_refuses_a_sub_minute_interval_before_starting_anything(tmp_path):
    """`interval: true` / `0.001` once made `cje serve` fork 14 flow runs in 46 s: now exit 2 at load."""
    for bad in ("true", "0.001", "5"):
        config = tmp_path / "evaluations.yaml"
        config.write_text(f"evaluations:\n  - {{name: fast, logs_uri: logs, interval: {bad}}}\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_URL")}
        r = subprocess.run([sys.executable, "-m", "flows.cli.main", "serve", "--config", str(config)], env=env,
                           cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "key interval" in r.stderr and str(config) in r.stderr, r.stderr
        assert "starting a local" not in r.stderr


@pytest.mark.parametrize("overlap", ["queue", "skip"])
def test_overlapping_runs_of_a_served_evaluation_never_run_at_once(prefect_server, tmp_path, overlap):
    """Issue 25: the deployments of `cje serve` had no concurrency limit (only `cje deploy` set one), so a
    scheduled run due while the previous one still ran started beside it: two writers on one window.
    Now every declared entry has a limit of one run, enforced by the server; ``overlap: queue`` (default)
    holds the second in ``AwaitingConcurrencySlot``, ``overlap: skip`` cancels it with the reason in its state."""
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Pending, Running

    from flows.pipelines.deployments import evaluation_deployments
    from flows.runtime.schedules import load_evaluations

    name = f"overlap-{overlap}-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "evaluations.yaml"
    config.write_text(f"evaluations:\n  - name: {name}\n    logs_uri: {tmp_path}\n    interval: 3600\n"
                      + (f"    overlap: {overlap}\n" if overlap == "skip" else ""))
    (dep,) = evaluation_deployments(load_evaluations(config).values())  # what `cje serve` serves
    assert dep.concurrency_limit == 1
    assert dep.concurrency_options.collision_strategy.value == ("ENQUEUE" if overlap == "queue" else "CANCEL_NEW")
    dep_id = dep.apply()
    with get_client(sync_client=True) as client:
        try:
            first, second = (client.create_flow_run_from_deployment(dep_id) for _ in range(2))
            assert client.set_flow_run_state(first.id, Pending()).status.value == "ACCEPT"
            client.set_flow_run_state(first.id, Running())
            answer = client.set_flow_run_state(second.id, Pending())  # the runner asks before it starts a run
            state = client.read_flow_run(second.id).state
            assert answer.status.value != "ACCEPT" and not state.is_running() and not state.is_pending()
            if overlap == "queue":
                assert state.name == "AwaitingConcurrencySlot"
            else:
                assert state.is_cancelled() and "concurrency" in (state.message or "").lower()
            client.set_flow_run_state(first.id, Completed())
        finally:
            client.delete_deployment(dep_id)


def test_overlap_is_a_typed_option_of_each_entry(tmp_path):
    """``overlap:`` other than queue or skip is exit 2 at load naming the file, the entry and the key."""
    config = tmp_path / "evaluations.yaml"
    config.write_text(f"evaluations:\n  - name: ev\n    logs_uri: {tmp_path}\n    overlap: parallel\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_URL")}
    r = subprocess.run([sys.executable, "-m", "flows.cli.main", "serve", "--config", str(config)], env=env,
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "key overlap" in r.stderr and str(config) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "starting a local" not in r.stderr
