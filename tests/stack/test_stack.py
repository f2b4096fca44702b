"""The production topology, running: PostgreSQL-backed Prefect server, a process work pool and its
worker, a two-node Ray cluster reached through the Ray Client, radosgw S3 (tests/stack/conftest.py).

Each test deploys its own evaluation with `cje deploy` into its own bucket and watches the runs
through the Prefect API; the fault tests stop single services by the PIDs start.sh recorded and
relaunch them from its launch scripts.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from .conftest import (
    FAST_B,
    RUN_OPTIONS,
    SLOW_B,
    SLOW_PROMPTS,
    deploy,
    evaluations_file,
    published,
    read_run,
    result_of,
    runs_of,
    start_run,
    wait_state,
    write_window,
)

pytestmark = pytest.mark.stack

#: The Pending automation's timeout in its test (the product's default is 600 s): long enough that the
#: automation's own polling (every few seconds) is not what the test measures.
PENDING_TIMEOUT = 20.0


def _ray_task_running(stack, node: str, title: str = "cje_bootstrap") -> bool:
    """A Ray worker process of ``node``'s session runs the task ``title`` (Ray sets the process
    title to ``ray::<task name>`` while a task runs, ``ray::IDLE`` otherwise)."""
    from .conftest import session_pids

    for pid in session_pids(stack.pids()[node]):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(f"ray::{title}".encode()):
                    return True
        except OSError:
            pass
    return False


def _wait_bootstrap(stack, run_id: str, nodes=("ray-head", "ray-worker"), timeout: float = 240) -> None:
    """Until a bootstrap chunk of the run runs on one of ``nodes``."""
    deadline = time.monotonic() + timeout
    while not any(_ray_task_running(stack, n) for n in nodes):
        assert time.monotonic() < deadline, "no bootstrap chunk started"
        run = read_run(stack, run_id)
        assert not (run.state and run.state.is_final()), f"run ended {run.state.type.value} before the bootstrap"
        time.sleep(0.2)


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _numbers(result: dict) -> dict:
    """Every policy's estimate, standard error and interval (what must not change)."""
    return {p: (v["estimate"], v["se"], tuple(v["ci"] or ())) for p, v in result["policies"].items()}


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
    assert dep.entrypoint == "flows.pipelines.audit.evaluate_and_audit"
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


def test_worker_killed_mid_run_crashes_publishes_nothing_and_the_next_run_succeeds(stack, bucket, tmp_path):
    name = _name("crash")
    write_window(stack, bucket, n_prompts=SLOW_PROMPTS)
    dep_id = deploy(stack, evaluations_file(tmp_path, name, bucket, n_bootstrap=SLOW_B))
    run_id = start_run(stack, dep_id)
    _wait_bootstrap(stack, run_id)
    # A lost host: the worker and the flow-run process it started (the process worker puts each
    # flow run in a session of its own; its pid is the run's infrastructure_pid).
    flow_pid = int(str(read_run(stack, run_id).infrastructure_pid).rsplit(":", 1)[-1])
    assert os.getsid(flow_pid) != stack.pids()["prefect-worker"]
    try:
        # `Stack.kill` reaches the worker's descendants in sessions of their own, the flow-run process among
        # them; the second kill is for a flow run that is not (yet) below the worker
        stack.kill("prefect-worker")
        with contextlib.suppress(ProcessLookupError):
            os.kill(flow_pid, signal.SIGKILL)
        # No heartbeat for 90 s (HEARTBEAT_TIMEOUT): cje deploy's automation marks the run Crashed.
        run = wait_state(stack, run_id, {"CRASHED"}, timeout=240)
        assert "heartbeat" in (run.state.message or "")
        assert published(stack, bucket, name) == []
        from flows.storage.objects import Storage

        st = Storage.for_uri(f"s3://{bucket}", stack.storage_config())
        assert [o.key for o in st.list(f"results/{name}/")] == []  # not even an attempt folder
    finally:
        stack.launch("prefect-worker")
    # The crash released the deployment's concurrency slot: the next run is not blocked. (Its bootstrap need not
    # be long: nothing interrupts it; `FAST_B` replicates spare the tier ~18 CPU s of SLOW_B's.)
    fast = {"evaluation": name, "options": dict(RUN_OPTIONS, n_bootstrap=FAST_B)}
    run2 = wait_state(stack, start_run(stack, dep_id, fast), {"COMPLETED"}, timeout=300)
    assert run2.state.is_completed()
    [manifest] = published(stack, bucket, name)
    assert result_of(stack, bucket, manifest)["inference"]["n_bootstrap"] == FAST_B


def test_a_run_left_pending_by_a_dead_engine_is_crashed_and_frees_its_slot(stack, bucket, tmp_path):
    """A run whose engine died before it set the run Running (a PostgreSQL restart while it started: the soak's
    hung runs) stays Pending with its deployment's slot and no heartbeat; `cje deploy`'s second automation marks
    it Crashed after its timeout, and the next run of the deployment runs."""
    from prefect.states import Pending, Scheduled

    from flows.runtime.deploy import ensure_pending_automation

    name = _name("pending")
    write_window(stack, bucket)
    dep_id = deploy(stack, evaluations_file(tmp_path, name, bucket))
    with stack.client() as c:
        ensure_pending_automation(c, PENDING_TIMEOUT)
    try:
        with stack.client() as c:
            # what a worker does before it starts the engine (Scheduled -> Pending takes the deployment's slot),
            # then no engine: scheduled an hour ahead, so the stack's worker never takes it
            run = c.create_flow_run_from_deployment(
                uuid.UUID(dep_id), state=Scheduled(scheduled_time=datetime.now(timezone.utc) + timedelta(hours=1)))
            assert c.set_flow_run_state(run.id, Pending()).status.value == "ACCEPT"
        t0 = time.monotonic()
        stuck = wait_state(stack, str(run.id), {"CRASHED"}, timeout=PENDING_TIMEOUT + 120)
        assert time.monotonic() - t0 >= PENDING_TIMEOUT - 5  # not before its timeout (5 s: the polls' spacing)
        assert "still Pending" in (stuck.state.message or "")
    finally:
        with stack.client() as c:
            ensure_pending_automation(c, 600.0)  # `cje deploy`'s default, as the other tests expect
    # The crash released the slot: a run of the same deployment completes (with the slot held it would wait).
    run2 = wait_state(stack, start_run(stack, dep_id), {"COMPLETED"}, timeout=300)
    assert run2.state.is_completed()
    assert len(published(stack, bucket, name)) == 1


def test_prefect_server_restarted_mid_run(stack, bucket, tmp_path):
    name = _name("restart")
    write_window(stack, bucket, n_prompts=SLOW_PROMPTS)
    # the crash automation must outlast a heartbeat interval (30 s) plus the API's outage: a restart on PostgreSQL
    # took longer than 40 s (CRASHED with "no heartbeat for 40 s" under load)
    dep_id = deploy(stack, evaluations_file(tmp_path, name, bucket, n_bootstrap=SLOW_B), heartbeat_timeout=150)
    run_id = start_run(stack, dep_id)
    _wait_bootstrap(stack, run_id)
    stack.kill("prefect-server", signal.SIGTERM)
    t0 = time.monotonic()
    stack.launch("prefect-server")
    stack.wait_api()
    down = time.monotonic() - t0
    run = wait_state(stack, run_id, {"COMPLETED"}, timeout=300)
    assert run.state.is_completed(), f"API down {down:.0f} s"
    manifests = published(stack, bucket, name)
    assert len(manifests) == 1 and manifests[0]["ray"] == "cluster"




def test_ray_worker_node_killed_mid_bootstrap_gives_identical_numbers(stack, bucket, tmp_path):
    write_window(stack, bucket, n_prompts=SLOW_PROMPTS)
    ref_name, kill_name = _name("ref"), _name("nodekill")
    ref_dep = deploy(stack, evaluations_file(tmp_path, ref_name, bucket, n_bootstrap=SLOW_B))
    kill_dep = deploy(stack, evaluations_file(tmp_path, kill_name, bucket, n_bootstrap=SLOW_B))
    wait_state(stack, start_run(stack, ref_dep), {"COMPLETED"}, timeout=300)
    run_id = start_run(stack, kill_dep)
    _wait_bootstrap(stack, run_id, nodes=("ray-worker",))
    stack.kill("ray-worker")  # raylet, object store and the chunk's worker process
    try:
        wait_state(stack, run_id, {"COMPLETED"}, timeout=300)
    finally:
        stack.launch("ray-worker")
    (ref,), (killed,) = published(stack, bucket, ref_name), published(stack, bucket, kill_name)
    assert _numbers(result_of(stack, bucket, killed)) == _numbers(result_of(stack, bucket, ref))


def test_two_workers_racing_for_the_same_window_publish_one_result(stack, bucket, tmp_path):
    name = _name("race")
    write_window(stack, bucket)
    dep_id = deploy(stack, evaluations_file(tmp_path, name, bucket))
    stack.launch("prefect-worker-2", script="prefect-worker", extra_env={"CJE_WORKER_NAME": "worker-2"})
    try:
        ids = [start_run(stack, dep_id), start_run(stack, dep_id)]
        runs = [wait_state(stack, i, {"COMPLETED"}, timeout=400) for i in ids]
    finally:
        stack.kill("prefect-worker-2", signal.SIGTERM)
    first, second = sorted(runs, key=lambda r: r.start_time)
    # The deployment's concurrency limit: the second run started only after the first ended.
    assert second.start_time >= first.end_time
    manifests = published(stack, bucket, name)
    assert len(manifests) == 1  # the second found the window already published
    from flows.storage.objects import Storage
    from flows.storage.publish import read_latest

    latest = read_latest(Storage.for_uri(f"s3://{bucket}", stack.storage_config()), name)
    assert latest is not None and latest["run_key"] == manifests[0]["run_key"]


def test_shared_state_goes_into_the_cluster_directly_through_the_ray_client(stack):
    """put_shared over ray:// takes the direct path (a receiver actor on the head) and the tasks
    see exactly the driver's arrays; a wrong token is refused."""
    import subprocess
    import sys

    script = r'''
import numpy as np, ray
from flows.runtime import ray_fanout as rf
with rf.ray_session() as kind:
    assert kind == "cluster" and rf.is_client()
    x = {"a": np.arange(5_000_000, dtype=np.int64), "b": np.linspace(0, 1, 3_000_001)}
    ref, actor = rf.put_shared(x)
    assert actor is not None, "not the direct path"
    out = rf.map_ordered(lambda s, i: (int(s["a"].sum()) + i, float(s["b"][-1])), [(0,), (1,)], shared=x)
    assert out == [(int(x["a"].sum()), 1.0), (int(x["a"].sum()) + 1, 1.0)], out
    # a second receiver refuses a connection with the wrong token
    import secrets, socket
    bad = ray.remote(rf._Receiver).options(num_cpus=0).remote(secrets.token_bytes(32))
    host, port = ray.get(bad.address.remote())
    pending = bad.receive.remote()
    with socket.create_connection((host, port)) as s:
        s.sendall(b"x" * 32 + b"\0" * 8)
    try:
        ray.get(pending)
        raise SystemExit("wrong token accepted")
    except ray.exceptions.RayTaskError as exc:
        assert "wrong token" in str(exc)
print("ok")
'''
    env = stack.command_env()
    env["CJE_RAY_DIRECT_PUT_MIN_BYTES"] = str(32 * 2**20)  # the production threshold: 64 MB is above it
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
