"""Argilla records and settings checked against the ``argilla`` SDK's own models (no server).

``rg.Record(**record)`` builds the SDK's record (its ``api_model()`` is the pydantic ``RecordModel``
the server receives); the settings map onto ``FieldModel`` / ``QuestionModel`` /
``MetadataFieldModel``.  Answers come back through ``Record.to_dict()``, the SDK's export form.
"""
from __future__ import annotations

import json
import uuid

import pytest

from flows.integrations.labelling.argilla import parse_argilla
from flows.label_requests.exports import export_request, request_items

rg = pytest.importorskip("argilla", reason="the argilla SDK (test extra: argilla==2.8.0) validates the records")
M = pytest.importorskip("argilla._models")

MANIFEST = {"request_id": "lr-20250305-9f3a0e85bf64", "label_scale": [1.0, 5.0],
            "reasons": [{"trigger": "audit_failed", "reason": "the transport audit of 'u' failed"}],
            "rows": [{"response_id": f"u:p{i}:0", "policy": "u", "dt": "2025-03-01", "stratum": i % 2,
                      "judge_score": 0.1 * i, "selection_probability": 0.25, "inclusion_probability": 0.0125}
                     for i in range(4)],
            "anchors": [{"anchor_id": "a003", "selection_probability": 0.2}], "drift": {"set_name": "anchors"}}
TEXTS = {r["response_id"]: {"prompt": f"q{i}", "response": f"a{i}"} for i, r in enumerate(MANIFEST["rows"])}
ANCHORS = {"a003": {"prompt": "anchor q", "response": "anchor a"}}


def _doc(include_judge_score=False):
    items = request_items(MANIFEST, TEXTS, ANCHORS, include_judge_score=include_judge_score)
    return json.loads(export_request(items, "argilla", label_scale=MANIFEST["label_scale"]))


def _settings_models(settings: dict):
    fields = [M.FieldModel(name=f["name"], required=f["required"], settings=M.TextFieldSettings())
              for f in settings["fields"]]
    qs = []
    for q in settings["questions"]:
        s = (M.RatingQuestionSettings(options=[{"value": v} for v in q["values"]]) if q["type"] == "rating"
             else M.TextQuestionSettings())
        qs.append(M.QuestionModel(name=q["name"], title=q["title"], required=q["required"], settings=s))
    kinds = {"terms": M.TermsMetadataPropertySettings, "float": M.FloatMetadataPropertySettings}
    meta = [M.MetadataFieldModel(name=m["name"], settings=kinds[m["type"]]()) for m in settings["metadata"]]
    return fields, qs, meta


def test_records_and_settings_are_valid_sdk_models():
    doc = _doc()
    fields, questions, meta = _settings_models(doc["settings"])
    assert [f.name for f in fields] == ["prompt", "response"]
    assert questions[0].settings.options == [{"value": v} for v in range(1, 6)]  # the 1-5 scale
    float_props = {m.name for m in meta if m.settings.type == "float"}
    for rec in doc["records"]:
        model = rg.Record(**rec).api_model()  # the SDK's pydantic RecordModel: raises on a bad record
        assert model.external_id == rec["id"]
        assert set(model.fields) == {f.name for f in fields} and all(model.fields.values())
        for k in float_props & set(rec["metadata"]):
            assert isinstance(rec["metadata"][k], float)
    by = {r["id"]: r for r in doc["records"]}
    assert by["a003"]["metadata"]["kind"] == "anchor" and by["a003"]["fields"]["prompt"] == "anchor q"
    assert by["u:p1:0"]["metadata"]["inclusion_probability"] == 0.0125
    assert all("judge_score" not in r["metadata"] for r in doc["records"])
    assert "judge_score" in _doc(include_judge_score=True)["records"][1]["metadata"]


def test_answers_come_back_from_the_sdks_record_dicts():
    doc = _doc()
    users = [uuid.uuid4(), uuid.uuid4()]
    out = []
    for i, rec in enumerate(doc["records"]):
        responses = [rg.Response(question_name="oracle_label", value=1 + i % 5, user_id=users[0],
                                 status="submitted")]
        if i == 0:  # a second labeller agrees
            responses.append(rg.Response(question_name="oracle_label", value=1, user_id=users[1], status="submitted"))
        out.append(rg.Record(**rec, responses=responses).to_dict())
    out.append(rg.Record(id="u:p9:0", fields={"prompt": "q", "response": "a"}).to_dict())  # not answered yet
    got = parse_argilla(json.loads(json.dumps(out, default=str)), "argilla.json")
    assert got.ids == [r["id"] for r in doc["records"]] and got.values == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert got.duplicates == 1 and got.unanswered == ["u:p9:0"]
