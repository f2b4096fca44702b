"""Anchor sets (versioned, create-only, manifest with content hash) and anchor score partitions."""
from __future__ import annotations

import io
import json
import threading
from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cje_engine.errors import CJEInputError
from flows.storage.anchors import (anchor_key, list_versions, manifest_key, read_anchor_scores, read_anchor_set, score_files,
                           split_looks, write_anchor_scores, write_anchor_set)
from flows.storage.objects import Storage

DAY = datetime(2025, 3, 1, 8, tzinfo=timezone.utc)


def _anchors(n: int = 6, labelled: int = 3) -> pd.DataFrame:
    return pd.DataFrame({"anchor_id": [f"a{i}" for i in range(n)], "prompt": [f"p{i}" for i in range(n)],
                         "response": [f"r{i}" for i in range(n)],
                         "oracle_label": [0.1 * i if i < labelled else None for i in range(n)]})


@pytest.fixture
def st(tmp_path):
    return Storage.for_uri(str(tmp_path / "root"))


def test_versions_are_create_only_idempotent_and_hashed(st):
    a1 = write_anchor_set(st, "set1", _anchors(), metadata={"source": "test"})
    assert a1.version == 1 and list_versions(st, "set1") == [1]
    v1_bytes = st.read_bytes(anchor_key("set1", 1))
    # identical content (rows in another order) is not re-versioned
    again = write_anchor_set(st, "set1", _anchors().iloc[::-1])
    assert again.version == 1 and list_versions(st, "set1") == [1]
    # a new label makes a new version; version 1 is untouched
    changed = _anchors()
    changed.loc[4, "oracle_label"] = 0.9
    a2 = write_anchor_set(st, "set1", changed)
    assert a2.version == 2 and list_versions(st, "set1") == [1, 2]
    assert st.read_bytes(anchor_key("set1", 1)) == v1_bytes
    m1 = json.loads(st.read_bytes(manifest_key("set1", 1)))
    m2 = json.loads(st.read_bytes(manifest_key("set1", 2)))
    assert m1["content_sha256"] != m2["content_sha256"] and m1["metadata"] == {"source": "test"}
    assert (m1["n_anchors"], m1["n_labelled"], m2["n_labelled"]) == (6, 3, 4)
    latest = read_anchor_set(st, "set1")
    assert latest.version == 2 and latest.labels()["a4"] == 0.9
    old = read_anchor_set(st, "set1", 1)
    assert np.isnan(old.labels()["a4"]) and old.anchor_ids == [f"a{i}" for i in range(6)]
    assert old.items()[0] == {"anchor_id": "a0", "prompt": "p0", "response": "r0"}
    assert old.clusters() is None


def test_tampered_missing_and_orphaned_versions(st):
    with pytest.raises(CJEInputError) as err:
        read_anchor_set(st, "nope")
    assert "anchors/nope" in str(err.value) and "no versions" in str(err.value)
    write_anchor_set(st, "s", _anchors())
    with pytest.raises(CJEInputError, match="no version 7"):
        read_anchor_set(st, "s", 7)
    # a modified data object is refused (its sha256 no longer matches the manifest)
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(_anchors(5), preserve_index=False), buf)
    st.write_bytes(anchor_key("s", 1), buf.getvalue())
    with pytest.raises(CJEInputError) as err:
        read_anchor_set(st, "s", 1)
    assert err.value.source.endswith("anchors/s/v000001.parquet") and "sha256" in str(err.value)
    # a data object left without a manifest by a crashed writer (other content) is skipped
    st.put_if_absent(anchor_key("t", 1), b"half-written")
    assert write_anchor_set(st, "t", _anchors()).version == 2 and list_versions(st, "t") == [2]


def test_concurrent_writers_get_distinct_versions(st):
    out, errors = [], []

    def go(i):
        try:
            frame = _anchors()
            frame.loc[0, "oracle_label"] = 0.01 * (i + 1)
            out.append(write_anchor_set(st, "race", frame).version)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(out) == [1, 2, 3, 4] and list_versions(st, "race") == [1, 2, 3, 4]
    labels = {read_anchor_set(st, "race", v).labels()["a0"] for v in out}
    assert labels == {0.01, 0.02, 0.03, 0.04}


@pytest.mark.parametrize("mutate, column, row, text", [
    (lambda f: f.drop(columns=["response"]), "response", None, "missing"),
    (lambda f: f.assign(anchor_id=["a0", "a1", "a2", "a1", "a4", "a5"]), "anchor_id", 3, "appears twice"),
    (lambda f: f.assign(prompt=["x", None, "x", "x", "x", "x"]), "prompt", 1, "null"),
    (lambda f: f.assign(oracle_label=[0.1, float("inf"), None, None, None, None]), "oracle_label", 1, "finite"),
    (lambda f: f.assign(oracle_label=["a", "b", "c", "d", "e", "f"]), "oracle_label", None, "number"),
])
def test_bad_anchors(st, mutate, column, row, text):
    with pytest.raises(CJEInputError) as err:
        write_anchor_set(st, "bad", mutate(_anchors()))
    assert err.value.column == column and err.value.row == row and text in str(err.value)
    assert list_versions(st, "bad") == []
    with pytest.raises(CJEInputError, match="anchor set name"):
        write_anchor_set(st, "../escape", _anchors())


def _scores(ids, judge, ts, values) -> pd.DataFrame:
    return pd.DataFrame({"anchor_id": ids, "judge_id": judge, "ts": ts, "judge_score": values})


def test_scores_partition_by_day_and_split_into_looks(st):
    ids = [f"a{i}" for i in range(6)]
    # day 1: judge v1 twice (the later score of a2 wins), day 1 also judge v2; day 2: v1
    write_anchor_scores(st, "s", _scores(ids, "v1", DAY, np.arange(6) / 10))
    write_anchor_scores(st, "s", _scores(["a2"], "v1", DAY + timedelta(hours=2), [0.9]))
    write_anchor_scores(st, "s", _scores(ids, "v2", DAY + timedelta(hours=1), np.ones(6)))
    keys = write_anchor_scores(st, "s", pd.concat([
        _scores(ids[:3], "v1", DAY + timedelta(days=1), [0.5, 0.5, 0.5]),
        _scores(ids[3:], "v1", DAY + timedelta(days=1, hours=12), [0.2, 0.2, 0.2])]))
    assert len(keys) == 1 and keys[0].startswith("anchor_scores/s/dt=2025-03-02/part-")
    files = score_files(st, "s")
    assert len(files) == 4 and [f.key[16:29] for f in files].count("dt=2025-03-01") == 3
    assert len(score_files(st, "s", "2025-03-02", "2025-03-02")) == 1
    table = read_anchor_scores(st, files, known_ids=ids)
    looks = split_looks(table)
    assert [lk.key for lk in looks] == ["2025-03-01/v1", "2025-03-01/v2", "2025-03-02/v1"]
    first = looks[0]
    assert first.n_rows == 7 and first.scores.to_dict() == {"a0": 0.0, "a1": 0.1, "a2": 0.9, "a3": 0.3,
                                                             "a4": 0.4, "a5": 0.5}
    assert looks[2].scores.tolist() == [0.5, 0.5, 0.5, 0.2, 0.2, 0.2]
    assert looks[0].fingerprint() != looks[2].fingerprint()
    # numbers written as text are accepted
    write_anchor_scores(st, "txt", _scores(ids, "v1", DAY, [str(v) for v in np.arange(6) / 10]))
    assert split_looks(read_anchor_scores(st, score_files(st, "txt")))[0].scores.tolist() == list(np.arange(6) / 10)


def _raw(st, key: str, frame: pd.DataFrame) -> str:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), buf)
    st.write_bytes(key, buf.getvalue())
    return st.url(key)


@pytest.mark.parametrize("frame, column, row, text", [
    (_scores(["a0", "a1", "zz"], "v1", DAY, [0.1, 0.2, 0.3]), "anchor_id", 2, "not in the anchor set"),
    (_scores(["a0", "a1", "a2"], "v1", DAY, ["0.1", "high", "0.3"]), "judge_score", 1, "'high' is not a number"),
    (_scores(["a0", "a1", "a2"], "v1", DAY, [0.1, 0.2, float("inf")]), "judge_score", 2, "not a finite number"),
    (_scores(["a0", "a1", "a2"], "v1", DAY, [0.1, None, 0.3]).astype({"judge_score": object}),
     "judge_score", 1, "null"),
    (_scores(["a0", "a1", "a2"], [None, "v1", "v1"], DAY, [0.1, 0.2, 0.3]), "judge_id", 0, "null"),
    (_scores(["a0", "a1", "a2"], "v1", DAY, [0.1, 0.2, 0.3]).drop(columns=["ts"]), "ts", None, "missing"),
    (_scores(["a0", "a1", "a2"], "v1", "2025-03-01", [0.1, 0.2, 0.3]), "ts", None, "timestamp"),
])
def test_bad_score_objects_name_the_object_and_row(st, frame, column, row, text):
    url = _raw(st, "anchor_scores/s/dt=2025-03-01/part-bad.parquet", frame)
    with pytest.raises(CJEInputError) as err:
        read_anchor_scores(st, score_files(st, "s"), known_ids=["a0", "a1", "a2"])
    assert err.value.source == url and err.value.column == column and err.value.row == row
    assert text in str(err.value)


def test_unreadable_score_object(st):
    st.write_bytes("anchor_scores/s/dt=2025-03-01/part-x.parquet", b"not parquet at all")
    with pytest.raises(CJEInputError) as err:
        read_anchor_scores(st, score_files(st, "s"))
    assert err.value.source.endswith("dt=2025-03-01/part-x.parquet") and "not a readable Parquet" in str(err.value)


def test_anchor_set_and_scores_on_s3(direct_storage, bucket):
    st = direct_storage(f"s3://{bucket}/cje")
    a = write_anchor_set(st, "s3set", _anchors().assign(prompt_id=["q0", "q0", "q1", "q1", "q2", "q2"]))
    assert write_anchor_set(st, "s3set", _anchors().assign(prompt_id=["q0", "q0", "q1", "q1", "q2", "q2"])).version == 1
    back = read_anchor_set(st, "s3set")
    assert back.content_sha256 == a.content_sha256 and back.clusters().tolist() == ["q0", "q0", "q1", "q1", "q2", "q2"]
    write_anchor_scores(st, "s3set", _scores(a.anchor_ids, "v1", DAY, np.linspace(0, 1, 6)))
    looks = split_looks(read_anchor_scores(st, score_files(st, "s3set"), known_ids=a.anchor_ids))
    assert len(looks) == 1 and looks[0].scores.tolist() == list(np.linspace(0, 1, 6))
    assert not st.put_if_absent(anchor_key("s3set", 1), b"overwrite attempt")
