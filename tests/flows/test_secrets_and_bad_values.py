"""No secret reaches Prefect (flow-run parameters, its database, logs) and a bad value in a log
partition is reported with the object key and its row.

Real Prefect API server process, a two-node Ray cluster and moto's S3 server (tests/flows/conftest.py).
The S3 credentials are in the environment only (``S3_ENV``); the test then looks for the secret
through the Prefect API, in the server's SQLite database file and its log, and in the captured logs.
"""
from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from cje_engine.errors import CJEInputError
from flows.pipelines.evaluate import evaluate
from flows.storage.logs import discover_partitions, read_window, write_logs
from flows.storage.publish import read_latest

from .conftest import S3_ENV, write_simulated_logs

OPTIONS = {"n_bootstrap": 100, "seed": 2}
SECRET = S3_ENV["AWS_SECRET_ACCESS_KEY"]
SMUGGLED = "wJalrXUtnFEMI-K7MDENG-smuggled"


def _all_flow_run_parameters() -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return " ".join(repr(r.parameters) for r in client.read_flow_runs(limit=200))


def _server_files_text(server) -> bytes:
    """Every byte the Prefect server keeps: its SQLite database (with WAL) and its log."""
    blob = b""
    for path in server.home.iterdir():
        if path.is_file():
            blob += path.read_bytes()
    return blob


def test_no_secret_in_prefect_parameters_database_or_logs(prefect_server, ray_cluster, s3_env, bucket,
                                                          direct_storage, caplog):
    from flows.runtime.prefect_server import drain_workers

    caplog.set_level(logging.DEBUG)
    d = direct_storage
    _, window = write_simulated_logs(d(f"s3://{bucket}/logs"), d(f"s3://{bucket}/labels"), 300, 2)
    out = evaluate(logs_uri=f"s3://{bucket}/logs", labels_uri=f"s3://{bucket}/labels", results_uri=f"s3://{bucket}",
                   window=window, evaluation="secrets", options=OPTIONS, retry_delays=[0.2])
    assert out["published"] is True
    manifest = d(f"s3://{bucket}").read_bytes(f"results/secrets/{out['window']}/{out['run_key']}/manifest.json")
    # A flow that refuses credentials in a URI before it logs or reads anything.
    with pytest.raises(CJEInputError, match="credentials") as err:
        evaluate(logs_uri=f"s3://AKIAXSMUGGLED:{SMUGGLED}@{bucket}/logs", window=window, evaluation="smuggled",
                 options=OPTIONS)
    assert SMUGGLED not in str(err.value)
    drain_workers()
    params = _all_flow_run_parameters()
    assert f"s3://{bucket}/logs" in params  # the runs are there, with their URIs...
    assert SECRET not in params and S3_ENV["AWS_ACCESS_KEY_ID"] not in params  # ...and no credential
    blob = _server_files_text(prefect_server)
    assert b"secrets" in blob  # the database holds this run
    assert SECRET.encode() not in blob and S3_ENV["AWS_ACCESS_KEY_ID"].encode() not in blob
    logged = caplog.text + str(out) + manifest.decode()
    assert SECRET not in logged and S3_ENV["AWS_ACCESS_KEY_ID"] not in logged
    assert SMUGGLED not in logged
    # The refused URI's secret never reached Prefect either: the check runs before the flow run is created.
    assert SMUGGLED not in params
    assert SMUGGLED.encode() not in blob


def test_a_bad_value_is_reported_with_its_object_key_and_row(prefect_server, ray_cluster, tmp_path):
    from flows.storage.objects import Storage

    logs, labels = Storage.for_uri(str(tmp_path / "logs")), Storage.for_uri(str(tmp_path / "labels"))
    _, window = write_simulated_logs(logs, labels, 300, 3)
    files = discover_partitions(logs, *window.split(".."))
    victim = files[1]  # the middle day's partition
    table = read_window(logs, [victim])
    row = 117
    scores = table["judge_score"].to_pylist()
    scores[row] = 7.5  # outside the declared score scale [0, 1]
    bad = table.drop_columns(["dt"]).set_column(table.schema.get_field_index("judge_score"), "judge_score",
                                                pa.array(scores, pa.float64()))
    logs.delete(victim.key)
    written = write_logs(logs, bad, basename="bad")
    assert len(written) == 1
    with pytest.raises(CJEInputError) as err:
        evaluate(logs_uri=str(tmp_path / "logs"), labels_uri=str(tmp_path / "labels"), results_uri=str(tmp_path),
                 window=window, evaluation="bad-value", options=OPTIONS, retry_delays=[])
    exc = err.value
    assert exc.source == logs.url(written[0]) and exc.column == "judge_score" and exc.row == row, str(exc)
    assert "pyarrow.Table" not in str(exc) and "7.5" in str(exc)
    # the object's row really holds the bad value
    again = read_window(logs, [written[0]])
    assert again["judge_score"][row].as_py() == 7.5
    assert pc.sum(pc.equal(again["judge_score"], 7.5)).as_py() == 1
    assert read_latest(Storage.for_uri(str(tmp_path)), "bad-value") is None  # nothing published
