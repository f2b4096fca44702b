"""The production topology, running: PostgreSQL-backed Prefect server, a process work pool and its
worker, a two-node Ray cluster reached through the Ray Client, radosgw S3 (tests/stack/conftest.py).

Each test deploys its own evaluation with `cje deploy` into its own bucket and watches the runs
through the Prefect API; the fault tests stop single services by the PIDs start.sh recorded and
relaunch them from its launch scripts.
"""
from __future__ import annotations

import signal
import time
import uuid
from datetime import datetime, timezone

import pytest

from .conftest import (
    deploy,
    evaluations_file,
    published,
    read_run,
    result_of,
    runs_of,
    start_run,
    wait_state,
    wait_task_running,
    write_window,
)

pytestmark = pytest.mark.stack


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _numbers(result: dict) -> dict:
    """Every policy's estimate, standard error and interval (what must not change)."""
    return {p: (v["estimate"], v["se"], tuple(v["ci"])) for p, v in result["policies"].items()}


def test_schedule_fires_and_the_worker_runs_it_on_ray_and_s3(stack, bucket, tmp_path):
    name = _name("sched")
    write_window(stack, bucket)
    # Interval schedules are anchored in the past: a 60 s interval fires within a minute.
    dep_id = deploy(stack, evaluations_file(tmp_path, name, bucket, interval=60))
    with stack.client() as c:
        dep = c.read_deployment(uuid.UUID(dep_id))
    assert dep.work_pool_name == stack.pool
    assert dep.global_concurrency_limit is not None and dep.global_concurrency_limit.limit == 1
    assert dep.concurrency_options.collision_strategy.value == "ENQUEUE"
    assert dep.entrypoint == "flows.label_requests.requests.evaluate_and_audit"
    # Nobody asked for a run: the server's scheduler creates it from the interval schedule.
    deadline = time.monotonic() + 30
    while not (runs := sorted(runs_of(stack, dep_id), key=lambda r: r.expected_start_time)):
        assert time.monotonic() < deadline, "the schedule produced no flow run in 30 s"
        time.sleep(1)
    assert (runs[0].expected_start_time - datetime.now(timezone.utc)).total_seconds() < 65
    run = wait_state(stack, str(runs[0].id), {"COMPLETED"}, timeout=300)
    assert run.auto_scheduled, "the run was not created by the schedule"
    assert run.work_pool_name == stack.pool
    # The worker ran it: its process worker records the flow-run subprocess as host:pid.
    assert run.infrastructure_pid, "no infrastructure pid: not run by a worker"
    manifests = published(stack, bucket, name)
    assert len(manifests) == 1
    m = manifests[0]
    assert m["ray"] == "cluster"  # fanned out on the Ray cluster (RAY_ADDRESS), not a local Ray
    assert m["inputs"]["logs_uri"] == f"s3://{bucket}/logs" and m["inputs"]["n_files"] == 3
    assert m["flow_run_id"] != str(run.id)  # the evaluate subflow of this run
    result = result_of(stack, bucket, m)
    assert set(result["policies"]) == {"base", "clone", "verbose", "concise", "unhelpful"}
