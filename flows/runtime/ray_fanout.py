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
  through ``runtime_env`` (Prefect API URL, telemetry off, the code path), and storage
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
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

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


def worker_env() -> dict[str, str]:
    """Environment variables every Ray worker of a run gets through ``runtime_env``."""
    env = dict(_TELEMETRY_OFF)
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


@contextlib.contextmanager
def _local_ray(num_cpus: int | None, runtime_env: dict) -> Iterator[None]:
    """An in-process local Ray on 127.0.0.1 with its own temporary folder (removed after)."""
    import ray

    from flows.runtime.watchdog import graceful_sigterm, register_cleanup

    _prepare_local_auth()
    temp_dir = tempfile.mkdtemp(prefix="cjeray")  # short: Ray's socket paths have a length limit
    register_cleanup(temp_dir)  # starts the watchdog: Ray's processes die with this one
    log.info("starting a local Ray")
    try:
        with graceful_sigterm(), _loopback_only():
            ray.init(num_cpus=num_cpus, include_dashboard=False, dashboard_host="127.0.0.1",
                     _node_ip_address="127.0.0.1", _temp_dir=temp_dir, runtime_env=runtime_env,
                     log_to_driver=False, logging_level=logging.WARNING)
            try:
                yield
            finally:
                ray.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


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
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=False,
                 logging_level=logging.WARNING)
        try:
            yield "cluster"
        finally:
            ray.shutdown()
        return
    with _local_ray(num_cpus, runtime_env):
        yield "local"


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
    (not re-serialised per task).  Worker deaths are retried by Ray ``max_retries``
    times; a Python exception raised by ``fn`` is re-raised as itself (not wrapped).
    """
    import ray
    from ray.exceptions import RayTaskError

    remote = ray.remote(fn).options(max_retries=max_retries, retry_exceptions=False,
                                    num_cpus=num_cpus, name=name or fn.__name__)
    if shared is not None:
        ref = ray.put(shared)
        refs = [remote.remote(ref, *a) for a in args]
    else:
        refs = [remote.remote(*a) for a in args]
    try:
        return ray.get(refs)
    except RayTaskError as exc:
        # The other tasks are left to finish (their results are dropped): ray.cancel of
        # tasks racing their completion crashed the driver in Ray 2.60 (a failed
        # CHECK in TaskManager::CompletePendingTask aborts the process).
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise


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
                policies: list[str] | None):
    """Read some partition files on a worker; storage settings arrive explicitly."""
    from flows.storage.logs import read_window
    from flows.storage.objects import Storage, StorageConfig

    st = Storage.for_uri(uri, StorageConfig.from_dict(cfg_dict))
    return read_window(st, keys, columns=columns, policies=policies)


def remote_bootstrap(prep, start: int, stop: int):
    """Bootstrap replicates ``start..stop-1`` (deterministic in ``(seed, b)``)."""
    from cje_engine.pipeline.direct import bootstrap_chunk

    return bootstrap_chunk(prep, start, stop)
