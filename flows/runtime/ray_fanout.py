"""Ray start-up and fan-out helpers.

* `ray_session` connects to ``RAY_ADDRESS`` (a cluster) when it is set, otherwise starts
  an in-process local Ray for the duration of the block.  A Ray that is already
  initialised by the caller is reused and left running.
* Token authentication: Ray 2.60 turns token auth on by default for a new local cluster
  and, if no token exists, writes one to ``~/.ray/auth_token``.  For the embedded local
  Ray we set ``RAY_AUTH_MODE=token`` and a fresh per-run ``RAY_AUTH_TOKEN`` in the
  environment instead (highest precedence in Ray's token lookup, inherited by the
  raylet and workers, never written to disk or logged).  To join a cluster, set
  ``RAY_ADDRESS`` plus the cluster's ``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN`` (or
  ``RAY_AUTH_TOKEN_PATH``); nothing is generated then.
* Workers do not inherit the driver's environment on a cluster: `worker_env` is shipped
  through ``runtime_env`` (Prefect API URL, telemetry off, the code path, the allocators'
  settings: `WORKER_ALLOCATOR_ENV`), and storage
  settings travel as explicit task arguments (``StorageConfig.to_dict``), never through
  the environment.
* The embedded local Ray listens on 127.0.0.1 only (GCS, raylet, agents, driver, workers):
  Ray turns a loopback ``node_ip_address`` into the machine's address unless it runs in its
  single-machine mode, which `_loopback_only` switches on for the session (Ray's
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, inherited by the processes Ray starts).  Its
  temporary folder is the session's own and is removed afterwards; if `cje` is killed, its
  watchdog stops Ray's processes and removes the folder (`flows.runtime.watchdog`).
* `map_ordered` submits one task per argument tuple with Ray task retries (a worker
  killed mid-task is re-run elsewhere) and returns results in submission order, with
  a task's own exception re-raised unwrapped (so a `CJEInputError` keeps its message).
* `put_shared` puts the object every task shares (the prepared state) into the cluster
  once.  Through the Ray Client (``ray://``) ``ray.put`` streams it over the client's gRPC
  data channel (chunked, pickled twice, buffered on both ends: 52.8 s instead of 22.9 s for
  the 10M-row bootstrap stage, docs/scaling.md).  Large objects therefore go straight into
  the cluster instead: a zero-CPU receiver actor on the head node listens on a TCP port,
  the driver sends the pickle-5 frame and its out-of-band buffers (the numpy arrays,
  without copying them) with a one-time token, and the actor returns the object, which Ray
  stores in the head node's object store, owned by this driver.  The tasks get that
  reference; the driver never holds a second copy.  If the node cannot be reached (a
  firewall between the flow runner and the Ray pods) it falls back to ``ray.put``.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import os
import pickle
import secrets
import socket
import struct
import time
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from flows.runtime.timeouts import RAY_GET_TIMEOUT_ENV, RayTimeoutError, ray_connect_patience, ray_get_timeout

log = logging.getLogger(__name__)

#: Root of the source tree holding `flows` and `cje_engine` (added to workers' path).
CODE_ROOT = Path(__file__).resolve().parents[2]

#: Ray retries of a task whose worker process died (system failures, not exceptions).
DEFAULT_MAX_RETRIES = 3

_TELEMETRY_OFF = {
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


def chunk_ranges(n: int, n_chunks: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into at most ``n_chunks`` contiguous, nearly equal ranges.

    >>> chunk_ranges(10, 3)
    [(0, 4), (4, 7), (7, 10)]
    """
    if n <= 0:
        return []
    n_chunks = max(1, min(int(n_chunks), n))
    base, extra = divmod(n, n_chunks)
    out, start = [], 0
    for i in range(n_chunks):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


#: The allocators of every Ray worker of a run, so that a task does not fault back in, page by page, the memory the
#: previous one freed: Arrow's (mimalloc) hands what it frees back to the kernel lazily (``MADV_FREE``: taken when the
#: kernel needs memory, counted as available meanwhile) instead of decommitting it 10 ms later (``MADV_DONTNEED``);
#: glibc's (numpy's arrays) keeps fixed thresholds instead of its dynamic ones: arrays under 32 MiB from the heap,
#: at most 256 MiB of free heap top kept. A sharded reader of a 1M-row file took ~5,000-8,000 page faults in its task
#: so (~0.02-0.07 s of system CPU; ~150-220 with these settings); the numbers are the same (`benchmarks/RESULTS.md`,
#: "The readers' task as Ray runs it and the workers' allocators, round 23"). The driver's own value of a variable
#: wins.
WORKER_ALLOCATOR_ENV = {"MIMALLOC_PURGE_DECOMMITS": "0", "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
                        "MALLOC_TRIM_THRESHOLD_": str(256 * 2**20)}


def worker_env() -> dict[str, str]:
    """Environment variables every Ray worker of a run gets through ``runtime_env``: telemetry off, the Prefect API
    URL, the code path, and the allocators' settings (`WORKER_ALLOCATOR_ENV`, the driver's own values first)."""
    env = dict(_TELEMETRY_OFF)
    env.update({k: os.environ.get(k) or v for k, v in WORKER_ALLOCATOR_ENV.items()})
    api = os.environ.get("PREFECT_API_URL")
    if api:
        env["PREFECT_API_URL"] = api
    paths = [str(CODE_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _prepare_local_auth() -> None:
    """Per-run token for an embedded local Ray (see module docstring).

    Only the token is put in the environment: ``ray.init`` itself then switches the new
    local cluster to token mode (and refreshes its cached config), finds the token in
    ``RAY_AUTH_TOKEN`` and therefore writes nothing to ``~/.ray``.  An explicit
    ``RAY_AUTH_MODE`` (``disabled`` or ``token``) is respected.
    """
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _loopback_only() -> Iterator[None]:
    """Ray's single-machine mode for the block: every Ray server binds 127.0.0.1."""
    from ray._private import ray_constants

    old_env, old_flag = os.environ.get(_LOCAL_ONLY_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_LOCAL_ONLY_ENV] = "0"  # read by the processes Ray starts
    ray_constants.ENABLE_RAY_CLUSTER = False  # read by this process (imported before the env was set)
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_flag
        if old_env is None:
            os.environ.pop(_LOCAL_ONLY_ENV, None)
        else:
            os.environ[_LOCAL_ONLY_ENV] = old_env


#: Starts of a local Ray tried when its node does not register in time (Ray waits a fixed 30 s for it).
LOCAL_START_ATTEMPTS = 3
_START_TIMEOUT = "timed out during startup"


@contextlib.contextmanager
def _local_ray(num_cpus: int | None, runtime_env: dict) -> Iterator[None]:
    """An in-process local Ray on 127.0.0.1 with its own temporary folder (removed after)."""
    import ray

    from flows.runtime.watchdog import graceful_sigterm

    _prepare_local_auth()
    with graceful_sigterm(), _loopback_only():
        temp_dir = _start_local_ray(ray, num_cpus, runtime_env)
        try:
            yield
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


def _start_local_ray(ray: Any, num_cpus: int | None, runtime_env: dict) -> str:
    """``ray.init`` of a local Ray in a fresh temporary folder; returns the folder.

    Ray gives its node a fixed 30 s to register ("The current node timed out during startup"), which a loaded
    machine can exceed (seen in CI's service tier at a load of ~10 on 2 cores: a ``cje run`` failed with exit
    69).  Such a start is tried again, in a fresh folder, ``LOCAL_START_ATTEMPTS`` times in all.  A failed start
    is shut down, what it left running in its folder stopped and the folder removed; any other error is raised.
    """
    from flows.runtime.watchdog import register_cleanup, stop_users_of

    attempt = 1
    while True:
        temp_dir = tempfile.mkdtemp(prefix="cjeray")  # short: Ray's socket paths have a length limit
        register_cleanup(temp_dir)  # starts the watchdog: Ray's processes die with this one
        log.info("starting a local Ray")
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, dashboard_host="127.0.0.1",
                     _node_ip_address="127.0.0.1", _temp_dir=temp_dir, runtime_env=runtime_env,
                     log_to_driver=False, logging_level=logging.WARNING)
            return temp_dir
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this timeout
            with contextlib.suppress(Exception):
                ray.shutdown()
            stop_users_of(temp_dir)  # the failed node's GCS, raylet or agents, if any are left
            shutil.rmtree(temp_dir, ignore_errors=True)
            if _START_TIMEOUT not in str(exc) or attempt == LOCAL_START_ATTEMPTS:
                raise
            log.warning("the local Ray did not start (attempt %d of %d): %s; starting it again", attempt,
                        LOCAL_START_ATTEMPTS, exc)
            attempt += 1


#: Attempts and pauses (s) for a Ray Client connection whose server failed to start.
CLIENT_INIT_ATTEMPTS, CLIENT_INIT_PAUSE = 3, 2.0
#: Longest pause (s) between two attempts of a connection that timed out.
CLIENT_PAUSE_MAX = 30.0


def _connect(ray: Any, address: str, runtime_env: dict, patience: float = 0.0) -> None:
    """``ray.init`` on a cluster; a Ray Client connection is retried when its server failed to start, and,
    for ``patience`` s, when it timed out.

    Through ``ray://`` the head's proxier spawns one server process per client connection, and that
    spawn can fail transiently (seen once in CI under load: "Initialization failure from server ...
    Starting Ray client server failed"); the proxier frees the port and the next connection starts a
    fresh one. That error is retried (``CLIENT_INIT_ATTEMPTS`` in all, ``CLIENT_INIT_PAUSE`` s apart,
    doubling).

    A connection that timed out (Ray raises a plain `ConnectionError`, "ray client connection timeout",
    after ~35 s without an answer from the client port: a head being relaunched, or a client server
    starved of CPU) is tried again, the pauses doubling up to ``CLIENT_PAUSE_MAX`` s, as long as an
    attempt can start before ``patience`` s have passed since the first; then it is raised, so a run
    that cannot reach its cluster still ends (failed) and frees its slot.  Anything else (a wrong
    address's ``ValueError``, a refused or aborted connection) is raised at once.
    """
    _forget_lost_client(ray, address)
    t0 = time.monotonic()
    pause, failed_starts, timeouts = CLIENT_INIT_PAUSE, 0, 0
    while True:
        try:
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=False, logging_level=logging.WARNING)
            if timeouts:
                log.warning("connected to the Ray Client at %s after %d timed-out attempt(s), %.0f s", address,
                            timeouts, time.monotonic() - t0)
            return
        except ConnectionAbortedError as exc:
            failed_starts += 1
            if "Initialization failure from server" not in str(exc) or failed_starts == CLIENT_INIT_ATTEMPTS:
                raise
            log.warning("Ray Client at %s: its server failed to start (attempt %d of %d), retrying in %.0f s: %s",
                        address, failed_starts, CLIENT_INIT_ATTEMPTS, pause, str(exc).splitlines()[-1][:200])
        except ConnectionError as exc:
            # exactly ConnectionError: Ray's client timeout (its subclasses, refused or reset, are other faults)
            if type(exc) is not ConnectionError or time.monotonic() - t0 + pause > patience:
                raise
            timeouts += 1
            log.warning("Ray Client at %s did not answer (attempt %d, %.0f s of %.0f s patience), retrying in "
                        "%.0f s: %s", address, timeouts, time.monotonic() - t0, patience, pause, exc)
        with contextlib.suppress(Exception):
            ray.shutdown()
        time.sleep(pause)
        pause = min(pause * 2, CLIENT_PAUSE_MAX)


def _forget_lost_client(ray: Any, address: str) -> None:
    """Drop a Ray Client connection that was lost (its head died or restarted) before connecting again.

    The client keeps the dead connection registered, and the next ``ray.init("ray://...")`` of the same
    process (a retried task) then failed with "The client has already connected to the cluster with
    allow_multiple=True", which names neither the cluster nor the lost head.
    """
    if not str(address).startswith("ray://"):
        return
    from ray.util import client as ray_client

    if ray_client.num_connected_contexts() > 0 and not ray_client.ray.is_connected():
        log.warning("the Ray Client connection to %s was lost (head down or restarted); connecting again", address)
        with contextlib.suppress(Exception):
            ray_client.ray.disconnect()


#: The cluster session `ray_session` opened (address and runtime env), for `reconnect_if_lost`.
_SESSION: dict[str, Any] = {}


class RayConnectionLost(ConnectionError):
    """The Ray Client connection of the session was lost (head down or restarted) and could not be made again."""


def reconnect_if_lost() -> bool:
    """Connect again when the session's Ray Client connection was lost (its head died or restarted).

    A task retried inside `ray_session` after the head was lost otherwise reached Ray's auto-init, which
    failed with "The client has already connected to the cluster with allow_multiple=True" (naming neither
    the cluster nor the lost head).  Returns True when it reconnected.

    Raises
    ------
    RayConnectionLost
        The connection was lost and connecting again failed (the head is still down): names the address.
    """
    address = _SESSION.get("address")
    if not address or not str(address).startswith("ray://"):
        return False
    import ray
    from ray.util import client as ray_client

    if ray_client.num_connected_contexts() == 0 or ray_client.ray.is_connected():
        return False
    try:
        _connect(ray, address, _SESSION.get("runtime_env") or {})
    except Exception as exc:  # noqa: BLE001 - any failure to connect: the cluster is unreachable
        raise RayConnectionLost(f"the Ray cluster at {address} was lost (head down or restarted) and connecting "
                                f"again failed: {type(exc).__name__}: {str(exc)[:300]}") from exc
    log.warning("connected again to the Ray cluster at %s after its connection was lost", address)
    return True


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None) -> Iterator[str]:
    """Ray for the duration of the block.

    Parameters
    ----------
    address : str, optional
        Cluster address; defaults to ``RAY_ADDRESS``.  Neither set: a local in-process Ray.
    num_cpus : int, optional
        CPUs of the local Ray (ignored when connecting to a cluster).

    Yields
    ------
    str
        ``"existing"``, ``"cluster"`` or ``"local"``.
    """
    import ray

    if ray.is_initialized():
        yield "existing"
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    runtime_env = {"env_vars": worker_env()}
    if address:
        log.info("connecting to the Ray cluster at %s", address)
        _connect(ray, address, runtime_env, patience=ray_connect_patience() if str(address).startswith("ray://")
                 else 0.0)
        _SESSION.update(address=address, runtime_env=runtime_env)
        try:
            yield "cluster"
        finally:
            _SESSION.clear()
            ray.shutdown()
        return
    with _local_ray(num_cpus, runtime_env):
        yield "local"


def task_error_cause(exc: BaseException) -> BaseException | None:
    """The exception a failed Ray task raised (a `ray.exceptions.RayTaskError`'s ``cause``), or None when Ray kept
    none: re-raised as itself, a task's error reaches the caller unwrapped (`map_ordered`)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else None


def map_ordered(
    fn: Callable[..., Any],
    args: Sequence[tuple],
    *,
    shared: Any = None,
    max_retries: int = DEFAULT_MAX_RETRIES,
    num_cpus: float = 1,
    name: str | None = None,
) -> list[Any]:
    """Run ``fn(*a)`` (or ``fn(shared, *a)``) as Ray tasks, results in order.

    ``shared`` is put into the object store once and handed to every task by reference
    (not re-serialised per task); a function with a ``ship`` attribute gets ``fn.ship(shared)``
    instead (`remote_bootstrap`: the compact bootstrap view, not the whole prepared state).
    Worker deaths are retried by Ray ``max_retries`` times; a Python exception raised by ``fn``
    is re-raised as itself (not wrapped).  The wait for the results is bounded by
    `flows.runtime.timeouts.ray_get_timeout` (``CJE_RAY_GET_TIMEOUT``): past it `RayTimeoutError`
    names the tasks, how many finished and the setting (the unfinished tasks are left to end by
    their own storage timeouts).
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayTaskError

    reconnect_if_lost()  # a retried task after the head was lost
    remote = ray.remote(fn).options(max_retries=max_retries, retry_exceptions=False,
                                    num_cpus=num_cpus, name=name or fn.__name__)
    receiver = None
    if shared is not None:
        ship = getattr(fn, "ship", None)
        ref, receiver = put_shared(shared if ship is None else ship(shared))
        refs = [remote.remote(ref, *a) for a in args]
    else:
        refs = [remote.remote(*a) for a in args]
    limit = ray_get_timeout()
    try:
        return ray.get(refs, timeout=limit)
    except GetTimeoutError:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        raise RayTimeoutError(f"Ray tasks {name or fn.__name__!r}: {len(refs) - len(done)} of {len(refs)} did not "
                              f"finish within {limit:g} s ({RAY_GET_TIMEOUT_ENV})") from None
    except RayTaskError as exc:
        # The other tasks are left to finish (their results are dropped): ray.cancel of
        # tasks racing their completion crashed the driver in Ray 2.60 (a failed
        # CHECK in TaskManager::CompletePendingTask aborts the process).
        cause = task_error_cause(exc)
        if cause is not None:
            raise cause from None
        raise
    finally:
        if receiver is not None:  # its result stays in the object store (owned by the driver)
            with contextlib.suppress(Exception):
                ray.kill(receiver)


# --------------------------------------------------------------------------------------
# shared state: straight into the cluster when the driver is a Ray Client

#: Shared objects whose pickled size reaches this go into the cluster through `_Receiver`
#: when the driver is a Ray Client (smaller ones: ``ray.put``).  ``CJE_RAY_DIRECT_PUT_MIN_BYTES``
#: overrides it (the stack tests set 1, so every bootstrap takes the direct path).
DIRECT_PUT_MIN_BYTES = 32 * 2**20

#: Seconds the receiver waits for the driver's connection and each read.
DIRECT_PUT_TIMEOUT = 300.0

_TOKEN_BYTES = 32


def is_client() -> bool:
    """True when this process is connected to a cluster through the Ray Client (``ray://``)."""
    try:
        from ray.util.client import ray as client_ray

        return bool(client_ray.is_connected())
    except Exception:  # noqa: BLE001 - no client support: not a client
        return False


def _pickle5(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle protocol 5 with out-of-band buffers (numpy arrays are referenced, not copied)."""
    from ray import cloudpickle  # handles what the stdlib pickler cannot (local classes)

    buffers: list[pickle.PickleBuffer] = []
    main = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return main, buffers


def _head_strategy() -> Any:
    """Soft affinity to the head node (its object store then holds the shared state)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in (node.get("Resources") or {}):
            return NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=True)
    return "DEFAULT"


def put_shared(obj: Any) -> tuple[Any, Any]:
    """Put ``obj`` into the cluster once; returns ``(object_ref, receiver_actor_or_None)``.

    In a driver inside the cluster (or a local Ray) this is ``ray.put``.  Through the Ray
    Client, objects of at least `DIRECT_PUT_MIN_BYTES` travel over a direct TCP connection
    to a receiver actor on the head node (module docstring); the caller kills the actor
    (``ray.kill``) when the tasks are done: the object itself stays.
    """
    import ray

    if not is_client():
        return ray.put(obj), None
    main, buffers = _pickle5(obj)
    raws = [b.raw() for b in buffers]
    total = len(main) + sum(r.nbytes for r in raws)
    threshold = int(os.environ.get("CJE_RAY_DIRECT_PUT_MIN_BYTES") or DIRECT_PUT_MIN_BYTES)
    if total < threshold:
        return ray.put(obj), None
    t0 = time.perf_counter()
    token = secrets.token_bytes(_TOKEN_BYTES)
    actor = ray.remote(_Receiver).options(num_cpus=0, max_restarts=0, name=None,
                                          scheduling_strategy=_head_strategy()).remote(token)
    try:
        host, port = ray.get(actor.address.remote(), timeout=120)
        ref = actor.receive.remote()
        _send_frames((host, port), token, main, raws)
    except Exception as exc:  # noqa: BLE001 - unreachable node: the client's own channel
        log.warning("direct transfer into the cluster failed (%s: %s); using ray.put through the "
                    "Ray Client", type(exc).__name__, exc)
        with contextlib.suppress(Exception):
            ray.kill(actor)
        return ray.put(obj), None
    log.info("shared state (%.0f MB) sent into the cluster directly in %.2f s", total / 1e6,
             time.perf_counter() - t0)
    return ref, actor


def _send_frames(addr: tuple[str, int], token: bytes, main: bytes, raws: list[memoryview]) -> None:
    """Token, a header of sizes, the pickle frame and every buffer; waits for the ack."""
    sizes = [len(main)] + [r.nbytes for r in raws]
    header = struct.pack(f"!Q{len(sizes)}Q", len(sizes), *sizes)
    with socket.create_connection(addr, timeout=DIRECT_PUT_TIMEOUT) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(token + header)
        s.sendall(main)
        for r in raws:
            s.sendall(r.cast("B"))
        if _recv_exact(s, 1) != b"\x01":
            raise ConnectionError("the receiver did not acknowledge the shared state")


def _recv_exact(conn: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes from ``conn`` into a fresh buffer (``ConnectionError`` on EOF)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:], min(n - got, 1 << 24))
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


class _Receiver:
    """Ray actor (one per shared object): accepts ONE connection presenting its token."""

    def __init__(self, token: bytes):
        import ray

        self._token = token
        self._host = ray.util.get_node_ip_address()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((self._host, 0))
        self._sock.listen(1)
        self._sock.settimeout(DIRECT_PUT_TIMEOUT)

    def address(self) -> tuple[str, int]:
        return self._host, int(self._sock.getsockname()[1])

    def receive(self) -> Any:
        """The object the driver sends (stored by Ray as this call's result)."""
        conn, _ = self._sock.accept()
        with conn:
            conn.settimeout(DIRECT_PUT_TIMEOUT)
            if not hmac.compare_digest(bytes(_recv_exact(conn, _TOKEN_BYTES)), self._token):
                raise PermissionError("wrong token on the shared-state connection")
            (count,) = struct.unpack("!Q", _recv_exact(conn, 8))
            sizes = struct.unpack(f"!{count}Q", _recv_exact(conn, 8 * count))
            main = _recv_exact(conn, sizes[0])
            buffers = [_recv_exact(conn, n) for n in sizes[1:]]
            obj = pickle.loads(main, buffers=buffers)
            conn.sendall(b"\x01")
        self._sock.close()
        return obj


def cluster_cpus() -> int:
    """CPUs of the connected Ray cluster (1 when unknown)."""
    import ray

    try:
        return max(1, int(ray.cluster_resources().get("CPU", 1)))
    except Exception:  # noqa: BLE001 - not initialised
        return 1


# --------------------------------------------------------------------------------------
# functions that run on Ray workers (this module imports neither Prefect nor heavy deps)


def remote_read(uri: str, cfg_dict: dict, keys: list[str], columns: list[str] | None,
                policies: list[str] | None, mapping: dict[str, str] | None = None):
    """Read some partition files on a worker (columns renamed by ``mapping``); storage settings
    arrive explicitly."""
    from flows.storage.logs import read_window
    from flows.storage.objects import Storage, StorageConfig

    st = Storage.for_uri(uri, StorageConfig.from_dict(cfg_dict))
    return read_window(st, keys, columns=columns, policies=policies, mapping=mapping)


def remote_bootstrap(state, start: int, stop: int):
    """Bootstrap replicates ``start..stop-1`` (deterministic in ``(seed, b)``) of any evaluation mode.

    ``state`` is what `bootstrap_state` ships (a `cje_engine.pipeline.prepared.ReplicateSource`): a
    Direct evaluation's `BootstrapView` (8 bytes a row plus the labelled rows, instead of the ~100
    bytes a row of the prepared state), or the prepared state itself.
    """
    return state.replicates(start, stop)


def bootstrap_state(prep):
    """What the bootstrap tasks receive for a prepared evaluation ``prep``: ``prep.bootstrap_source()``
    (`cje_engine.pipeline.prepared.Prepared`), replicates bit-identical to ``prep``'s own."""
    return prep.bootstrap_source()


remote_bootstrap.ship = bootstrap_state  # type: ignore[attr-defined]  # see map_ordered
