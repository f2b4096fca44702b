"""Time limits of the flows' remote calls and runs, so that a hung dependency ends in a final state.

Every remote call has a limit, set explicitly:

* S3 (boto3 and pyarrow): ``CJE_S3_CONNECT_TIMEOUT`` (default 5 s) to open a connection and
  ``CJE_S3_READ_TIMEOUT`` (default 60 s) for each wait for bytes (`flows.storage.s3.client_config`);
* Ray results (``ray.get`` of one fan-out, `flows.runtime.ray_fanout.map_ordered`):
  ``CJE_RAY_GET_TIMEOUT`` (default: the task limit);
* a Prefect task run: ``CJE_TASK_TIMEOUT`` (default 3600 s), ``timeout_seconds`` of every task
  of the flows;
* a Prefect flow run: ``CJE_FLOW_TIMEOUT`` (default 14400 s), ``timeout_seconds`` of every flow;
* a run's first Ray Client connection (`flows.runtime.ray_fanout.ray_session`): Ray's own ~35 s per
  attempt, retried while ``CJE_RAY_CONNECT_PATIENCE`` (default 120 s, longer than a head relaunch
  takes) has not passed, then the run fails.

A run past its limit ends ``Failed`` (Prefect's ``TimedOut``), which releases its concurrency
slot; a ``ray.get`` past its limit raises `RayTimeoutError` naming the tasks and the setting.
The task and flow limits are read when the flows are imported; the Ray limit at each call.
"""
from __future__ import annotations

import logging
import math
import os

log = logging.getLogger(__name__)

TASK_TIMEOUT_ENV = "CJE_TASK_TIMEOUT"
FLOW_TIMEOUT_ENV = "CJE_FLOW_TIMEOUT"
RAY_GET_TIMEOUT_ENV = "CJE_RAY_GET_TIMEOUT"
RAY_CONNECT_PATIENCE_ENV = "CJE_RAY_CONNECT_PATIENCE"

DEFAULT_TASK_TIMEOUT = 3600.0
DEFAULT_FLOW_TIMEOUT = 4 * 3600.0
#: A Ray head relaunched by its supervisor answered again ~60 s after it was killed on the loopback stack
#: (tests/stack, 4 December 2026): twice that.
DEFAULT_RAY_CONNECT_PATIENCE = 120.0


class RayTimeoutError(TimeoutError):
    """Ray tasks did not finish within the configured time (``CJE_RAY_GET_TIMEOUT``)."""


def _seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable ``name``, else ``default``.

    A value that is not a positive finite number is ignored with a warning naming the variable
    (a limit must never be switched off by a typo).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        log.warning("%s=%r is not a positive number of seconds; using %g", name, raw, default)
        return default
    return value


def task_timeout() -> float:
    """Seconds a Prefect task run of the flows may take (``CJE_TASK_TIMEOUT``, default 3600)."""
    return _seconds(TASK_TIMEOUT_ENV, DEFAULT_TASK_TIMEOUT)


def flow_timeout() -> float:
    """Seconds a flow run may take (``CJE_FLOW_TIMEOUT``, default 14400)."""
    return _seconds(FLOW_TIMEOUT_ENV, DEFAULT_FLOW_TIMEOUT)


def ray_get_timeout() -> float:
    """Seconds to wait for the results of one Ray fan-out (``CJE_RAY_GET_TIMEOUT``, default the task limit)."""
    return _seconds(RAY_GET_TIMEOUT_ENV, task_timeout())


def ray_connect_patience() -> float:
    """Seconds a run's first Ray Client connection keeps retrying (``CJE_RAY_CONNECT_PATIENCE``, default 120)."""
    return _seconds(RAY_CONNECT_PATIENCE_ENV, DEFAULT_RAY_CONNECT_PATIENCE)


__all__ = ["RayTimeoutError", "task_timeout", "flow_timeout", "ray_get_timeout", "ray_connect_patience",
           "TASK_TIMEOUT_ENV", "FLOW_TIMEOUT_ENV", "RAY_GET_TIMEOUT_ENV", "RAY_CONNECT_PATIENCE_ENV"]
