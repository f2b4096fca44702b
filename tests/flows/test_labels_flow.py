"""The labels flow: reading, validation errors, append-only ingestion, fulfilment, windows."""
from __future__ import annotations

import io
import json
from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from cje_engine import evaluate
from cje_engine.errors import CJEInputError
from cje_engine.simulate.direct import PolicySpec, simulate
from flows.label_requests.manifests import list_requests
from flows.label_requests.raising import raise_requests_for_run
from flows.storage.labels import LabelStore
from flows.pipelines.labels import affected_windows, labels, parse_labels, validate_labels
from flows.storage.logs import write_logs
from flows.runtime.schedules import EvaluationSpec
from flows.storage.objects import Storage

POLICIES = (PolicySpec("base", quality_shift=0.8), PolicySpec("unhelpful", quality_shift=-1.0, adversarial=True))
NOW = datetime(2025, 3, 5, 12, tzinfo=timezone.utc)


def _bytes(table: pa.Table, fmt: str) -> bytes:
    buf = io.BytesIO()
    if fmt == "parquet":
        pq.write_table(table, buf)
    elif fmt == "csv":
        pacsv.write_csv(table, buf)
    else:
        buf.write("\n".join(json.dumps(r) for r in table.to_pylist()).encode())
    return buf.getvalue()


LABELS = pa.table({"response_id": ["a", "b", "c"], "oracle_label": [0.1, 0.5, 1.0]})
KNOWN = {"a": {"inclusion_probability": 0.02, "request_id": "lr-1"}, "b": {"inclusion_probability": None},
         "c": {"inclusion_probability": None}}


@pytest.mark.parametrize("fmt, name", [("parquet", "x.parquet"), ("csv", "x.csv"), ("jsonl", "x.jsonl"),
                                       ("jsonl", "x.ndjson")])
def test_every_format_reads_the_same(fmt, name):
    t = parse_labels(_bytes(LABELS, fmt), name, name)
    out = validate_labels(t, name, KNOWN)
    assert out.column("response_id").to_pylist() == ["a", "b", "c"]
    assert out.column("oracle_label").to_pylist() == [0.1, 0.5, 1.0]
    # the request's inclusion probability is filled in; ad-hoc labels keep none
    assert out.column("label_probability").to_pylist() == [0.02, None, None]


def test_numeric_ids_in_csv_stay_strings():
    t = parse_labels(b"response_id,oracle_label\n007,0.5\n", "x.csv", "x.csv")
    assert validate_labels(t, "x.csv", {"007": {}}).column("response_id").to_pylist() == ["007"]


def test_unknown_extension_and_unreadable_file():
    with pytest.raises(CJEInputError, match="unknown label file type '.xlsx'"):
        parse_labels(b"", "x.xlsx", "x.xlsx")
    with pytest.raises(CJEInputError, match=r"file bad.parquet: is not a readable parquet"):
        parse_labels(b"not parquet", "bad.parquet", "bad.parquet")


@pytest.mark.parametrize("rows, known, match", [
    ({"response_id": ["a", "zzz"], "oracle_label": [0.1, 0.2]}, KNOWN,
     r"file f.csv, column 'response_id', row 1: unknown response_id 'zzz'"),
    ({"response_id": ["a", "b"], "oracle_label": [0.1, 1.7]}, KNOWN,
     r"column 'oracle_label', row 1: label 1.7 is outside the label scale \[0, 1\]"),
    ({"response_id": ["a", "b", "a"], "oracle_label": [0.1, 0.2, 0.1]}, KNOWN,
     r"column 'response_id', row 2: response_id 'a' appears twice in the file \(rows 0 and 2\)"),
    ({"response_id": ["a", None], "oracle_label": [0.1, 0.2]}, KNOWN, r"column 'response_id', row 1: is empty"),
    ({"response_id": ["a", "b"], "oracle_label": [0.1, None]}, KNOWN, r"column 'oracle_label', row 1: is empty"),
    ({"response_id": ["a"], "label": [0.1]}, KNOWN, r"column 'oracle_label': required label column is missing"),
    ({"response_id": ["a"], "oracle_label": [0.1], "label_probability": [0.5]}, KNOWN,
     r"row 0: label_probability 0.5 disagrees with the inclusion probability 0.02 recorded by request lr-1"),
    ({"response_id": ["b"], "oracle_label": [0.1], "label_probability": [1.5]}, KNOWN,
     r"row 0: label_probability 1.5 is not in \(0, 1\]"),
    ({"response_id": ["b"], "oracle_label": ["good"]}, KNOWN, r"column 'oracle_label': has type string"),
])
def test_validation_errors_name_file_column_and_row(rows, known, match):
    with pytest.raises(CJEInputError, match=match):
        validate_labels(pa.table(rows), "f.csv", known)


def test_custom_label_scale():
    t = pa.table({"response_id": ["b"], "oracle_label": [7.0]})
    assert validate_labels(t, "f", KNOWN, label_scale=(1, 10)).num_rows == 1
    with pytest.raises(CJEInputError, match=r"outside the label scale \[1, 10\]"):
        validate_labels(pa.table({"response_id": ["b"], "oracle_label": [0.0]}), "f", KNOWN, label_scale=(1, 10))


def test_affected_windows():
    published = ["2025-03-01_2025-03-03", "2025-03-04_2025-03-06", "2025-02-01_2025-02-07"]
    got = affected_windows({"2025-03-02", "2025-03-05"}, published, 10)
    # the two published windows holding a touched date; never a window nobody published
    assert got == ["2025-03-01_2025-03-03", "2025-03-04_2025-03-06"]
    assert affected_windows({"2025-03-02", "2025-03-05"}, published, 1) == ["2025-03-04_2025-03-06"]
    assert affected_windows({"2024-01-01"}, published, 10) == []


# ----------------------------------------------------------------------------- the flow


@pytest.fixture
def local_setup(tmp_path):
    """Local logs over two days, the label store, a published-looking request for unhelpful."""
    sim = simulate(200, POLICIES, label_design="calibration_policy", oracle_fraction=0.3, audit_labels=5, seed=4)
    frame = sim.frame.copy()
    start = datetime(2025, 3, 1, tzinfo=timezone.utc)
    frame["ts"] = [start + timedelta(days=i % 2, hours=1) for i in range(len(frame))]
    logs_uri = str(tmp_path / "logs")
    st_logs = Storage.for_uri(logs_uri)
    write_logs(st_logs, pa.Table.from_pandas(frame.drop(columns=["oracle_label", "label_probability"]),
                                             preserve_index=False), basename="sim")
    lab = frame.loc[frame["oracle_label"].notna(), ["response_id", "oracle_label", "label_probability"]]
    LabelStore(st_logs).append(pa.Table.from_pandas(lab.reset_index(drop=True), preserve_index=False), "initial")
    result = evaluate(frame.drop(columns=["ts"]), calibration_policies=["base"], inference="analytic").to_dict()
    made = raise_requests_for_run(None, logs_uri, "ev", "2025-03-01_2025-03-02", result, logs_uri,
                                  {"notify": False, "triggers": ["audit_failed"]}, now=NOW)
    assert len(made) == 1 and made[0]["scope"] == "unhelpful"
    oracle = dict(zip(frame["response_id"], sim.oracle_all))
    return {"uri": logs_uri, "st": st_logs, "request": made[0], "oracle": oracle, "frame": frame, "tmp": tmp_path}


def _write_returned(setup, name, rows):
    path = setup["tmp"] / name
    df = pd.DataFrame(rows)
    if name.endswith(".jsonl"):
        path.write_text("\n".join(json.dumps(r) for r in df.to_dict("records")))
    else:
        df.to_csv(path, index=False)
    return str(path)


def test_flow_ingests_fulfils_and_is_idempotent(prefect_server, local_setup):
    s = local_setup
    req = s["request"]
    ids = [r["response_id"] for r in req["rows"]]
    # the requested rows plus one ad-hoc label for a base row that no request asked for
    adhoc = next(r for r in s["frame"].loc[s["frame"]["oracle_label"].isna(), "response_id"] if r.startswith("base"))
    path = _write_returned(s, "returned.jsonl", {"response_id": ids + [adhoc],
                                                 "oracle_label": [s["oracle"][i] for i in ids + [adhoc]]})
    out = labels(path=path, labels_uri=s["uri"], logs_uri=s["uri"], reevaluate=False)
    assert out["new"] is True and out["version"] == 2 and out["rows"] == len(ids) + 1 and out["conflicts"] == []
    # (the request was created on NOW = 2025-03-05 with a 7-day deadline, so it is complete but late)
    assert out["requests"] == [{"request_id": req["request_id"], "status": "fulfilled", "received": len(ids),
                                "requested": len(ids), "late": True}]
    assert [m["status"] for m in list_requests(s["st"])] == ["fulfilled"]
    pos = int(np.flatnonzero(s["frame"]["response_id"].to_numpy() == adhoc)[0])
    adhoc_dt = f"2025-03-0{1 + pos % 2}"  # ts = start + (row position % 2) days; found by scanning the logs
    assert all(r["dt"] in ("2025-03-01", "2025-03-02") for r in req["rows"])
    expect = sorted({r["dt"] for r in req["rows"]} | {adhoc_dt})
    assert out["touched_dates"] == expect
    store = LabelStore(s["st"]).read()
    prob = dict(zip(store.column("response_id").to_pylist(), store.column("label_probability").to_pylist()))
    assert all(prob[r["response_id"]] == pytest.approx(r["inclusion_probability"]) for r in req["rows"])
    assert prob[adhoc] is None  # ad-hoc label, no design probability given
    # same file again: nothing new
    again = labels(path=path, labels_uri=s["uri"], logs_uri=s["uri"], reevaluate=False)
    assert again["new"] is False and again["version"] == 2 and LabelStore(s["st"]).version() == 2


def test_conflicting_label_is_kept_and_flagged(prefect_server, local_setup):
    s = local_setup
    labelled = s["frame"].loc[s["frame"]["oracle_label"].notna()].iloc[0]
    other = 1.0 if labelled["oracle_label"] < 0.5 else 0.0
    path = _write_returned(s, "second.csv", {"response_id": [labelled["response_id"]], "oracle_label": [other]})
    out = labels(path=path, labels_uri=s["uri"], logs_uri=s["uri"], reevaluate=False)
    assert out["conflicts"] == [labelled["response_id"]]
    rows = LabelStore(s["st"]).read().to_pandas()
    mine = rows[rows["response_id"] == labelled["response_id"]]
    assert sorted(mine["oracle_label"]) == sorted([labelled["oracle_label"], other])  # nothing overwritten
    assert mine["flagged"].all()


def test_flow_rejects_unknown_ids_naming_file_and_row(prefect_server, local_setup):
    s = local_setup
    path = _write_returned(s, "typo.csv", {"response_id": [s["request"]["rows"][0]["response_id"], "nope:1"],
                                           "oracle_label": [0.5, 0.5]})
    with pytest.raises(CJEInputError, match=r"typo.csv, column 'response_id', row 1: unknown response_id 'nope:1'"):
        labels(path=path, labels_uri=s["uri"], logs_uri=s["uri"], reevaluate=False)
    assert LabelStore(s["st"]).version() == 1  # nothing appended
    with pytest.raises(CJEInputError, match="label file not found"):
        labels(path=str(s["tmp"] / "missing.csv"), labels_uri=s["uri"], logs_uri=s["uri"], reevaluate=False)


# ----------------------------------------------------------------------------- inline labels + store


def _inline_logs(tmp_path, n_inline: int, seed: int = 7):
    """Two days of logs of base (rows 0-399) and unhelpful (400-799): base rows 0-299 and the first
    ``n_inline - 300`` unhelpful rows carry their oracle label inline; no label store yet."""
    sim = simulate(400, POLICIES, label_design="calibration_policy", oracle_fraction=1.0, audit_labels=400,
                   seed=seed)
    frame = sim.frame.copy().reset_index(drop=True)
    i = np.arange(len(frame))
    inline = (i < 300) | ((i >= 400) & (i < 100 + n_inline))
    frame["oracle_label"] = np.where(inline, sim.oracle_all, np.nan)
    frame["label_probability"] = np.where(inline, 1.0, np.nan)
    start = datetime(2025, 3, 1, tzinfo=timezone.utc)
    frame["ts"] = [start + timedelta(days=i % 2, hours=1) for i in range(len(frame))]
    uri = str(tmp_path / "logs")
    write_logs(Storage.for_uri(uri), pa.Table.from_pandas(frame, preserve_index=False), basename="sim")
    return uri, frame, dict(zip(frame["response_id"], sim.oracle_all))


def test_inline_labels_and_label_store_are_combined(prefect_server, ray_cluster, tmp_path):
    """The issue's walk-through: 356 inline labels -> run -> 60 new labels for other rows -> 416."""
    from flows.pipelines.audit import evaluate_and_audit
    from flows.storage.publish import list_runs

    uri, frame, oracle = _inline_logs(tmp_path, 356)
    evaluation = {"name": "inline", "logs_uri": uri, "window": "2025-03-01..2025-03-02",
                  "options": {"calibration_policies": ["base"], "inference": "analytic"}}
    params = {k: v for k, v in evaluation.items() if k != "name"}
    first = evaluate_and_audit(**params, evaluation="inline", label_requests={"notify": False})
    assert first["published"] and first["labels"]["source"] == "logs" and first["labels"]["n_joined"] == 356
    assert sum(p["n_labelled"] for p in first["result"]["policies"].values()) == 356
    # 60 new labels for rows without one (unhelpful rows), ingested through the labels flow
    others = frame.loc[frame["oracle_label"].isna(), "response_id"].tolist()[:60]
    path = tmp_path / "new.csv"
    pd.DataFrame({"response_id": others, "oracle_label": [oracle[i] for i in others]}).to_csv(path, index=False)
    out = labels(path=str(path), labels_uri=uri, evaluations=[evaluation], label_requests={"notify": False})
    assert out["new"] and out["version"] == 1 and out["rows"] == 60
    (re,) = out["reevaluations"]
    runs = list_runs(Storage.for_uri(uri), "inline")
    latest = runs[-1]
    assert latest["run_key"] == re["run_key"] != first["run_key"]
    info = latest["manifest"]["labels"]
    assert info["n_joined"] == 416 and info["n_inline_labels"] == 356 and info["n_store_labels"] == 60
    assert info["source"] == "logs+label_store" and info["n_inline_overridden"] == 0
    assert latest["manifest"]["rows"]["n_labelled"] == 416
    assert "labelled_count_drop" not in info


def test_a_labels_run_killed_before_its_reevaluation_is_completed_by_the_retry(prefect_server, ray_cluster, tmp_path,
                                                                             monkeypatch):
    """Issue 25: ``kill -9`` of ``cje labels`` after the label store committed and before the re-evaluation:
    the retry said "already stored" and never re-evaluated.  Now the commit's re-evaluation is recorded
    when it completes, and a retry of the same file whose version has no record re-evaluates."""
    import flows.pipelines.labels as labels_module
    from flows.pipelines.audit import evaluate_and_audit
    from flows.storage.publish import list_runs

    uri, frame, oracle = _inline_logs(tmp_path, 356)
    evaluation = {"name": "crash", "logs_uri": uri, "window": "2025-03-01..2025-03-02",
                  "options": {"calibration_policies": ["base"], "inference": "analytic"}}
    others = frame.loc[frame["oracle_label"].isna(), "response_id"].tolist()[:60]
    path = tmp_path / "new.csv"
    pd.DataFrame({"response_id": others, "oracle_label": [oracle[i] for i in others]}).to_csv(path, index=False)
    run = dict(path=str(path), labels_uri=uri, evaluations=[evaluation], label_requests={"notify": False})
    real = labels_module.reevaluate_windows

    def killed(*args, **kwargs):
        raise RuntimeError("killed between the label commit and the re-evaluation")

    first = evaluate_and_audit(**{k: v for k, v in evaluation.items() if k != "name"}, evaluation="crash",
                               label_requests={"notify": False})
    monkeypatch.setattr(labels_module, "reevaluate_windows", killed)
    with pytest.raises(RuntimeError, match="killed between"):
        labels(**run)
    store = LabelStore(Storage.for_uri(uri))
    assert store.version() == 1 and store.reevaluated(1) is None
    assert [r["run_key"] for r in list_runs(Storage.for_uri(uri), "crash")] == [first["run_key"]]
    monkeypatch.setattr(labels_module, "reevaluate_windows", real)
    retry = labels(**run)
    assert retry["new"] is False and retry["version"] == 1
    (re,) = retry["reevaluations"]
    assert re["published"] is True and re["window"] == "2025-03-01_2025-03-02"
    _, published = list_runs(Storage.for_uri(uri), "crash")
    assert published["run_key"] == re["run_key"] and published["manifest"]["labels"]["n_store_labels"] == 60
    assert store.reevaluated(1)["runs"][0]["run_key"] == re["run_key"]
    # done once: the next retry of the same file has nothing left to do
    assert labels(**run)["reevaluations"] == []


def test_store_wins_over_a_differing_inline_label_and_it_is_counted(tmp_path):
    from flows.storage.labels import join_counts, join_labels

    logs = pa.table({"response_id": ["a", "b", "c", "d"], "oracle_label": [0.2, 0.4, None, 1.0],
                     "label_probability": [1.0, 1.0, None, 1.0]})
    store = LabelStore(Storage.for_uri(str(tmp_path)))
    store.append(pa.table({"response_id": ["b", "c", "d"], "oracle_label": [0.9, 0.5, 1.0]}), "s")
    joined = join_labels(logs, store.read())
    assert joined.column("oracle_label").to_pylist() == [0.2, 0.9, 0.5, 1.0]  # inline kept, store wins on b
    assert join_counts(joined) == {"n_inline_labels": 3, "n_store_labels": 3, "n_inline_overridden": 1,
                                   "n_conflicting_rows": 0}


def test_inline_label_columns_reads_footers_and_flags_mixed_files(tmp_path):
    from flows.storage.labels import inline_label_columns

    st = Storage.for_uri(str(tmp_path))
    with_lab = pa.table({"response_id": ["a"], "oracle_label": [0.5]})
    without = pa.table({"response_id": ["b"]})
    for key, t in (("dt=2025-03-01/x.parquet", with_lab), ("dt=2025-03-02/y.parquet", without)):
        buf = io.BytesIO()
        pq.write_table(t, buf)
        st.write_bytes(key, buf.getvalue())
    assert inline_label_columns(st, ["dt=2025-03-01/x.parquet"]) == {"columns": ["oracle_label"], "mixed": False}
    assert inline_label_columns(st, ["dt=2025-03-02/y.parquet"]) == {"columns": [], "mixed": False}
    assert inline_label_columns(st, ["dt=2025-03-01/x.parquet", "dt=2025-03-02/y.parquet"]) == {
        "columns": ["oracle_label"], "mixed": True}
    # an unreadable footer is left to the read (which names the object and is not retried): read everything
    st.write_bytes("dt=2025-03-03/z.parquet", b"PAR1 not parquet")
    assert inline_label_columns(st, ["dt=2025-03-01/x.parquet", "dt=2025-03-03/z.parquet"]) == {
        "columns": ["oracle_label"], "mixed": True}


def test_a_drop_of_labelled_rows_warns_and_is_recorded(prefect_server, ray_cluster, tmp_path):
    """The logs are rewritten without their inline labels: the next run of the window says so."""
    from flows.pipelines.evaluate import evaluate as evaluate_flow
    from flows.storage.publish import list_runs

    uri, frame, _ = _inline_logs(tmp_path, 356)
    params = {"logs_uri": uri, "window": "2025-03-01..2025-03-02", "evaluation": "drop",
              "options": {"calibration_policies": ["base"], "inference": "analytic"}}
    first = evaluate_flow(**params)
    assert first["warnings"] == []
    fewer = frame.copy()
    fewer.loc[400:, ["oracle_label", "label_probability"]] = np.nan  # the 300 base labels are left
    write_logs(Storage.for_uri(uri), pa.Table.from_pandas(fewer, preserve_index=False), basename="sim")
    second = evaluate_flow(**params)
    assert second["published"] and second["run_key"] != first["run_key"]
    (msg,) = second["warnings"]
    assert "356 -> 300" in msg and "unhelpful 56 -> 0" in msg
    drop = list_runs(Storage.for_uri(uri), "drop")[-1]["manifest"]["labels"]["labelled_count_drop"]
    assert drop["previous_run_key"] == first["run_key"] and drop["previous_n_labelled"] == 356
    assert drop["n_labelled"] == 300 and drop["policies"] == {"unhelpful": {"before": 56, "now": 0}}


# ----------------------------------------------------------------------------- anchors and scales


def test_anchor_labels_of_a_drift_request_become_a_new_anchor_set_version(prefect_server, local_setup):
    """A drift request asks for anchor labels ('a003'...): they go back into their anchor set."""
    from flows.label_requests.raising import raise_drift_requests
    from flows.storage.anchors import list_versions, read_anchor_set, write_anchor_set

    s = local_setup
    anchors_root = str(s["tmp"] / "anchors")
    st_a = Storage.for_uri(anchors_root)
    ids = [f"a{i:03d}" for i in range(20)]
    write_anchor_set(st_a, "anchors", pd.DataFrame({"anchor_id": ids, "prompt": ["p"] * 20, "response": ["r"] * 20,
                                                    "oracle_label": [0.5] * 3 + [None] * 17}))
    look = {"look": 3, "alarm": True, "alarms": ["mean_shift"], "first_alarm": {"mean_shift": 3},
            "meta": {"monitor": "m", "set_name": "anchors", "judge_id": "v2", "anchors_version": 1}}
    (req,) = raise_drift_requests(None, s["uri"], look, ids, config={"drift_anchor_labels": 6, "notify": False},
                                  now=datetime.now(timezone.utc))["requests"]
    asked = [a["anchor_id"] for a in req["anchors"]]
    rows = {"response_id": asked, "oracle_label": [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]}
    path = _write_returned(s, "anchors.csv", rows)
    # without knowing where the anchor set lives, nothing is written and the error says what to pass
    with pytest.raises(CJEInputError, match="pass --anchors-uri"):
        labels(path=path, labels_uri=s["uri"], logs_uri=s["uri"], reevaluate=False)
    assert list_versions(st_a, "anchors") == [1]
    out = labels(path=path, labels_uri=s["uri"], logs_uri=s["uri"], reevaluate=False, anchors_uri=anchors_root)
    assert out["version"] is None and out["rows"] == 0  # nothing for the label store
    (v,) = out["anchors"]
    assert v["set_name"] == "anchors" and v["version"] == 2 and v["labels"] == 6
    new = read_anchor_set(st_a, "anchors").labels()
    assert [new[a] for a in asked] == rows["oracle_label"]
    assert read_anchor_set(st_a, "anchors", 1).labels().notna().sum() == 3  # version 1 untouched
    assert {r["request_id"]: r["status"] for r in out["requests"]} == {req["request_id"]: "fulfilled"}
    assert LabelStore(s["st"]).version() == 1


def test_answers_on_a_one_to_five_scale_are_mapped_onto_the_requests_scale(prefect_server, local_setup):
    s = local_setup
    req = s["request"]
    ids = [r["response_id"] for r in req["rows"]]
    stars = [1 + (i % 5) for i in range(len(ids))]
    path = _write_returned(s, "stars.csv", {"response_id": ids, "oracle_label": stars})
    with pytest.raises(CJEInputError, match=r"label 2.0 is outside the label scale \[0, 1\]"):
        labels(path=path, labels_uri=s["uri"], logs_uri=s["uri"], reevaluate=False)  # scale not declared
    out = labels(path=path, labels_uri=s["uri"], logs_uri=s["uri"], reevaluate=False, label_scale=[1, 5])
    assert out["label_scale"] == [0.0, 1.0] and out["rows"] == len(ids)
    store = LabelStore(s["st"]).read()
    got = dict(zip(store.column("response_id").to_pylist(), store.column("oracle_label").to_pylist()))
    assert [got[i] for i in ids] == [(x - 1) / 4 for x in stars]
    bad = _write_returned(s, "bad.csv", {"response_id": ids[:2], "oracle_label": [3, 6]})
    with pytest.raises(CJEInputError, match=r"row 1: answer 6 for .* is outside the label scale \[1, 5\]"):
        labels(path=bad, labels_uri=s["uri"], logs_uri=s["uri"], reevaluate=False, label_scale=[1, 5])


# ----------------------------------------------------------------------------- which windows labels re-evaluate


def _four_days(tmp_path, seed: int = 11):
    """Logs on 2025-03-01..04 (row i on day i % 4): base rows 0-299 and unhelpful rows 400-455 carry labels."""
    sim = simulate(400, POLICIES, label_design="calibration_policy", oracle_fraction=1.0, audit_labels=400,
                   seed=seed)
    frame = sim.frame.copy().reset_index(drop=True)
    i = np.arange(len(frame))
    inline = (i < 300) | ((i >= 400) & (i < 456))
    frame["oracle_label"] = np.where(inline, sim.oracle_all, np.nan)
    frame["label_probability"] = np.where(inline, 1.0, np.nan)
    start = datetime(2025, 3, 1, tzinfo=timezone.utc)
    frame["ts"] = [start + timedelta(days=int(k % 4), hours=1) for k in i]
    frame["day"] = [f"2025-03-0{1 + k % 4}" for k in i]
    uri = str(tmp_path / "logs")
    write_logs(Storage.for_uri(uri), pa.Table.from_pandas(frame.drop(columns=["day"]), preserve_index=False),
               basename="sim")
    return uri, frame, dict(zip(frame["response_id"], sim.oracle_all))


def _label_file(tmp_path, name, frame, oracle, days, n):
    pick = frame.loc[frame["oracle_label"].isna() & frame["day"].isin(days), "response_id"].tolist()[:n]
    path = tmp_path / name
    pd.DataFrame({"response_id": pick, "oracle_label": [oracle[i] for i in pick]}).to_csv(path, index=False)
    return str(path)


def test_labels_reevaluate_only_published_windows_and_never_one_with_days_missing(prefect_server, ray_cluster,
                                                                                  tmp_path):
    """Issue 26: `cje labels` re-evaluated and published a window nobody asked for (the declared "last 7 days"
    as of today: 4 of its 7 days had logs, overlapping a published window); it became latest.  Now only
    published windows holding the labels are re-evaluated, one with days that have no logs only when asked
    (``partial_windows``), and the report and manifest name the days the run holds."""
    from flows.pipelines.audit import evaluate_and_audit
    from flows.storage.publish import list_runs, read_latest

    uri, frame, oracle = _four_days(tmp_path)
    st = Storage.for_uri(uri)
    opts = {"calibration_policies": ["base"], "inference": "analytic"}
    spec = {"name": "wk", "logs_uri": uri, "window": "last 7 days", "options": opts}
    full = evaluate_and_audit(logs_uri=uri, window="2025-03-01..2025-03-02", evaluation="wk", options=opts,
                              label_requests={"notify": False})
    gap = evaluate_and_audit(logs_uri=uri, window="2025-03-03..2025-03-05", evaluation="wk", options=opts,
                             label_requests={"notify": False})
    assert full["published"] and gap["published"]
    # the report and the manifest say which days a run holds
    gap_run = list_runs(st, "wk", "2025-03-03_2025-03-05")[-1]
    spec_days = gap_run["manifest"]["window_spec"]
    assert spec_days["days"] == ["2025-03-03", "2025-03-04"] and spec_days["missing_days"] == ["2025-03-05"]
    report = open(gap["report"]).read()
    assert "data-days='2025-03-03 2025-03-04' data-missing-days='2025-03-05'" in report
    assert "2 of 3 with logs" in report
    assert "data-days='2025-03-01 2025-03-02' data-missing-days=''" in open(full["report"]).read()

    # labels for rows of 03-02 and 03-03; the declared window as of 03-08 would be 03-01..03-07
    path = _label_file(tmp_path, "new.csv", frame, oracle, ["2025-03-02", "2025-03-03"], 40)
    out = labels(path=path, labels_uri=uri, evaluations=[spec], as_of="2025-03-08", label_requests={"notify": False})
    assert out["new"] and out["touched_dates"] == ["2025-03-02", "2025-03-03"]
    assert [(r["window"], r["published"]) for r in out["reevaluations"]] == [("2025-03-01_2025-03-02", True)]
    (skipped,) = out["skipped_windows"]
    assert skipped["window"] == "2025-03-03_2025-03-05" and skipped["missing_days"] == ["2025-03-05"]
    assert "--partial-windows" in skipped["reason"]
    windows = {r["window"] for r in list_runs(st, "wk")}
    assert windows == {"2025-03-01_2025-03-02", "2025-03-03_2025-03-05"}  # no window nobody published
    # latest.json follows the runs' identity (window end, start, label version; issue 25): the re-evaluated
    # older window is a new run but not the latest one
    assert read_latest(st, "wk")["window"] == "2025-03-03_2025-03-05"
    assert LabelStore(st).reevaluated(out["version"])["skipped"][0]["window"] == "2025-03-03_2025-03-05"

    # asked for: the window with a day missing is re-evaluated and says so
    path2 = _label_file(tmp_path, "more.csv", frame.loc[~frame["response_id"].isin(pd.read_csv(path)["response_id"])],
                        oracle, ["2025-03-04"], 20)
    out2 = labels(path=path2, labels_uri=uri, evaluations=[spec], partial_windows=True,
                  label_requests={"notify": False})
    (re2,) = out2["reevaluations"]
    assert re2["window"] == "2025-03-03_2025-03-05" and re2["published"] and re2["missing_days"] == ["2025-03-05"]
    assert out2["skipped_windows"] == []
    assert "data-missing-days='2025-03-05'" in open(re2["report"]).read()
