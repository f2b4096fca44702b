"""The `evaluate` flow end to end on real parts, and its faults.

Real Prefect API server process, a two-node Ray cluster, moto's S3 server behind a TCP
fault proxy.  Each fault has a test: storage down mid-run, a Ray worker killed during the
bootstrap, the flow killed during publishing, a malformed partition.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cje_engine import evaluate as engine_evaluate
from cje_engine.errors import CJEInputError
from flows.pipelines.evaluate import evaluate
from flows.storage.publish import list_runs, read_latest
from flows.storage.objects import StorageError

from .conftest import REPO, S3_ENV, write_simulated_logs

OPTIONS = {"covariates": ["response_length"], "calibration_policies": ["base"], "n_bootstrap": 200, "seed": 3}
FAST_RETRIES = [0.2, 0.4]  # backoff of the flow's storage retries in these tests (default 2, 10, 30 s)


@pytest.fixture
def setup(prefect_server, ray_cluster, s3_env, bucket, direct_storage):
    """Logs and labels in a fresh bucket; returns what the tests need."""
    uri = f"s3://{bucket}/logs"
    labels_uri = f"s3://{bucket}/labels"
    results_uri = f"s3://{bucket}"
    return {"uri": uri, "labels_uri": labels_uri, "results_uri": results_uri,
            "direct": direct_storage, "bucket": bucket}


def _write(setup, n_prompts=400, days=3, seed=0):
    d = setup["direct"]
    return write_simulated_logs(d(setup["uri"]), d(setup["labels_uri"]), n_prompts, days, seed)


def _task_runs(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r for r in runs}


def _assert_nothing_published(setup, evaluation):
    st = setup["direct"](setup["results_uri"])
    assert read_latest(st, evaluation) is None
    assert list_runs(st, evaluation) == []
    return st


def test_flow_on_two_node_ray_and_s3_matches_engine_and_is_idempotent(setup):
    expected, window = _write(setup)
    out = evaluate(logs_uri=setup["uri"], labels_uri=setup["labels_uri"], results_uri=setup["results_uri"],
                   window=window, evaluation="e2e", options=OPTIONS, n_chunks=4, retry_delays=FAST_RETRIES)
    assert out["published"] is True and out["reason"] == "published"
    # The distributed run gives exactly the engine's single-process numbers.
    ref = engine_evaluate(expected, **OPTIONS).to_dict()
    assert out["result"]["policies"] == ref["policies"]
    assert out["result"]["comparisons"] == ref["comparisons"]

    st = setup["direct"](setup["results_uri"])
    latest = read_latest(st, "e2e")
    assert latest is not None and latest["run_key"] == out["run_key"]
    manifest = json.loads(st.read_bytes(f"results/e2e/{out['window']}/{out['run_key']}/manifest.json"))
    assert manifest["inputs"]["n_files"] == 3 and all(f["etag_or_mtime"] for f in manifest["inputs"]["files"])
    assert manifest["labels"]["label_store_version"] == 1
    assert manifest["rows"]["n_rows"] == len(expected)
    assert manifest["seed"] == 3 and manifest["ray"] == "existing"
    assert set(manifest["artifacts"]) == {"result.json", "policies.parquet", "report.html"}
    for name, art in manifest["artifacts"].items():
        key = f"results/e2e/{out['window']}/{out['run_key']}/{art['key']}"
        assert len(st.read_bytes(key)) == art["size"]
    # Credentials never reach the published files.
    for art in manifest["artifacts"].values():
        blob = st.read_bytes(f"results/e2e/{out['window']}/{out['run_key']}/{art['key']}")
        assert S3_ENV["AWS_SECRET_ACCESS_KEY"].encode() not in blob
    assert S3_ENV["AWS_SECRET_ACCESS_KEY"] not in json.dumps(manifest)

    # Same inputs and configuration: same run key, nothing duplicated or overwritten.
    again = evaluate(logs_uri=setup["uri"], labels_uri=setup["labels_uri"], results_uri=setup["results_uri"],
                     window=window, evaluation="e2e", options=OPTIONS, n_chunks=2, retry_delays=FAST_RETRIES)
    assert again["run_key"] == out["run_key"]
    assert again["published"] is False and again["reason"] == "already published"
    assert len(list_runs(st, "e2e")) == 1


def _bootstrap_workers(cluster):
    """PIDs of Ray worker processes of OUR cluster currently running a bootstrap chunk."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if cmd.startswith(b"ray::cje_bootstrap") and cluster.owns(int(entry)):
            pids.append(int(entry))
    return pids


def _cli_run(setup, name, options, window, tmp_path, proxy, prefect_server, ray_cluster):
    """`cje run NAME` in a subprocess configured as at scale: PREFECT_API_URL, RAY_ADDRESS and
    the S3 endpoint (plus credentials) in the environment, nothing else."""
    config = tmp_path / "evaluations.yaml"
    config.write_text(json.dumps({"evaluations": [{
        "name": name, "logs_uri": setup["uri"], "labels_uri": setup["labels_uri"],
        "results_uri": setup["results_uri"], "window": window, "options": options}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RAY_ADDRESS"))}
    env.update(S3_ENV, CJE_S3_ENDPOINT=proxy.endpoint, PREFECT_API_URL=prefect_server.url,
               RAY_ADDRESS=ray_cluster.address, PYTHONPATH=str(REPO))
    log = open(tmp_path / f"{name}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "flows.cli.main", "run", name, "--config", str(config),
                             "--exit-zero"],  # the simulated `unhelpful` policy fails its audit (exit 1)
                            env=env, cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _log(tmp_path, name):
    return (tmp_path / f"{name}.log").read_text(errors="replace")[-4000:]


def test_ray_worker_killed_during_bootstrap_gives_identical_numbers(
        setup, ray_cluster, prefect_server, fault_proxy, tmp_path):
    # 1,600 replicates in 4 chunks of 400 on 1,500 prompts (each chunk takes about a
    # second or more here), so a chunk is surely running when we look.  The flow runs in a
    # subprocess (its own Ray driver) so that Ray's report of the dead worker goes there.
    options = {**OPTIONS, "n_bootstrap": 1600}
    expected, window = _write(setup, n_prompts=1500)
    proc = _cli_run(setup, "killed", options, window, tmp_path, fault_proxy, prefect_server, ray_cluster)
    killed = None
    try:
        deadline = time.monotonic() + 600  # bounds a hang only, as the wait for the run's end below
        while proc.poll() is None and time.monotonic() < deadline and killed is None:
            pids = _bootstrap_workers(ray_cluster)
            if pids:
                time.sleep(0.3)  # let it get into the computation
                os.kill(pids[0], signal.SIGKILL)
                killed = pids[0]
            time.sleep(0.05)
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert killed is not None, "no bootstrap chunk was seen running on the cluster\n" + _log(tmp_path, "killed")
    assert rc == 0, _log(tmp_path, "killed")
    st = setup["direct"](setup["results_uri"])
    latest = read_latest(st, "killed")
    assert latest is not None
    result = latest["result"]  # checked against the manifest's sha256 by read_latest
    ref = engine_evaluate(expected, **options).to_dict()
    assert result["policies"] == ref["policies"]
    assert result["comparisons"] == ref["comparisons"]


def test_storage_down_mid_run_retries_then_fails_cleanly(setup, fault_proxy):
    _, window = _write(setup)
    # Storage goes away at the first read of a log partition (after discovery and labels).
    fault_proxy.trip(rb"^(GET|HEAD) /[^ ]*/logs/dt(=|%3D)", "down")  # "=" is URL-encoded
    state = evaluate(logs_uri=setup["uri"], labels_uri=setup["labels_uri"], results_uri=setup["results_uri"],
                     window=window, evaluation="down", options=OPTIONS, retry_delays=FAST_RETRIES,
                     return_state=True)
    assert fault_proxy.tripped.is_set(), "\n".join(map(repr, fault_proxy.requests)) + str(state.message)
    assert state.is_failed()
    with pytest.raises(StorageError) as err:
        state.result()
    assert "logs/dt=" in str(err.value)
    assert S3_ENV["AWS_SECRET_ACCESS_KEY"] not in str(err.value)
    runs = _task_runs(state.state_details.flow_run_id)
    assert runs["discover"].state.is_completed() and runs["load_labels"].state.is_completed()
    assert runs["read"].state.is_failed()
    assert runs["read"].run_count == 1 + len(FAST_RETRIES)  # retried with backoff, then gave up
    assert "publish" not in runs
    fault_proxy.reset()
    _assert_nothing_published(setup, "down")


def test_malformed_partition_names_the_object_and_is_not_retried(setup):
    _, window = _write(setup)
    bad_key = "logs/dt=2025-03-02/part-broken.parquet"
    setup["direct"](setup["results_uri"]).write_bytes(bad_key, b"PAR1 this is not parquet at all")
    state = evaluate(logs_uri=setup["uri"], labels_uri=setup["labels_uri"], results_uri=setup["results_uri"],
                     window=window, evaluation="bad", options=OPTIONS, retry_delays=FAST_RETRIES,
                     return_state=True)
    assert state.is_failed()
    with pytest.raises(CJEInputError) as err:
        state.result()
    assert f"s3://{setup['bucket']}/{bad_key}" in str(err.value)
    assert _task_runs(state.state_details.flow_run_id)["read"].run_count == 1  # bad data is never retried
    _assert_nothing_published(setup, "bad")


def test_flow_killed_during_publishing_leaves_nothing_visible_and_next_run_succeeds(
        setup, fault_proxy, ray_cluster, prefect_server, tmp_path):
    _, window = _write(setup)
    # The second PUT under results/ (one artifact is already stored) stalls; then we kill.
    fault_proxy.trip(rb"^PUT /[^ ]*/results/", "hang", count=2)
    proc = _cli_run(setup, "pub", OPTIONS, window, tmp_path, fault_proxy, prefect_server, ray_cluster)
    try:
        assert fault_proxy.tripped.wait(timeout=600), _log(tmp_path, "pub")  # bounds a hang only
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    fault_proxy.reset()
    st = _assert_nothing_published(setup, "pub")
    partial = [i.key for i in st.list("results/pub/")]
    assert partial and not any(k.endswith("manifest.json") for k in partial)  # died mid-publish

    out = evaluate(logs_uri=setup["uri"], labels_uri=setup["labels_uri"], results_uri=setup["results_uri"],
                   window=window, evaluation="pub", options=OPTIONS, retry_delays=FAST_RETRIES)
    assert out["published"] is True
    latest = read_latest(st, "pub")
    assert latest is not None and latest["run_key"] == out["run_key"]
    leftovers = [i.key for i in st.list("results/pub/") if i.key in partial]
    assert leftovers == []  # the dead attempt's objects were cleaned up by the successful publish
