"""After an evaluate run is published: changes across windows, regression alarms and the run's Prefect artifacts.

`monitor_evaluation` is called once at the end of the evaluate flow. It reads the evaluation's published
history, computes each policy's changes across windows (`cje_engine.inference.changes`: consecutive and
against the baseline window, alpha spending over windows), sends one ``regression_alarm`` notification
(webhook and Prefect event, like a drift alarm) per policy whose value dropped significantly in the
published window (once per run: the step ``regression_alarms`` of its manifest, recorded when done, so a
rerun sends nothing again and the retry of a run killed before it sends them), and creates the run's Prefect artifacts (`flows.reports.artifacts`). Nothing here can
fail the flow: the run is already published.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from flows.config import MonitoringConfig
from flows.reports.artifacts import evaluate_artifacts
from flows.reports.history import read_history, window_changes_of
from flows.storage.objects import Storage

log = logging.getLogger(__name__)

__all__ = ["monitor_evaluation", "regression_payload", "undecided_at"]


def regression_payload(evaluation: str, window: str, run_key: str, policy: str, pc: Any,
                       links: Mapping[str, Any]) -> dict[str, Any]:
    """The notification of one regression alarm: the failing test(s) with their anytime intervals."""
    i = pc.windows.index(window)
    tests = [c.to_dict() for c in pc.tests_at(i)]
    return {"evaluation": evaluation, "window": window, "run_key": run_key, "policy": policy,
            "baseline": pc.baseline, "first_alarm": pc.first_alarm,
            "tests": [t for t in tests if t["status"] == "regression"],
            "labels_needed": max((t["labels_needed"] or 0 for t in tests), default=0) or None,
            **{k: v for k, v in links.items() if v}}


def undecided_at(changes: Mapping[str, Any], window: str) -> dict[str, int]:
    """Policy -> the most own labels in ``window`` any of its undecided drop tests asks for (the
    ``regression_undecided`` label-request trigger, `flows.label_requests.triggers`)."""
    out: dict[str, int] = {}
    for name, pc in changes.items():
        if window not in pc.windows:
            continue
        needed = [int(t.labels_needed) for t in pc.tests_at(pc.windows.index(window))
                  if t.status == "undecided" and t.labels_needed]
        if needed:
            out[name] = max(needed)
    return out


def monitor_evaluation(results_uri: str, cfg: Any, evaluation: str, window: str, run_key: str,
                       outcome: Mapping[str, Any], result: Mapping[str, Any],
                       monitoring: MonitoringConfig | None = None) -> dict[str, Any]:
    """Regression alarms and Prefect artifacts of a published evaluate run (see the module docstring).

    ``monitoring``: the evaluation's ``monitoring:`` settings (alpha, baseline, pooled windows, ...;
    default `MonitoringConfig()`); with ``label_requests: false`` no undecided drop is reported for a
    label request.

    Returns ``{"alarms": [policy, ...], "undecided": {policy: labels}, "notifications": [...], "artifacts": [id, ...], "error": str | None}``.
    """
    out: dict[str, Any] = {"alarms": [], "undecided": {}, "notifications": [], "artifacts": [], "error": None}
    changes: dict[str, Any] = {}
    trend = None
    monitoring = monitoring or MonitoringConfig()
    try:
        st = Storage.for_uri(results_uri, cfg)
        changes = window_changes_of(read_history(st, evaluation), **monitoring.change_options())
        trend = st.url(f"results/{evaluation}/trend.html")
        out["alarms"] = sorted(n for n, pc in changes.items() if window in pc.alarms)
        out["undecided"] = undecided_at(changes, window) if monitoring.label_requests else {}
    except Exception as exc:  # noqa: BLE001 - the run is published; monitoring is an addition
        log.warning("changes across windows of %s not computed: %s", evaluation, exc)
        out["error"] = f"{type(exc).__name__}: {exc}"
    if out["alarms"] and _owed(results_uri, cfg, evaluation, window, run_key, "regression_alarms"):
        from flows.integrations.notify import notify

        links = {"report": (outcome.get("artifacts") or {}).get("report.html"), "trend": trend}
        for name in out["alarms"]:
            payload = regression_payload(evaluation, window, run_key, name, changes[name], links)
            log.warning("regression alarm: %s of %s dropped in window %s", name, evaluation, window)
            out["notifications"].append(notify("regression_alarm", payload))
        _done(results_uri, cfg, evaluation, window, run_key, "regression_alarms", len(out["notifications"]))
    try:
        out["artifacts"] = evaluate_artifacts(evaluation, window, run_key, result, outcome, trend, changes,
                                              out["alarms"])
    except Exception as exc:  # noqa: BLE001 - artifacts never fail a flow
        log.warning("Prefect artifacts of %s %s not created: %s", evaluation, window, exc)
        out["error"] = out["error"] or f"{type(exc).__name__}: {exc}"
    return out


def _owed(results_uri: str, cfg: Any, evaluation: str, window: str, run_key: str, step: str) -> bool:
    """Whether the run still owes ``step`` (`flows.storage.publish.followup_due`); True when storage cannot
    tell (a notification sent twice is better than one lost)."""
    from flows.storage.publish import followup_due

    try:
        return followup_due(Storage.for_uri(results_uri, cfg), evaluation, window, run_key, step)
    except Exception as exc:  # noqa: BLE001 - the run is published; monitoring is an addition
        log.warning("could not read whether %s of %s/%s/%s is done (%s): doing it", step, evaluation, window,
                    run_key, exc)
        return True


def _done(results_uri: str, cfg: Any, evaluation: str, window: str, run_key: str, step: str, sent: int) -> None:
    """Record ``step`` of the run as done (`flows.storage.publish.record_followup`); a failure is logged."""
    from flows.storage.publish import record_followup

    try:
        record_followup(Storage.for_uri(results_uri, cfg), evaluation, window, run_key, step, {"sent": sent})
    except Exception as exc:  # noqa: BLE001 - the notifications went out; a rerun may send them again
        log.warning("could not record %s of %s/%s/%s as done: %s", step, evaluation, window, run_key, exc)
