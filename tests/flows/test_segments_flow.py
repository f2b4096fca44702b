"""Issue 28 end to end: label requests that target segment x policy cells whose claims are undecided or whose
audit is inconclusive (with inclusion probabilities, the pool being the cell's own rows), and a segmented
evaluation through the service (Prefect + Ray): the published result keeps its segments, the report shows
them, the trend page draws a trend per segment and the label requests read the segment column."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from cje_engine import evaluate
from flows.label_requests.planning import plan_requests
from flows.label_requests.triggers import find_triggers, segment_keys
from flows.storage.objects import Storage
from flows.storage.publish import read_latest
from tests.flows.test_segments_config import write_segment_logs
from tests.unit.test_segments_report import segmented_frame


@pytest.fixture(scope="module")
def segmented():
    frame = segmented_frame()
    frame["response_id"] = frame["prompt_id"] + "-" + frame["policy"]
    result = evaluate(frame, segment_by=["segment"], baseline="base", n_bootstrap=200, seed=0).to_dict()
    return result, pa.Table.from_pandas(frame.drop(columns=["label_probability"]), preserve_index=False)


def test_segment_requests_target_undecided_claims_and_inconclusive_audits(segmented):
    result, logs = segmented
    seg = result["segments"]
    trig = find_triggers(result, logs, {"max_labels_per_request": 400})
    by_code = {}
    for t in trig:
        by_code.setdefault(t["trigger"], set()).add(t["scope"])
    inconclusive = {f"{c['policy']} @ {c['segment']}" for c in seg["cells"]
                    if c["audit"]["verdict"] == "inconclusive" and c["claim_kind"] != "too_few"}
    assert inconclusive and by_code.get("segment_audit_inconclusive") == inconclusive
    assumed = [c for c in seg["comparisons"] if c["claim_kind"] == "assumes_transport"]
    assert assumed
    for c in assumed:  # an assumed level is never a decided claim: labels for the unverified cell
        assert f"{c['policy']} @ {c['segment']}" in by_code["segment_undecided"]
    margin = result["policies"]["base"]["audit"]["margin"]
    for c in seg["comparisons"]:  # a verified, claimed difference asks for nothing
        if c["claim_kind"] == "verified" and c["significant"]:
            assert not any(t["trigger"] == "segment_undecided" and t["detail"]["segment"] == c["segment"] and
                           t["detail"]["compared"] == c["policy"] for t in trig)
        if c["claim_kind"] == "verified" and not c["significant"] and (c["ci"][0] < -margin or c["ci"][1] > margin):
            assert any(t["trigger"] == "segment_undecided" and t["detail"]["segment"] == c["segment"] and
                       t["detail"]["compared"] == c["policy"] for t in trig), c
    assert not any(t["detail"].get("segment") == "other" for t in trig if t["trigger"].startswith("segment_"))
    # the manifests: drawn from the cell's own unlabelled rows, with inclusion probabilities, saying why
    plan = plan_requests(result, logs, {"max_labels_per_request": 400, "max_labels_per_period": 100_000},
                         evaluation="ev", window="2025-06-01_2025-06-01", now="2025-06-02T00:00:00+00:00")
    keys = np.asarray(segment_keys(logs, ["segment"]).to_pylist(), dtype=object)
    rid = {r: i for i, r in enumerate(logs.column("response_id").to_pylist())}
    labelled = np.asarray(logs.column("oracle_label").is_valid())
    seg_reqs = [m for m in plan["requests"] if m.get("segment")]
    assert {m["scope"] for m in seg_reqs} == inconclusive | by_code["segment_undecided"]
    taken: set[str] = set()  # rows of the requests planned before (a policy's own request may draw from a segment)
    for m in plan["requests"]:
        if not m.get("segment"):
            taken |= {r["response_id"] for r in m["rows"]}
            continue
        pol, name = m["segment"]["policy"], m["segment"]["segment"]
        assert m["scope"] == f"{pol} @ {name}" and m["segment"]["columns"] == ["segment"]
        assert any(f"segment {name!r}" in r["reason"] for r in m["reasons"])
        assert m["rows"] and m["n_labels"] == len(m["rows"])
        for r in m["rows"]:
            i = rid[r["response_id"]]
            assert r["policy"] == pol and keys[i] == name and not labelled[i]
            assert 0 < r["inclusion_probability"] <= 1
            assert r["inclusion_probability"] == pytest.approx(r["selection_probability"] * r["prior_probability"])
        cell = (keys == name) & (np.asarray(logs.column("policy").to_pylist(), dtype=object) == pol) & ~labelled
        pool = {r for r, i in rid.items() if cell[i]} - taken
        assert m["pool_size"] == len(pool) > 0
        taken |= {r["response_id"] for r in m["rows"]}


def test_a_segmented_evaluation_through_the_service(prefect_server, ray_cluster, tmp_path):
    from flows.pipelines.audit import evaluate_and_audit

    days = write_segment_logs(tmp_path / "logs", days=2, n_prompts=400)
    outs = []
    for day in days:
        outs.append(evaluate_and_audit(
            logs_uri=str(tmp_path / "logs"), results_uri=str(tmp_path), window=day, evaluation="seg", retry_delays=[0.2],
            options={"segment_by": ["category"], "baseline": "base", "n_bootstrap": 100, "seed": 0,
                     "segment_min_labels": 10},
            label_requests={"notify": False, "max_labels_per_request": 50}))
    for o in outs:
        assert o["published"] and "label_requests_error" not in o, o.get("label_requests_error")
    latest = read_latest(Storage.for_uri(tmp_path), "seg")
    seg = latest["result"]["segments"]  # the published result keeps its segments
    assert seg["columns"] == ["category"] and seg["baseline"] == "base" and seg["cells"]
    report = Path(outs[-1]["report"]).read_text()
    assert "<section id='segments'>" in report and "data-baseline='base'" in report
    trend = (tmp_path / "results" / "seg" / "trend.html").read_text()
    assert "Segments over windows" in trend
    for day in days:
        assert f"data-window=\"{day}_{day}\"" in trend.split("<section id='segments'>")[1]
    # the label requests of the last run read the segment column: their segment triggers are the ones the
    # published result calls for, less those still pending from the first run (deduplicated per scope and trigger)
    def pairs(requests):
        return {(m["scope"], r["trigger"]) for m in requests if m.get("segment") for r in m["reasons"]}

    expected = {(t["scope"], t["trigger"]) for t in find_triggers(latest["result"], _logs_of(tmp_path / "logs", days[-1]))
                if t["trigger"].startswith("segment_")}
    assert pairs(outs[0]["label_requests"]), "the first window raised segment requests"
    assert pairs(outs[-1]["label_requests"]) == expected - pairs(outs[0]["label_requests"])
    for m in outs[-1]["label_requests"]:
        if m.get("segment"):
            assert m["segment"]["columns"] == ["category"] and json.dumps(m)


def _logs_of(root: Path, day: str) -> pa.Table:
    from flows.label_requests.raising import read_evaluated_logs

    return read_evaluated_logs(str(root), f"{day}_{day}", None, None, extra=["category"])
