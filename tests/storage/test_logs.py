"""Logs layout: hive-partitioned Parquet, pushed-down reads, malformed partitions named by key."""
from __future__ import annotations

from datetime import date, datetime, timedelta, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from cje_engine.errors import CJEInputError
from flows.storage.logs import (
    check_unique_response_ids,
    discover_partitions,
    first_duplicate,
    partition_of,
    read_window,
    write_logs,
)
from flows.storage.objects import Storage
from tests.storage.conftest import make_s3_config, new_bucket

POLICIES = ["base", "clone", "premium", "unhelpful"]
DAY0 = datetime(2025, 3, 1, tzinfo=timezone.utc)


def make_logs(n: int = 400, days: int = 3, seed: int = 0, start: datetime = DAY0, id_prefix: str = "r") -> pa.Table:
    rng = np.random.default_rng(seed)
    ts = [start + timedelta(seconds=int(s)) for s in rng.integers(0, days * 86400, n)]
    return pa.table({
        "prompt_id": [f"p{i // len(POLICIES)}" for i in range(n)],
        "policy": [POLICIES[i % len(POLICIES)] for i in range(n)],
        "judge_score": rng.uniform(0, 1, n),
        "response_id": [f"{id_prefix}{i:06d}" for i in range(n)],
        "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
        "response_length": rng.integers(10, 2000, n),
    })


def _sorted(t: pa.Table) -> pa.Table:
    return t.sort_by("response_id")


def test_write_discover_read_roundtrip(storage: Storage):
    logs = make_logs()
    keys = write_logs(storage, logs, basename="b0")
    assert keys == [f"dt=2025-03-0{d}/part-b0.parquet" for d in (1, 2, 3)]
    files = discover_partitions(storage, "2025-03-01", date(2025, 3, 3))
    assert [f.key for f in files] == keys and all(f.size > 0 and f.etag_or_mtime for f in files)
    got = read_window(storage, files)
    assert got.num_rows == logs.num_rows
    assert set(got.column_names) == set(logs.column_names) | {"dt"}
    want = _sorted(logs)
    got_s = _sorted(got)
    for col in logs.column_names:
        assert got_s.column(col).to_pylist() == want.column(col).to_pylist(), col
    # dt is the UTC date of ts
    dates = [t.date().isoformat() for t in got_s.column("ts").to_pylist()]
    assert got_s.column("dt").to_pylist() == dates


def test_window_pruning_and_non_parquet_objects_skipped(storage: Storage):
    write_logs(storage, make_logs(days=5), basename="x")
    storage.write_bytes("dt=2025-03-02/_SUCCESS", b"")
    storage.write_bytes("dt=2025-03-02/notes.txt", b"hello")
    files = discover_partitions(storage, "2025-03-02", "2025-03-03")
    assert [f.key for f in files] == ["dt=2025-03-02/part-x.parquet", "dt=2025-03-03/part-x.parquet"]
    got = read_window(storage, files, columns=["response_id", "dt"])
    assert set(got.column("dt").to_pylist()) == {"2025-03-02", "2025-03-03"}
    assert discover_partitions(storage, "2024-01-01", "2024-01-05") == []
    with pytest.raises(CJEInputError, match="after its end"):
        discover_partitions(storage, "2025-03-05", "2025-03-01")
    with pytest.raises(CJEInputError, match="not a date"):
        discover_partitions(storage, "March 1st", "2025-03-01")


def test_projection_and_policy_filter(storage: Storage):
    logs = make_logs(n=800)
    write_logs(storage, logs, basename="a")
    files = discover_partitions(storage, "2025-03-01", "2025-03-03")
    got = read_window(storage, files, columns=["policy", "judge_score"], policies=["clone", "premium"])
    assert got.column_names == ["policy", "judge_score"]
    want = logs.filter(pc.is_in(logs.column("policy"), pa.array(["clone", "premium"])))
    assert got.num_rows == want.num_rows == 400
    assert sorted(got.column("judge_score").to_pylist()) == sorted(want.column("judge_score").to_pylist())
    assert got.schema.field("judge_score").type == pa.float64()
    # An extra row filter on a column that is not returned.
    cut = pa.scalar(DAY0 + timedelta(days=2), pa.timestamp("us", tz="UTC"))
    late = read_window(storage, files, columns=["response_id"], row_filter=pc.field("ts") >= cut)
    want_late = logs.filter(pc.greater_equal(logs.column("ts"), cut))
    assert sorted(late.column("response_id").to_pylist()) == sorted(want_late.column("response_id").to_pylist())
    assert 0 < late.num_rows < logs.num_rows


def _corrupt_column_chunks(st: Storage, key: str, predicate) -> None:
    """Overwrite the data pages of column chunks selected by predicate(row_group, column_name)."""
    raw = bytearray(st.read_bytes(key))
    meta = pq.ParquetFile(pa.BufferReader(bytes(raw))).metadata
    for rg in range(meta.num_row_groups):
        for ci in range(meta.num_columns):
            col = meta.row_group(rg).column(ci)
            if predicate(rg, col.path_in_schema):
                start = col.dictionary_page_offset or col.data_page_offset
                for i in range(start, start + col.total_compressed_size):
                    raw[i] = 0xFF
    st.write_bytes(key, bytes(raw))


def test_projection_is_pushed_down(storage: Storage):
    """A column that is not requested is never decoded: corrupting it does not disturb the read."""
    logs = make_logs(n=300, days=1).append_column("blob", pa.array(["x" * 50] * 300))
    (key,) = write_logs(storage, logs, basename="p")
    _corrupt_column_chunks(storage, key, lambda rg, name: name == "blob")
    files = discover_partitions(storage, "2025-03-01", "2025-03-01")
    got = read_window(storage, files, columns=["response_id", "judge_score"])
    assert got.num_rows == 300
    with pytest.raises(CJEInputError) as err:
        read_window(storage, files)  # all columns: now the corrupt one is decoded
    assert key in str(err.value)


def test_policy_filter_is_pushed_down_to_row_groups(storage: Storage):
    """Row groups whose statistics exclude the requested policies are skipped entirely."""
    logs = make_logs(n=400, days=1).sort_by("policy")  # one policy per row group of 100 rows
    (key,) = write_logs(storage, logs, basename="rg", row_group_size=100)
    meta = pq.ParquetFile(pa.BufferReader(storage.read_bytes(key))).metadata
    assert meta.num_row_groups == 4
    # Destroy every column of the row group that holds "unhelpful" (sorted last -> group 3).
    _corrupt_column_chunks(storage, key, lambda rg, name: rg == 3)
    files = discover_partitions(storage, "2025-03-01", "2025-03-01")
    got = read_window(storage, files, policies=["base", "clone"])
    assert sorted(set(got.column("policy").to_pylist())) == ["base", "clone"] and got.num_rows == 200
    with pytest.raises(CJEInputError):
        read_window(storage, files, policies=["unhelpful"])


def test_timestamps_partition_by_utc_date(storage: Storage):
    ny = timezone(timedelta(hours=-5))
    t = pa.table({
        "prompt_id": ["p1", "p2", "p3"], "policy": ["a", "a", "a"], "judge_score": [0.1, 0.2, 0.3],
        "response_id": ["x1", "x2", "x3"],
        # 23:30 in New York is 04:30 UTC the next day; naive timestamps are taken as UTC.
        "ts": pa.array([datetime(2025, 1, 1, 23, 30, tzinfo=ny), datetime(2025, 1, 1, 1, 0, tzinfo=ny),
                        datetime(2025, 1, 1, 4, 0, tzinfo=ny)], pa.timestamp("us", tz="America/New_York")),
    })
    keys = write_logs(storage, t, basename="tz")
    assert keys == ["dt=2025-01-01/part-tz.parquet", "dt=2025-01-02/part-tz.parquet"]
    naive = t.set_column(4, "ts", pa.array([datetime(2025, 2, 1, 23, 59), datetime(2025, 2, 2, 0, 0),
                                            datetime(2025, 2, 2, 0, 1)], pa.timestamp("ns")))
    keys2 = write_logs(storage, naive, basename="naive")
    assert keys2 == ["dt=2025-02-01/part-naive.parquet", "dt=2025-02-02/part-naive.parquet"]
    got = read_window(storage, discover_partitions(storage, "2025-02-01", "2025-02-02"), columns=["ts", "dt"])
    assert got.schema.field("ts").type == pa.timestamp("us", tz="UTC")


def test_integer_ids_and_scores_are_canonicalised(local_storage: Storage):
    t = pa.table({"prompt_id": [1, 2], "policy": ["a", "b"], "judge_score": [1, 0],
                  "response_id": [10, 11], "ts": pa.array([DAY0, DAY0], pa.timestamp("ms", tz="UTC"))})
    write_logs(local_storage, t, basename="i")
    got = read_window(local_storage, discover_partitions(local_storage, DAY0, DAY0))
    assert got.schema.field("prompt_id").type == pa.string() and got.column("response_id").to_pylist() == ["10", "11"]
    assert got.schema.field("judge_score").type == pa.float64()


def test_optional_column_missing_in_some_files_is_null_there(storage: Storage):
    a = make_logs(n=20, days=1, id_prefix="a")
    b = make_logs(n=20, days=1, id_prefix="b", start=DAY0 + timedelta(days=1)).drop_columns(["response_length"])
    write_logs(storage, a, basename="a")
    write_logs(storage, b, basename="b")
    files = discover_partitions(storage, "2025-03-01", "2025-03-02")
    got = read_window(storage, files, columns=["response_id", "response_length"])
    assert got.column("response_length").null_count == 20
    with pytest.raises(CJEInputError, match="not in any") as err:
        read_window(storage, files, columns=["response_id", "nonexistent"])
    assert err.value.column == "nonexistent"


def test_no_files_is_a_clear_error(storage: Storage):
    with pytest.raises(CJEInputError, match="no log files"):
        read_window(storage, [])


# --------------------------------------------------------------------------- malformed partitions


def _write_raw_parquet(st: Storage, key: str, table: pa.Table) -> None:
    with st.open_output(key) as out:
        pq.write_table(table, out)


def _malform(kind: str, st: Storage) -> tuple[str, str | None]:
    """Write one bad object next to a good partition; return (bad key, column named or None)."""
    good = make_logs(n=50, days=1)
    write_logs(st, good, basename="good")
    bad_key = "dt=2025-03-01/part-bad.parquet"
    other = make_logs(n=10, days=1, id_prefix="z")
    if kind == "garbage":
        st.write_bytes(bad_key, b"this is not parquet at all")
        return bad_key, None
    if kind == "empty":
        st.write_bytes(bad_key, b"")
        return bad_key, None
    if kind == "truncated":
        _write_raw_parquet(st, bad_key, other)
        raw = st.read_bytes(bad_key)
        st.write_bytes(bad_key, raw[: len(raw) // 2])
        return bad_key, None
    if kind == "corrupt_pages":
        _write_raw_parquet(st, bad_key, other)
        _corrupt_column_chunks(st, bad_key, lambda rg, name: name == "judge_score")
        return bad_key, None
    if kind == "missing_column":
        _write_raw_parquet(st, bad_key, other.drop_columns(["judge_score"]))
        return bad_key, "judge_score"
    if kind == "wrong_type":
        _write_raw_parquet(st, bad_key, other.set_column(
            2, "judge_score", pa.array([str(v) for v in other.column("judge_score").to_pylist()])))
        return bad_key, "judge_score"
    if kind == "wrong_ts_type":
        _write_raw_parquet(st, bad_key, other.set_column(4, "ts", pa.array(["2025-03-01"] * 10)))
        return bad_key, "ts"
    if kind == "null_response_id":
        rid = other.column("response_id").to_pylist()
        rid[3] = None
        _write_raw_parquet(st, bad_key, other.set_column(3, "response_id", pa.array(rid, pa.string())))
        return bad_key, "response_id"
    if kind == "duplicate_response_id":
        _write_raw_parquet(st, bad_key, good.slice(5, 3))  # ids already in part-good
        return bad_key, "response_id"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["garbage", "empty", "truncated", "corrupt_pages", "missing_column", "wrong_type",
                                  "wrong_ts_type", "null_response_id", "duplicate_response_id"])
def test_malformed_partition_names_the_object_key(storage: Storage, kind: str):
    bad_key, column = _malform(kind, storage)
    files = discover_partitions(storage, "2025-03-01", "2025-03-01")
    assert bad_key in [f.key for f in files]
    with pytest.raises(CJEInputError) as err:
        read_window(storage, files)
    assert storage.url(bad_key) in str(err.value), str(err.value)
    if kind == "duplicate_response_id":  # both files are named: "first in <bad>", source = the other
        assert storage.url("dt=2025-03-01/part-good.parquet") in str(err.value)
    else:
        assert err.value.source == storage.url(bad_key)
    if column is not None:
        assert err.value.column == column
    if kind == "null_response_id":
        assert err.value.row == 3
    # The good partition alone still reads fine.
    good = [f for f in files if f.key != bad_key]
    assert read_window(storage, good).num_rows == 50


def test_write_logs_rejects_bad_tables(local_storage: Storage):
    t = make_logs(n=5, days=1)
    with pytest.raises(CJEInputError) as err:
        write_logs(local_storage, t.drop_columns(["ts"]))
    assert err.value.column == "ts"
    ts = t.column("ts").to_pylist()
    ts[2] = None
    with pytest.raises(CJEInputError) as err:
        write_logs(local_storage, t.set_column(4, "ts", pa.array(ts, pa.timestamp("us", tz="UTC"))))
    assert (err.value.column, err.value.row) == ("ts", 2)
    with pytest.raises(CJEInputError, match="basename"):
        write_logs(local_storage, t, basename="../escape")
    assert local_storage.list() == []


def test_read_window_on_s3_survives_transient_outage(s3_endpoint: str, fault_proxy):
    direct = make_s3_config(s3_endpoint)
    bucket = new_bucket(s3_endpoint, direct)
    st = Storage.for_uri(f"s3://{bucket}/logs", make_s3_config(fault_proxy.endpoint, max_attempts=4))
    logs = make_logs(n=200)
    write_logs(st, logs, basename="t")
    files = discover_partitions(st, "2025-03-01", "2025-03-03")
    fault_proxy.drop_next(2)
    got = read_window(st, files, columns=["response_id", "judge_score"])
    assert fault_proxy.dropped == 2
    assert sorted(got.column("response_id").to_pylist()) == sorted(logs.column("response_id").to_pylist())


def test_partition_of():
    assert partition_of("dt=2025-01-02/part-0.parquet") == "2025-01-02"
    assert partition_of("logs/dt=2025-01-02/x.parquet") == "2025-01-02"
    assert partition_of("x/part-0.parquet") is None


def test_uniqueness_helpers_for_tables_read_in_groups():
    assert first_duplicate(pa.chunked_array([["a", "b"], ["c"]])) is None
    assert first_duplicate(pa.chunked_array([["a", "b"], ["c", "b"]])) == "b"
    assert first_duplicate(pa.array([], pa.string())) is None
    part1, part2 = make_logs(n=10, days=1), make_logs(n=10, days=1).slice(7)
    joined = pa.concat_tables([part1, part2])
    check_unique_response_ids(part1, "group-1")
    with pytest.raises(CJEInputError, match="r000007") as err:
        check_unique_response_ids(joined, "window 2025-03-01")
    assert (err.value.source, err.value.column, err.value.row) == ("window 2025-03-01", "response_id", 10)


def test_rows_of_an_assembled_window_are_traced_to_their_object_and_row(storage: Storage):
    """A bad value found at row N of the table assembled from several reads (as the flow does
    on Ray) is traced to its object and its row there, even through a policy filter."""
    from flows.storage.logs import concat_with_sources, locate_row, row_sources

    table = make_logs(600, days=3, seed=4)
    write_logs(storage, table, basename="t")
    files = discover_partitions(storage, "2025-03-01", "2025-03-03")
    parts = [read_window(storage, files[:1], policies=["clone", "premium"]),
             read_window(storage, files[1:], policies=["clone", "premium"])]
    assembled = concat_with_sources(parts)
    assert [k for k, _ in row_sources(assembled)] == [f.key for f in files]
    assert sum(n for _, n in row_sources(assembled)) == assembled.num_rows
    for row in (0, parts[0].num_rows - 1, parts[0].num_rows, assembled.num_rows - 1):
        url, obj_row = locate_row(storage, row_sources(assembled), assembled, row)
        rid = assembled["response_id"][row].as_py()
        key = next(f.key for f in files if storage.url(f.key) == url)
        whole = pq.read_table(storage.arrow_path(key), filesystem=storage.arrow_fs[0])  # unfiltered object
        assert whole["response_id"][obj_row].as_py() == rid  # the object's own row, not the filtered one
    assert locate_row(storage, row_sources(assembled), assembled, assembled.num_rows) is None


# --------------------------------------------------------------------------- work folders, dangling links


def test_spark_and_hive_work_folders_inside_a_day_are_not_read(storage: Storage):
    """``dt=.../_temporary/0/.../part-0.parquet`` and ``.staging/`` copies are not data (Hive/Spark/Arrow rule)."""
    logs = make_logs(n=1080, days=1)
    [key] = write_logs(storage, logs, basename="final")
    copy = make_logs(n=360, days=1, id_prefix="tmp")  # a task attempt's output, not committed
    for work in ("dt=2025-03-01/_temporary/0/task_0001/part-0.parquet", "dt=2025-03-01/.staging/part-1.parquet",
                 "dt=2025-03-01/sub/_attempt/part-2.parquet", "dt=2025-03-01/.part-3.parquet"):
        _write_raw_parquet(storage, work, copy)
    files = discover_partitions(storage, "2025-03-01", "2025-03-01")
    assert [f.key for f in files] == [key]
    assert read_window(storage, files).num_rows == 1080  # the old listing read 1080 + 4 * 360 rows


def test_a_dangling_symlink_as_a_days_file_is_an_error_naming_it(local_storage: Storage):
    import os

    write_logs(local_storage, make_logs(n=300, days=3), basename="b")
    target = local_storage.root / "dt=2025-03-02" / "part-b.parquet"
    target.unlink()
    os.symlink(local_storage.root / "gone" / "part-b.parquet", target)  # the day's only file
    with pytest.raises(CJEInputError, match="symbolic link whose target does not exist") as err:
        discover_partitions(local_storage, "2025-03-01", "2025-03-03")
    assert err.value.source == str(target)
    loop = local_storage.root / "dt=2025-03-03" / "part-b.parquet"
    loop.unlink()
    os.symlink(loop, loop)  # a link to itself
    with pytest.raises(CJEInputError, match="cannot be followed") as err:
        discover_partitions(local_storage, "2025-03-03", "2025-03-03")
    assert err.value.source == str(loop)


def test_a_dangling_symlinked_day_folder_is_an_error_naming_it(local_storage: Storage):
    """Issue 25: a day's folder ``dt=2025-03-02`` that is a symbolic link to a folder moved away was listed
    as an empty day (the day silently missing from the window).  Now: `CJEInputError` naming the link; a
    symlinked day folder whose target exists is read as any other."""
    import os
    import shutil

    write_logs(local_storage, make_logs(n=300, days=3), basename="b")
    day = local_storage.root / "dt=2025-03-02"
    moved = local_storage.root.parent / "elsewhere"
    shutil.move(day, moved)
    os.symlink(moved, day)
    assert [f.key for f in discover_partitions(local_storage, "2025-03-02", "2025-03-02")] == [
        "dt=2025-03-02/part-b.parquet"]  # a link to an existing folder: read
    shutil.rmtree(moved)
    with pytest.raises(CJEInputError, match="symbolic link whose target does not exist") as err:
        discover_partitions(local_storage, "2025-03-01", "2025-03-03")
    assert err.value.source == str(day)
    with pytest.raises(CJEInputError, match="symbolic link whose target does not exist"):
        local_storage.list("")  # the whole listing (pre-flight) names it too


def test_engine_folder_reader_and_log_listing_share_the_work_path_rule():
    from cje_engine.data.readers import is_work_path
    from flows.storage.logs import is_log_object

    for key in ("dt=2025-03-01/_temporary/0/part-0.parquet", "dt=2025-03-01/.staging/p.parquet",
                "dt=2025-03-01/_SUCCESS", "_temporary/dt=2025-03-01/p.parquet"):
        assert is_work_path(key) and not is_log_object(key)
    assert not is_work_path("dt=2025-03-01/part-0.parquet") and is_log_object("dt=2025-03-01/part-0.parquet")
    assert not is_log_object("dt=2025-03-01/part-0.csv") and not is_log_object("x/part-0.parquet")


def test_logs_without_response_ids_say_how_to_make_opaque_stable_ones(local_storage: Storage):
    """Issue 26: logs must carry a ``response_id`` that exports rarely have, and nothing said how to make one;
    the ids the simulator (and so `cje demo`) wrote, ``policy:prompt:k``, showed labellers the policy. Now the
    error says what an id needs and names `opaque_response_ids`, which makes stable ids that show no policy."""
    from flows.cli.demo import generate_logs
    from flows.storage.logs import opaque_response_ids

    table = make_logs(40).drop(["response_id"])
    (local_storage.root / "dt=2025-03-01").mkdir(parents=True)
    pq.write_table(table, local_storage.root / "dt=2025-03-01" / "part-0.parquet")
    with pytest.raises(CJEInputError) as exc:
        read_window(local_storage, discover_partitions(local_storage, "2025-03-01", "2025-03-01"))
    msg = str(exc.value)
    assert "column 'response_id'" in msg and "opaque_response_ids" in msg and "does not contain the policy name" in msg
    assert "docs/logs-layout.md" in msg
    ids = opaque_response_ids([table.column("prompt_id").to_pylist(), table.column("policy").to_pylist()])
    assert ids == opaque_response_ids([table.column("prompt_id").to_pylist(), table.column("policy").to_pylist()])
    assert len(set(ids)) == len(ids) == 40 and all(len(i) == 22 and i.startswith("r-") for i in ids)
    assert not any(p in i for i in ids for p in POLICIES)
    assert opaque_response_ids([["p0"], ["base"]], salt="team") != opaque_response_ids([["p0"], ["base"]])
    # cje demo's logs: opaque ids, the same on every generation
    firsts = []
    for k in range(2):
        out = generate_logs(local_storage.root / f"demo{k}", days=1, prompts_per_day=10)
        logs = read_window(Storage.for_uri(out["logs_uri"]), discover_partitions(
            Storage.for_uri(out["logs_uri"]), out["dates"][0], out["dates"][0]), columns=["response_id", "policy"])
        rids, pols = logs.column("response_id").to_pylist(), set(logs.column("policy").to_pylist())
        assert rids and not any(p in r for r in rids for p in pols) and all(r.startswith("r-") for r in rids)
        firsts.append(sorted(rids))
    assert firsts[0] == firsts[1]


def test_a_row_group_that_would_exhaust_memory_is_bad_data_naming_the_object(local_storage: Storage, monkeypatch):
    """Issue 25: out of memory was a killed process, an "internal error" or reported as bad data of another
    row.  A row group is decoded whole: one that holds more bytes (uncompressed, in the columns read) than
    the process may spend on it is refused from the footer, before it is read, naming the object and the row
    group (exit 2); a MemoryError while reading an object names the object too."""
    import pyarrow.dataset as pads

    from flows.storage import logs as logs_module
    from flows.storage.logs import read_window

    write_logs(local_storage, make_logs(n=3000, days=1), basename="big", row_group_size=1_000_000)
    files = discover_partitions(local_storage, "2025-03-01", "2025-03-01")
    assert read_window(local_storage, files).num_rows == 3000  # within the default budget: read
    monkeypatch.setenv("CJE_MAX_ROW_GROUP_BYTES", "40000")
    with pytest.raises(CJEInputError, match=r"row group 0 holds .* uncompressed .*CJE_MAX_ROW_GROUP_BYTES") as err:
        read_window(local_storage, files)
    assert err.value.source == local_storage.url(files[0].key)
    # a projection that fits is read: only the columns read count
    assert read_window(local_storage, files, columns=["judge_score"]).num_rows == 3000
    monkeypatch.delenv("CJE_MAX_ROW_GROUP_BYTES")

    class Exhausted:
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def to_table(self, *args, **kwargs):
            raise pa.ArrowMemoryError("malloc of size 8589934592 failed")

    real_dataset = pads.dataset
    monkeypatch.setattr(logs_module.ds, "dataset", lambda *a, **k: Exhausted(real_dataset(*a, **k)))
    with pytest.raises(CJEInputError, match="does not fit in memory") as err:
        read_window(local_storage, files)
    assert err.value.source == local_storage.url(files[0].key)
