"""The sharded readers' fast paths of round 22 (issue 29) against the code they replace (kept as references).

* `cje_engine.pipeline.sharded._score_codes`: a piece's scores coded through a table of slots of the values of its
  first rows (`_table_codes`), not Arrow's dictionary encoding (`_score_codes_reference`): the same codes (type and
  bytes) and values (bit patterns), or None where the reference gives None.
* `cje_engine.pipeline.sharded._labelled`: the labelled rows' positions and labels from each chunk's values and
  validity bits (`_labelled_reference`: the column as float64 with its nulls as NaN).
* `cje_engine.pipeline.sharded.pack_piece` with both: the same packed piece as with the references.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.pipeline import sharded
from cje_engine.pipeline.sharded import LABEL, LABEL_PROB, ROW, SCORE


def _chunked(values: np.ndarray | pa.Array, cuts: list[int], typ=pa.float64()) -> pa.ChunkedArray:
    arr = values if isinstance(values, pa.Array) else pa.array(values, typ)
    edges = [0, *cuts, len(arr)]
    return pa.chunked_array([arr.slice(a, b - a) for a, b in zip(edges, edges[1:])], typ)


def _same_codes(a, b) -> None:
    if b is None:
        assert a is None
        return
    assert a is not None
    assert a[0].dtype == b[0].dtype and a[0].tobytes() == b[0].tobytes()
    assert a[1].dtype == b[1].dtype and a[1].tobytes() == b[1].tobytes()


def _score_cases():
    rng = np.random.default_rng(7)
    grid = np.round(np.arange(21) * 0.05, 2)
    many = rng.random(5000)
    yield "grid", grid[rng.integers(0, 21, 20_000)], []
    yield "grid chunks", grid[rng.integers(0, 21, 20_000)], [5, 131, 9000]
    yield "tiny first chunk", grid[rng.integers(0, 21, 6000)], [3, 4, 100]
    yield "one row", np.array([0.25]), []
    yield "one value", np.full(3000, 0.5), [1000]
    yield "zeros signed", np.array([0.0, -0.0] * 1500), []
    nan2 = np.array([np.nan, 1.0]).copy()
    nan2.view(np.uint64)[0] |= np.uint64(1)  # a NaN of another payload: its own value
    yield "nans", np.concatenate([np.full(100, np.nan), nan2, np.full(50, np.inf), np.full(50, -np.inf)]), [60]
    late = grid[rng.integers(0, 5, 5000)]
    late[4000] = 0.95  # a value after the first rows: the reference's way
    yield "late value", late, [2500]
    yield "256 values", rng.permutation(np.repeat(rng.random(256), 20)), [100]
    yield "257 values", rng.permutation(np.repeat(rng.random(257), 20)), []
    yield "many values", many, []
    yield "head many then few", np.concatenate([many[:2048], np.full(3000, many[0])]), []
    yield "exactly probe rows", grid[rng.integers(0, 21, sharded.PACK_SCORE_PROBE)], []
    yield "colliding bits", (np.arange(64, dtype=np.uint64) << np.uint64(52)).view(np.float64)[
        rng.integers(0, 64, 4000)], [7]


@pytest.mark.parametrize("case", list(_score_cases()), ids=lambda c: c[0])
def test_score_codes_are_the_references(case):
    _, values, cuts = case
    t = pa.table({SCORE: _chunked(values, cuts)})
    _same_codes(sharded._score_codes(t), sharded._score_codes_reference(t))
    _same_codes(sharded._score_codes(t.slice(1)), sharded._score_codes_reference(t.slice(1)))
    plain = pa.table({SCORE: pa.array(values, pa.float64())})
    _same_codes(sharded._score_codes(plain), sharded._score_codes_reference(plain))


def test_score_codes_refuse_as_the_reference():
    for col in (pa.array([], pa.float64()), pa.array([1.0, None, 2.0]), pa.array([1, 2, 3], pa.int64()),
                pa.array([0.5, 0.25], pa.float32()), pa.chunked_array([], pa.float64())):
        t = pa.table({SCORE: col})
        _same_codes(sharded._score_codes(t), sharded._score_codes_reference(t))


def test_table_codes_refuse_values_outside():
    values = np.array([1, 2, 3], dtype=np.uint64)
    assert sharded._table_codes([np.array([1, 2, 4], dtype=np.uint64)], values) is None
    got = sharded._table_codes([np.array([3, 1], dtype=np.uint64), np.array([2], dtype=np.uint64)], values)
    assert got.dtype == np.uint8 and got.tolist() == [2, 0, 1]
    assert sharded._table_codes([values], np.arange(257, dtype=np.uint64)) is None


def _label_cases():
    rng = np.random.default_rng(3)
    n = 5000
    vals = rng.random(n)
    valid = rng.random(n) < 0.1
    nan_vals = vals.copy()
    nan_vals[::17] = np.nan
    yield "nulls", pa.array(vals, pa.float64(), mask=~valid), []
    yield "nulls chunks", pa.array(vals, pa.float64(), mask=~valid), [1, 999, 2500]
    yield "nan and nulls", pa.array(nan_vals, pa.float64(), mask=~valid), [1234]
    yield "no nulls", pa.array(nan_vals, pa.float64()), [10]
    yield "all null", pa.array([None] * 40, pa.float64()), [13]
    yield "empty", pa.array([], pa.float64()), []
    yield "one row", pa.array([0.75], pa.float64()), []
    yield "float32", pa.array(vals.astype(np.float32), pa.float32(), mask=~valid), [77]
    yield "int", pa.array(rng.integers(0, 2, n), pa.int64(), mask=~valid), [50]


@pytest.mark.parametrize("case", list(_label_cases()), ids=lambda c: c[0])
def test_labelled_is_the_reference(case):
    _, arr, cuts = case
    t = pa.table({LABEL: _chunked(arr, cuts, arr.type)})
    for part in (t, t.slice(0), t.slice(min(3, t.num_rows)), t.slice(1, max(0, t.num_rows - 5))):
        a, b = sharded._labelled(part), sharded._labelled_reference(part)
        assert a[0].dtype == b[0].dtype and a[0].tolist() == b[0].tolist()
        assert a[1].dtype == b[1].dtype and a[1].tobytes() == b[1].tobytes()


def _pack_reference(table, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(sharded, "_score_codes", sharded._score_codes_reference)
        m.setattr(sharded, "_labelled", sharded._labelled_reference)
        return sharded.pack_piece(table)


def _same_piece(a, b) -> None:
    assert a.table.schema.equals(b.table.schema, check_metadata=True) and a.table.equals(b.table)
    assert a.schema.equals(b.schema, check_metadata=True) and a.row_first == b.row_first
    for f in ("row_step", "row", "score_values", "lab_pos", "label", "label_prob"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pack_piece_is_the_references(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    n = 3000
    valid = rng.random(n) < 0.2
    lab = np.where(rng.random(n) < 0.05, np.nan, rng.integers(0, 2, n).astype(float))
    score = np.round(rng.integers(0, 21, n) * 0.05, 2)
    if seed == 2:
        score = rng.random(n)  # too many values: shipped plain
    t = pa.table({"prompt_id": pa.array([f"p{i // 3:05d}" for i in range(n)]),
                  "policy": pa.array(["a", "b", "c"] * (n // 3)).dictionary_encode(),
                  SCORE: _chunked(score, [100, 2000]),
                  LABEL: pa.array(lab, pa.float64(), mask=~valid),
                  LABEL_PROB: pa.array(rng.random(n), pa.float64(), mask=rng.random(n) < 0.3),
                  ROW: pa.array(np.arange(n, dtype=np.int64) + (3 << 40))})
    for part in (t, t.slice(5, 1000), t.slice(0, 1), t.slice(0, 0)):
        _same_piece(sharded.pack_piece(part), _pack_reference(part, monkeypatch))


def test_score_codes_take_the_table_way(monkeypatch):
    """The grid of a judge's scores (every value among the first rows) is coded without the reference."""
    rng = np.random.default_rng(11)
    t = pa.table({SCORE: _chunked(np.round(rng.integers(0, 21, 9000) * 0.05, 2), [4000])})
    want = sharded._score_codes_reference(t)
    monkeypatch.setattr(sharded, "_score_codes_reference", lambda table: pytest.fail("the reference's way"))
    _same_codes(sharded._score_codes(t), want)
