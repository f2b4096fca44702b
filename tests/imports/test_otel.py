"""`cje import otel`: spans exported by the OpenTelemetry SDK (fixtures: scripts/fixtures/make_otel.py)."""
from __future__ import annotations

import base64
import json

import pandas as pd
import pytest

from cje_engine.errors import CJEInputError
from flows.cli import main as cli
from flows.integrations.importers import ImportMapping, ImportReport, get, map_records
from tests.imports.helpers import FIXTURES, assert_same_numbers, direct_result, import_and_evaluate, text_id

JSONL = FIXTURES / "otel_spans.jsonl"


def _attrs(items):
    return {kv["key"]: next(iter(kv["value"].values())) for kv in items}


def direct_frame() -> pd.DataFrame:
    """The fixture read with plain json, independently of the importer."""
    spans, labels = [], {}
    for line in JSONL.read_text().splitlines():
        doc = json.loads(line)
        for rl in doc.get("resourceLogs", []):
            for sl in rl["scopeLogs"]:
                for lr in sl["logRecords"]:
                    a = _attrs(lr["attributes"])
                    labels[lr["spanId"]] = a["gen_ai.evaluation.score.value"]
        for rs in doc.get("resourceSpans", []):
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    a = _attrs(sp.get("attributes", []))
                    if "gen_ai.request.model" not in a:
                        continue
                    judge = [_attrs(e["attributes"])["gen_ai.evaluation.score.value"] for e in sp["events"]]
                    prompt = json.loads(a["gen_ai.input.messages"])[0]["parts"][0]["content"]
                    spans.append({"prompt_id": text_id(prompt), "policy": a["gen_ai.request.model"],
                                  "response_id": f"{sp['traceId']}:{sp['spanId']}", "judge_score": judge[0],
                                  "span": sp["spanId"]})
    frame = pd.DataFrame(spans)
    frame["oracle_label"] = frame["span"].map(labels)
    return frame.drop(columns="span")


def test_otel_import_then_evaluate_gives_the_direct_numbers(capsys, tmp_path):
    report, result, _ = import_and_evaluate(capsys, tmp_path, "otel", JSONL, "--label-from", "human_rating")
    frame = direct_frame()
    assert (report["records"], report["mapped"], report["written"]) == (300, 300, 300)
    assert report["labels"] == {"human_rating": int(frame["oracle_label"].notna().sum())} == {"human_rating": 132}
    assert report["notes"] == {"spans without gen_ai operation attributes (not responses)": 1}
    assert_same_numbers(result, direct_result(frame), frame)


def test_the_three_otel_encodings_map_to_the_same_rows():
    """OTLP/JSON lines (hex ids), protobuf JSON (base64 ids) and the SDK console JSON agree span for span."""
    imp = get("otel")
    rows = {}
    for name in ("otel_spans.jsonl", "otel_spans.json", "otel_console.json"):
        rep = ImportReport("otel", name)
        rows[name] = {r.response_id: (r.policy, r.prompt_id, r.judge_score, r.ts)
                      for r in map_records(imp.records(FIXTURES / name), ImportMapping.build(imp, judge_from="relevance"), rep)}
    assert len(rows["otel_spans.json"]) == 300 and len(rows["otel_console.json"]) == 12
    assert rows["otel_spans.json"] == rows["otel_spans.jsonl"]
    assert all(rows["otel_spans.jsonl"][k] == v for k, v in rows["otel_console.json"].items())


def test_two_unnamed_evaluations_ask_for_label_from(capsys, tmp_path):
    code = cli.main(["import", "otel", str(JSONL), "--out", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert code == 2 and "several scores that could be the judge" in err and "--label-from" in err
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").rglob("*.parquet"))


def test_bad_span_names_file_record_and_field(tmp_path):
    doc = json.loads(JSONL.read_text().splitlines()[0])
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][3]["startTimeUnixNano"] = "yesterday"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(doc) + "\n")
    with pytest.raises(CJEInputError) as e:
        list(get("otel").records(bad))
    assert e.value.source == str(bad) and e.value.row == 3 and e.value.column == "startTimeUnixNano"
    assert "record 3" in str(e.value) and "timestamp" in str(e.value)


def test_truncated_otlp_document_is_bad_input_with_its_offset(tmp_path):
    text = (FIXTURES / "otel_spans.json").read_text()
    bad = tmp_path / "cut.json"
    bad.write_text(text[: len(text) // 2])
    with pytest.raises(CJEInputError) as e:
        list(get("otel").records(bad))
    assert e.value.source == str(bad) and "character" in str(e.value)


def test_base64_and_hex_ids_agree():
    from flows.integrations.importers.otel import hex_id

    raw = bytes(range(16))
    assert hex_id(base64.b64encode(raw).decode()) == raw.hex() == hex_id(raw.hex().upper()) == hex_id("0x" + raw.hex())
