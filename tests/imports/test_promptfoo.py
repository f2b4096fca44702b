"""`cje import promptfoo`: result files written by promptfoo 0.121.20 itself (scripts/fixtures/make_promptfoo.sh).

The fixture run: 40 tests x 3 local Python providers (``careful``, ``hasty``, ``verbose``), an ``llm-rubric``
judge (``metric: helpfulness``) whose grader is a local stub, and an expert's 1-5 rating (a ``python``
assertion with ``metric: expert``) on every other test: the oracle labels, named with ``--label-from``.
"""
from __future__ import annotations

import gzip
import hashlib
import json

import pandas as pd
import pytest

from cje_engine.errors import CJEInputError
from flows.cli import main as cli
from flows.integrations.importers import ImportMapping, ImportReport, get, map_records
from tests.imports.helpers import FIXTURES, assert_same_numbers, direct_result, import_and_evaluate

PF = FIXTURES / "promptfoo"
RESULTS = PF / "results.json.gz"
RESULTS_JSONL = PF / "results.jsonl.gz"
PROMPTS = PF / "prompts-results.json"


def case_key(test_case: dict) -> str:
    """The prompt id of a test case, recomputed here on purpose (sha1 of its description and vars)."""
    body = json.dumps({"description": test_case.get("description"), "vars": test_case.get("vars")},
                      sort_keys=True, separators=(",", ":"))
    return "pf:" + hashlib.sha1(body.encode()).hexdigest()[:16]


def direct_frame(path=RESULTS) -> pd.DataFrame:
    """The results read with plain json: provider label, llm-rubric score, the expert's rating."""
    doc = json.loads(gzip.decompress(path.read_bytes()))
    rows = []
    for r in doc["results"]["results"]:
        comps = {c["assertion"]["metric"]: c["score"] for c in r["gradingResult"]["componentResults"]}
        rows.append({"prompt_id": case_key(r["testCase"]), "policy": r["provider"]["label"], "response_id": r["id"],
                     "judge_score": comps["helpfulness"], "oracle_label": comps.get("expert")})
    return pd.DataFrame(rows)


def _rows(src, **flags):
    imp = get("promptfoo")
    rep = ImportReport("promptfoo", str(src))
    return list(map_records(imp.records(src), ImportMapping.build(imp, **flags), rep)), rep


def test_promptfoo_import_then_evaluate_gives_the_direct_numbers(capsys, tmp_path):
    report, result, _ = import_and_evaluate(capsys, tmp_path, "promptfoo", RESULTS, "--label-from", "score:expert",
                                            evaluate_flags=("--label-scale", "1-5"))
    frame = direct_frame()
    assert (report["records"], report["mapped"], report["written"]) == (120, 120, 120)
    assert report["policies"] == {"careful": 40, "hasty": 40, "verbose": 40}
    assert report["judges"] == {"helpfulness": 120} and report["labels"] == {"expert": 60}
    assert report["judge_scale"] == [0.0, 1.0] and report["label_range"] == [1.0, 5.0]
    assert "--label-scale LO-HI (observed 1..5; declare the scale)" in report["next"]  # not guessed
    assert_same_numbers(result, direct_result(frame, label_scale="1-5"), frame)
    # the verbose provider pads its answers and the judge likes length; the expert does not
    pol = result["policies"]
    assert pol["verbose"]["raw_judge_mean"] > pol["hasty"]["raw_judge_mean"]
    assert pol["verbose"]["estimate"] < pol["careful"]["estimate"]


def test_jsonl_output_maps_to_the_same_rows_as_the_json_output():
    rows_json, _ = _rows(RESULTS, label_from="score:expert")
    rows_jsonl, rep = _rows(RESULTS_JSONL, label_from="score:expert")
    key = lambda r: (r.response_id, r.prompt_id, r.policy, r.judge_score, r.oracle_label, r.prompt, r.response)  # noqa: E731
    assert sorted(map(key, rows_json)) == sorted(map(key, rows_jsonl)) and len(rows_json) == 120
    assert any("carry no timestamp" in n for n in rep.notes)


def test_several_prompts_make_the_prompt_label_part_of_the_policy():
    rows, rep = _rows(PROMPTS, label_from="expert")
    assert dict(rep.policies) == {"careful/qa-v1": 5, "careful/qa-v2": 5, "hasty/qa-v1": 5, "hasty/qa-v2": 5}
    by_prompt = {}
    for r in rows:
        by_prompt.setdefault(r.prompt_id, set()).add(r.policy)
    assert len(by_prompt) == 5 and all(len(p) == 4 for p in by_prompt.values())  # one test case, four policies
    rows2, rep2 = _rows(PROMPTS, label_from="expert", policy_from="provider:label")
    assert dict(rep2.policies) == {"careful": 10, "hasty": 10}


def test_without_label_from_the_two_assertion_scores_ask_for_a_choice(capsys, tmp_path):
    code = cli.main(["import", "promptfoo", str(RESULTS), "--out", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert code == 2 and "several scores that could be the" in err and "helpfulness" in err and "expert" in err
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").rglob("*.parquet"))


def test_reimport_is_idempotent_and_ids_are_stable(capsys, tmp_path):
    logs = tmp_path / "logs"
    reports = []
    for _ in range(2):
        assert cli.main(["import", "promptfoo", str(RESULTS), "--out", str(logs), "--label-from", "expert",
                         "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0]["written"] == 120 and reports[1]["already_imported"] is True
    assert len(list(logs.rglob("*.parquet"))) == 1
    # the JSON Lines output of the same eval holds the same response ids: nothing new on that day
    rows_a, _ = _rows(RESULTS, label_from="expert")
    rows_b, _ = _rows(RESULTS, label_from="expert")
    assert [r.response_id for r in rows_a] == [r.response_id for r in rows_b]
    assert len({r.response_id for r in rows_a}) == 120


# ----------------------------------------------------------------------------- bad input


def _doc() -> dict:
    return json.loads(PROMPTS.read_text())


def _write(tmp_path, doc, name="bad.json"):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def test_truncated_results_file_is_bad_input_naming_file_and_record(capsys, tmp_path):
    text = PROMPTS.read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: len(text) // 2])
    with pytest.raises(CJEInputError) as e:
        _rows(cut, label_from="expert")
    assert e.value.source == str(cut) and "record" in str(e.value) and "character" in str(e.value)
    code = cli.main(["import", "promptfoo", str(cut), "--out", str(tmp_path / "logs"), "--label-from", "expert"])
    assert code == 2 and "cut.json" in capsys.readouterr().err
    assert not any((tmp_path / "logs").rglob("*.parquet")) if (tmp_path / "logs").exists() else True


def test_truncated_gzip_is_bad_input(tmp_path):
    raw = RESULTS.read_bytes()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CJEInputError) as e:
        _rows(cut, label_from="expert")
    assert e.value.source == str(cut) and "gzip" in str(e.value)


def test_a_result_without_provider_names_record_and_field(tmp_path):
    doc = _doc()
    del doc["results"]["results"][3]["provider"]
    bad = _write(tmp_path, doc)
    with pytest.raises(CJEInputError) as e:
        _rows(bad, label_from="expert")
    assert e.value.source == str(bad) and e.value.row == 3 and e.value.column == "provider"
    assert "results.results[3]" in str(e.value)


def test_a_score_of_the_wrong_type_names_record_and_field(tmp_path):
    doc = _doc()
    doc["results"]["results"][7]["gradingResult"]["componentResults"][0]["score"] = "high"
    bad = _write(tmp_path, doc)
    with pytest.raises(CJEInputError) as e:
        _rows(bad, label_from="expert")
    assert e.value.row == 7 and e.value.column == "gradingResult.componentResults[0].score"
    assert '"high"' in str(e.value)


def test_vars_of_the_wrong_type_name_record_and_field(tmp_path):
    doc = _doc()
    doc["results"]["results"][2]["vars"] = ["not", "an", "object"]
    with pytest.raises(CJEInputError) as e:
        _rows(_write(tmp_path, doc), label_from="expert")
    assert e.value.row == 2 and e.value.column == "vars"


def test_a_file_that_is_not_promptfoo_output_says_so(tmp_path):
    bad = _write(tmp_path, {"resourceSpans": []}, "spans.json")
    with pytest.raises(CJEInputError) as e:
        _rows(bad)
    assert "not a promptfoo results file" in str(e.value)


def test_provider_errors_are_counted_not_imported(tmp_path):
    doc = _doc()
    r = doc["results"]["results"][0]
    r["failureReason"], r["response"] = 2, {"error": "API error: 500"}
    rows, rep = _rows(_write(tmp_path, doc), label_from="expert")
    assert len(rows) == 19 and rep.records == 19
    assert rep.notes["results with an error instead of a response (failureReason ERROR): not responses"] == 1
