"""The ``evaluate_and_audit`` flow: the `evaluate` flow, then notifications, automatic label requests and the
results pages rebuilt with them (`flows.pipelines.pages`).

It is the flow that ``cje run``, ``cje serve`` (scheduled deployments), the demo and the re-evaluations of
the ``labels`` flow call (docs/label-requests.md).  A failure after publishing (notification or request
step) never unpublishes the result: it is logged and returned as ``label_requests_error``.

A run killed between its commit and a later step, then retried: the retry finds the run "already
published" and does what is still owed, once.  The result's notifications are a step of the manifest
(``followups``), recorded as done (`flows.storage.publish.record_followup`); the label requests are
planned again against the stored requests and the budget ledger, whose reservations of requests never
written are kept for them (`flows.label_requests.budget`); the pages are rebuilt by every run.
"""
from __future__ import annotations

from typing import Any, Literal

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.utilities.annotations import quote

from flows.config import EngineOptionsParameter
from flows.integrations.notify import notify_result
from flows.label_requests.config import RequestConfig
from flows.label_requests.raising import raise_requests_for_run
from flows.pipelines.evaluate import check_parameters as check_evaluate
from flows.pipelines.evaluate import evaluate
from flows.pipelines.pages import refresh_pages
from flows.runtime.guard import checked_flow
from flows.runtime.retries import TASK_TIMEOUT
from flows.storage.objects import Storage, StorageConfig
from flows.storage.publish import followup_due, record_followup


@task(name="raise_label_requests", retries=2, retry_delay_seconds=[1.0, 5.0], cache_policy=NO_CACHE, **TASK_TIMEOUT)
def raise_label_requests(results_uri: str, cfg: Any, evaluation: str, window: str, outcome: dict,
                         logs_uri: str, config: dict, drift_look: dict | None,
                         anchor_ids: list[str] | None, columns: dict[str, str] | None = None) -> list[dict]:
    """`flows.label_requests.raising.raise_requests_for_run` as a Prefect task (storage retries)."""
    return raise_requests_for_run(cfg, results_uri, evaluation, window, outcome, logs_uri, config,
                                  drift_look=drift_look, anchor_ids=anchor_ids, columns=columns)


def check_parameters(p: dict[str, Any]) -> None:
    """Checks before a run is created: the `evaluate` flow's, then the label-request settings."""
    check_evaluate(p)
    RequestConfig.from_dict(p["label_requests"])


@checked_flow(name="evaluate_and_audit", log_prints=False, validate_parameters=True, check=check_parameters)
def evaluate_and_audit(
    logs_uri: str,
    window: str = "last 7 days",
    evaluation: str = "default",
    results_uri: str | None = None,
    labels_uri: str | None = None,
    policies: list[str] | None = None,
    options: EngineOptionsParameter = None,
    as_of: str | None = None,
    n_chunks: int | None = None,
    retry_delays: list[float] | None = None,
    label_requests: dict[str, Any] | None = None,
    drift_look: dict[str, Any] | None = None,
    anchor_ids: list[str] | None = None,
    mode: str = "direct",
    columns: dict[str, str] | None = None,
    monitoring: dict[str, Any] | None = None,
    row_pass: Literal["auto", "single", "sharded"] = "auto",
) -> dict:
    """The `evaluate` flow, then notifications and automatic label requests.

    Same parameters as `flows.pipelines.evaluate.evaluate` (``mode`` is passed on when that flow
    has it), plus ``label_requests`` (a `RequestConfig` mapping), ``drift_look``
    (`DriftLook.to_dict()`) and ``anchor_ids``.

    Returns
    -------
    dict
        The `evaluate` flow's output plus ``notifications``, ``label_requests`` (manifests created)
        and ``warnings`` (e.g. a labelled count that dropped against the previous run of the window).
    """
    logger = get_run_logger()
    cfg_req = RequestConfig.from_dict(label_requests)  # bad settings fail before any work
    req_dict = cfg_req.to_dict()
    req_dict["labels_uri"] = req_dict["labels_uri"] or labels_uri or logs_uri
    extra = {"mode": mode} if (mode != "direct" or "mode" in evaluate.parameters.properties) else {}
    if columns:  # the evaluation's column mapping (``columns:`` in evaluations.yaml)
        extra["columns"] = dict(columns)
    if monitoring:  # the evaluation's ``monitoring:`` (regression alarms across windows)
        extra["monitoring"] = dict(monitoring)
    if row_pass != "auto":  # the evaluation's ``row_pass:`` (flows.pipelines.sharded_pass)
        extra["row_pass"] = row_pass
    out = evaluate(logs_uri=logs_uri, window=window, evaluation=evaluation, results_uri=results_uri,
                   labels_uri=labels_uri, policies=policies, options=options, as_of=as_of, n_chunks=n_chunks,
                   retry_delays=retry_delays, **extra)
    out["notifications"] = []
    out["label_requests"] = []
    cfg = StorageConfig.from_env()
    results = Storage.for_uri(results_uri or logs_uri, cfg)
    # Owed by the run until recorded (the manifest lists the step): a fresh publish notifies, a rerun of a
    # notified run does not, and the retry of a run killed between its commit and this step does.
    if followup_due(results, evaluation, out["window"], out["run_key"], "notify"):
        out["notifications"] = notify_result(out["result"], evaluation=evaluation, window=out["window"],
                                             path=out.get("path"), webhook_url=cfg_req.webhook_url)
        record_followup(results, evaluation, out["window"], out["run_key"], "notify",
                        {"sent": len(out["notifications"])})
    try:
        out["label_requests"] = raise_label_requests(results_uri or logs_uri, quote(cfg), evaluation,
                                                     out["window"], quote(out), logs_uri, req_dict, drift_look,
                                                     anchor_ids, columns)
    except Exception as exc:  # noqa: BLE001 - the result is published; report, do not unpublish
        logger.error("label requests for %s/%s failed: %s", evaluation, out["window"], exc)
        out["label_requests_error"] = f"{type(exc).__name__}: {exc}"
    logger.info("%d label request(s) raised", len(out["label_requests"]))
    # the pages show the open requests (and where they and the label store live): rebuild them now
    refresh_pages(results_uri or logs_uri, cfg, evaluation, requests_uri=req_dict.get("requests_uri"),
                  labels_uri=req_dict["labels_uri"], why="the run's label requests")
    return out


__all__ = ["evaluate_and_audit"]
