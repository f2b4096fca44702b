"""`cje import langfuse`: an export built with the Langfuse SDK's models (scripts/fixtures/make_langfuse.py)."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from cje_engine.errors import CJEInputError
from flows.integrations.importers import ImportMapping, ImportReport, get, map_records
from tests.imports.helpers import FIXTURES, assert_same_numbers, direct_result, import_and_evaluate, text_id

EXPORT = FIXTURES / "langfuse_export"


def direct_frame() -> pd.DataFrame:
    """The export read with plain json: generations joined with their EVAL and ANNOTATION scores."""
    scores = [json.loads(line) for line in (EXPORT / "scores.jsonl").read_text().splitlines()]
    judge = {s["observationId"]: s["value"] for s in scores if s["name"] == "helpfulness"}
    human = {s["traceId"]: s["value"] for s in scores if s["source"] == "ANNOTATION"}
    rows = []
    for line in (EXPORT / "observations.jsonl").read_text().splitlines():
        o = json.loads(line)
        if o["type"] != "GENERATION":
            continue
        rows.append({"prompt_id": text_id(o["input"][-1]["content"]), "policy": o["model"], "response_id": o["id"],
                     "judge_score": judge[o["id"]], "oracle_label": human.get(o["traceId"])})
    return pd.DataFrame(rows)


def test_langfuse_import_then_evaluate_gives_the_direct_numbers(capsys, tmp_path):
    report, result, _ = import_and_evaluate(capsys, tmp_path, "langfuse", EXPORT, "--judge-from", "helpfulness",
                                            evaluate_flags=("--label-scale", "1-5"))
    frame = direct_frame()
    assert (report["records"], report["mapped"], report["written"]) == (300, 300, 300)
    assert report["labels"] == {"quality": 132} and report["label_scale"] == [1.0, 5.0]
    assert report["unused_scores"] == {"toxicity": 300}
    assert report["next"].endswith("--label-scale 1-5")  # the scale the score config declares
    assert_same_numbers(result, direct_result(frame, label_scale="1-5"), frame)


def test_trace_scores_are_not_attached_to_one_of_several_generations(tmp_path):
    obs = [json.loads(line) for line in (EXPORT / "observations.jsonl").read_text().splitlines()]
    gens = [o for o in obs if o["type"] == "GENERATION"][:2]
    gens[1]["traceId"] = gens[0]["traceId"]  # two generations in one trace
    scores = [json.loads(line) for line in (EXPORT / "scores.jsonl").read_text().splitlines()]
    keep = [s for s in scores if s.get("observationId") in {g["id"] for g in gens}]
    keep.append({"id": "h1", "traceId": gens[0]["traceId"], "name": "quality", "value": 4, "dataType": "NUMERIC",
                 "source": "ANNOTATION"})
    src = tmp_path / "one.json"
    src.write_text(json.dumps(gens + keep))  # one JSON array holding every record
    imp = get("langfuse")
    rep = ImportReport("langfuse", str(src))
    rows = list(map_records(imp.records(src), ImportMapping.build(imp, judge_from="helpfulness"), rep))
    assert len(rows) == 2 and all(r.oracle_label is None for r in rows)
    assert rep.notes["generations whose trace-level scores were not attached (the trace has several generations)"] == 2


def test_bad_observation_names_file_record_and_field(tmp_path):
    lines = (EXPORT / "observations.jsonl").read_text().splitlines()[:4]
    bad = json.loads(lines[3])
    bad["startTime"] = "not a time"
    src = tmp_path / "obs.jsonl"
    src.write_text("\n".join(lines[:3] + [json.dumps(bad)]) + "\n")
    with pytest.raises(CJEInputError) as e:
        list(get("langfuse").records(src))
    assert e.value.source == str(src) and e.value.column == "startTime" and e.value.row == 1
    assert "line 4" in str(e.value)
