"""The evaluate flow's modes (direct, logs-only, hybrid) end to end on real parts.

Real Prefect API server, the two-node Ray cluster and moto's S3 server (fixtures in conftest.py).
The logs hold the logger's responses (``policy = base``) with ``base_logprob``,
``logprob__near`` and ``logprob__far`` plus the candidates' fresh draws (rows of ``near`` and
``far``), simulated with known truth; labels live in the label store.
"""
from __future__ import annotations

import json
from datetime import date, datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from cje_engine import evaluate as engine_evaluate
from cje_engine.errors import CJEInputError
from cje_engine.pipeline.offpolicy import evaluate_offpolicy
from cje_engine.simulate.logs import simulate_logs
from flows.pipelines.evaluate import evaluate
from flows.storage.publish import check_result_gate, read_latest

from .conftest import FIRST_DAY

FAST_RETRIES = [0.2, 0.4]
N_PROMPTS, DAYS = 240, 3
OPTIONS = {"targets": ["near", "far"], "logger": "base", "length_column": "n_tokens", "n_bootstrap": 100, "seed": 5}
#: What the flow reads in an off-policy run (projection): Direct's columns plus the log-probabilities.
READ = ["prompt_id", "policy", "judge_score", "response_id", "base_logprob", "logprob__near", "logprob__far",
        "n_tokens", "oracle_label", "label_probability"]


@pytest.fixture
def logs(prefect_server, ray_cluster, s3_env, bucket, direct_storage):
    """Simulated logs (logged responses + fresh draws) over 3 days, labels in the label store.

    Returns the URIs and ``expected``: the rows in the order the flow reads them (by day, then
    file order), labels joined, restricted to the columns the flow projects.
    """
    from flows.storage.labels import LabelStore
    from flows.storage.logs import write_logs

    sim = simulate_logs(n_prompts=N_PROMPTS, length=32, targets={"near": 0.02, "far": 0.6}, seed=11,
                        label_fraction=0.3)
    logged, fresh = sim.to_frames("base")
    frame = pd.concat([logged, fresh], ignore_index=True)
    day = frame["prompt_id"].astype("category").cat.codes.to_numpy() % DAYS
    start = datetime.combine(date.fromisoformat(FIRST_DAY), datetime.min.time(), tzinfo=timezone.utc)
    rng = np.random.default_rng(0)
    frame["ts"] = [start + timedelta(days=int(d), seconds=float(s)) for d, s in zip(day, rng.uniform(0, 86399, len(frame)))]
    uri, labels_uri = f"s3://{bucket}/logs", f"s3://{bucket}/labels"
    write_logs(direct_storage(uri), pa.Table.from_pandas(frame.drop(columns=["oracle_label"]), preserve_index=False),
               basename="sim")
    lab = frame.loc[frame["oracle_label"].notna(), ["response_id", "oracle_label"]].reset_index(drop=True)
    lab["label_probability"] = 0.3  # labels missing completely at random (the simulation's label fraction)
    LabelStore(direct_storage(labels_uri)).append(pa.Table.from_pandas(lab, preserve_index=False), "oracle")
    frame["label_probability"] = np.where(frame["oracle_label"].notna(), 0.3, np.nan)
    expected = frame.iloc[np.argsort(day, kind="stable")][READ].reset_index(drop=True)
    window = f"{FIRST_DAY}..{(date.fromisoformat(FIRST_DAY) + timedelta(days=DAYS - 1)).isoformat()}"
    return {"uri": uri, "labels_uri": labels_uri, "results_uri": f"s3://{bucket}", "window": window,
            "expected": expected, "direct": direct_storage, "sim": sim}


def _run(logs, evaluation, **kw):
    return evaluate(logs_uri=logs["uri"], labels_uri=logs["labels_uri"], results_uri=logs["results_uri"],
                    window=logs["window"], evaluation=evaluation, retry_delays=FAST_RETRIES, **kw)


def _published(logs, out):
    st = logs["direct"](logs["results_uri"])
    base = f"results/{out['evaluation']}/{out['window']}/{out['run_key']}"
    manifest = json.loads(st.read_bytes(f"{base}/manifest.json"))
    arts = {name: st.read_bytes(f"{base}/{a['key']}") for name, a in manifest["artifacts"].items()}
    return manifest, arts


def test_logs_only_and_hybrid_through_the_flow(logs):
    exp = logs["expected"]
    # logs-only: only the logger's rows are read (policy filter and projection pushed down)
    out = _run(logs, "offpolicy", options=OPTIONS, mode="logs-only", n_chunks=3)
    assert out["published"] is True
    res = out["result"]
    ref = evaluate_offpolicy(exp[exp["policy"] == "base"], mode="logs-only", **OPTIONS).to_dict()
    assert res["policies"] == ref["policies"]  # Ray chunks and the S3 round trip change nothing
    assert res["comparisons"] == ref["comparisons"]
    assert res["mode"] == "logs-only" and res["data"]["n_rows"] == N_PROMPTS
    row_pass = res["inference"]["row_pass"]  # auto: the single path, and the result says why (no sharded one)
    assert row_pass["path"] == "single" and row_pass["reason"].startswith("mode 'logs-only' has no sharded row pass")
    assert res["data"]["n_fresh"] == {"near": 0, "far": 0}
    near, far = res["policies"]["near"], res["policies"]["far"]
    # no label of the candidate's responses: its level assumes transport and is kept in ``assumed``
    assert near["level_claim"] == "assumes_transport" and near["basis_code"] == "logs-only/calibrated_ips"
    assert near["estimate"] is None and near["assumed"]["level_claim"] == "ok"
    assert far["level_claim"] == "refused" and res["best_policy"] != "far"
    assert any("TTC" in r for r in far["refusal_reasons"])
    assert "collect fresh draws" in far["refusal_reasons"][-1]
    assert not far["offpolicy"]["gate_checks"][0]["passed"]  # the TTC gate
    manifest, arts = _published(logs, out)
    assert json.loads(arts["result.json"]) == res
    check_result_gate(res, arts["policies.parquet"])  # the publishing gate, as the publisher ran it
    assert manifest["config"]["mode"] == "logs-only" and manifest["config"]["options"]["targets"] == ["near", "far"]
    html = arts["report.html"].decode()
    assert "refused" in html and "far" in html
    assert read_latest(logs["direct"](logs["results_uri"]), "offpolicy")["run_key"] == out["run_key"]

    # hybrid: the candidates' fresh draws are read too; same numbers as in-process
    hy = _run(logs, "hybrid", options=OPTIONS, mode="hybrid", n_chunks=2)
    assert hy["published"] is True
    ref_h = evaluate_offpolicy(exp, mode="hybrid", **OPTIONS).to_dict()
    assert hy["result"]["policies"] == ref_h["policies"]
    assert hy["result"]["data"]["n_fresh"] == {"near": N_PROMPTS, "far": N_PROMPTS}
    assert hy["result"]["inference"]["row_pass"]["reason"].startswith("mode 'hybrid' has no sharded row pass")
    near_h = hy["result"]["policies"]["near"]
    assert near_h["basis_code"] == "hybrid/stacked" and near_h["direct"]["basis_code"] == "plug_in"
    assert near_h["offpolicy"]["diagnostics"]["ttc_reference"] == "fresh/per-token"
    check_result_gate(hy["result"])
    assert hy["run_key"] != out["run_key"]


def test_direct_mode_is_the_default_flow(logs):
    """mode='direct' evaluates every policy's rows with the engine, ignoring the log-probabilities."""
    out = _run(logs, "direct", options={"n_bootstrap": 100, "seed": 5}, mode="direct", n_chunks=2)
    exp = logs["expected"].drop(columns=["base_logprob", "logprob__near", "logprob__far", "n_tokens"])
    ref = engine_evaluate(exp, n_bootstrap=100, seed=5).to_dict()
    assert out["result"]["policies"] == ref["policies"]
    assert out["result"]["mode"] == "direct"  # every result names its mode (the typed result)
    assert out["result"]["inference"]["row_pass"]["path"] == "single"  # a small window: auto's single path
    manifest, _ = _published(logs, out)
    assert "mode" not in manifest["config"]  # direct run keys are unchanged by the new parameter


def test_bad_mode_and_missing_candidates_are_clear_errors(logs):
    with pytest.raises(CJEInputError, match="mode must be one of direct, logs-only, hybrid"):
        _run(logs, "bad", options=OPTIONS, mode="offline")
    with pytest.raises(CJEInputError, match="needs its candidates"):
        _run(logs, "bad", options={"logger": "base", "n_bootstrap": 100}, mode="hybrid")
    with pytest.raises(CJEInputError, match="logprob__nobody"):
        _run(logs, "bad", options={**OPTIONS, "targets": ["nobody"]}, mode="logs-only")
    assert read_latest(logs["direct"](logs["results_uri"]), "bad") is None
