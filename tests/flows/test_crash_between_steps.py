"""A crash between the steps of `evaluate_and_audit`, then a retry (issue 25).

The steps after the commit (the manifest) are: the run's notifications (refused levels, failed
audits), the regression alarms, the label requests (budget reservation, then the request manifest)
and the pages.  A process killed between two of them is simulated by raising at that point; the
retry of the same window finds the run published ("already published") and must finish what the
killed run left undone, once: nothing partial published, no notification lost or sent twice, no
request duplicated, the budget ledger equal to the stored requests.

Real parts: a Prefect server, a two-node Ray cluster, local storage and a webhook receiver.
"""
from __future__ import annotations

from datetime import timedelta

import pytest

import flows.label_requests.raising as raising
import flows.pipelines.audit as audit
from flows.label_requests.budget import LabelBudget
from flows.label_requests.manifests import list_requests
from flows.pipelines.audit import evaluate_and_audit
from flows.storage.objects import Storage
from flows.storage.publish import list_runs, read_latest

from .test_audit_loop_e2e import DAYS, FIRST_DAY, OPTIONS, _arrive
from .test_notify import Receiver

WINDOW = f"{FIRST_DAY}..{FIRST_DAY + timedelta(days=DAYS - 1)}"


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def _setup(tmp_path, receiver):
    root = str(tmp_path / "data")
    _arrive(Storage.for_uri, root, root)
    params = {"logs_uri": root, "window": WINDOW, "evaluation": "crashy", "options": OPTIONS, "retry_delays": [0.1],
              "label_requests": {"webhook_url": receiver.url, "max_labels_per_request": 150,
                                 "max_labels_per_period": 1000}}
    return Storage.for_uri(root), params


def _result_messages(receiver) -> list[tuple[str, str]]:
    return sorted((m["body"]["kind"], m["body"]["payload"].get("policy")) for m in receiver.messages
                  if m["body"]["kind"] in ("level_refused", "audit_failed"))


def test_a_crash_after_the_commit_before_the_notifications_is_finished_by_the_retry(
        prefect_server, ray_cluster, tmp_path, receiver, monkeypatch):
    """Killed after the manifest, before notifying: the retry said "already published" and never
    notified (the refusal and the failed audit were lost).  Now the manifest lists the steps due after
    the commit and each step's completion is recorded: the retry notifies once, a further rerun not."""
    st, params = _setup(tmp_path, receiver)

    def killed(*args, **kwargs):
        raise RuntimeError("killed after the commit, before the notifications")

    monkeypatch.setattr(audit, "notify_result", killed)
    with pytest.raises(RuntimeError, match="killed after the commit"):
        evaluate_and_audit(**params)
    (run,) = list_runs(st, "crashy")  # published (the commit happened), complete
    assert read_latest(st, "crashy")["run_key"] == run["run_key"]
    assert _result_messages(receiver) == []
    monkeypatch.undo()

    retry = evaluate_and_audit(**params)
    assert retry["published"] is False and retry["reason"] == "already published"
    assert retry["run_key"] == run["run_key"]
    policies = retry["result"]["policies"]
    expected = sorted([("level_refused", n) for n, p in policies.items() if p["level_claim"] == "refused"]
                      + [("audit_failed", n) for n, p in policies.items() if (p.get("audit") or {}).get("verdict") == "fail"])
    assert ("level_refused", "unhelpful") in expected and ("audit_failed", "unhelpful") in expected
    assert _result_messages(receiver) == expected
    assert len(retry["notifications"]) == len(expected)
    again = evaluate_and_audit(**params)
    assert again["notifications"] == [] and _result_messages(receiver) == expected  # once, not per rerun


def test_a_crash_between_the_budget_reservation_and_the_request_manifest_is_redone_once(
        prefect_server, ray_cluster, tmp_path, receiver, monkeypatch):
    """Killed after the label budget was reserved, before the request manifest was written: the retry
    writes the reserved request (no second reservation), and the ledger equals the stored requests."""
    st, params = _setup(tmp_path, receiver)

    def killed(*args, **kwargs):
        raise RuntimeError("killed between the budget reservation and the request manifest")

    monkeypatch.setattr(raising, "write_request", killed)
    first = evaluate_and_audit(**params)
    assert first["published"] is True and "killed between" in first["label_requests_error"]
    assert list_requests(st) == []
    (period,) = {p.key.split("/")[2] for p in st.list("label_requests/_budget/")}
    reserved = sum(e["labels"] for e in LabelBudget(st, period).entries())
    assert reserved > 0
    monkeypatch.undo()

    retry = evaluate_and_audit(**params)
    stored = list_requests(st)
    assert len(stored) >= 1
    assert sorted(m["request_id"] for m in retry["label_requests"]) == sorted(m["request_id"] for m in stored)
    ledger = LabelBudget(st, period).entries()
    assert sum(e["labels"] for e in ledger) == sum(m["n_labels"] for m in stored) == reserved
    ids = [r["response_id"] for m in stored for r in m["rows"]]
    assert len(ids) == len(set(ids))
    assert evaluate_and_audit(**params)["label_requests"] == [] and len(list_requests(st)) == len(stored)
    kinds = receiver.kinds()
    assert kinds.count("label_request") == len(stored)
    refused = [n for n, p in first["result"]["policies"].items() if p["level_claim"] == "refused"]
    assert refused and kinds.count("level_refused") == len(refused)  # sent once, by the first run
