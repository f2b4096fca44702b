"""Oracle label requests raised automatically from a published result (docs/label-requests.md).

The package is split by concern; this module re-exports the public names so that existing imports
(``from flows.label_requests.requests import list_requests``) keep working:

* `flows.label_requests.config`     `RequestConfig`, trigger names, ids and periods
* `flows.label_requests.triggers`   the six trigger rules (pure)
* `flows.label_requests.sampling`   random / stratified / targeted designs (pure, deterministic)
* `flows.label_requests.planning`   triggers -> manifests (pure)
* `flows.label_requests.budget`     the per-period label budget, taken atomically
* `flows.label_requests.manifests`  stored manifests, fulfilment markers, status
* `flows.label_requests.raising`    raise requests for a run or a drift alarm (plan, budget, write, notify)
* `flows.label_requests.exports`    requests as CSV, JSONL, Label Studio tasks, Argilla records
* `flows.label_requests.answers`    answers from those tools back to ``oracle_label``

The ``evaluate_and_audit`` flow lives in `flows.pipelines.audit`.
"""
from __future__ import annotations

from typing import Any

from flows.label_requests.config import TRIGGERS, RequestConfig, iso_period
from flows.label_requests.manifests import list_requests, mark_fulfilled, request_key, status_key, status_of, \
    write_request
from flows.label_requests.planning import plan_requests
from flows.label_requests.raising import raise_drift_requests, raise_requests_for_run, read_evaluated_logs
from flows.label_requests.sampling import sample, score_strata
from flows.label_requests.triggers import _Rows, find_triggers, support_regions


def __getattr__(name: str) -> Any:
    # The flow imports Prefect and the evaluate flow; load it only when asked for (old import path).
    if name == "evaluate_and_audit":
        from flows.pipelines.audit import evaluate_and_audit

        return evaluate_and_audit
    raise AttributeError(name)


__all__ = ["RequestConfig", "find_triggers", "plan_requests", "sample", "score_strata", "raise_requests_for_run",
           "list_requests", "write_request", "mark_fulfilled", "status_of", "request_key", "status_key",
           "iso_period", "TRIGGERS", "raise_drift_requests", "read_evaluated_logs", "support_regions", "_Rows"]
