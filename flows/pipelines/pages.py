"""The ``refresh_pages`` step: rebuild the results index and an evaluation's trend page after a step that
changes what they show (a run published, label requests raised or answered, a drift look), and
`contextual_report`, the renderer the evaluate flow gives `flows.storage.publish.publish_run` (storage
renders nothing itself).

The pages agree with ``cje requests status``, ``cje runs`` and the drift state at once, not at the next
publish. A failure here is logged and returned, never fails the flow (the pages are rebuilt by the next step).
"""
from __future__ import annotations

import html
import re
from datetime import datetime, timezone
from typing import Any, Mapping

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from flows.reports.evaluation import render_report
from flows.reports.history import evaluations, report_context
from flows.reports.trend import write_pages
from flows.storage.objects import Storage
from flows.storage.publish import RunPlace

__all__ = ["refresh_pages", "rebuild_pages", "contextual_report"]


def contextual_report(st: Storage, run: RunPlace, result: Mapping[str, Any], report: bytes,
                      manifest: Mapping[str, Any]) -> bytes:
    """The run's report rendered again with its place in the evaluation (a `ReportRenderer`).

    Parameters
    ----------
    st : Storage
        The results storage the run is published on.
    run : RunPlace
        Evaluation, window, run key and the attempt folder the report goes to.
    result : mapping
        The run's ``result.json``.
    report : bytes
        The caller's ``report.html`` (its ``<title>`` is kept).
    manifest : mapping
        The caller's manifest; its ``window_spec`` gives the days of the window the run holds.

    Returns
    -------
    bytes
        ``report.html`` with generated-at time, links to result.json, the previous run, the trend page and
        the index, what changed since the previous run and the drift of linked monitors
        (`flows.reports.history.report_context`).
    """
    m = re.search(rb"<title>(.*?)</title>", report, re.S)
    title = html.unescape(m.group(1).decode("utf-8", "replace")) if m else None
    ctx = report_context(st, run.evaluation, run.window, run.key, result, run.attempt,
                         datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"))
    spec = (manifest or {}).get("window_spec")
    days = spec if isinstance(spec, Mapping) and "days" in spec else None
    return render_report(dict(result), title=title, context=ctx, days=days).encode("utf-8")


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
