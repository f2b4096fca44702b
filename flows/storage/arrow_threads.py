"""Arrow's thread pools and the end of the process: no Arrow worker may touch Python while it finalizes.

Arrow runs Parquet decoding on its CPU pool and reads (pre-buffering, read-ahead) on its IO pool. A
task of those pools that holds a Python object (the ``bytes`` behind ``pq.read_table(io.BytesIO(data))``
is wrapped zero-copy as an ``arrow::py::PyBuffer``; a Python file object as a ``PythonFile``) takes the
GIL to drop its reference when the task's closure is destroyed, which happens on the worker *after*
the future the caller waits on has completed. If the main thread reaches interpreter finalization
first, Python 3.11 ends the worker with ``pthread_exit`` inside that (``noexcept``) destructor:
``terminate called without an active exception``, SIGABRT, exit code 134, after all the work was
done (`cje anchors add-scores` did so in 1 of 40 runs on a loaded machine; core dump: a CPU-pool
worker in ``PyBuffer::~PyBuffer`` -> ``PyGILState_Ensure`` -> ``PyThread_exit_thread``).

Two measures, each sufficient for the path seen:

* `arrow_buffer` copies bytes into Arrow-owned memory, so what the readers hand to Arrow's pools
  holds no Python object (`read_parquet_bytes` uses it; so do the label and publication readers).
* `wait_for_arrow_threads`, run at exit (`install_exit_wait`, called by the `cje` entry point and by
  the import of `flows.storage`), waits until neither pool runs or queues a task, so any other
  Python object an Arrow task holds is released while the interpreter is still whole. The wait is
  bounded (a task stuck on a dead connection does not hold the exit for longer than ``timeout``).
"""
from __future__ import annotations

import atexit
import ctypes
import glob
import logging
import os
import sys
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

#: Itanium-ABI (Linux, macOS) names of the accessors of Arrow's global pools and of
#: ``ThreadPool::GetNumTasks()`` (tasks queued or running; a task counts until its closure is destroyed).
_POOL_GETTERS = ("_ZN5arrow8internal16GetCpuThreadPoolEv", "_ZN5arrow2io8internal15GetIOThreadPoolEv")
_NUM_TASKS = "_ZN5arrow8internal10ThreadPool11GetNumTasksEv"

#: Seconds the exit waits at most for Arrow's pools (`wait_for_arrow_threads`).
EXIT_WAIT_SECONDS = 10.0

_installed = False


def arrow_buffer(data: bytes | bytearray | memoryview) -> Any:
    """A copy of ``data`` in Arrow-owned memory (a ``pyarrow.Buffer`` that references no Python object).

    Parameters
    ----------
    data : bytes, bytearray or memoryview
        The bytes to copy (e.g. an object read from storage).

    Returns
    -------
    pyarrow.Buffer
        Readers given ``pa.BufferReader(arrow_buffer(data))`` never need the GIL to release it, on
        whatever Arrow thread that happens.
    """
    import pyarrow as pa

    view = memoryview(data).cast("B")
    buf = pa.allocate_buffer(view.nbytes)
    if view.nbytes:
        memoryview(buf).cast("B")[:] = view
    return buf


def read_parquet_bytes(data: bytes | bytearray | memoryview, **kwargs: Any) -> Any:
    """``pq.read_table`` of a Parquet file held in memory, through an Arrow-owned copy (`arrow_buffer`).

    Parameters
    ----------
    data : bytes, bytearray or memoryview
        The Parquet file's bytes.
    **kwargs
        Passed to ``pyarrow.parquet.read_table`` (``columns``, ``schema``, ...).

    Returns
    -------
    pyarrow.Table
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(arrow_buffer(data)), **kwargs)


def _library() -> ctypes.CDLL | None:
    """The libarrow that ``pyarrow`` loaded (dlopen of a loaded library returns it), or None."""
    pa = sys.modules.get("pyarrow")
    if pa is None:
        return None
    for folder in pa.get_library_dirs():
        for path in sorted(glob.glob(os.path.join(folder, "libarrow.so.*")) +
                           glob.glob(os.path.join(folder, "libarrow.*.dylib"))):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def arrow_task_counters() -> list[Callable[[], int]]:
    """Callables returning the number of tasks queued or running in Arrow's CPU and IO pools.

    Returns
    -------
    list of callables
        Empty when pyarrow is not imported or its library does not export the accessors (another ABI,
        a static build): `wait_for_arrow_threads` then returns at once.
    """
    lib = _library()
    if lib is None:
        return []
    try:
        num_tasks = getattr(lib, _NUM_TASKS)
        getters = [getattr(lib, name) for name in _POOL_GETTERS]
    except AttributeError:
        return []
    num_tasks.restype, num_tasks.argtypes = ctypes.c_int, [ctypes.c_void_p]
    counters: list[Callable[[], int]] = []
    for get in getters:
        get.restype, get.argtypes = ctypes.c_void_p, []
        pool = get()
        if pool:
            counters.append(lambda pool=pool: int(num_tasks(pool)))
    return counters


def wait_for_arrow_threads(timeout: float = EXIT_WAIT_SECONDS, poll: float = 0.002) -> bool:
    """Wait until Arrow's CPU and IO pools run and queue no task (their closures destroyed).

    Parameters
    ----------
    timeout : float
        Seconds to wait at most.
    poll : float
        Seconds between two looks (the GIL is released meanwhile, so a task needing it can finish).

    Returns
    -------
    bool
        True when both pools are idle (or pyarrow is not loaded), False when ``timeout`` passed first
        (logged as a warning: a task still holding a Python object can then still abort the exit).
    """
    counters = arrow_task_counters()
    deadline = time.monotonic() + timeout
    while True:
        busy = sum(count() for count in counters)
        if not busy:
            return True
        if time.monotonic() >= deadline:
            log.warning("Arrow still runs %d task(s) after %.0f s; exiting without waiting for them",
                        busy, timeout)
            return False
        time.sleep(poll)


def install_exit_wait() -> None:
    """Run `wait_for_arrow_threads` at interpreter exit (once per process, whoever calls this).

    ``atexit`` handlers run before Python starts finalizing, while a worker can still take the GIL;
    handlers run last-registered first, so this one runs before pyarrow's own S3 finalization when
    it is installed after ``pyarrow.fs`` was imported (as `flows.storage` does).
    """
    global _installed
    if not _installed:
        atexit.register(wait_for_arrow_threads)
        _installed = True
