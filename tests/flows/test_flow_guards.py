"""Every flow checks its parameters before Prefect creates a flow run (`flows.runtime.guard`).

A direct Python call of the ``evaluate``, ``evaluate_and_audit``, ``drift`` or ``labels`` flow with
a URI carrying credentials, or with a bad parameter, raises `CJEInputError` and no flow run is
created: the real Prefect API server (tests/flows/conftest.py) holds no new run, and the secret
appears nowhere, neither in the error nor in the server's database, its log or the captured logs.
"""
from __future__ import annotations

import logging

import pytest

from cje_engine.errors import CJEInputError
from flows.pipelines.audit import evaluate_and_audit
from flows.pipelines.drift import drift
from flows.pipelines.drift_config import DriftSettings
from flows.pipelines.evaluate import evaluate
from flows.pipelines.labels import labels

SECRET = "wJalrXUtnFEMI-K7MDENG-guarded"
KEY_ID = "AKIAXGUARDED"
URI = f"s3://{KEY_ID}:{SECRET}@bucket/logs"


def _n_flow_runs() -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.count_flow_runs()


def _recent_parameters() -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return " ".join(repr(r.parameters) for r in client.read_flow_runs(limit=200))


def _server_bytes(server) -> bytes:
    return b"".join(p.read_bytes() for p in server.home.iterdir() if p.is_file())


CALLS = {
    "evaluate": lambda: evaluate(logs_uri=URI, window="2025-01-01", evaluation="guarded"),
    "evaluate_and_audit": lambda: evaluate_and_audit(logs_uri="/tmp/logs", results_uri=URI, window="2025-01-01"),
    "drift (mapping)": lambda: drift(settings={"set_name": "guarded", "anchors_uri": URI}),
    "drift (model)": lambda: drift(settings=DriftSettings(set_name="guarded", anchors_uri="/tmp/a", results_uri=URI)),
    "labels": lambda: labels(path="/tmp/answers.csv", labels_uri="/tmp/labels", logs_uri=URI),
}

BAD = {
    "evaluate": (lambda: evaluate(logs_uri="/tmp/logs", n_chunks="many"), "n_chunks"),
    "evaluate (window)": (lambda: evaluate(logs_uri="/tmp/logs", window="last 999999 days"), "longer than"),
    "evaluate (monitoring)": (lambda: evaluate(logs_uri="/tmp/logs", monitoring={"alpah": 0.1}), "alpha"),
    "evaluate_and_audit": (lambda: evaluate_and_audit(logs_uri="/tmp/logs", label_requests={"budgett": 3}),
                           "budgett"),
    "drift": (lambda: drift(settings={"set_name": "guarded"}), "anchors_uri"),
    "labels": (lambda: labels(path="/tmp/a.csv", labels_uri="/tmp/l", answers_format="xlsx"), "xlsx"),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_uri_with_credentials_is_refused_before_a_flow_run_exists(name, prefect_server, caplog):
    from flows.runtime.prefect_server import drain_workers

    caplog.set_level(logging.DEBUG)
    before = _n_flow_runs()
    with pytest.raises(CJEInputError, match="credentials") as err:
        CALLS[name]()
    assert SECRET not in str(err.value) and KEY_ID not in str(err.value)
    drain_workers()
    assert _n_flow_runs() == before  # no flow run was created
    assert SECRET not in _recent_parameters()
    blob = _server_bytes(prefect_server)
    assert SECRET.encode() not in blob and KEY_ID.encode() not in blob
    assert SECRET not in caplog.text and KEY_ID not in caplog.text


@pytest.mark.parametrize("name", list(BAD))
def test_bad_parameters_are_refused_before_a_flow_run_exists(name, prefect_server, caplog):
    call, needle = BAD[name]
    before = _n_flow_runs()
    with pytest.raises(CJEInputError, match=needle):
        call()
    assert _n_flow_runs() == before
    assert "Traceback" not in caplog.text


def test_webhook_urls_keep_their_query_token_but_not_user_info():
    from flows.runtime.guard import refuse_credentials

    # a receiver's token cannot be told from its address: accepted (CJE_WEBHOOK_URL keeps it out of Prefect)
    refuse_credentials({"settings": {"webhook_url": "http://127.0.0.1:9/hook?token=abc"}})
    refuse_credentials({"label_requests": {"webhook_url": "https://hooks.example/T0/B0/xyz"}})
    with pytest.raises(CJEInputError, match="credentials") as err:
        refuse_credentials({"settings": {"webhook_url": f"https://{KEY_ID}:{SECRET}@hooks.example/x?token=abc"}})
    assert SECRET not in str(err.value)
    with pytest.raises(CJEInputError, match="credentials"):  # any other URL: a token in the query is refused
        refuse_credentials({"results_uri": "s3://bucket/x?token=abc"})
