"""The ``refresh_pages`` step: rebuild the results index and an evaluation's trend page after a step that
changes what they show without publishing a run (label requests raised or answered, a drift look).

Publishing a run rebuilds them too (`flows.storage.publish`); this step covers the rest, so the pages agree
with ``cje requests status``, ``cje runs`` and the drift state at once, not at the next publish. A failure
here is logged and returned, never fails the flow (the pages are rebuilt by the next step or publish).
"""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from flows.reports.history import evaluations
from flows.reports.trend import write_pages
from flows.storage.objects import Storage

__all__ = ["refresh_pages", "rebuild_pages"]


def rebuild_pages(results_uri: str, cfg: Any, evaluation: str | None, *, requests_uri: str | None = None,
                  labels_uri: str | None = None, drift_uri: str | None = None) -> dict[str, str]:
    """Rebuild ``results/index.html`` and ``results/<evaluation>/trend.html`` under ``results_uri``.

    Parameters
    ----------
    results_uri : str
        The results root (where runs are published and the pages live).
    cfg : StorageConfig or None
    evaluation : str or None
        The evaluation whose trend page changed (None: every evaluation's).
    requests_uri, labels_uri, drift_uri : str, optional
        Where the evaluation's label requests, label store and drift looks live when not under
        ``results_uri``.

    Returns
    -------
    dict
        Page key -> location; empty when nothing is published under ``results_uri`` (no page is created).
    """
    st = Storage.for_uri(results_uri, cfg)
    if not evaluations(st) or (evaluation is not None and evaluation not in evaluations(st)):
        return {}

    def other(uri: str | None) -> Storage | None:
        return Storage.for_uri(uri, cfg) if uri and uri != results_uri else None

    return write_pages(st, evaluation, requests_st=other(requests_uri), labels_st=other(labels_uri),
                       drift_st=other(drift_uri))


@task(name="refresh_pages", retries=1, retry_delay_seconds=[1.0], cache_policy=NO_CACHE)
def _refresh(results_uri: str, cfg: Any, evaluation: str | None, requests_uri: str | None, labels_uri: str | None,
             drift_uri: str | None) -> dict[str, str]:
    return rebuild_pages(results_uri, cfg, evaluation, requests_uri=requests_uri, labels_uri=labels_uri,
                         drift_uri=drift_uri)


def refresh_pages(results_uri: str, cfg: Any, evaluation: str | None, *, requests_uri: str | None = None,
                  labels_uri: str | None = None, drift_uri: str | None = None, why: str = "") -> dict[str, str]:
    """`rebuild_pages` as a Prefect task; a failure is logged (with ``why`` the pages changed) and gives ``{}``."""
    from prefect.utilities.annotations import quote

    try:
        written = _refresh(results_uri, quote(cfg), evaluation, requests_uri, labels_uri, drift_uri)
    except Exception as exc:  # noqa: BLE001 - the step's own work is done; the pages follow at the next change
        get_run_logger().warning("could not rebuild the results pages of %s after %s: %s", evaluation or "all",
                                 why or "a change", exc)
        return {}
    if written:
        get_run_logger().info("results pages rebuilt after %s: %s", why or "a change", ", ".join(sorted(written)))
    return written
