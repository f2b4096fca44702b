"""`cje deploy` without a server: what it would register, and its refusals.

The deployments really applied to a PostgreSQL-backed server and run by a worker are in
tests/stack/ (the stack tier).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _config(tmp_path: Path) -> Path:
    doc = {
        "evaluations": [
            {"name": "daily", "logs_uri": "s3://b/logs", "window": "last 7 days", "cron": "0 6 * * *",
             "options": {"n_bootstrap": 200, "seed": 1}},
            {"name": "hourly", "logs_uri": "s3://b/logs", "window": "last 1 days", "interval": 3600},
        ],
        "drift_monitors": [{"name": "anchors", "set_name": "anchors", "anchors_uri": "s3://b", "cron": "30 6 * * *"}],
    }
    path = tmp_path / "evaluations.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_runner_deployments_carry_schedules_parameters_and_a_limit_of_one(tmp_path):
    from flows.pipelines.deployments import runner_deployments

    deps = {d.name: d for d in runner_deployments(str(_config(tmp_path)))}
    assert set(deps) == {"daily", "hourly", "drift-anchors"}
    for d in deps.values():
        assert d.concurrency_limit == 1
        assert d.concurrency_options.collision_strategy.value == "ENQUEUE"
        assert "." in d.entrypoint and ":" not in d.entrypoint, "a module path (the worker imports the package)"
    assert deps["daily"].entrypoint == "flows.pipelines.audit.evaluate_and_audit"
    assert deps["drift-anchors"].entrypoint == "flows.pipelines.drift.drift"
    assert deps["daily"].parameters["options"] == {"n_bootstrap": 200, "seed": 1}
    assert deps["daily"].parameters["evaluation"] == "daily"
    (sched,) = deps["daily"].schedules
    assert sched.schedule.cron == "0 6 * * *"
    (sched,) = deps["hourly"].schedules
    assert sched.schedule.interval.total_seconds() == 3600
    only = runner_deployments(str(_config(tmp_path)), only=["hourly"], drift=False)
    assert [d.name for d in only] == ["hourly"]


def test_unknown_evaluation_is_bad_input(tmp_path):
    from cje_engine.errors import CJEInputError
    from flows.pipelines.deployments import runner_deployments

    with pytest.raises(CJEInputError, match="no evaluation named 'nope'"):
        runner_deployments(str(_config(tmp_path)), only=["nope"])


def _cje(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    base.update(env or {})
    return subprocess.run([str(BIN / "cje"), *args], capture_output=True, text=True, env=base, timeout=120, cwd=REPO)


def test_deploy_without_an_api_is_service_unavailable(tmp_path):
    out = _cje("deploy", "--config", str(_config(tmp_path)))
    assert out.returncode == 69, out.stderr
    assert "PREFECT_API_URL is not set" in out.stderr


@pytest.mark.parametrize("option,value", [("--pending-timeout", "0"), ("--heartbeat-timeout", "-5"),
                                          ("--pending-timeout", "nan")])
def test_deploy_with_a_timeout_that_is_not_positive_is_bad_input(tmp_path, option, value):
    """A timeout of 0 (or less, or NaN) would crash every run as it starts: refused before any server, naming it."""
    out = _cje("deploy", "--config", str(_config(tmp_path)), option, value,
               env={"PREFECT_API_URL": "http://127.0.0.1:9/api"})
    assert out.returncode == 2, out.stderr
    assert option in out.stderr and "positive number of seconds" in out.stderr


def test_deploy_with_a_broken_template_is_bad_input(tmp_path):
    bad = tmp_path / "template.json"
    bad.write_text("{not json")
    out = _cje("deploy", "--config", str(_config(tmp_path)), "--base-job-template", str(bad),
               env={"PREFECT_API_URL": "http://127.0.0.1:9/api"})
    assert out.returncode == 2, out.stderr
    assert "template.json" in out.stderr and "not a JSON base job template" in out.stderr


def test_zombie_automation_watches_heartbeats_and_crashes_the_run():
    """The automation `cje deploy` creates, as the server will receive it (no server needed)."""
    from flows.runtime.deploy import ensure_zombie_automation

    class Recorder:
        def __init__(self):
            self.created = []

        def read_automations_by_name(self, name):
            return []

        def create_automation(self, automation):
            self.created.append(automation)
            return "id-1"

    rec = Recorder()
    assert ensure_zombie_automation(rec, 45) == "id-1"
    (auto,) = rec.created
    body = json.loads(auto.model_dump_json())
    trig = body["trigger"]
    assert trig["posture"] == "Proactive" and trig["within"] == 45.0
    assert trig["after"] == ["prefect.flow-run.heartbeat"]
    assert "prefect.flow-run.Completed" in trig["expect"] and "prefect.flow-run.heartbeat" in trig["expect"]
    assert trig["for_each"] == ["prefect.resource.id"]
    assert body["actions"][0]["type"] == "change-flow-run-state" and body["actions"][0]["state"] == "CRASHED"


def test_pending_automation_crashes_a_run_that_never_leaves_pending():
    """The second automation `cje deploy` creates: a run Pending for ``within`` seconds with no state after it is
    marked Crashed (no heartbeat is ever sent by a run whose engine died before it ran)."""
    from flows.runtime.deploy import PENDING_AUTOMATION, ensure_pending_automation

    class Recorder:
        def __init__(self):
            self.created, self.deleted = [], []

        def read_automations_by_name(self, name):
            return [type("A", (), {"id": f"old-{name}"})()]

        def delete_automation(self, automation_id):
            self.deleted.append(automation_id)

        def create_automation(self, automation):
            self.created.append(automation)
            return "id-2"

    rec = Recorder()
    assert ensure_pending_automation(rec, 600) == "id-2"
    assert rec.deleted == [f"old-{PENDING_AUTOMATION}"]  # replaced, never two
    (auto,) = rec.created
    body = json.loads(auto.model_dump_json())
    assert body["name"] == PENDING_AUTOMATION
    trig = body["trigger"]
    assert trig["posture"] == "Proactive" and trig["within"] == 600.0
    assert trig["after"] == ["prefect.flow-run.Pending"]
    assert "prefect.flow-run.Pending" not in trig["expect"]
    for left in ("Running", "Completed", "Failed", "Cancelled", "Crashed", "Cancelling", "Scheduled",
                 "AwaitingConcurrencySlot"):
        assert f"prefect.flow-run.{left}" in trig["expect"], left
    assert trig["for_each"] == ["prefect.resource.id"]
    assert body["actions"][0]["type"] == "change-flow-run-state" and body["actions"][0]["state"] == "CRASHED"
    assert "Pending" in body["actions"][0]["message"]
