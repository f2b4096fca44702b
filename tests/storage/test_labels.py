"""Append-only label store: versions, idempotent re-ingest, conflicts, concurrency, join."""
from __future__ import annotations

import re
import threading

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.errors import CJEInputError
from flows.storage.labels import LabelStore, join_labels, label_conflicts
from flows.storage.objects import Storage


def labels(ids, values, probs=None) -> pa.Table:
    cols = {"response_id": pa.array(ids, pa.string()), "oracle_label": pa.array(values, pa.float64())}
    if probs is not None:
        cols["label_probability"] = pa.array(probs, pa.float64())
    return pa.table(cols)


def _data_objects(st: Storage) -> list[str]:
    return [o.key for o in st.list("labels/") if "/_commits/" not in o.key]


def test_append_versions_and_read(storage: Storage):
    ls = LabelStore(storage)
    assert ls.version() == 0
    assert ls.read().num_rows == 0 and ls.read().column_names == [
        "response_id", "oracle_label", "label_probability", "version", "flagged"]
    assert ls.append(labels(["r2", "r1"], [0.5, 1.0], [0.1, 0.2]), "batch-1.csv") == 1
    assert ls.append(labels(["r3"], [0.0]), "batch-2.csv") == 2
    assert ls.version() == 2
    objs = _data_objects(storage)
    assert len(objs) == 2 and all(re.fullmatch(r"labels/v00000[12]-[0-9a-f]{16}\.parquet", k) for k in objs)
    t = ls.read()
    assert t.column("response_id").to_pylist() == ["r1", "r2", "r3"]
    assert t.column("version").to_pylist() == [1, 1, 2]
    assert t.column("label_probability").to_pylist() == [0.2, 0.1, None]
    assert t.column("flagged").to_pylist() == [False, False, False]
    assert ls.read(version=1).num_rows == 2 and ls.read(version=0).num_rows == 0
    with pytest.raises(CJEInputError, match="does not exist"):
        ls.read(version=3)
    hist = ls.history()
    assert [h["source_name"] for h in hist] == ["batch-1.csv", "batch-2.csv"] and hist[0]["rows"] == 2


def test_identical_reingest_is_idempotent(storage: Storage):
    ls = LabelStore(storage)
    first = labels(["a", "b", "c"], [1.0, 0.0, 0.5])
    assert ls.append(first, "day1") == 1
    n_objects = len(storage.list())
    # Same content in another order and with a repeated row: same version, nothing written.
    again = labels(["c", "a", "b", "a"], [0.5, 1.0, 0.0, 1.0])
    assert ls.append(again, "day1-retry") == 1
    assert ls.version() == 1 and len(storage.list()) == n_objects
    assert ls.append(labels(["d"], [1.0]), "day2") == 2
    assert ls.append(first, "day1-again-later") == 1  # still recognised after newer versions


def test_conflicting_label_is_kept_and_flagged(storage: Storage):
    ls = LabelStore(storage)
    ls.append(labels(["r1", "r2", "r3"], [1.0, 0.0, 0.5]), "first")
    # r1 relabelled differently (conflict); r2 repeated identically (not a conflict); r4 new.
    assert ls.append(labels(["r1", "r2", "r4"], [0.0, 0.0, 1.0]), "second") == 2
    t = ls.read()
    rows = list(zip(t.column("response_id").to_pylist(), t.column("oracle_label").to_pylist(),
                    t.column("version").to_pylist(), t.column("flagged").to_pylist()))
    assert rows == [("r1", 1.0, 1, True), ("r2", 0.0, 1, False), ("r3", 0.5, 1, False),
                    ("r1", 0.0, 2, True), ("r4", 1.0, 2, False)]
    assert label_conflicts(t) == ["r1"]


def test_concurrent_appends_get_distinct_contiguous_versions(storage: Storage):
    ls = LabelStore(storage)
    n = 6
    barrier = threading.Barrier(n)
    got: dict[int, int] = {}
    errors = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            got[i] = LabelStore(storage).append(labels([f"w{i}-{j}" for j in range(50)], [float(i % 2)] * 50),
                                                f"writer-{i}")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    assert sorted(got.values()) == list(range(1, n + 1))
    assert ls.version() == n
    t = ls.read()
    assert t.num_rows == 50 * n
    # every writer's rows carry the version that writer was given
    for i, v in got.items():
        mine = t.filter(pa.compute.starts_with(t.column("response_id"), f"w{i}-"))
        assert set(mine.column("version").to_pylist()) == {v}
    assert len(_data_objects(storage)) == n  # losers removed their data objects


def test_concurrent_identical_appends_make_one_version(storage: Storage):
    n = 4
    barrier = threading.Barrier(n)
    got = []

    def worker() -> None:
        barrier.wait()
        got.append(LabelStore(storage).append(labels(["x", "y"], [1.0, 0.0]), "same"))

    threads = [threading.Thread(target=worker) for _ in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert got == [1] * n and LabelStore(storage).version() == 1


def test_uncommitted_leftover_is_ignored(storage: Storage):
    """A writer that died after its data object but before its commit leaves an invisible object."""
    ls = LabelStore(storage)
    ls.append(labels(["a"], [1.0]), "ok")
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(labels(["ghost"], [0.0], [None]), buf)
    storage.write_bytes("labels/v000002-0123456789abcdef.parquet", buf.getvalue())
    assert ls.version() == 1
    assert ls.read().column("response_id").to_pylist() == ["a"]
    assert ls.append(labels(["b"], [0.5]), "next") == 2
    assert ls.read().column("response_id").to_pylist() == ["a", "b"]


@pytest.mark.parametrize("table, column, row, match", [
    (pa.table({"oracle_label": [1.0]}), "response_id", None, "missing"),
    (pa.table({"response_id": ["a"], "oracle_label": ["high"]}), "oracle_label", None, "expected a number"),
    (labels(["a", None], [1.0, 0.0]), "response_id", 1, "null"),
    (labels(["a", "b", "c"], [1.0, float("nan"), 0.0]), "oracle_label", 1, "finite"),
    (labels(["a", "b"], [1.0, 0.0], [0.5, 1.5]), "label_probability", 1, "probability"),
    (labels(["a", "b"], [1.0, 0.0], [0.0, 0.5]), "label_probability", 0, "probability"),
    (labels([], []), None, None, "empty"),
])
def test_bad_label_tables_are_rejected(local_storage: Storage, table, column, row, match):
    with pytest.raises(CJEInputError, match=match) as err:
        LabelStore(local_storage).append(table, "upload.parquet")
    assert err.value.source == "upload.parquet"
    assert err.value.column == column and err.value.row == row
    assert local_storage.list() == []


def test_join_labels_preserves_order_and_fills(storage: Storage):
    ls = LabelStore(storage)
    ls.append(labels(["r3", "r1", "zz-not-logged"], [1.0, 0.25, 0.0], [0.5, 0.5, 0.5]), "a")
    ls.append(labels(["r3", "r5"], [0.0, 0.75]), "b")  # r3 conflicts
    rng = np.random.default_rng(1)
    ids = [f"r{i}" for i in rng.permutation(8)]
    logs = pa.table({"response_id": ids, "judge_score": rng.uniform(size=8), "policy": ["p"] * 8})
    out = join_labels(logs, ls.read())
    assert out.column("response_id").to_pylist() == ids  # order preserved
    assert out.column("judge_score").equals(logs.column("judge_score"))
    lab = dict(zip(ids, out.column("oracle_label").to_pylist()))
    prob = dict(zip(ids, out.column("label_probability").to_pylist()))
    conf = dict(zip(ids, out.column("label_conflict").to_pylist()))
    assert lab["r1"] == 0.25 and prob["r1"] == 0.5
    assert lab["r3"] == 1.0 and conf["r3"] is True  # first label (version 1) wins, conflict recorded
    assert lab["r5"] == 0.75 and prob["r5"] == 1.0 and conf["r5"] is False
    assert lab["r0"] is None and conf["r0"] is False
    assert out.num_rows == 8
    assert out.schema.metadata[b"cje.label_conflicts"] == b"1"


def test_join_keeps_existing_log_labels_where_store_has_none():
    logs = pa.table({"response_id": ["a", "b", "c"], "oracle_label": [0.1, None, 0.3],
                     "label_probability": [0.2, None, 0.2]})
    store = pa.table({"response_id": ["a", "b"], "oracle_label": [0.9, 0.5], "label_probability": [None, 0.4],
                      "version": [1, 1], "flagged": [False, False]})
    out = join_labels(logs, store)
    assert out.column("oracle_label").to_pylist() == [0.9, 0.5, 0.3]
    assert out.column("label_probability").to_pylist() == [0.2, 0.4, 0.2]
    with pytest.raises(CJEInputError, match="response_id"):
        join_labels(pa.table({"x": [1]}), store)


def test_damaged_store_errors_name_the_object(storage: Storage):
    from flows.storage.objects import StorageError

    ls = LabelStore(storage)
    ls.append(labels(["a"], [1.0]), "one")
    ls.append(labels(["b"], [0.0]), "two")
    (v2,) = [k for k in _data_objects(storage) if "/v000002-" in k]
    storage.write_bytes(v2, b"not parquet")
    with pytest.raises(CJEInputError) as err:
        ls.read()
    assert err.value.source == storage.url(v2)
    assert ls.read(version=1).num_rows == 1  # older versions stay readable
    storage.delete(v2)
    with pytest.raises(StorageError, match="committed but its object"):
        ls.read()
    storage.delete("labels/_commits/v000001.json")  # a hole in the commit sequence
    with pytest.raises(StorageError, match="non-contiguous"):
        ls.append(labels(["c"], [1.0]), "three")


# --------------------------------------------------------------------------- integrity (issue 25)


def _parquet_bytes(table: pa.Table) -> bytes:
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def test_a_swapped_label_object_is_refused_naming_it(storage: Storage):
    """Another valid label table put in place of a committed object is never used."""
    ls = LabelStore(storage)
    ls.append(labels(["a", "b"], [1.0, 0.0]), "one")
    ls.append(labels(["c", "d"], [0.0, 1.0]), "two")
    (v2,) = [k for k in _data_objects(storage) if "/v000002-" in k]
    record = ls.history()[1]
    assert record["object"] == v2 and len(record["object_sha256"]) == 64 and record["sha256"][:16] in v2
    storage.write_bytes(v2, _parquet_bytes(labels(["c", "d"], [1.0, 1.0], [None, None])))  # valid Parquet, other labels
    with pytest.raises(CJEInputError, match="checksum mismatch") as err:
        ls.read()
    assert err.value.source == storage.url(v2)
    assert ls.read(version=1).column("response_id").to_pylist() == ["a", "b"]  # older versions still verified


def test_a_swapped_object_under_an_old_commit_record_is_refused_by_its_content_hash(storage: Storage):
    """Records written before object_sha256 existed: the content hash (in the name) still catches a swap."""
    import json

    ls = LabelStore(storage)
    ls.append(labels(["a", "b"], [1.0, 0.0]), "one")
    record = ls.history()[0]
    legacy = {k: v for k, v in record.items() if k not in ("object_sha256", "object_bytes")}
    storage.write_bytes("labels/_commits/v000001.json", json.dumps(legacy).encode())
    assert ls.read().num_rows == 2  # an intact object verifies
    storage.write_bytes(record["object"], _parquet_bytes(labels(["a", "b"], [0.0, 0.0], [None, None])))
    with pytest.raises(CJEInputError, match="checksum mismatch") as err:
        ls.read()
    assert err.value.source == storage.url(record["object"])


def test_an_object_whose_bytes_verify_is_not_hashed_again(storage: Storage, monkeypatch):
    """A record with its object's bytes' sha256: the bytes verified, the content is the committed content, and the
    content hash is not computed again (~0.15 s of CPU a 1M labels); a record without it (written before it
    existed) still has its object's content hashed."""
    import json

    from flows.storage import labels as labels_mod

    ls = LabelStore(storage)
    ls.append(labels(["a", "b"], [1.0, 0.0]), "one")
    calls = []
    real = labels_mod.content_hash
    monkeypatch.setattr(labels_mod, "content_hash", lambda t: calls.append(t.num_rows) or real(t))
    assert ls.read().column("response_id").to_pylist() == ["a", "b"] and calls == []
    record = ls.history()[0]
    legacy = {k: v for k, v in record.items() if k not in ("object_sha256", "object_bytes")}
    storage.write_bytes("labels/_commits/v000001.json", json.dumps(legacy).encode())
    assert ls.read().num_rows == 2 and calls == [2]


@pytest.mark.parametrize("damage", ["truncated", "empty", "other_object", "wrong_rows", "wrong_version"])
def test_a_damaged_commit_record_is_refused_naming_it(storage: Storage, damage: str):
    import json

    ls = LabelStore(storage)
    ls.append(labels(["a"], [1.0]), "one")
    ls.append(labels(["b", "c"], [0.0, 1.0]), "two")
    key = "labels/_commits/v000002.json"
    raw = storage.read_bytes(key)
    record = json.loads(raw)
    damaged = {
        "truncated": raw[: len(raw) // 2],
        "empty": b"",
        "other_object": json.dumps({**record, "object": ls.history()[0]["object"]}).encode(),
        "wrong_rows": json.dumps({**record, "rows": 1}).encode(),
        "wrong_version": json.dumps({**record, "version": 1}).encode(),
    }[damage]
    storage.write_bytes(key, damaged)
    with pytest.raises(CJEInputError) as err:
        ls.read()
    source = storage.url(record["object"]) if damage == "wrong_rows" else storage.url(key)
    assert err.value.source == source, str(err.value)
    assert ("checksum mismatch" if damage == "wrong_rows" else "commit record") in str(err.value)


def test_labels_find_their_rows_whatever_the_unicode_spelling_of_the_id(storage: Storage):
    """Logs write ``café-1`` in NFD, the labelling tool returns it in NFC (or the reverse): the label is joined."""
    import unicodedata

    nfc, nfd = "caf\u00e9-1", unicodedata.normalize("NFD", "caf\u00e9-2")
    ls = LabelStore(storage)
    ls.append(labels([unicodedata.normalize("NFD", nfc), unicodedata.normalize("NFC", nfd)], [1.0, 0.0]), "tool")
    assert ls.read().column("response_id").to_pylist() == ["caf\u00e9-1", "caf\u00e9-2"]  # stored in NFC
    logs = pa.table({"response_id": [nfc, nfd, "other"], "judge_score": [0.5, 0.5, 0.5]})
    joined = join_labels(logs, ls.read())
    assert joined.column("oracle_label").to_pylist() == [1.0, 0.0, None]  # was: [None, None, None], both labels silently lost
    with pytest.raises(CJEInputError, match="invisible or control character U\\+200B") as err:
        ls.append(labels(["a", "clo\u200bne"], [1.0, 0.0]), "tool2")
    assert (err.value.source, err.value.column, err.value.row) == ("tool2", "response_id", 1)
