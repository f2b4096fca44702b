"""The default run's file scheduling (`tests.xdist_schedule.ClusterFirstScheduling`) on stand-in workers."""
from __future__ import annotations

import pytest

from tests import xdist_schedule
from tests.xdist_schedule import ClusterFirstScheduling


class FakeNode:
    """What the scheduler uses of a pytest-xdist worker: the tests it was sent, and its shutdown."""

    def __init__(self, name: str) -> None:
        self.gateway = type("G", (), {"id": name})()
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True

    def __repr__(self) -> str:
        return self.gateway.id


COLLECTION = (["tests/flows/test_a.py::t1", "tests/flows/test_a.py::t2", "tests/flows/test_b.py::t1"]
              + [f"tests/unit/test_many.py::t{i}" for i in range(30)]
              + ["tests/unit/test_costly.py::t1", "tests/cli/test_small.py::t1"])


@pytest.fixture
def sched(pytestconfig, monkeypatch):
    monkeypatch.setattr(xdist_schedule, "COST", {"tests/unit/test_costly.py": 50.0, "tests/flows/test_b.py": 40.0})
    monkeypatch.setattr(pytestconfig.option, "loadscopereorder", True, raising=False)
    monkeypatch.setattr(pytestconfig.option, "maxworkerrestart", None, raising=False)
    monkeypatch.setattr(pytestconfig.option, "numprocesses", 2, raising=False)
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"], raising=False)
    s = ClusterFirstScheduling(pytestconfig)
    nodes = [FakeNode("gw0"), FakeNode("gw1")]
    for n in nodes:
        s.add_node(n)
        s.add_node_collection(n, COLLECTION)
    return s, nodes


def _files(node) -> list[str]:
    out = []
    for i in node.sent:
        f = COLLECTION[i].split("::")[0]
        if not out or out[-1] != f:
            out.append(f)
    return out


def _finish(sched, node) -> None:
    """The worker runs every test it was sent (one report each), as pytest-xdist reports them."""
    done = 0
    while done < len(node.sent):
        sched.mark_test_complete(node, node.sent[done])
        done += 1


def test_the_flow_files_go_to_one_worker_first_and_the_others_costliest_first(sched):
    s, (a, b) = sched
    s.schedule()
    for _ in range(5):
        for n in (a, b):
            _finish(s, n)
    assert not s.workqueue and s.tests_finished
    files_a, files_b = _files(a), _files(b)
    assert [f for f in files_a + files_b if f.startswith("tests/flows/")] == \
        [f for f in files_a if f.startswith("tests/flows/")]  # no flow file on the second worker
    assert files_a[:2] == ["tests/flows/test_b.py", "tests/flows/test_a.py"]  # its own files first, costliest first
    assert files_b[0] == "tests/unit/test_costly.py"  # 50 s estimated, before the 30 tests of 0.1 s
    assert sorted(a.sent + b.sent) == list(range(len(COLLECTION)))  # every test once


def test_a_worker_with_only_flow_files_left_stops_and_the_other_takes_over_a_crashed_owner(sched):
    s, (a, b) = sched
    s.schedule()
    for _ in range(5):
        _finish(s, b)  # the second worker runs through every file it may take
    assert b.shutting_down and not any(f.startswith("tests/flows/") for f in _files(b))
    s.remove_node(b)
    # the first worker crashes before its flow files are done: a replacement worker runs them
    s.remove_node(a)
    c = FakeNode("gw2")
    s.add_node(c)
    s.add_node_collection(c, COLLECTION)
    s.schedule()
    for _ in range(5):
        _finish(s, c)
    assert not s.workqueue
    assert "tests/flows/test_a.py" in _files(c) or "tests/flows/test_a.py" in _files(a)
