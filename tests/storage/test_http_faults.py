"""Object storage over HTTP: S3 error answers, truncated bodies, lost responses and hung requests.

The faults come from `tests.s3proxy` (an HTTP reverse proxy in front of the moto server); the
storage layer is the real one (boto3 for small objects, pyarrow's S3 filesystem for Parquet).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest

from cje_engine.errors import CJEInputError
from flows.storage.logs import read_window, write_logs
from flows.storage.objects import (Storage, StorageConfig, StorageError, aws_error_type, error_code,
                                   is_transient)
from flows.storage.publish import list_runs, publish_run, read_latest, read_run
from flows.storage.s3 import client_config
from tests.storage.conftest import ACCESS_KEY, SECRET_KEY, make_s3_config, new_bucket
from tests.storage.test_publish import LINEAGE, artifacts_for, example_result

REPO = Path(__file__).resolve().parents[2]
LOG = r"/logs/dt=[0-9-]+/part-[^/]*\.parquet$"


def _logs_table(n: int = 6000, days: int = 2) -> pa.Table:
    start = datetime(2025, 3, 1, tzinfo=timezone.utc)
    return pa.table({
        "prompt_id": [f"p{i // 3}" for i in range(n)],
        "policy": [("base", "clone", "premium")[i % 3] for i in range(n)],
        "judge_score": [(i % 97) / 97 for i in range(n)],
        "response_id": [f"r{i}" for i in range(n)],
        "ts": pa.array([start + timedelta(days=i % days, seconds=i) for i in range(n)], pa.timestamp("us", "UTC")),
        "response_length": [float(50 + i % 400) for i in range(n)],
    })


@pytest.fixture
def stores(s3_endpoint, s3_faults):
    """``(direct, faulty)``: the same bucket read directly and through the fault proxy (3 attempts)."""
    bucket = new_bucket(s3_endpoint)
    direct = Storage.for_uri(f"s3://{bucket}", make_s3_config(s3_endpoint))
    faulty = Storage.for_uri(f"s3://{bucket}", make_s3_config(s3_faults.endpoint, max_attempts=3))
    return direct, faulty


def _write_logs(direct: Storage) -> list[str]:
    # small row groups: a read is several ranged GETs, so a fault can hit one in the middle
    return write_logs(Storage.for_uri(direct.url("logs"), direct.config), _logs_table(), basename="a",
                      row_group_size=500)


def _logs(st: Storage) -> Storage:
    return Storage.for_uri(st.url("logs"), st.config)


# --------------------------------------------------------------------------- classification (no server)


def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


@pytest.mark.parametrize("code,status,transient", [
    ("SlowDown", 503, True), ("ServiceUnavailable", 503, True), ("InternalError", 500, True),
    ("BadGateway", 502, True), ("GatewayTimeout", 504, True), ("TooManyRequests", 429, True),
    ("ThrottlingException", 400, True), ("RequestTimeout", 400, True), ("503", 0, True),
    ("AccessDenied", 403, False), ("NoSuchKey", 404, False), ("NoSuchBucket", 404, False),
    ("InvalidRange", 416, False), ("PreconditionFailed", 412, False), ("SignatureDoesNotMatch", 403, False),
    # a message saying "timeout" or "500" does not make a permanent error transient
    ("InvalidArgument", 400, False),
])
def test_transient_errors_are_classified_by_code_and_status_not_text(code, status, transient):
    exc = _client_error(code, status)
    if not transient:
        exc.response["Error"]["Message"] = "connection timeout 500 slow down throttled"
    assert is_transient(exc) is transient
    assert error_code(exc)[0] == code


def test_transient_errors_are_classified_by_exception_type_and_aws_error_type():
    from botocore.exceptions import (ConnectionClosedError, ConnectTimeoutError, EndpointConnectionError,
                                     IncompleteReadError, NoCredentialsError, ParamValidationError,
                                     ReadTimeoutError, ResponseStreamingError)

    for exc in (ReadTimeoutError(endpoint_url="http://x"), ConnectTimeoutError(endpoint_url="http://x"),
                EndpointConnectionError(endpoint_url="http://x"), ConnectionClosedError(endpoint_url="http://x"),
                IncompleteReadError(actual_bytes=1, expected_bytes=2), ResponseStreamingError(error="cut"),
                ConnectionResetError(errno.ECONNRESET, "reset"), TimeoutError("t"),
                OSError(errno.ETIMEDOUT, "timed out")):
        assert is_transient(exc), exc
    for exc in (NoCredentialsError(), ParamValidationError(report="bad"), ValueError("connection timeout"),
                OSError(errno.ENOENT, "no such file"), PermissionError(errno.EACCES, "denied")):
        assert not is_transient(exc), exc
    # pyarrow's S3 errors: the AWS SDK error type, as pyarrow 26 writes it
    aws = "Could not open Parquet input source 'b/k': AWS Error {} during GetObject operation: {}"
    for kind, transient in [("SLOW_DOWN", True), ("SERVICE_UNAVAILABLE", True), ("INTERNAL_FAILURE", True),
                            ("THROTTLING", True), ("NETWORK_CONNECTION", True), ("ACCESS_DENIED", False),
                            ("NO_SUCH_BUCKET", False), ("RESOURCE_NOT_FOUND", False)]:
        exc = OSError(aws.format(kind, "curlCode: 28, Timeout was reached, 503 slow down"))
        assert aws_error_type(exc) == kind
        assert is_transient(exc) is transient, kind
    # answers without an S3 error body (HEAD): pyarrow gives the HTTP status
    head = "When getting information for key 'k' in bucket 'b': AWS Error UNKNOWN (HTTP status {}) during " \
           "HeadObject operation: No response body."
    assert is_transient(OSError(head.format(503))) and is_transient(OSError(head.format(500)))
    assert not is_transient(OSError(head.format(403))) and aws_error_type(OSError(head.format(403))) == "UNKNOWN"
    # a corrupt file's message that merely mentions a connection is not a storage failure
    assert not is_transient(OSError("Couldn't deserialize thrift: connection 500 timed out"))


def test_the_s3_client_sets_attempts_and_timeouts_explicitly():
    conf = client_config(StorageConfig(max_attempts=4, connect_timeout=1.5, read_timeout=7.0))
    assert conf.retries == {"total_max_attempts": 4, "mode": "standard"}
    assert (conf.connect_timeout, conf.read_timeout) == (1.5, 7.0)
    env = StorageConfig.from_env({"CJE_S3_READ_TIMEOUT": "2.5", "CJE_S3_CONNECT_TIMEOUT": "0.5"})
    assert (env.read_timeout, env.connect_timeout) == (2.5, 0.5)


# --------------------------------------------------------------------------- transient answers: retried


def test_transient_500_and_slowdown_on_logs_and_results_are_retried_to_the_same_answer(stores, s3_faults):
    direct, faulty = stores
    keys = _write_logs(direct)
    clean = read_window(_logs(direct), keys)
    s3_faults.add("GET", LOG, "error", status=503, code="SlowDown", times=2)
    s3_faults.add("HEAD", LOG, "error", status=500, code="InternalError", times=1)
    s3_faults.add("GET", LOG, "error", status=429, code="TooManyRequests", nth=4, times=1)
    got = read_window(_logs(faulty), keys)
    assert got.equals(clean)
    assert s3_faults.fired("GET", LOG, "error") == 3 and s3_faults.fired("HEAD", LOG, "error") == 1

    blob = json.dumps(example_result()).encode()
    s3_faults.add("PUT", r"/results/r\.json$", "error", status=503, code="SlowDown", times=2)
    s3_faults.add("GET", r"/results/r\.json$", "error", status=500, code="InternalError", times=2)
    faulty.write_bytes("results/r.json", blob)
    assert faulty.read_bytes("results/r.json") == blob
    assert direct.read_bytes("results/r.json") == blob
    assert s3_faults.fired("PUT", r"r\.json$") == 2 and s3_faults.fired("GET", r"r\.json$") == 2


# --------------------------------------------------------------------------- persistent answers: a clear failure


def test_a_persistent_503_is_a_storage_error_after_exactly_max_attempts(stores, s3_faults):
    direct, faulty = stores
    direct.write_bytes("results/r.json", b"{}")
    s3_faults.add("GET", r"/results/r\.json$", "error", status=503, code="SlowDown", times=None)
    t0 = time.monotonic()
    with pytest.raises(StorageError) as err:
        faulty.read_bytes("results/r.json")
    assert f"{faulty.url('results/r.json')} failed" in str(err.value) and "SlowDown" in str(err.value)
    # max_attempts = 3 means 3 requests in all (botocore's "max_attempts" key made 4)
    assert s3_faults.count("GET", r"r\.json$") == 3
    assert time.monotonic() - t0 < 15

    keys = _write_logs(direct)
    s3_faults.add("GET", LOG, "error", status=503, code="SlowDown", times=None)
    with pytest.raises(StorageError) as err:  # never CJEInputError: the data is not to blame
        read_window(_logs(faulty), keys)
    assert _logs(faulty).url(keys[0]) in str(err.value)


def test_access_denied_on_a_log_object_fails_at_once_as_a_storage_error(stores, s3_faults):
    direct, faulty = stores
    keys = _write_logs(direct)
    s3_faults.add("GET", LOG, "error", status=403, code="AccessDenied", times=None)
    with pytest.raises(StorageError) as err:  # was: retried as "transient" (its text says "AWS Error")
        read_window(_logs(faulty), keys[:1])
    assert not isinstance(err.value, CJEInputError)
    assert _logs(faulty).url(keys[0]) in str(err.value) and "ACCESS_DENIED" in str(err.value)
    assert s3_faults.count("GET", LOG) == 1  # not retried


def test_the_preflight_footer_check_reports_a_503_as_storage_not_bad_input(stores, s3_faults):
    from flows.pipelines.preflight import logs_columns

    direct, faulty = stores
    keys = _write_logs(direct)
    assert "judge_score" in logs_columns(direct.url("logs"), direct.config, [{"key": keys[0]}], strict=True)
    s3_faults.add(None, LOG, "error", status=503, code="SlowDown", times=None)
    with pytest.raises(StorageError) as err:  # was: CJEInputError "is not a readable Parquet log file" (exit 2)
        logs_columns(faulty.url("logs"), faulty.config, [{"key": keys[0]}], strict=True)
    assert not isinstance(err.value, CJEInputError)
    assert _logs(faulty).url(keys[0]) in str(err.value) and "503" in str(err.value)


def test_cje_exits_69_service_unavailable_when_storage_answers_503(stores, s3_faults, tmp_path):
    direct, faulty = stores
    bucket = faulty.bucket
    config = tmp_path / "evaluations.yaml"
    config.write_text(json.dumps({"evaluations": [{"name": "ev", "logs_uri": f"s3://{bucket}/logs",
                                                   "results_uri": f"s3://{bucket}"}]}))
    s3_faults.add(None, r"", "error", status=503, code="SlowDown", times=None)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CJE_"))}
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION="us-east-1",
               CJE_S3_ENDPOINT=s3_faults.endpoint, CJE_S3_MAX_ATTEMPTS="2", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "flows.cli.main", "runs", "ev", "--config", str(config)],
                          env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 69, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("config: ")]  # the file read
    assert len(lines) == 1 and "service unavailable" in lines[0] and f"s3://{bucket}" in lines[0], proc.stderr
    assert "SlowDown" in lines[0] and "Traceback" not in proc.stderr and SECRET_KEY not in proc.stderr
    assert s3_faults.count() == 2


# --------------------------------------------------------------------------- truncated bodies


def test_a_truncated_parquet_body_is_retried_never_read_as_fewer_rows(stores, s3_faults):
    direct, faulty = stores
    keys = _write_logs(direct)
    clean = read_window(_logs(direct), keys, columns=["response_id", "judge_score"])
    # Content-Length kept, a third of the body sent, then the connection closes: on the 2nd ranged GET
    s3_faults.add("GET", LOG, "truncate", fraction=0.3, nth=2, times=2)
    got = read_window(_logs(faulty), keys, columns=["response_id", "judge_score"])
    assert s3_faults.fired("GET", LOG, "truncate") == 2
    assert got.num_rows == clean.num_rows and got.equals(clean)

    s3_faults.clear()
    s3_faults.add("GET", LOG, "truncate", fraction=0.3, times=None)  # every GET cut short
    with pytest.raises(StorageError) as err:
        read_window(_logs(faulty), keys[:1])
    assert not isinstance(err.value, CJEInputError)
    assert _logs(faulty).url(keys[0]) in str(err.value)


def test_a_truncated_small_object_body_is_retried_or_named(stores, s3_faults):
    direct, faulty = stores
    blob = os.urandom(200_000)
    direct.write_bytes("labels/x.bin", blob)
    s3_faults.add("GET", r"/labels/x\.bin$", "truncate", fraction=0.5, times=1)
    assert faulty.read_bytes("labels/x.bin") == blob
    s3_faults.add("GET", r"/labels/x\.bin$", "truncate", fraction=0.5, times=None)
    with pytest.raises(StorageError) as err:
        faulty.read_bytes("labels/x.bin")
    assert faulty.url("labels/x.bin") in str(err.value)


# --------------------------------------------------------------------------- lost responses


def test_a_lost_response_after_a_result_put_is_retried_idempotently(stores, s3_faults):
    direct, faulty = stores
    arts = artifacts_for()
    # the PUTs reach the store; their answers never reach the client; the client retries
    s3_faults.add("PUT", r"/result\.json$", "drop", times=1)
    s3_faults.add("PUT", r"/policies\.parquet$", "drop", times=2)
    out = publish_run(faulty, "ev", "w1", "k1", arts, LINEAGE)
    assert out.published and s3_faults.fired("PUT", r"result\.json$", "drop") == 1
    assert s3_faults.fired("PUT", r"policies\.parquet$", "drop") == 2
    run = "results/ev/w1/k1"
    manifest = json.loads(direct.read_bytes(f"{run}/manifest.json"))
    stored = [o.key for o in direct.list(run + "/")]
    attempts = {k[len(run) + 1:].split("/")[0] for k in stored if k != f"{run}/manifest.json"}
    assert attempts == {manifest["attempt"]}  # one attempt folder: nothing duplicated
    assert sorted(stored) == sorted([f"{run}/manifest.json"] + [f"{run}/{e['key']}" for e in
                                                               manifest["artifacts"].values()])
    for name, entry in manifest["artifacts"].items():  # nothing lost or partial
        data = direct.read_bytes(f"{run}/{entry['key']}")
        assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["size"]
        if name != "report.html":
            assert data == arts[name]
    assert read_run(direct, "ev", "w1", "k1")["result"] == example_result()
    assert read_latest(direct, "ev")["run_key"] == "k1" and len(list_runs(direct, "ev")) == 1


# --------------------------------------------------------------------------- hung requests


def test_a_hung_get_ends_in_a_clear_error_within_the_read_timeout(s3_endpoint, s3_faults, monkeypatch):
    bucket = new_bucket(s3_endpoint)
    direct = Storage.for_uri(f"s3://{bucket}", make_s3_config(s3_endpoint))
    keys = _write_logs(direct)
    direct.write_bytes("results/r.json", b"{}")
    # the timeouts come from the environment, as in production
    for k, v in {"CJE_S3_ENDPOINT": s3_faults.endpoint, "CJE_S3_READ_TIMEOUT": "1", "CJE_S3_CONNECT_TIMEOUT": "1",
                 "CJE_S3_MAX_ATTEMPTS": "2", "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                 "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    faulty = Storage.for_uri(f"s3://{bucket}")
    assert faulty.config.read_timeout == 1.0
    s3_faults.add("GET", r"", "hang", seconds=60, times=None)  # no answer for a minute

    t0 = time.monotonic()
    with pytest.raises(StorageError) as err:
        faulty.read_bytes("results/r.json")
    took = time.monotonic() - t0
    assert faulty.url("results/r.json") in str(err.value) and "timeout" in str(err.value).lower()
    assert took < 8, took  # 2 attempts x 1 s + backoff, not a minute

    t0 = time.monotonic()
    with pytest.raises(StorageError) as err:
        read_window(_logs(faulty), keys[:1])
    took = time.monotonic() - t0
    assert _logs(faulty).url(keys[0]) in str(err.value)
    assert took < 15, took  # 2 reads x 2 requests x 1 s + backoff


# --------------------------------------------------------------------------- the proxy itself


def test_the_fault_proxy_answers_each_rule_as_documented(s3_endpoint, s3_faults):
    """Raw HTTP through the proxy: forwarding, nth/times counting, and every action."""
    import http.client

    direct = Storage.for_uri(f"s3://{new_bucket(s3_endpoint)}", make_s3_config(s3_endpoint))
    direct.write_bytes("k/obj.bin", bytes(range(256)) * 40)
    path = f"/{direct.bucket}/k/obj.bin"

    def signed(method: str, key: str) -> str:  # moto refuses anonymous requests: presigned URLs
        op = {"GET": "get_object", "HEAD": "head_object", "PUT": "put_object"}[method]
        url = direct.client.generate_presigned_url(op, Params={"Bucket": direct.bucket, "Key": key})
        return url[len(s3_endpoint):]

    def get(method="GET"):
        conn = http.client.HTTPConnection("127.0.0.1", s3_faults.port, timeout=5)
        try:
            conn.request(method, signed(method, "k/obj.bin"))
            resp = conn.getresponse()
            return resp.status, resp.getheader("Content-Length"), resp.read()
        finally:
            conn.close()

    assert get() == (200, "10240", bytes(range(256)) * 40)
    assert get("HEAD")[:2] == (200, "10240")
    s3_faults.add("GET", r"/obj\.bin$", "error", status=503, code="SlowDown", nth=2, times=1)
    assert get()[0] == 200 and get()[0] == 503 and get()[0] == 200  # fires on the 2nd match only
    s3_faults.clear()
    s3_faults.add("GET", r"/obj\.bin$", "error", status=503)
    status, _, body = get()
    assert status == 503 and b"<Code>SlowDown</Code>" in body and path.encode() in body
    s3_faults.add("GET", r"/obj\.bin$", "truncate", fraction=0.25)
    with pytest.raises(http.client.IncompleteRead) as cut:
        get()
    assert len(cut.value.partial) == 2560  # Content-Length 10240 announced, a quarter sent
    s3_faults.add("GET", r"/obj\.bin$", "corrupt")
    status, length, body = get()
    assert status == 200 and length == "10240" and body != bytes(range(256)) * 40 and len(body) == 10240
    for action in ("drop", "reset"):
        s3_faults.add("GET", r"/obj\.bin$", action)
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            get()
    s3_faults.add("PUT", r"/new\.bin$", "drop")
    conn = http.client.HTTPConnection("127.0.0.1", s3_faults.port, timeout=5)
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        conn.request("PUT", signed("PUT", "k/new.bin"), body=b"written")
        conn.getresponse()
    conn.close()
    assert direct.read_bytes("k/new.bin") == b"written"  # the write happened, its answer was lost
    s3_faults.add("GET", r"/obj\.bin$", "hang", seconds=30)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        conn = http.client.HTTPConnection("127.0.0.1", s3_faults.port, timeout=1)
        conn.request("GET", signed("GET", "k/obj.bin"))
        conn.getresponse()
    assert time.monotonic() - t0 < 3
    assert get()[0] == 200  # every rule above fired once (times=1): forwarded again
    assert s3_faults.fired("GET", r"obj\.bin$") == 7 and s3_faults.fired("PUT") == 1
