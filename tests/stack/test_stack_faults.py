"""Faults of the production topology's services during a run (issue 25): PostgreSQL killed, a hard Prefect
server crash with a 90 s outage, the Ray head lost, a frozen worker host, a scheduler firing twice, and a
short chaos soak (benchmarks/chaos_soak.py).

Every test ends with the same invariants (`tests/stack/faults.py::check_integrity`): the run in a final
state (never hung), at most one valid published run per window (its artifacts match the manifest's sha256,
``latest.json`` resolves), no duplicated label request, the budget ledger equal to the stored requests, the
label store unchanged.  The tests share one window and one deployment (each run names its own evaluation,
so each has its own results folder); `_healthy_stack` relaunches whatever a test left down.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from . import faults as F
from .conftest import (
    _DEPLOYED,
    FAST_B,
    HEARTBEAT_TIMEOUT,
    REPO,
    RUN_OPTIONS,
    SLOW_B,
    SLOW_PROMPTS,
    deploy,
    evaluations_file,
    new_bucket,
    read_run,
    start_run,
    write_window,
)
from .test_stack import _wait_bootstrap

pytestmark = pytest.mark.stack

#: The long fault tests and the chaos soak. In CI the fault tests run after test_stack.py in the stack process on
#: the first stack, the soak in a pytest process of its own on a second stack (.ci/services: ``-m "soak"`` with
#: ``CJE_STACK_ENV`` naming that stack); by hand, on a started stack: ``pytest -m stack_faults tests/stack``
#: (docs/stack.md).
LONG = pytest.mark.stack_faults
#: Short fault tests that, in CI, run in a pytest process of their own (``-m "after_soak"``) once the first of the
#: two stack chains (the stack process, the soak) has ended, on that chain's stack: they even out the chains,
#: whose lengths depend on the machine (docs/testing.md); the soak's stack is restored after its last round. By
#: hand they run with the other stack tests (``-m stack``).
AFTER_SOAK = pytest.mark.after_soak

#: The shared window and the runs' options (tests/stack/conftest.py): `SLOW` replicates keep the bootstrap busy
#: while a fault hits it; `FAST` ones make a run of a few seconds.
SLOW = dict(RUN_OPTIONS, n_bootstrap=SLOW_B)
FAST = dict(RUN_OPTIONS, n_bootstrap=FAST_B)
#: The heartbeat automation's timeout for the tests that do not restart the API (heartbeats every 30 s): the
#: product's 90 s, as every stack test (at 40 s a late heartbeat crashed a healthy run in CI).
CRASH_AFTER = HEARTBEAT_TIMEOUT
#: Days of an older window the fast-clock publisher publishes.
WINDOW = 3


class Shared:
    """The module's bucket, window and deployment."""

    def __init__(self, stack, bucket: str, dep_id: str, labels: int):
        self.stack, self.bucket, self.dep_id, self.labels = stack, bucket, dep_id, labels
        self.evaluations: list[str] = []

    def run(self, tag: str, options: dict) -> tuple[str, str]:
        """Start a run of the deployment under its own evaluation name; returns (run id, evaluation)."""
        ev = f"f{uuid.uuid4().hex[:6]}-{tag}"
        self.evaluations.append(ev)
        return start_run(self.stack, self.dep_id, {"evaluation": ev, "options": options}), ev

    def check(self, ev: str, published: int) -> F.Integrity:
        """The invariants over the whole bucket; ``published`` runs of ``ev``."""
        got = F.check_integrity(self.stack, self.bucket, self.evaluations)
        assert got.problems() == [], got.problems()
        assert got.published[ev] == published, got.published
        assert got.ledger_labels == got.requested_labels
        assert got.labels_stored == self.labels, "label rows lost or added"
        return got


@pytest.fixture(scope="module")
def shared(stack, tmp_path_factory):
    with new_bucket(stack) as bucket:
        write_window(stack, bucket, n_prompts=SLOW_PROMPTS)
        cfg = evaluations_file(tmp_path_factory.mktemp("faults"), f"faults-{uuid.uuid4().hex[:6]}", bucket)
        dep_id = deploy(stack, cfg, heartbeat_timeout=CRASH_AFTER)
        _DEPLOYED.remove(dep_id)  # kept for the whole module (the autouse fixture deletes per test)
        try:
            yield Shared(stack, bucket, dep_id, F.labels_stored(stack, bucket))
        finally:
            with stack.client() as c:
                c.delete_deployment(uuid.UUID(dep_id))


@pytest.fixture(autouse=True)
def _healthy_stack(stack):
    """After each test: every service running and answering again (a fault test that failed halfway
    must not break the next one), the crash automation back at `CRASH_AFTER`."""
    yield
    fixed = F.restore(stack)
    F.set_crash_timeout(stack, CRASH_AFTER)
    if fixed:
        print(f"restored after the test: {', '.join(fixed)}")


def _state(run) -> str:
    return run.state.type.value


def _states_seen(stack, ev: str) -> set[str]:
    """Every state type the runs of ``ev`` (the run and its subflows) went through."""
    with stack.client() as c:
        runs = [r for r in c.read_flow_runs(limit=200) if (r.parameters or {}).get("evaluation") == ev]
        return {s.type.value for r in runs for s in c.read_flow_run_states(r.id)}


@LONG
def test_postgres_killed_and_restarted_mid_run_the_run_completes_once(shared):
    stack = shared.stack
    # The product's crash timeout (`cje deploy` default 90 s = three heartbeats): with 40 s, the heartbeat lost
    # while the database was down marked the running evaluate subflow Crashed (it then completed anyway).
    F.set_crash_timeout(stack, 90)
    run_id, ev = shared.run("pg", SLOW)
    _wait_bootstrap(stack, run_id)
    stack.kill("postgres")  # SIGKILL of the postmaster and every backend: the API's database is gone
    assert not F.alive(stack, "postgres")
    time.sleep(3)
    F.restart_postgres(stack)  # crash recovery, then the API's pool reconnects
    run = F.wait_final(stack, run_id, timeout=300)
    assert _state(run) == "COMPLETED", run.state.message
    assert "CRASHED" not in _states_seen(stack, ev)
    shared.check(ev, published=1)


def test_prefect_server_started_while_postgres_is_down_comes_back_by_itself(stack):
    """The chaos soak's lost API: a Prefect server crash relaunched while PostgreSQL was down exits at startup
    ("Application startup failed"); its launch script starts it again until the database is back (as compose's
    ``restart: unless-stopped``), with no second launch by anyone."""
    log = Path(stack.env["CJE_STACK_LOGS"]) / "prefect-server.log"
    launches = Path(stack.env["CJE_STACK_PIDS"]).read_text().count("prefect-server ")
    stack.kill("postgres")
    stack.kill("prefect-server")
    seen = log.stat().st_size
    stack.launch("prefect-server")
    deadline = time.monotonic() + 120
    while "Application startup failed" not in log.read_text(errors="replace")[seen:]:  # the startup did fail
        assert time.monotonic() < deadline, "the Prefect server did not try to start without its database"
        time.sleep(1.0)
    assert F.alive(stack, "prefect-server") and not F.api_ready(stack)
    F.restart_postgres(stack)  # waits (90 s at most) for the API's /ready: the server came back by itself
    assert Path(stack.env["CJE_STACK_PIDS"]).read_text().count("prefect-server ") == launches + 1
    assert "starting it again" in log.read_text(errors="replace")[seen:]


@LONG
def test_prefect_server_sigkilled_for_90_s_then_restarted(shared):
    stack = shared.stack
    # The automation must outlast the outage plus a heartbeat interval (30 s) plus the restart.
    F.set_crash_timeout(stack, 200)
    run_id, ev = shared.run("api", SLOW)
    _wait_bootstrap(stack, run_id)
    stack.kill("prefect-server")  # SIGKILL: no graceful shutdown
    t0 = time.monotonic()
    time.sleep(90)
    stack.launch("prefect-server")
    stack.wait_api(timeout=180)
    outage = time.monotonic() - t0
    run = F.wait_final(stack, run_id, timeout=300)
    state = _state(run)
    assert state == "COMPLETED", f"after a {outage:.0f} s outage: {state}: {run.state.message}"
    shared.check(ev, published=1)


@LONG
def test_ray_head_killed_mid_run_the_run_ends_and_the_next_run_publishes(shared):
    stack = shared.stack
    run_id, ev = shared.run("head", SLOW)
    _wait_bootstrap(stack, run_id)
    stack.kill("ray-head")  # GCS, Ray Client server, the head's raylet and workers
    t0 = time.monotonic()
    try:
        run = F.wait_final(stack, run_id, timeout=300)  # never hung
    finally:
        F.restart_ray(stack, head=True)
    took = time.monotonic() - t0
    assert _state(run) in {"FAILED", "COMPLETED"}, f"{_state(run)} after {took:.0f} s: {run.state.message}"
    # was: "The client has already connected to the cluster with allow_multiple=True" (a retried task's
    # reconnect tripped over the lost connection)
    assert "allow_multiple" not in (run.state.message or ""), run.state.message
    if _state(run) == "FAILED":
        shared.check(ev, published=0)
    # the head is back: the next run of the window publishes (or finds it published)
    nxt = start_run(stack, shared.dep_id, {"evaluation": ev, "options": FAST})
    assert _state(F.wait_final(stack, nxt, timeout=300)) == "COMPLETED"
    shared.check(ev, published=1)


def test_worker_host_frozen_sigstop_is_crashed_and_nothing_half_published(shared):
    stack = shared.stack
    run_id, ev = shared.run("stop", SLOW)
    _wait_bootstrap(stack, run_id)
    flow_pid = F.flow_run_pid(stack, run_id)
    assert flow_pid and os.getsid(flow_pid) != stack.pids()["prefect-worker"]
    # a frozen host: the worker and its flow-run process stop (no heartbeats), nothing exits
    frozen = F.signal_session(stack, "prefect-worker", signal.SIGSTOP)
    os.kill(flow_pid, signal.SIGSTOP)
    try:
        run = F.wait_final(stack, run_id, timeout=40 + CRASH_AFTER + 60)
        assert _state(run) == "CRASHED" and "heartbeat" in (run.state.message or ""), run.state.message
        shared.check(ev, published=0)
    finally:
        for pid in [*frozen, flow_pid]:
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    # The host thaws: the crashed run's process resumes. Whatever it does next, it must not publish a
    # second result beside the next run's, nor leave a half-published one.
    nxt = start_run(stack, shared.dep_id, {"evaluation": ev, "options": SLOW})
    assert _state(F.wait_final(stack, nxt, timeout=300)) == "COMPLETED"
    F.wait_process_gone(flow_pid, timeout=120)
    zombie = read_run(stack, run_id)
    assert _state(zombie) in F.FINAL, _state(zombie)
    shared.check(ev, published=1)


#: The soak in CI: 30 slots, 5 in flight at once (benchmarks/chaos_soak.py). Seed 33 draws every fault kind
#: (asserted below): none 9, flow_kill 4, ray_node 3, api_crash 4, pg_kill 5, double_fire 4, ray_head 1. Until
#: 6 December seed 12 (none 10, flow_kill 3, ray_node 4, api_crash 4, pg_kill 5, double_fire 2, ray_head 2): each
#: Ray head kill fails every run in flight, and their five slots are retried in a round of their own (134-267 s
#: of CI's 40 minutes, with the head's relaunch); one such kill covers the kind, so the seed with one.
SOAK = {"runs": 30, "lanes": 5, "seed": 33}
#: Its time limit in CI, a guard against a soak that stops making progress (each run's own hang is counted by the soak,
#: 420 s a round): measured 1,148-1,234 s on the CI layout, then 1,329-1,654 s on machines ~1.35-1.6x slower
#: (docs/testing.md, runs 7-9; 146 s left of the former 1,800 s in run 9).
SOAK_LIMIT_S = 2100


#: In CI, alone on a second stack (.ci/services: ``-m soak`` with ``CJE_STACK_ENV`` its env file).
#: By hand on a started stack: ``pytest -m soak tests/stack``.
@LONG
@pytest.mark.soak
def test_chaos_soak_30_scheduled_runs(stack, tmp_path):
    """benchmarks/chaos_soak.py: 30 scheduled runs, faults at seeded random points, every invariant held."""
    # the whole report (rows, rounds) kept where CJE_SOAK_REPORT says, for docs/testing.md; else in tmp_path
    out = Path(os.environ.get("CJE_SOAK_REPORT") or tmp_path / "soak.json")
    env = stack.command_env()
    env["CJE_STACK_ENV"] = os.environ.get("CJE_STACK_ENV") or "/tmp/cje-stack/env"
    env["PYTHONPATH"] = str(REPO)
    try:
        proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "chaos_soak.py"), "--runs", str(SOAK["runs"]),
                               "--lanes", str(SOAK["lanes"]), "--seed", str(SOAK["seed"]), "--json", str(out)],
                              env=env, capture_output=True, text=True, timeout=SOAK_LIMIT_S, cwd=REPO)
    except subprocess.TimeoutExpired as exc:  # the rounds it ended (written after each) say where the time went
        rounds = json.loads(out.read_text())["round_walls"] if out.exists() else "none ended"
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        pytest.fail(f"the soak did not end within {SOAK_LIMIT_S} s; its rounds: {json.dumps(rounds)}; "
                    f"its log's end: {err[-3000:]}")
    assert out.exists(), proc.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert rep["complete"], proc.stderr[-4000:]
    print(json.dumps({k: v for k, v in rep.items() if k != "rows"}))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert rep["runs"] >= 30 and len(rep["rows"]) == rep["runs"]
    assert set(rep["faults"]) == set(F.SOAK_FAULTS), rep["faults"]  # every kind of fault happened
    assert rep["published"] + rep["failed_cleanly"] + rep["failed_after_publishing"] == rep["runs"]
    assert rep["hung"] == 0 and rep["dangling_pointers"] == 0 and rep["bad_artifacts"] == 0
    assert rep["duplicated_results"] == 0 and rep["lost_results"] == 0 and rep["lost_labels"] == 0
    assert rep["duplicated_requests"] == 0 and rep["ledger_labels"] == rep["requested_labels"]
    assert rep["problems"] == []
    # every slot whose first run did not publish had a retry, and the retry was checked: each slot has exactly
    # one published run in the end (lost_results and duplicated_results above)
    unpublished = [r for r in rep["rows"] if r["published_before_retry"] == 0]
    assert all(r["retries"] for r in unpublished), [r["slot"] for r in unpublished if not r["retries"]]
    assert rep["retries"] == sum(len(r["retries"]) for r in rep["rows"]) >= len(unpublished)


@AFTER_SOAK
def test_scheduler_double_fire_runs_one_at_a_time_and_publishes_one_result(shared):
    """Two flow runs for the same slot (a scheduler firing twice): the deployment's concurrency limit runs
    them one after the other; the second finds the window published."""
    stack = shared.stack
    ev = f"f{uuid.uuid4().hex[:6]}-twice"
    shared.evaluations.append(ev)
    ids = [start_run(stack, shared.dep_id, {"evaluation": ev, "options": FAST}) for _ in range(2)]
    runs = [F.wait_final(stack, i, timeout=300) for i in ids]
    assert [_state(r) for r in runs] == ["COMPLETED", "COMPLETED"], [r.state.message for r in runs]
    first, second = sorted(runs, key=lambda r: r.start_time)
    assert second.start_time >= first.end_time  # never at once
    shared.check(ev, published=1)


@AFTER_SOAK
def test_publisher_clock_2_hours_fast_neither_holds_nor_moves_back_latest(shared, monkeypatch):
    """A publisher whose clock runs 2 h ahead (its ``published_at`` and attempt ids 2 h in the future) publishes
    older windows of the evaluation on the stack's radosgw, before and after the deployment's run of the current
    window.  ``latest.json`` follows the runs' identity (`publication_order`: window dates, then label-store
    version; the clock only between runs of the same window and labels) by a conditional write on its ETag:
    the fast publisher neither keeps the pointer from the next run (was: for 2 h) nor moves it back.

    The skew is the publisher's clock only (``flows.storage.publish.datetime``): a whole host 2 h fast is refused
    by S3 itself (SigV4 requests more than 15 min off are ``RequestTimeTooSkewed``)."""
    from datetime import datetime as real_datetime, timedelta, timezone

    import flows.storage.publish as publish
    from flows.storage.publish import publish_run, read_latest
    from tests.storage.test_publish import artifacts_for

    class FastClock(real_datetime):
        @classmethod
        def now(cls, tz=None):
            return real_datetime.now(tz) + timedelta(hours=2)

    stack = shared.stack
    st = F.storage(stack, shared.bucket)
    ev = f"f{uuid.uuid4().hex[:6]}-clock"
    shared.evaluations.append(ev)
    today = real_datetime.now(timezone.utc).date()

    def fast_publish(days_back: int) -> str:
        start, end = (today - timedelta(days=days_back + WINDOW), today - timedelta(days=days_back))
        window = f"{start}_{end}"
        with monkeypatch.context() as m:
            m.setattr(publish, "datetime", FastClock)
            out = publish_run(st, ev, window, f"fast{days_back}", artifacts_for(),
                              {"window_spec": {"start": str(start), "end": str(end)},
                               "labels": {"label_store_version": 1}})
        assert out.published, out
        return f"fast{days_back}"

    first = fast_publish(30)
    assert read_latest(st, ev)["run_key"] == first  # the only run so far
    run_id = start_run(stack, shared.dep_id, {"evaluation": ev, "options": FAST})
    run = F.wait_final(stack, run_id, timeout=300)
    assert _state(run) == "COMPLETED", run.state.message
    (current,) = [r for r in F.list_runs(st, ev) if not r["run_key"].startswith("fast")]
    assert current["published_at"] < F.list_runs(st, ev)[-1]["published_at"]  # the fast clock's is later
    assert read_latest(st, ev)["run_key"] == current["run_key"]  # was: still fast30, for 2 h
    fast_publish(20)  # an older window published later by the fast publisher
    assert read_latest(st, ev)["run_key"] == current["run_key"]  # was: moved back to fast20
    shared.check(ev, published=3)
