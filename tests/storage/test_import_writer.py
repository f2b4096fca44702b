"""The import writer on a local folder and on S3: create-only, checksummed, idempotent on re-import."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cje_engine.errors import CJEInputError
from flows.integrations.importers import ImportMapping, import_source
from flows.integrations.importers.writer import manifest_key
from flows.storage.logs import discover_partitions, read_window
from tests.imports.toy import ToyImporter

TOY = ToyImporter()


def _src(path: Path, ids: list[int], *, human_every: int = 2) -> Path:
    rows = [{"id": f"r{i}", "model": "ab"[i % 2], "prompt_id": f"p{i // 2}", "judge": round(i / 20, 3),
             **({"human": 0.5} if i % human_every == 0 else {}), "ts": f"2025-03-0{1 + i % 3}T10:00:00Z"}
            for i in ids]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _state(st) -> dict[str, str]:
    return {o.key: (o.etag_or_mtime, o.modified) for o in st.list("")}


def test_a_second_import_of_the_same_source_changes_nothing(storage, tmp_path):
    src = _src(tmp_path / "a.jsonl", list(range(12)))
    first = import_source(TOY, src, storage, ImportMapping.build(TOY))
    assert first.written == 12 and not first.already_imported and len(first.objects) == 3
    before = _state(storage)
    again = import_source(TOY, src, storage, ImportMapping.build(TOY))
    assert again.already_imported and again.written == 12 and again.objects == first.objects
    assert _state(storage) == before  # not one object written again
    table = read_window(storage, discover_partitions(storage, "2025-03-01", "2025-03-03"))
    assert table.num_rows == 12 and sorted(table.column("response_id").to_pylist()) == sorted(f"r{i}" for i in range(12))


def test_an_overlapping_export_writes_only_the_responses_not_yet_in_the_logs(storage, tmp_path):
    import_source(TOY, _src(tmp_path / "a.jsonl", list(range(0, 8))), storage, ImportMapping.build(TOY))
    rep = import_source(TOY, _src(tmp_path / "b.jsonl", list(range(5, 14))), storage, ImportMapping.build(TOY))
    assert (rep.mapped, rep.already_present, rep.written) == (9, 3, 6)
    table = read_window(storage, discover_partitions(storage, "2025-03-01", "2025-03-03"))  # checks ids unique
    assert table.num_rows == 14
    # the same rows again under another file name: everything present, nothing written, said so
    rep = import_source(TOY, _src(tmp_path / "c.jsonl", list(range(0, 14))), storage, ImportMapping.build(TOY))
    assert (rep.written, rep.already_present, rep.objects) == (0, 14, [])


def test_an_object_of_the_import_key_with_other_content_is_not_overwritten(local_storage, tmp_path):
    src = _src(tmp_path / "a.jsonl", [0, 3, 6])  # one day: 2025-03-01
    rep = import_source(TOY, src, local_storage, ImportMapping.build(TOY))
    key = rep.objects[0]
    local_storage.delete(manifest_key(rep.import_id))  # as if the run had stopped before its manifest
    local_storage.write_bytes(key, b"PAR1 not this import's rows")
    with pytest.raises(CJEInputError, match="exists with other content"):
        import_source(TOY, src, local_storage, ImportMapping.build(TOY))
    assert local_storage.read_bytes(key) == b"PAR1 not this import's rows"


def test_an_interrupted_import_is_completed_by_a_rerun(local_storage, tmp_path):
    src = _src(tmp_path / "a.jsonl", list(range(9)))
    rep = import_source(TOY, src, local_storage, ImportMapping.build(TOY))
    local_storage.delete(manifest_key(rep.import_id))
    again = import_source(TOY, src, local_storage, ImportMapping.build(TOY))
    assert not again.already_imported and again.written == 9 and again.already_present == 0
    assert local_storage.exists(manifest_key(rep.import_id))


def test_a_logged_object_changed_after_the_import_fails_its_checksum(local_storage, tmp_path):
    src = _src(tmp_path / "a.jsonl", list(range(6)))
    rep = import_source(TOY, src, local_storage, ImportMapping.build(TOY))
    local_storage.write_bytes(rep.objects[0], local_storage.read_bytes(rep.objects[0]) + b"x")
    with pytest.raises(CJEInputError, match="does not match the sha256"):
        import_source(TOY, src, local_storage, ImportMapping.build(TOY))


def test_a_response_id_twice_in_one_source_is_bad_input_and_nothing_is_written(local_storage, tmp_path):
    src = _src(tmp_path / "a.jsonl", [0, 1, 2, 1])
    with pytest.raises(CJEInputError) as e:
        import_source(TOY, src, local_storage, ImportMapping.build(TOY))
    assert "records [1, 3]" in str(e.value) and "'r1'" in str(e.value)
    assert local_storage.list("") == []


def test_rows_staged_in_small_batches_are_the_rows_of_one_batch(local_storage, tmp_path):
    """Memory holds one batch: flushing every 7 rows writes exactly what one batch writes."""
    import pyarrow.parquet as pq

    from flows.storage.objects import Storage

    src = _src(tmp_path / "a.jsonl", list(range(40)))
    other = Storage.for_uri(str(tmp_path / "other"))
    small = import_source(TOY, src, local_storage, ImportMapping.build(TOY), batch_rows=7)
    whole = import_source(TOY, src, other, ImportMapping.build(TOY), batch_rows=1000)
    assert small.objects == whole.objects and small.written == whole.written == 40
    for key in small.objects:
        a = pq.read_table(local_storage.arrow_path(key)).sort_by("response_id")
        b = pq.read_table(other.arrow_path(key)).sort_by("response_id")
        assert a.equals(b)
