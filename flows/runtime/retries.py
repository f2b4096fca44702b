"""The one retry policy of the flows' tasks: retry storage and infrastructure failures with
backoff, never bad data.

An exception is final (not retried) when it is a `CJEInputError` (bad input: retrying reads
the same bad bytes) or carries ``retryable = False`` (e.g. a lost optimistic-concurrency
race that the caller resolves itself).
"""
from __future__ import annotations

from typing import Any

from prefect.cache_policies import NO_CACHE

from cje_engine.errors import CJEInputError

from flows.runtime.timeouts import task_timeout

#: Default backoff (seconds) between retries of storage steps.
DEFAULT_RETRY_DELAYS: tuple[float, ...] = (2.0, 10.0, 30.0)


def is_retryable(exc: BaseException | Any) -> bool:
    """False for bad input and for exceptions marked ``retryable = False``."""
    if isinstance(exc, CJEInputError):
        return False
    return getattr(exc, "retryable", True) is not False


def retry_unless_bad_input(task_: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry unless the failure is final (`is_retryable`)."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - cannot tell: retry
        return True
    return is_retryable(exc)


def storage_task_options(delays: tuple[float, ...] | list[float] = DEFAULT_RETRY_DELAYS) -> dict[str, Any]:
    """``@task`` keywords of a step that touches storage: retries with ``delays`` backoff."""
    return dict(retries=len(delays), retry_delay_seconds=list(delays) or [0.0],
                retry_condition_fn=retry_unless_bad_input, cache_policy=NO_CACHE, timeout_seconds=task_timeout())


#: ``@task`` keywords of a pure computation (no retries: it would compute the same again).
PURE_TASK: dict[str, Any] = dict(cache_policy=NO_CACHE, timeout_seconds=task_timeout())

#: ``timeout_seconds`` of every task (``CJE_TASK_TIMEOUT``), see `flows.runtime.timeouts`; flows get
#: theirs (``CJE_FLOW_TIMEOUT``) from `flows.runtime.guard`.
TASK_TIMEOUT: dict[str, Any] = dict(timeout_seconds=task_timeout())

__all__ = ["DEFAULT_RETRY_DELAYS", "is_retryable", "retry_unless_bad_input", "storage_task_options", "PURE_TASK",
           "TASK_TIMEOUT"]
