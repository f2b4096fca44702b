"""No Arrow worker outlives the interpreter: `flows.storage.arrow_threads`.

`cje anchors add-scores` aborted (SIGABRT, exit code 134, "terminate called without an active
exception") after its work was done, in 1 of 40 runs on a loaded machine: an Arrow CPU-pool worker
released the Python ``bytes`` behind ``pq.read_table(io.BytesIO(data))`` after the read had returned,
while the interpreter was already finalizing (core dump: ``PyBuffer::~PyBuffer`` ->
``PyGILState_Ensure`` -> ``PyThread_exit_thread`` inside a ``noexcept`` destructor).
"""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv

from flows.storage import arrow_threads
from flows.storage.arrow_threads import arrow_buffer, arrow_task_counters, read_parquet_bytes, wait_for_arrow_threads

REPO = Path(__file__).resolve().parents[2]

# An Arrow IO-pool task (the CSV reader's read-ahead) is inside a read of a Python file object when the
# main thread exits; it returns when the interpreter finalizes (or after 1 s). A finalizer keeps the
# interpreter finalizing for 0.5 s, so without a wait at exit the worker always meets a finalizing
# interpreter and the process aborts; with it the read ends before finalization starts.
_EXIT_SCRIPT = r'''
import io, os, sys, time
import flows.storage  # what every storage user imports (it installs the wait at exit)
import pyarrow.csv as pacsv

class SlowFile(io.RawIOBase):
    def __init__(self, data):
        self.b, self.n = io.BytesIO(data), 0
    def readable(self):
        return True
    def readinto(self, b):
        self.n += 1
        if self.n == 20:  # a read-ahead block after the first batch, on an Arrow IO thread
            end = time.monotonic() + 1.0
            while time.monotonic() < end and not sys.is_finalizing():
                time.sleep(0.01)
            os.write(2, b"read-ahead done\n")
        d = self.b.read(len(b)); b[:len(d)] = d
        return len(d)

class SlowTeardown:
    def __del__(self, write=os.write, sleep=time.sleep):  # module globals are None by then
        sleep(0.5)

data = b"a,b\n" + b"".join(b"%d,%d\n" % (i, i) for i in range(20000))
reader = pacsv.open_csv(SlowFile(data), read_options=pacsv.ReadOptions(block_size=4096))
os.write(2, b"first batch %d\n" % reader.read_next_batch().num_rows)
keep = SlowTeardown()
'''


def test_exit_waits_for_arrow_tasks_holding_python_objects():
    """A process that imported `flows.storage` exits 0 while an Arrow pool task still reads a Python
    file object at exit: it waits for the task before finalizing.

    Deterministic (no repetition needed): on the old code the task always finds the interpreter
    finalizing and the process aborts (exit code 134 / -6, "Fatal Python error: PyGILState_Release",
    10 of 10 runs); the same race in `cje anchors add-scores` was 1 in 40 runs, too rare for a
    subprocess loop in the default tier (about 180 runs of ~4.5 s CPU for a 0.99 chance of failing the
    old code at that rate, and the rate falls with the machine's load). About 1.5 s CPU.
    """
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "first batch" in r.stderr and "read-ahead done" in r.stderr  # the task ran to its end
    assert "Fatal Python error" not in r.stderr and "terminate called" not in r.stderr


def test_arrow_buffer_copies_without_holding_the_python_object():
    """`arrow_buffer` owns its memory: no reference to the Python bytes for an Arrow thread to drop."""
    data = bytes(range(256)) * 8
    before = sys.getrefcount(data)
    buf = arrow_buffer(data)
    assert sys.getrefcount(data) == before  # pa.py_buffer(data) would hold one more
    assert buf.to_pybytes() == data and buf.size == len(data)
    assert arrow_buffer(b"").size == 0 and arrow_buffer(memoryview(data)[8:16]).to_pybytes() == data[8:16]


def test_read_parquet_bytes_round_trip():
    """`read_parquet_bytes` reads what ``pq.write_table`` wrote, options passed through."""
    import pyarrow.parquet as pq

    table = pa.table({"a": list(range(50)), "b": [str(i) for i in range(50)]})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    data = sink.getvalue().to_pybytes()
    assert read_parquet_bytes(data).equals(table)
    assert read_parquet_bytes(data, columns=["b"]).column_names == ["b"]


class _BlockingFile:
    """A Python file whose 20th read (an Arrow read-ahead task) waits for ``release``."""

    def __init__(self, data: bytes, release: threading.Event) -> None:
        import io

        self.b, self.n, self.release, self.closed = io.BytesIO(data), 0, release, False

    def read(self, size: int = -1) -> bytes:
        self.n += 1
        if self.n == 20:
            self.release.wait(60)
        return self.b.read(size)

    def readable(self) -> bool:
        return True


def test_wait_for_arrow_threads_sees_a_running_task():
    """The pool counters are found on this platform and count a task until it has ended."""
    assert len(arrow_task_counters()) == 2  # CPU and IO pools: otherwise the wait at exit is a no-op
    assert wait_for_arrow_threads(timeout=60)  # idle: returns at once; the timeout bounds a hang only
    release = threading.Event()
    data = b"a,b\n" + b"".join(b"%d,%d\n" % (i, i) for i in range(20000))
    reader = pacsv.open_csv(_BlockingFile(data, release), read_options=pacsv.ReadOptions(block_size=4096))
    try:
        assert reader.read_next_batch().num_rows > 0
        assert not wait_for_arrow_threads(timeout=0.2)  # the read-ahead is blocked in Python
    finally:
        release.set()
    assert wait_for_arrow_threads(timeout=60)  # returns once the released task has ended
    assert sum(count() for count in arrow_task_counters()) == 0


def test_cje_entry_point_installs_the_exit_wait(monkeypatch):
    """Every `cje` command runs the wait at exit (also one that imports no storage module itself)."""
    import atexit
    import importlib

    registered = []
    monkeypatch.setattr(arrow_threads, "_installed", False)
    monkeypatch.setattr(atexit, "register", lambda fn, *a, **k: registered.append(fn))
    cli = importlib.import_module("flows.cli.main")
    assert cli.main(["--version"]) == 0
    assert registered == [wait_for_arrow_threads]
    assert cli.main(["--version"]) == 0 and registered == [wait_for_arrow_threads]  # once per process
