"""The prompt ids' bounds from the log files' Parquet footers (issue 29, round 22).

`flows.storage.logs.footer_bounds` must bound every id the reader reads (`cje_engine.pipeline.sharded.id_bounds` of
the column read): its least id, an upper bound of its greatest that puts it in the same shard or the next
(`TOP` appended) and a null flag that is set where a null is, whatever the file: several row groups, nulls, a row
group of nulls only, no row, non-ASCII and long ids, a ``columns:`` mapping. Where the footer cannot say (integer
ids, binary ids, no statistics, a column renamed away) it says so, and the readers sample the file as before.
`flows.runtime.sharded_ray.sample_picks` samples one file of each distinct footer range.
"""
from __future__ import annotations

from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cje_engine.pipeline.sharded import bounds_shards, id_bounds
from flows.runtime.sharded_ray import sample_picks
from flows.storage.logs import TOP, Footer, footer_bounds, parquet_footers, read_window
from flows.storage.objects import Storage

IDS = {
    "plain": ["b1-0003", "b1-0001", "b1-0010", "b1-0002"] * 3,
    "non_ascii": ["é-1", "z-2", "ä-3", "Z-0", "\U0001f600-9", "a"],
    "long": ["p-" + "x" * 40 + str(i) for i in range(9)],
    "nulls": ["b2-5", None, "b2-1", None, "b2-9", "b2-3"],
    "one_group_null": [None, None, None, "c-7", "c-2", "c-9"],
}


def _write(tmp_path, name: str, ids: list, row_group: int = 2) -> str:
    key = f"dt=2026-03-01/{name}.parquet"
    (tmp_path / "dt=2026-03-01").mkdir(exist_ok=True)
    n = len(ids)
    table = pa.table({"prompt_id": pa.array(ids, pa.string()), "policy": ["A"] * n, "judge_score": [0.5] * n,
                      "response_id": [f"{name}-{i}" for i in range(n)],
                      "ts": pa.array([datetime(2026, 3, 1, tzinfo=timezone.utc)] * n, pa.timestamp("us", "UTC"))})
    pq.write_table(table, tmp_path / key, row_group_size=row_group)
    return key


@pytest.mark.parametrize("name", sorted(IDS))
def test_footer_bounds_bound_every_id_the_reader_reads(tmp_path, name):
    key = _write(tmp_path, name, IDS[name])
    st = Storage.for_uri(str(tmp_path), None)
    [footer] = parquet_footers(st, [key], column="prompt_id")
    assert footer.rows == len(IDS[name]) and footer.bounds_known
    want = id_bounds(read_window(st, [key], columns=["prompt_id"])["prompt_id"])
    lo, hi, nulls = footer.bounds
    assert lo == want[0] and hi == want[1] + TOP and nulls == want[2]
    # the shards of the footer's range: those of the ids' own range, or one more at the top
    for splitters in (sorted(x for x in IDS[name] if x is not None)[::2], [want[1]], [want[1] + "\0"], []):
        a, b = bounds_shards(footer.bounds, splitters), bounds_shards(want, splitters)
        assert a[0] == b[0] and b[1] <= a[1] <= b[1] + 1


def test_footer_bounds_of_a_file_without_rows_and_of_null_ids_only(tmp_path):
    st = Storage.for_uri(str(tmp_path), None)
    empty = _write(tmp_path, "empty", [])
    nulls = _write(tmp_path, "nulls", [None, None, None])
    got = parquet_footers(st, [empty, nulls], column="prompt_id")
    assert got == [Footer(0, None, True), Footer(3, (None, None, True), True)]
    assert id_bounds(read_window(st, [nulls], columns=["prompt_id"])["prompt_id"]) == (None, None, True)


def test_a_footer_that_cannot_say_leaves_the_bounds_unknown(tmp_path):
    """Integer and binary ids (their string order is not the footer's), a file written without statistics, a
    mapped column missing, and a missing column: unknown, the rows still counted."""
    st = Storage.for_uri(str(tmp_path), None)
    (tmp_path / "dt=2026-03-01").mkdir()
    keys = []
    for name, table, kw in (
            ("ints", pa.table({"prompt_id": pa.array([10, 9, 100], pa.int64())}), {}),
            ("binary", pa.table({"prompt_id": pa.array([b"a", b"b", b"c"], pa.binary())}), {}),
            ("nostats", pa.table({"prompt_id": pa.array(["a", "b", "c"])}), {"write_statistics": False}),
            ("other", pa.table({"judge_score": [0.1, 0.2, 0.3]}), {})):
        key = f"dt=2026-03-01/{name}.parquet"
        pq.write_table(table, tmp_path / key, **kw)
        keys.append(key)
    got = parquet_footers(st, keys, column="prompt_id")
    assert [f.rows for f in got] == [3, 3, 3, 3] and not any(f.bounds_known for f in got)
    # a mapping: the file's ``id`` is the prompt id (its bounds known)
    key = "dt=2026-03-01/mapped.parquet"
    pq.write_table(pa.table({"id": ["q2", "q1"], "model": ["A", "B"],
                             "judge": [0.1, 0.2], "rid": ["r1", "r2"],
                             "ts": pa.array([datetime(2026, 3, 1, tzinfo=timezone.utc)] * 2, pa.timestamp("us", "UTC"))}),
                   tmp_path / key)
    mapping = {"prompt_id": "id", "policy": "model", "judge_score": "judge", "response_id": "rid"}
    [mapped] = parquet_footers(st, [key], column="prompt_id", mapping=mapping)
    assert mapped.bounds == ("q1", "q2" + TOP, False)
    [missing] = parquet_footers(st, [key], column="prompt_id", mapping={**mapping, "prompt_id": "id2"})
    assert missing.rows == 2 and not missing.bounds_known  # a mapped column missing: the read names it
    assert parquet_footers(st, keys + ["dt=2026-03-02/none.parquet"], column="prompt_id") is None


def test_sample_picks_samples_one_file_of_each_footer_range():
    r1, r2 = ("a", "c" + TOP, False), ("d", "f" + TOP, False)
    footers = [Footer(5, r1, True), Footer(5, r1, True), Footer(4), Footer(5, r2, True), Footer(3),
               Footer(0, None, True), Footer(2, (None, None, True), True), Footer(5, r2, True)]
    assert sample_picks(footers, len(footers)) == [(0, False), (2, True), (3, False), (4, True)]
    assert sample_picks(None, 3) == [(0, True), (1, True), (2, True)]
