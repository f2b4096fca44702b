"""Fast checks of the flow's configuration pieces: windows, chunking, evaluations.yaml."""
from __future__ import annotations

from datetime import date

import pytest

from cje_engine.errors import CJEInputError
from flows.pipelines.evaluate import Window, _group_files, parse_window
from flows.runtime.ray_fanout import chunk_ranges
from flows.runtime.schedules import DEFAULT_FILE, load_evaluations


def test_parse_window_forms():
    ref = "2025-03-10"
    assert parse_window("last 7 days", ref) == Window(date(2025, 3, 3), date(2025, 3, 9))
    assert parse_window("last_1_day", ref) == Window(date(2025, 3, 9), date(2025, 3, 9))
    assert parse_window("3d", ref) == Window(date(2025, 3, 7), date(2025, 3, 9))
    assert parse_window("2025-01-01..2025-01-31").days == 31
    assert parse_window("2025-01-05").label == "2025-01-05_2025-01-05"
    assert parse_window({"start": "2025-01-01", "end": "2025-01-02"}).days == 2
    assert parse_window({"last_days": 2}, ref).start == date(2025, 3, 8)


@pytest.mark.parametrize("bad, needle", [
    ("last 0 days", "at least one day"),
    ("2025-02-01..2025-01-01", "ends before it starts"),
    ("yesterday-ish", "not a date"),
    ({"from": "2025-01-01"}, "'start' and 'end'"),
])
def test_parse_window_rejects_bad_specs_clearly(bad, needle):
    with pytest.raises(CJEInputError, match=needle):
        parse_window(bad, "2025-03-10")


@pytest.mark.parametrize("n, k", [(10, 3), (2000, 8), (5, 9), (1, 1), (1601, 4)])
def test_chunk_ranges_cover_every_replicate_once_in_order(n, k):
    ranges = chunk_ranges(n, k)
    assert [b for lo, hi in ranges for b in range(lo, hi)] == list(range(n))
    sizes = [hi - lo for lo, hi in ranges]
    assert len(ranges) == min(n, k) and max(sizes) - min(sizes) <= 1


def test_group_files_keeps_order_and_balances_sizes():
    files = [{"key": f"dt=2025-01-0{i}/p.parquet", "size": s} for i, s in enumerate([5, 5, 5, 5, 20, 1], 1)]
    groups = _group_files(files, 3)
    assert [f for g in groups for f in g] == files and len(groups) <= 3 and all(groups)
    assert _group_files(files, 100) == [[f] for f in files]


def test_repository_evaluations_file_deploys_with_its_cron():
    specs = load_evaluations(DEFAULT_FILE)
    assert specs, "evaluations.yaml declares no evaluation"
    for spec in specs.values():
        dep = spec.to_deployment()
        assert dep.name == spec.name and dep.entrypoint == "flows.pipelines.audit.evaluate_and_audit"
        assert dep.parameters["evaluation"] == spec.name and dep.parameters["logs_uri"] == spec.logs_uri
        if spec.cron:
            assert dep.schedules[0].schedule.cron == spec.cron


@pytest.mark.parametrize("text, needle", [
    ("evaluations: []", "at least one entry"),
    ("evaluations:\n  - logs_uri: x\n", "name must be"),
    ("evaluations:\n  - name: a\n", "needs logs_uri"),
    ("evaluations:\n  - {name: a, logs_uri: x, cron: '61 * * * *'}\n", "cron '61 \\* \\* \\* \\*'"),
    ("evaluations:\n  - {name: a, logs_uri: x, cron: '0 * * * *', interval: 5}\n", "either cron or interval"),
    ("evaluations:\n  - {name: a, logs_uri: x, options: {n_bootstrapp: 5}}\n", "unknown option"),
    ("evaluations:\n  - {name: a, logs_uri: x, window: 'last week'}\n", "not a date"),
    ("evaluations:\n  - {name: a, logs_uri: x}\n  - {name: a, logs_uri: y}\n", "declared twice"),
    ("evaluations:\n  - {name: a, logs_uri: x, colour: red}\n", "unknown key"),
    ("evaluations: [unclosed\n", "not valid YAML"),
])
def test_evaluations_file_errors_name_file_and_entry(tmp_path, text, needle):
    f = tmp_path / "ev.yaml"
    f.write_text(text)
    with pytest.raises(CJEInputError, match=needle) as err:
        load_evaluations(f)
    assert str(f) in str(err.value)


def test_relative_paths_resolve_against_the_file(tmp_path):
    f = tmp_path / "sub" / "ev.yaml"
    f.parent.mkdir()
    f.write_text("evaluations:\n  - {name: a, logs_uri: ./logs, results_uri: s3://b/r, interval: 60}\n")
    spec = load_evaluations(f)["a"]
    assert spec.logs_uri == str(tmp_path / "sub" / "logs") and spec.results_uri == "s3://b/r"
    assert spec.interval == 60.0 and spec.results_uri.startswith("s3://")
