"""The import framework on a toy importer: mapping, report, the daily layout, idempotent re-import."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from flows.cli import main as cli
from flows.integrations import importers
from tests.imports.toy import ToyImporter


@pytest.fixture
def toy():
    imp = importers.register(ToyImporter(), replace=True)
    yield imp
    importers.IMPORTERS.unregister(imp.name)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"id": "r1", "model": "a", "prompt_id": "p1", "judge": 0.5, "human": 0.6, "ts": "2025-03-01T10:00:00Z"},
    {"id": "r2", "model": "b", "prompt_id": "p1", "judge": 0.7, "ts": "2025-03-02T10:00:00Z"},
    {"id": "r3", "prompt_id": "p2", "judge": 0.1, "ts": "2025-03-02T11:00:00Z"},            # no policy
    {"id": "r4", "model": "a", "prompt_id": "p2", "human": 0.9, "ts": "2025-03-02T12:00:00Z"},  # label, no judge
]


def test_toy_import_writes_the_daily_layout_and_a_second_import_writes_nothing(toy, tmp_path, capsys):
    src = _write(tmp_path / "toy.jsonl", ROWS)
    logs = tmp_path / "logs"
    assert cli.main(["import", "toy", str(src), "--out", str(logs), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["records"], doc["mapped"], doc["written"]) == (4, 2, 2)
    assert doc["skipped"]["no policy"]["count"] == 1
    assert doc["skipped"]["label without judge score"]["examples"][0]["record"] == 3
    assert sorted(p.parent.name for p in logs.rglob("*.parquet")) == ["dt=2025-03-01", "dt=2025-03-02"]
    table = ds.dataset(logs, format="parquet", partitioning="hive").to_table().sort_by("response_id")
    assert table.column("oracle_label").to_pylist() == [0.6, None]
    assert table.column("judge_name").to_pylist() == ["judge", "judge"]

    before = sorted((p, p.stat().st_mtime_ns) for p in logs.rglob("*") if p.is_file())
    assert cli.main(["import", "toy", str(src), "--out", str(logs), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["already_imported"] is True and again["written"] == 2
    assert sorted((p, p.stat().st_mtime_ns) for p in logs.rglob("*") if p.is_file()) == before


def test_bad_record_exits_2_naming_file_record_and_field_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "spans.jsonl"
    src.write_text('{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "ab", "spanId": "cd", '
                   '"startTimeUnixNano": "soon", "attributes": [{"key": "gen_ai.request.model", '
                   '"value": {"stringValue": "m"}}]}]}]}]}\n')
    logs = tmp_path / "logs"
    assert cli.main(["import", "otel", str(src), "--out", str(logs)]) == 2
    err = capsys.readouterr().err
    assert str(src) in err and "record 0" in err and "'startTimeUnixNano'" in err and "timestamp" in err
    assert not logs.exists() or not any(logs.rglob("*.parquet"))


def test_unknown_format_and_bad_selector_exit_2_naming_the_choices(tmp_path, capsys):
    src = _write(tmp_path / "x.jsonl", ROWS)
    assert cli.main(["import", "langfuze", str(src), "--out", str(tmp_path / "logs")]) == 2
    assert "did you mean 'langfuse'" in capsys.readouterr().err
    assert cli.main(["import", "otel", str(src), "--out", str(tmp_path / "logs"), "--policy-from", "atr:model"]) == 2
    err = capsys.readouterr().err
    assert "--policy-from" in err and "'attr'" in err
    assert cli.main(["import", "otel", str(src)]) == 64  # --out is required: a usage error


def test_every_builtin_importer_follows_the_protocol():
    assert importers.names()[:3] == ("otel", "langfuse", "langsmith")
    with pytest.raises(TypeError, match="lacks"):
        importers.register(type("Half", (), {"name": "half"})())
    with pytest.raises(ValueError, match="already registered"):
        importers.register(importers.get("otel"))


def test_selectors_join_and_fall_back():
    from flows.integrations.importers import Selector

    sel = Selector.parse("attr:model+metadata:v|attr:system", ("attr", "metadata"), "attr", "--policy-from")
    assert sel.resolve({"attr:model": "m", "metadata:v": 3}) == "m/3"
    assert sel.resolve({"attr:model": "m", "attr:system": "openai"}) == "openai"
    assert sel.resolve({}) is None


def test_scale_hints_are_declared_scales_never_guesses():
    from flows.integrations.importers import ImportReport

    rep = ImportReport("toy", "x", judge_range=(0.1, 0.9), label_range=(1.5, 5.0), label_scale=(1.0, 5.0))
    assert rep.scale_hint() == "--label-scale 1-5"
    rep = ImportReport("toy", "x", judge_range=(2.0, 9.0))
    assert rep.scale_hint() == "--score-scale LO-HI (observed 2..9; declare the scale)"
    assert ImportReport("toy", "x", judge_range=(0.0, 1.0), judge_scale=(0.0, 1.0)).scale_hint() == ""
