"""The `evaluate` flow over object storage that answers with HTTP faults, and the flows' time limits.

Real Prefect API server, the two-node Ray cluster and the moto S3 server behind the HTTP fault
proxy of `tests.s3proxy` (S3 error answers, lost responses, hung requests).
"""
from __future__ import annotations

import hashlib
import time

import pytest

from cje_engine import evaluate as engine_evaluate
from flows.pipelines.evaluate import evaluate
from flows.runtime.timeouts import RayTimeoutError
from flows.storage.objects import StorageError
from flows.storage.publish import list_runs, read_latest

from .conftest import write_simulated_logs

OPTIONS = {"covariates": ["response_length"], "calibration_policies": ["base"], "n_bootstrap": 200, "seed": 3}
FAST_RETRIES = [0.2, 0.4]
LOG_GET = r"/logs/dt=[0-9-]+/[^/]*\.parquet$"


@pytest.fixture
def setup(prefect_server, ray_cluster, s3_faults_env, bucket, direct_storage):
    return {"uri": f"s3://{bucket}/logs", "labels_uri": f"s3://{bucket}/labels", "results_uri": f"s3://{bucket}",
            "direct": direct_storage, "bucket": bucket}


def _write(setup, n_prompts=400, days=3):
    d = setup["direct"]
    return write_simulated_logs(d(setup["uri"]), d(setup["labels_uri"]), n_prompts, days, 0)


def _run(setup, window, evaluation, **kw):
    return evaluate(logs_uri=setup["uri"], labels_uri=setup["labels_uri"], results_uri=setup["results_uri"],
                    window=window, evaluation=evaluation, options=OPTIONS, retry_delays=FAST_RETRIES, **kw)


def _nothing_published(setup, evaluation):
    st = setup["direct"](setup["results_uri"])
    assert read_latest(st, evaluation) is None
    assert list_runs(st, evaluation) == []
    assert not [o.key for o in st.list(f"results/{evaluation}/")]


def test_transient_http_errors_and_lost_responses_give_the_fault_free_result(setup, s3_faults):
    expected, window = _write(setup)
    # the first GET of each of the 3 files is the driver reading footers; the later ones are the Ray reads
    s3_faults.add("GET", LOG_GET, "error", status=503, code="SlowDown", nth=4, times=2)
    s3_faults.add("GET", LOG_GET, "error", status=500, code="InternalError", nth=5, times=1)
    s3_faults.add("GET", r"/labels/", "error", status=503, code="SlowDown", times=1)
    s3_faults.add("PUT", r"/result\.json$", "error", status=500, code="InternalError", times=1)
    s3_faults.add("PUT", r"/policies\.parquet$", "drop", times=1)  # stored, the answer lost
    out = _run(setup, window, "transient")
    assert out["published"] is True
    assert s3_faults.fired("GET", LOG_GET) == 3  # on the Ray workers' reads
    for method, pattern in (("GET", "/labels/"), ("PUT", r"result\.json$"),
                            ("PUT", r"policies\.parquet$")):
        assert s3_faults.fired(method, pattern) >= 1, (method, pattern, s3_faults.requests)
    ref = engine_evaluate(expected, **OPTIONS).to_dict()  # the fault-free answer
    assert out["result"]["policies"] == ref["policies"] and out["result"]["comparisons"] == ref["comparisons"]
    st = setup["direct"](setup["results_uri"])
    latest = read_latest(st, "transient")  # checked against the manifest's sha256
    assert latest["result"]["policies"] == ref["policies"]
    run = f"results/transient/{out['window']}/{out['run_key']}"
    stored = sorted(o.key for o in st.list(run + "/"))
    manifest = latest["manifest"]
    # one attempt: every artifact once, whole (nothing duplicated by the retried PUTs, nothing lost)
    assert stored == sorted([f"{run}/manifest.json"] + [f"{run}/{e['key']}" for e in manifest["artifacts"].values()])
    for entry in manifest["artifacts"].values():
        assert hashlib.sha256(st.read_bytes(f"{run}/{entry['key']}")).hexdigest() == entry["sha256"]


def test_a_persistent_503_fails_the_flow_cleanly_with_nothing_published(setup, s3_faults):
    _, window = _write(setup)
    s3_faults.add("GET", LOG_GET, "error", status=503, code="SlowDown", times=None)
    t0 = time.monotonic()
    state = _run(setup, window, "slowdown", return_state=True)
    assert state.is_failed()
    with pytest.raises(StorageError) as err:
        state.result()
    # pyarrow names the 503 by its S3 code or, when it reads no body (a HEAD), by its HTTP meaning
    assert f"s3://{setup['bucket']}/logs/dt=" in str(err.value)
    assert "SLOW_DOWN" in str(err.value) or "SERVICE_UNAVAILABLE" in str(err.value)
    assert time.monotonic() - t0 < 60
    s3_faults.clear()
    _nothing_published(setup, "slowdown")


def test_a_hung_storage_read_ends_the_flow_within_the_ray_get_timeout(setup, s3_faults, monkeypatch):
    _, window = _write(setup)
    monkeypatch.setenv("CJE_RAY_GET_TIMEOUT", "2")
    # the storage read itself would wait 2 attempts x 2 requests x 5 s (CJE_S3_READ_TIMEOUT) per try;
    # the first GET of each of the 3 files (the driver reading their footers) passes, the Ray reads hang
    s3_faults.add("GET", LOG_GET, "hang", seconds=60, nth=4, times=None)
    t0 = time.monotonic()
    state = _run(setup, window, "hung", return_state=True)
    took = time.monotonic() - t0
    assert state.is_failed(), state
    with pytest.raises(RayTimeoutError) as err:
        state.result()
    assert "cje_read" in str(err.value) and "CJE_RAY_GET_TIMEOUT" in str(err.value)
    assert took < 40, took  # 3 tries of the read task x 2 s + backoff (was: >= 3 x 2 x 2 x 5 s of storage timeouts)
    s3_faults.clear()  # release the held requests: the Ray tasks end
    _nothing_published(setup, "hung")


def test_every_task_and_flow_of_the_pipelines_has_a_time_limit():
    import importlib

    from prefect import Flow, Task

    from flows.runtime.timeouts import flow_timeout, task_timeout

    seen = {"task": 0, "flow": 0}
    for name in ("evaluate", "audit", "labels", "drift", "drift_tasks"):
        module = importlib.import_module(f"flows.pipelines.{name}")
        for obj in vars(module).values():
            if isinstance(obj, Flow):
                assert obj.timeout_seconds == flow_timeout(), obj.name
                seen["flow"] += 1
            elif isinstance(obj, Task):
                assert obj.timeout_seconds == task_timeout(), obj.name
                seen["task"] += 1
    assert seen["flow"] >= 4 and seen["task"] >= 20, seen
