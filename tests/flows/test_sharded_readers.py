"""The sharded readers' fast paths (issue 29, round 21) against their references.

`flows.runtime.sharded_ray.split_file` reads only the columns its file's rows need (`FileRows.read_columns`) where it
read every column: each reader's pieces (packed, every array bit for bit, the tables' chunks and schemas), response-id
buckets and info must be those of a reader that reads every column (a ``prepare_rows`` without ``read_columns``),
and a missing column the same error, whatever the file: inline labels, covariates read or derived, segment columns,
a ``columns:`` mapping, a policy filter, a ``dt`` column of its own, NFD ids, no label store.
"""
from __future__ import annotations

import unicodedata

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cje_engine.errors import CJEInputError
from cje_engine.pipeline.sharded import PackedPiece
from flows.pipelines.sharded_pass import FileRows, shard_columns
from flows.runtime import sharded_ray
from flows.runtime.label_index import LabelIndex
from flows.storage import logs as logs_mod


class _EveryColumn:
    """`FileRows` without its ``read_columns``: the reader reads every column (the reference)."""

    def __init__(self, inner: FileRows) -> None:
        self.inner = inner

    def __call__(self, *args):
        return self.inner(*args)


def _same_array(a, b) -> None:
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _same_table(a: pa.Table, b: pa.Table) -> None:
    assert a.schema.equals(b.schema, check_metadata=True)
    assert a.equals(b) or a.to_pandas().equals(b.to_pandas())  # NaN equal to NaN
    assert [[len(k) for k in c.chunks] for c in a.columns] == [[len(k) for k in c.chunks] for c in b.columns]
    for x, y in zip(a.columns, b.columns):
        for p, q in zip(x.chunks, y.chunks):
            assert [None if buf is None else buf.to_pybytes() for buf in p.buffers()] == \
                   [None if buf is None else buf.to_pybytes() for buf in q.buffers()]


def _same_outputs(got: tuple, want: tuple) -> None:
    assert len(got) == len(want)
    for a, b in zip(got[:-1], want[:-1]):
        assert type(a) is type(b)
        if isinstance(a, PackedPiece):
            _same_table(a.table, b.table)
            assert a.schema.equals(b.schema, check_metadata=True) and a.row_first == b.row_first
            for f in ("row_step", "row", "score_values", "lab_pos", "label", "label_prob"):
                _same_array(getattr(a, f), getattr(b, f))
        else:
            _same_table(a, b)
    assert got[-1] == want[-1]


def _write(root, name: str, table: pa.Table, day: str = "2026-01-01") -> str:
    (root / f"dt={day}").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, root / f"dt={day}" / name, row_group_size=700)
    return f"dt={day}/{name}"


def _logs(n: int, rng: np.random.Generator, **extra) -> dict:
    ids = [f"resp-{i:06d}" for i in range(n)]
    return {"prompt_id": [f"p{i // 3:05d}" for i in range(n)], "policy": ["a", "b", "c"] * (n // 3),
            "judge_score": rng.integers(0, 21, n) / 20, "response_id": ids,
            "response_length": rng.integers(1, 500, n).astype(float),
            "ts": pa.array(np.full(n, 1_767_225_600_000_000, dtype="datetime64[us]")), **extra}


def _run(root, key: str, rows, index, keep, **kw):
    splitters = ["p00300", "p00600"]
    return sharded_ray.split_file(str(root), {}, key, 3, 3, None, kw.get("policies"), kw.get("mapping"), rows,
                                  splitters, keep, index, n_buckets=2)


CASES = ["plain", "inline_labels", "covariate", "derived", "segment", "mapping", "policies", "no_store", "own_dt",
         "nfd", "missing_segment", "missing_base", "missing_covariate", "no_keep"]


@pytest.mark.parametrize("case", CASES)
def test_a_reader_reads_what_its_rows_need_and_ships_the_same_objects(tmp_path, case, monkeypatch):
    rng = np.random.default_rng(CASES.index(case))
    n = 900
    cols = _logs(n, rng, other=rng.random(n), note=["x"] * n)
    covariates, extra, kw = [], [], {}
    if case == "inline_labels":
        cols["oracle_label"] = pa.array(np.where(rng.random(n) < 0.2, rng.random(n), np.nan), from_pandas=True)
        cols["label_probability"] = pa.array(np.full(n, 0.2))
    if case == "covariate":
        covariates = ["response_length"]
    if case == "derived":
        covariates = ["response_length"]
        cols["response"] = [" ".join(["w"] * int(k)) for k in rng.integers(1, 20, n)]
        del cols["response_length"]
    if case == "segment":
        cols["segment"] = rng.choice(["s1", "s2"], n).tolist()
        extra = ["segment"]
    if case == "mapping":
        cols["pid"], cols["score"] = cols.pop("prompt_id"), cols.pop("judge_score")
        kw["mapping"] = {"prompt_id": "pid", "judge_score": "score"}
    if case == "policies":
        kw["policies"] = ["a", "c"]
    if case == "own_dt":
        cols["dt"] = ["2026-01-01"] * n
    if case == "nfd":
        cols["response_id"][10] = unicodedata.normalize("NFD", "caf\u00e9-10")
    if case == "missing_segment":
        extra = ["segment"]
    if case == "missing_base":
        del cols["judge_score"]
    if case == "missing_covariate":
        covariates = ["response_length"]
        del cols["response_length"]
    key = _write(tmp_path / "logs", "part-0.parquet", pa.table(cols))
    ids = cols["response_id"]
    store = pa.table({"response_id": pa.array(ids[::7] + ["caf\u00e9-10"]),
                      "oracle_label": rng.normal(size=len(ids[::7]) + 1),
                      "label_probability": pa.array(np.full(len(ids[::7]) + 1, 0.5))})
    index = None if case == "no_store" else LabelIndex.build(store)
    keep = None if case == "no_keep" else shard_columns(covariates, extra)
    rows = FileRows(covariates, extra)
    read = []
    real = logs_mod._read_one
    monkeypatch.setattr(logs_mod, "_read_one", lambda *a, **k: read.append(r := real(*a, **k)) or r)
    if case.startswith("missing") or case == "own_dt":  # today's errors: a column missing, or a ``dt`` of the file
        with pytest.raises(CJEInputError) as got:
            _run(tmp_path / "logs", key, rows, index, keep, **kw)
        with pytest.raises(CJEInputError) as want:
            _run(tmp_path / "logs", key, _EveryColumn(rows), index, keep, **kw)
        assert str(got.value) == str(want.value) and got.value.column == want.value.column
        # every column read, to name them (or the file refused by the read, a required column missing: nothing read)
        assert len(read) in (0, 2) and all(r.column_names == read[0].column_names for r in read)
        return
    got = _run(tmp_path / "logs", key, rows, index, keep, **kw)
    want = _run(tmp_path / "logs", key, _EveryColumn(rows), index, keep, **kw)
    _same_outputs(got, want)
    assert got[-1]["rows"] == (n if case != "policies" else 2 * n // 3)
    names = read[0].column_names
    if case == "no_keep":  # the pieces keep every column: every column read
        assert names == read[1].column_names
    else:
        assert "other" not in names and "note" not in names and "ts" not in names and "dt" not in names
        assert ("response_length" in names) is (case == "covariate")
        assert ("response" in names) is (case == "derived")


def test_read_window_select_reads_the_chosen_columns_in_the_files_order(tmp_path):
    from flows.storage.objects import Storage

    rng = np.random.default_rng(3)
    key = _write(tmp_path / "logs", "part-0.parquet", pa.table(_logs(30, rng)))
    st = Storage.for_uri(str(tmp_path / "logs"))
    every = logs_mod.read_window(st, [key], check_unique=False)
    got = logs_mod.read_window(st, [key], check_unique=False, select=lambda names: ["judge_score", "prompt_id", "x"])
    assert got.column_names == ["prompt_id", "judge_score"]
    assert got.equals(every.select(["prompt_id", "judge_score"]).replace_schema_metadata(got.schema.metadata))
    whole = logs_mod.read_window(st, [key], check_unique=False, select=lambda names: None)  # as without select
    assert whole.equals(every) and whole.schema.equals(every.schema, check_metadata=True)


def _old_policy_counts(table: pa.Table) -> dict:
    """`FileRows`' counts as first written (a group-by of the table; refuses differing dictionaries)."""
    lab = table["oracle_label"] if "oracle_label" in table.column_names else None
    g = table.group_by("policy").aggregate([("policy", "count")] + ([("oracle_label", "count")] if lab else []))
    return {p: {"rows": int(r), "labelled": int(n)} for p, r, n in zip(
        g["policy"].to_pylist(), g["policy_count"].to_pylist(),
        g["oracle_label_count"].to_pylist() if lab else [0] * g.num_rows)}


def test_policy_counts_are_the_group_bys():
    """A file of one policy counted from its null counts: the counts (and their order) of the group-by, whatever the
    chunks, dictionaries, labels (null, NaN) or policies (several, null, plain strings, none of the rows)."""
    from flows.pipelines.sharded_pass import policy_counts, policy_counts_reference

    rng = np.random.default_rng(5)

    def dict_chunk(values, dictionary):
        return pa.DictionaryArray.from_arrays(pa.array(values, pa.int8()), pa.array(dictionary, pa.string()))

    def table(policy, n_lab=None):
        n = len(policy)
        label = pa.array(np.where(rng.random(n) < 0.3, rng.random(n), np.nan), from_pandas=True)
        if n:  # a NaN label (counted: not null)
            label = pa.concat_arrays([pa.array([np.nan]), label.slice(1)])
        cols = {"policy": policy, "prompt_id": pa.array([f"p{i}" for i in range(n)])}
        if n_lab is not False:
            cols["oracle_label"] = pa.chunked_array([label]) if n else pa.array([], pa.float64())
        return pa.table(cols)

    same = [pa.chunked_array([dict_chunk([0] * 5, ["a"]), dict_chunk([0] * 7, ["a"])]),
            pa.chunked_array([dict_chunk([0] * 5, ["a"]), dict_chunk([], []), dict_chunk([0] * 2, ["a"])]),
            pa.chunked_array([dict_chunk([0] * 4, ["é"])])]
    other = [pa.chunked_array([dict_chunk([0] * 5, ["a"]), dict_chunk([0] * 3, ["b"])]),  # one value a chunk, two
             pa.chunked_array([dict_chunk([0, 1, 0], ["a", "b"])]),  # two policies
             pa.chunked_array([dict_chunk([1, 1, 1], ["a", "b"])]),  # an unused value
             pa.chunked_array([dict_chunk([0, None, 0], ["a"])]),  # a null policy
             pa.chunked_array([dict_chunk([], ["a"])]),  # no row
             pa.chunked_array([pa.array(["a", "a", "b"])]), pa.chunked_array([pa.array(["a", "a"])])]
    for policy in same + other:
        for labels in (None, False):
            t = table(policy, labels)
            got = policy_counts(t)
            want = policy_counts_reference(t)
            assert got == want and list(got) == list(want)
            if policy.num_chunks == 1:  # the group-by as first written, where it worked
                assert got == _old_policy_counts(t)
    t = table(same[0])
    assert policy_counts(t) == {"a": {"rows": 12, "labelled": 12 - t["oracle_label"].null_count}}
    # several policies in several chunks: in order of their first row, every call (Arrow's threaded group-by orders
    # them as its threads finish)
    mixed = pa.chunked_array([dict_chunk([1, 0] * 50, ["a", "b"]), dict_chunk([0, 2] * 50, ["c", "a", "d"]),
                              dict_chunk([0, 1] * 50, ["e", "b"])])
    for _ in range(20):
        assert list(policy_counts(table(mixed))) == ["b", "a", "c", "d", "e"]


def test_a_reader_whose_rows_leave_the_range_known_before_the_read_names_its_file(tmp_path):
    """A file's shards come from the prompt-id range known before its read (its Parquet footer's statistics, or its
    sample): a row of another shard (statistics a writer got wrong) is refused as bad input naming the file and the
    column, not split into the wrong pieces."""
    rng = np.random.default_rng(3)
    key = _write(tmp_path / "logs", "part-0.parquet", pa.table(_logs(900, rng)))  # ids p00000..p00299: shards 0-1
    with pytest.raises(CJEInputError, match="outside the range the file's Parquet footer statistics give") as err:
        sharded_ray.split_file(str(tmp_path / "logs"), {}, key, 0, 3, None, None, None, None, ["p00100", "p00200"],
                               None, None, n_buckets=2, shards=[0])
    assert err.value.source.endswith(key) and err.value.column == "prompt_id"
    pieces = sharded_ray.split_file(str(tmp_path / "logs"), {}, key, 0, 3, None, None, None, None,
                                    ["p00100", "p00200"], None, None, n_buckets=2, shards=[0, 1, 2])
    assert sum(p.table.num_rows for p in pieces[:3]) == 900
