"""`cje import langsmith`: runs and feedback built with the LangSmith SDK's schemas (scripts/fixtures/make_langsmith.py)."""
from __future__ import annotations

import json

import pandas as pd

from flows.integrations.importers import ImportMapping, ImportReport, get, map_records
from tests.imports.helpers import FIXTURES, assert_same_numbers, direct_result, import_and_evaluate

EXPORT = FIXTURES / "langsmith_export"


def direct_frame() -> pd.DataFrame:
    """The export read with plain json: llm runs joined with model and app feedback by run id."""
    fb = json.loads((EXPORT / "feedback.json").read_text())
    judge = {f["run_id"]: f["score"] for f in fb if f["feedback_source"]["type"] == "model"}
    human = {f["run_id"]: f["score"] for f in fb if f["feedback_source"]["type"] == "app"}
    rows = []
    for line in (EXPORT / "runs.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["run_type"] != "llm":
            continue
        rows.append({"prompt_id": r["reference_example_id"], "policy": r["extra"]["metadata"]["ls_model_name"],
                     "response_id": r["id"], "judge_score": judge[r["id"]], "oracle_label": human.get(r["id"])})
    return pd.DataFrame(rows)


def test_langsmith_import_then_evaluate_gives_the_direct_numbers(capsys, tmp_path):
    report, result, _ = import_and_evaluate(capsys, tmp_path, "langsmith", EXPORT)  # no flags: sources say who scored
    frame = direct_frame()
    assert (report["records"], report["mapped"], report["written"]) == (300, 300, 300)
    assert report["judges"] == {"correctness": 300} and report["labels"] == {"user_rating": 132}
    assert_same_numbers(result, direct_result(frame), frame)


def test_feedback_stats_stand_in_when_there_is_no_feedback_file(tmp_path):
    src = tmp_path / "runs.jsonl"
    src.write_text((EXPORT / "runs.jsonl").read_text())
    imp = get("langsmith")
    rep = ImportReport("langsmith", str(src))
    rows = list(map_records(imp.records(src), ImportMapping.build(imp, judge_from="correctness",
                                                                  label_from="user_rating"), rep))
    frame = direct_frame().set_index("response_id")
    assert len(rows) == 300 and rep.labels == {"user_rating": 132}
    assert all(r.judge_score == frame.loc[r.response_id, "judge_score"] for r in rows)
