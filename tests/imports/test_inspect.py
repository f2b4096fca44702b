"""`cje import inspect`: logs written by inspect-ai 0.3.285 itself (scripts/fixtures/make_inspect.py).

The fixture: task ``capitals_qa`` (40 samples) run on three Inspect mock models (``mockllm/careful``,
``mockllm/hasty``, ``mockllm/verbose``) with ``model_graded_qa`` graded 0-10 by a fourth mock model, and an
expert's 1-5 rating added to every other sample with Inspect's ``edit_score`` (score ``human``, with
provenance): the oracle labels, found without a flag. Logs in Inspect's default ``.eval`` format (zip
archives with zstd members), and one 4-sample log in ``--log-format json``.
"""
from __future__ import annotations

import json
import struct
import zipfile

import pandas as pd
import pyarrow as pa
import pytest

from cje_engine.errors import CJEInputError
from flows.cli import main as cli
from flows.integrations.importers import ImportMapping, ImportReport, get, map_records
from tests.imports.helpers import FIXTURES, assert_same_numbers, direct_result, import_and_evaluate

INSPECT = FIXTURES / "inspect"
LOGS = INSPECT / "logs"
SMALL = INSPECT / "small.json"


def members(path):
    """Every JSON member of an .eval archive, decoded here on purpose (stored, deflate or zstd)."""
    with zipfile.ZipFile(path) as zf, open(path, "rb") as fh:
        for info in zf.infolist():
            if info.compress_type != 93:
                yield info.filename, json.loads(zf.read(info))
                continue
            fh.seek(info.header_offset)
            head = fh.read(30)
            n, m = struct.unpack("<HH", head[26:30])
            fh.seek(n + m, 1)
            data = pa.Codec("zstd").decompress(fh.read(info.compress_size), decompressed_size=info.file_size)
            yield info.filename, json.loads(data.to_pybytes())


def grade(v) -> float:
    return {"C": 1.0, "P": 0.5, "I": 0.0}.get(v, None) if isinstance(v, str) and not v.isdigit() else float(v)


def direct_frame() -> pd.DataFrame:
    """The .eval logs read with zipfile + json: model, sample id, the grader's grade, the human score."""
    rows = []
    for path in sorted(LOGS.glob("*.eval")):
        docs = dict(members(path))
        spec = docs["header.json"]["eval"]
        for name, s in docs.items():
            if not name.startswith("samples/"):
                continue
            human = s["scores"].get("human")
            rows.append({"prompt_id": f"{spec['task']}/{s['id']}", "policy": spec["model"],
                         "response_id": f"{spec['eval_id']}/{s['id']}/{s['epoch']}",
                         "judge_score": grade(s["scores"]["model_graded_qa"]["value"]),
                         "oracle_label": float(human["value"]) if human else None})
    return pd.DataFrame(rows)


def _rows(src, **flags):
    imp = get("inspect")
    rep = ImportReport("inspect", str(src))
    return list(map_records(imp.records(src), ImportMapping.build(imp, **flags), rep)), rep


def test_inspect_import_then_evaluate_gives_the_direct_numbers(capsys, tmp_path):
    report, result, _ = import_and_evaluate(capsys, tmp_path, "inspect", LOGS,
                                            evaluate_flags=("--score-scale", "0-10", "--label-scale", "1-5"))
    frame = direct_frame()
    assert (report["records"], report["mapped"], report["written"]) == (120, 120, 120)
    assert report["policies"] == {"mockllm/careful": 40, "mockllm/hasty": 40, "mockllm/verbose": 40}
    assert report["judges"] == {"model_graded_qa": 120} and report["labels"] == {"human": 60}
    assert_same_numbers(result, direct_result(frame, score_scale="0-10", label_scale="1-5"), frame)
    pol = result["policies"]
    assert pol["mockllm/verbose"]["raw_judge_mean"] > pol["mockllm/hasty"]["raw_judge_mean"]
    assert pol["mockllm/careful"]["estimate"] > pol["mockllm/verbose"]["estimate"]


def test_json_log_is_streamed_and_maps_like_the_document_says():
    rows, rep = _rows(SMALL)
    doc = json.loads(SMALL.read_text())
    assert len(rows) == len(doc["samples"]) == 4
    for r, s in zip(rows, doc["samples"]):
        assert r.policy == doc["eval"]["model"] and r.prompt_id == f"capitals_qa/{s['id']}"
        assert r.judge_score == float(s["scores"]["model_graded_qa"]["value"])
        human = s["scores"].get("human")
        assert r.oracle_label == (float(human["value"]) if human else None)
        assert r.response == s["output"]["completion"] and r.prompt == s["input"]
    assert rep.labels == {"human": 2}


def test_letter_grades_map_to_inspects_value_to_float(tmp_path):
    doc = json.loads(SMALL.read_text())
    for s, g in zip(doc["samples"], "CPIN"):
        s["scores"]["model_graded_qa"]["value"] = g
    p = tmp_path / "letters.json"
    p.write_text(json.dumps(doc))
    rows, rep = _rows(p)
    assert [r.judge_score for r in rows] == [1.0, 0.5, 0.0, 0.0] and rep.judge_scale == (0.0, 1.0)


def test_unscored_and_errored_samples_are_reported_not_dropped_silently(tmp_path):
    doc = json.loads(SMALL.read_text())
    doc["samples"][1]["scores"]["model_graded_qa"]["value"] = float("nan")
    doc["samples"][2]["error"] = {"message": "RuntimeError", "traceback": ""}
    p = tmp_path / "partial.json"
    p.write_text(json.dumps(doc))  # NaN written as Inspect writes it
    rows, rep = _rows(p)
    assert len(rows) == 2 and rep.skipped["judge score not numeric"].count == 1
    assert rep.notes["samples that ended in an error: not responses"] == 1


def test_reimport_is_idempotent(capsys, tmp_path):
    logs = tmp_path / "logs"
    out = []
    for _ in range(2):
        assert cli.main(["import", "inspect", str(LOGS), "--out", str(logs), "--json"]) == 0
        out.append(json.loads(capsys.readouterr().out))
    assert out[0]["written"] == 120 and out[1]["already_imported"] is True


# ----------------------------------------------------------------------------- bad input


def test_truncated_eval_archive_is_bad_input(capsys, tmp_path):
    src = sorted(LOGS.glob("*.eval"))[0]
    cut = tmp_path / "cut.eval"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    code = cli.main(["import", "inspect", str(cut), "--out", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert code == 2 and "cut.eval" in err and "not an Inspect .eval log" in err


def test_a_corrupt_zstd_member_fails_its_crc_and_names_the_member(tmp_path):
    src = sorted(LOGS.glob("*.eval"))[0]
    data = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as zf:
        info = zf.getinfo("samples/q005_epoch_1.json")
    n, m = struct.unpack("<HH", bytes(data[info.header_offset + 26: info.header_offset + 30]))
    at = info.header_offset + 30 + n + m + info.compress_size // 2
    data[at] ^= 0xFF
    bad = tmp_path / "flipped.eval"
    bad.write_bytes(bytes(data))
    with pytest.raises(CJEInputError) as e:
        _rows(bad)
    assert e.value.source == str(bad) and "samples/q005_epoch_1.json" in str(e.value)


def test_a_sample_without_id_names_record_and_field(tmp_path):
    doc = json.loads(SMALL.read_text())
    del doc["samples"][2]["id"]
    p = tmp_path / "noid.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(CJEInputError) as e:
        _rows(p)
    assert e.value.source == str(p) and e.value.row == 2 and e.value.column == "id" and "samples[2]" in str(e.value)


def test_scores_of_the_wrong_type_name_record_and_field(tmp_path):
    doc = json.loads(SMALL.read_text())
    doc["samples"][1]["scores"] = ["C"]
    p = tmp_path / "scores.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(CJEInputError) as e:
        _rows(p)
    assert e.value.row == 1 and e.value.column == "scores"


def test_a_truncated_json_log_is_bad_input_naming_the_offset(tmp_path):
    text = SMALL.read_text()
    p = tmp_path / "cut.json"
    p.write_text(text[: int(len(text) * 0.6)])
    with pytest.raises(CJEInputError) as e:
        _rows(p)
    assert e.value.source == str(p) and "character" in str(e.value)


def test_a_cancelled_run_imports_its_logged_samples_and_says_so(tmp_path):
    doc = json.loads(SMALL.read_text())
    doc["status"] = "cancelled"
    doc["samples"] = doc["samples"][:3]
    p = tmp_path / "cancelled.json"
    p.write_text(json.dumps(doc))
    rows, rep = _rows(p)
    assert len(rows) == 3
    assert rep.notes["logs of runs that did not finish (status cancelled): their logged samples imported"] == 1
