"""`ray_session`'s connection to a cluster: a Ray Client server that failed to start is retried; a connection
that timed out is retried within the run's connect patience (a head being relaunched); nothing else.

The failure is the proxier's (its per-connection server process died at start-up), so it is simulated here
with a stand-in for the ``ray`` module; the real connection path runs in tests/stack.
"""
from __future__ import annotations

import pytest

from flows.runtime import ray_fanout

SERVER_FAILED = ("Initialization failure from server:\nTraceback (most recent call last):\n"
                 "RuntimeError: Starting Ray client server failed. See ray_client_server_23000.err for detailed logs.")


class FakeRay:
    def __init__(self, errors: list[BaseException]) -> None:
        self.errors, self.inits, self.shutdowns = list(errors), 0, 0

    def init(self, **kwargs) -> None:
        self.inits += 1
        assert kwargs["address"] == "ray://127.0.0.1:1"
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture(autouse=True)
def _no_pause(monkeypatch):
    monkeypatch.setattr(ray_fanout, "CLIENT_INIT_PAUSE", 0.0)


def test_a_client_server_that_failed_to_start_is_retried(caplog):
    ray = FakeRay([ConnectionAbortedError(SERVER_FAILED), ConnectionAbortedError(SERVER_FAILED)])
    ray_fanout._connect(ray, "ray://127.0.0.1:1", {})
    assert ray.inits == 3 and ray.shutdowns == 2
    assert sum("failed to start (attempt" in r.getMessage() for r in caplog.records) == 2


def test_the_last_attempt_raises():
    ray = FakeRay([ConnectionAbortedError(SERVER_FAILED)] * ray_fanout.CLIENT_INIT_ATTEMPTS)
    with pytest.raises(ConnectionAbortedError, match="Starting Ray client server failed"):
        ray_fanout._connect(ray, "ray://127.0.0.1:1", {})
    assert ray.inits == ray_fanout.CLIENT_INIT_ATTEMPTS


@pytest.mark.parametrize("exc", [ConnectionAbortedError("connection refused by peer"), ConnectionRefusedError(),
                                 ConnectionError("ray client connection timeout"), ValueError("bad address")])
def test_other_failures_are_not_retried(exc):
    """Without patience (a reconnect inside a running task, whose task has retries of its own) a timeout is
    raised at once too."""
    ray = FakeRay([exc])
    with pytest.raises(type(exc)):
        ray_fanout._connect(ray, "ray://127.0.0.1:1", {})
    assert ray.inits == 1


def test_a_lost_client_connection_is_dropped_before_connecting_again(monkeypatch, caplog):
    """The head died under a connected client (a retried task connects again in the same process): Ray kept
    the dead connection registered and the next ``ray.init`` failed with "already connected to the cluster
    with allow_multiple=True" (seen on the stack, tests/stack/test_stack_faults.py).  It is dropped first."""
    from ray.util import client as ray_client

    dropped = []
    monkeypatch.setattr(ray_client, "num_connected_contexts", lambda: 1 - len(dropped))
    monkeypatch.setattr(ray_client.ray, "is_connected", lambda: False)
    monkeypatch.setattr(ray_client.ray, "disconnect", lambda *a, **k: dropped.append(1))
    ray = FakeRay([])
    ray_fanout._connect(ray, "ray://127.0.0.1:1", {})
    assert dropped == [1] and ray.inits == 1
    assert any("was lost" in r.getMessage() for r in caplog.records)
    ray_fanout._connect(ray, "ray://127.0.0.1:1", {})  # nothing lost now: nothing dropped
    assert dropped == [1]


def _lost_connection(monkeypatch, dropped: list) -> None:
    from ray.util import client as ray_client

    monkeypatch.setattr(ray_client, "num_connected_contexts", lambda: 1 - len(dropped))
    monkeypatch.setattr(ray_client.ray, "is_connected", lambda: bool(dropped))
    monkeypatch.setattr(ray_client.ray, "disconnect", lambda *a, **k: dropped.append(1))


def test_a_task_retried_after_the_head_was_lost_connects_again(monkeypatch, caplog):
    """Issue 25, the Ray head killed on the stack: the bootstrap task's retry ran inside the same `ray_session`,
    whose Ray Client connection was lost; `map_ordered` went to Ray's auto-init, which failed with "already
    connected to the cluster with allow_multiple=True".  `map_ordered` now connects again first."""
    import sys

    dropped: list = []
    _lost_connection(monkeypatch, dropped)
    fake = FakeRay([])
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(ray_fanout, "_SESSION", {"address": "ray://127.0.0.1:1", "runtime_env": {}})
    assert ray_fanout.reconnect_if_lost() is True
    assert dropped == [1] and fake.inits == 1
    assert any("connected again" in r.getMessage() for r in caplog.records)
    assert ray_fanout.reconnect_if_lost() is False  # connected: nothing to do


def test_a_head_still_down_is_a_clear_connection_error(monkeypatch):
    import sys

    _lost_connection(monkeypatch, [])
    monkeypatch.setitem(sys.modules, "ray", FakeRay([ConnectionError("ray client connection timeout")]))
    monkeypatch.setattr(ray_fanout, "_SESSION", {"address": "ray://127.0.0.1:1", "runtime_env": {}})
    with pytest.raises(ray_fanout.RayConnectionLost, match=r"ray://127.0.0.1:1 was lost .*connection timeout"):
        ray_fanout.reconnect_if_lost()


def test_outside_a_cluster_session_nothing_happens(monkeypatch):
    monkeypatch.setattr(ray_fanout, "_SESSION", {})
    assert ray_fanout.reconnect_if_lost() is False


TIMEOUT = "ray client connection timeout"
#: What one timed-out ``ray.init("ray://...")`` costs in Ray 2.60: channel waits of 5 + 10 + 20 s.
ATTEMPT_S = 35.0


class Clock:
    """`ray_fanout`'s view of time: each ``init`` of the fake Ray costs `ATTEMPT_S`, each pause its length."""

    def __init__(self) -> None:
        self.now, self.pauses = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.pauses.append(s)
        self.now += s


@pytest.fixture
def clock(monkeypatch):
    import types

    c = Clock()
    monkeypatch.setattr(ray_fanout, "time", types.SimpleNamespace(monotonic=c.monotonic, sleep=c.sleep))
    monkeypatch.setattr(ray_fanout, "CLIENT_INIT_PAUSE", 2.0)
    return c


class SlowFakeRay(FakeRay):
    def __init__(self, errors, clock: Clock) -> None:
        super().__init__(errors)
        self.clock = clock

    def init(self, **kwargs) -> None:
        if self.errors:
            self.clock.now += ATTEMPT_S
        super().init(**kwargs)


def test_a_timed_out_connection_is_retried_within_the_patience(clock, caplog):
    """Issue 25, the soak: a Ray head relaunched with runs in flight answered again ~60 s after its kill; a new
    run's connection timed out (~35 s) and the run failed.  Within its patience it connects again."""
    ray = SlowFakeRay([ConnectionError(TIMEOUT)] * 2, clock)
    ray_fanout._connect(ray, "ray://127.0.0.1:1", {}, patience=120.0)
    assert ray.inits == 3 and ray.shutdowns == 2
    assert clock.pauses == [2.0, 4.0]  # doubling
    assert any("after 2 timed-out attempt(s)" in r.getMessage() for r in caplog.records)


def test_past_the_patience_the_timeout_is_raised_and_the_run_can_end(clock):
    """A head that stays down: four attempts, then the timeout is raised (a run that cannot reach Ray fails)."""
    ray = SlowFakeRay([ConnectionError(TIMEOUT)] * 10, clock)
    with pytest.raises(ConnectionError, match=TIMEOUT):
        ray_fanout._connect(ray, "ray://127.0.0.1:1", {}, patience=120.0)
    # starts at 0, 37 (35 + 2), 76 (72 + 4), 119 (111 + 8); the fifth would start at 154 + 16 = 170 > 120
    assert ray.inits == 4
    assert clock.now <= 120.0 + ATTEMPT_S + ray_fanout.CLIENT_PAUSE_MAX  # bounded: patience + one attempt


def test_the_patience_comes_from_the_environment(monkeypatch):
    from flows.runtime import timeouts

    monkeypatch.delenv(timeouts.RAY_CONNECT_PATIENCE_ENV, raising=False)
    assert timeouts.ray_connect_patience() == timeouts.DEFAULT_RAY_CONNECT_PATIENCE == 120.0
    monkeypatch.setenv(timeouts.RAY_CONNECT_PATIENCE_ENV, "300")
    assert timeouts.ray_connect_patience() == 300.0
    monkeypatch.setenv(timeouts.RAY_CONNECT_PATIENCE_ENV, "0")  # never switched off by a typo or a zero
    assert timeouts.ray_connect_patience() == 120.0


@pytest.mark.parametrize("address, patience", [("ray://127.0.0.1:1", 120.0), ("127.0.0.1:6379", 0.0)])
def test_a_runs_session_connects_with_the_patience_only_through_the_ray_client(monkeypatch, address, patience):
    """`ray_session` gives its first connection the patience when it goes through ``ray://`` (a driver joining
    with the GCS address gets Ray's own behaviour)."""
    from flows.runtime import timeouts

    monkeypatch.delenv(timeouts.RAY_CONNECT_PATIENCE_ENV, raising=False)
    seen = []
    monkeypatch.setattr(ray_fanout, "_connect", lambda ray, a, env, patience=0.0: seen.append((a, patience)))
    # Another test of this worker may hold a Ray session: this one must neither see it nor shut it down.
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: None)
    with ray_fanout.ray_session(address) as kind:
        assert kind == "cluster"
    assert seen == [(address, patience)]


# ------------------------------------------------------------------ the local Ray's start (embedded mode)

NODE_TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                         "failed to startup or the GCS has become overloaded.")


class FakeLocalRay:
    """A stand-in for the ``ray`` module's local start: raises ``errors`` first, records each start's folder."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors, self.temp_dirs, self.shutdowns, self.stopped = list(errors), [], 0, []

    def init(self, **kwargs) -> None:
        self.temp_dirs.append(kwargs["_temp_dir"])
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def local_ray(monkeypatch):
    import sys

    def make(errors):
        fake = FakeLocalRay(errors)
        monkeypatch.setitem(sys.modules, "ray", fake)
        monkeypatch.setattr("flows.runtime.watchdog.register_cleanup", lambda path: None)
        monkeypatch.setattr(ray_fanout, "_prepare_local_auth", lambda: None)  # no token left in os.environ
        monkeypatch.setattr("flows.runtime.watchdog.stop_users_of", fake.stopped.append)
        return fake
    return make


def test_a_local_ray_whose_node_did_not_register_in_time_is_started_again_in_a_fresh_folder(local_ray, caplog):
    import os

    ray = local_ray([NODE_TIMEOUT, NODE_TIMEOUT])
    with ray_fanout._local_ray(1, {}):
        assert len(ray.temp_dirs) == ray_fanout.LOCAL_START_ATTEMPTS
    assert len(set(ray.temp_dirs)) == 3 and not any(os.path.exists(d) for d in ray.temp_dirs)  # each removed
    assert ray.shutdowns == 3  # after each failed start, and at the end
    assert ray.stopped == ray.temp_dirs[:2]  # what each failed start left in its folder is stopped
    assert sum("did not start (attempt" in r.getMessage() for r in caplog.records) == 2


def test_a_local_ray_that_never_starts_raises_rays_error_and_other_errors_are_not_retried(local_ray):
    ray = local_ray([NODE_TIMEOUT] * ray_fanout.LOCAL_START_ATTEMPTS)
    with pytest.raises(Exception, match="timed out during startup"), ray_fanout._local_ray(1, {}):
        pass
    assert len(ray.temp_dirs) == ray_fanout.LOCAL_START_ATTEMPTS
    ray = local_ray([ValueError("bad argument")])
    with pytest.raises(ValueError, match="bad argument"), ray_fanout._local_ray(1, {}):
        pass
    assert len(ray.temp_dirs) == 1


def test_an_error_inside_the_local_ray_session_is_not_a_restart(local_ray):
    ray = local_ray([])
    with pytest.raises(RuntimeError, match="in the block"), ray_fanout._local_ray(1, {}):
        raise RuntimeError("in the block")
    assert len(ray.temp_dirs) == 1 and ray.shutdowns == 1


def test_stop_users_of_stops_the_processes_naming_a_folder_and_no_other(tmp_path):
    import subprocess
    import sys

    from flows.runtime.watchdog import stop_users_of

    code = "import time, sys; time.sleep(120)"
    user = subprocess.Popen([sys.executable, "-c", code, f"--temp-dir={tmp_path}/session"])
    other = subprocess.Popen([sys.executable, "-c", code, f"--temp-dir={tmp_path}-other/session"])
    try:
        assert stop_users_of(tmp_path) == 1
        assert user.wait(timeout=60) != 0 and other.poll() is None  # bounds a hang only
    finally:
        for p in (user, other):
            p.kill()
            p.wait()
