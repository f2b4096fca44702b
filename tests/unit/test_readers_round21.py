"""The sharded readers' fast paths of round 21 (issue 29) against the code they replace (kept as references).

* `flows.runtime.sharded_ray.response_id_buckets`: the 1-byte keys ordered by Arrow's stable sort and the runs'
  bounds from their counts (not numpy's radix argsort and a search of the sorted keys), the reader's fingerprints
  read without a copy: the same buckets, bit for bit, in every mode (the fingerprints alone, sorted since session 30,
  take no 1-byte keys: the reference's the same by construction there; `tests/unit/test_ids_fast.py` pins them).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.pipeline.sharded import ROW
from flows.runtime import sharded_ray


def _same_tables(a: list[pa.Table], b: list[pa.Table]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.schema.equals(y.schema, check_metadata=True) and x.equals(y)
        assert [c.num_chunks for c in x.columns] == [c.num_chunks for c in y.columns]
        for cx, cy in zip(x.columns, y.columns):
            for p, q in zip(cx.chunks, cy.chunks):
                assert p.offset == q.offset and len(p) == len(q)
                if pa.types.is_integer(p.type):
                    assert p.to_numpy().tobytes() == q.to_numpy().tobytes()


def _table(rng: np.random.Generator, n: int, with_fp: bool, chunks: int) -> pa.Table:
    ids = [f"r-{int(i):08x}{'é' if i % 7 == 0 else ''}{'x' * int(i % 13)}" for i in rng.integers(0, 1 << 30, n)]
    if n > 3:
        ids[3] = ids[1]  # a repeated id: its copies in one bucket
    t = pa.table({"response_id": pa.array(ids, pa.string()), ROW: pa.array(np.arange(n, dtype=np.int64) + (5 << 40))})
    if with_fp:
        fp = sharded_ray.id_fingerprint(t["response_id"])
        if n > 10:
            fp[10] = fp[2]  # a repeated fingerprint
        t = t.append_column(sharded_ray.FINGERPRINT, pa.array(fp))
    if chunks > 1 and n:
        cut = sorted(set(rng.integers(0, n, chunks - 1).tolist()))
        t = pa.concat_tables([t.slice(a, b - a) for a, b in zip([0, *cut], [*cut, n])])
    return t


@pytest.mark.parametrize("n_buckets", [1, 2, 3, 4, 26, 32, 64, 128, 255, 256, 300])
def test_response_id_buckets_are_the_reference(n_buckets):
    rng = np.random.default_rng(n_buckets)
    for n in (0, 1, 2, 17, 3000):
        for with_fp in (True, False):
            for chunks in (1, 3):
                t = _table(rng, n, with_fp, chunks)
                for kw in ({}, {"ids": False}, {"ids": False, "places": False}):
                    _same_tables(sharded_ray.response_id_buckets(t, n_buckets, **kw),
                                 sharded_ray.response_id_buckets_reference(t, n_buckets, **kw))


def test_byte_runs_is_the_stable_argsort_and_its_search():
    rng = np.random.default_rng(0)
    for key in (np.zeros(0, np.uint8), np.array([7], np.uint8), rng.integers(0, 256, 10_000).astype(np.uint8),
                rng.integers(250, 256, 999).astype(np.uint8), np.full(500, 255, np.uint8)):
        order, bounds = sharded_ray._byte_runs(key)
        want, want_bounds = sharded_ray._byte_runs_reference(key)
        assert order.dtype == np.int64 and order.tobytes() == want.astype(np.int64).tobytes()
        assert bounds.tolist() == want_bounds.tolist()


def test_the_bit_test_is_the_word_by_word_test_at_the_edges():
    """`LabelIndex._may_hold` (its bytes taken by `numpy.take`, searched as booleans) against its reference: no
    query, one, every bit's query (the top and bottom bytes of the set), an index of one id, a chunked
    fingerprint column of the logs."""
    from flows.runtime.label_index import LabelIndex
    from flows.storage import fingerprints

    rng = np.random.default_rng(3)
    for n_stored in (1, 5000):
        stored = [f"r-{i}-{rng.integers(1 << 40)}" for i in range(n_stored)]
        index = LabelIndex.build(pa.table({"response_id": pa.array(stored),
                                           "oracle_label": pa.array(rng.random(n_stored)),
                                           "label_probability": pa.array(np.full(n_stored, 0.5))}))
        for q in (np.zeros(0, np.uint64), np.array([2**64 - 1], np.uint64), np.array([0], np.uint64),
                  fingerprints.id_fingerprint(pa.array(stored)),
                  rng.integers(0, 2**64 - 1, 20000, dtype=np.uint64, endpoint=True)):
            got, want = index._may_hold(q), index._may_hold_reference(q)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
        logs = pa.table({"response_id": pa.array(stored[::2] + ["nope"] * 3)})
        fp = fingerprints.id_fingerprint(logs["response_id"])
        with_fp = logs.append_column(sharded_ray.FINGERPRINT, pa.chunked_array([fp[:2], fp[2:]]))
        one = logs.append_column(sharded_ray.FINGERPRINT, pa.array(fp))
        want = index.join(logs)
        for t in (with_fp, one):
            got = index.join(t).drop_columns([sharded_ray.FINGERPRINT])
            assert got.equals(want) and got.schema.equals(want.schema, check_metadata=True)


def test_label_arrays_are_pyarrows():
    """`flows.storage.labels._float_array` (its validity packed by numpy) and `_bool_array` against ``pyarrow.array``
    of the same values: every length (not a multiple of 8 too), every null, none, some."""
    from flows.storage.labels import _bool_array, _float_array, _float_array_reference

    rng = np.random.default_rng(9)
    for n in (0, 1, 7, 8, 9, 1000, 1001):
        values = rng.random(n)
        values[: n // 3] = 0.0
        for valid in (np.ones(n, bool), np.zeros(n, bool), rng.random(n) < 0.05, rng.random(n) < 0.95):
            got, want = _float_array(values, valid), _float_array_reference(values, valid)
            assert got.type == want.type and got.null_count == want.null_count and got.equals(want)
            assert np.array_equal(got.is_valid().to_numpy(zero_copy_only=False), valid)
            assert got.fill_null(-1.0).to_numpy().tobytes() == want.fill_null(-1.0).to_numpy().tobytes()
            got_b, want_b = _bool_array(valid), pa.array(valid)
            assert got_b.type == want_b.type and got_b.null_count == 0 and got_b.equals(want_b)


def test_take_rows_is_arrows_take():
    """`flows.runtime.label_index._take_rows` (a chunked column's rows taken chunk by chunk) against
    ``pyarrow.compute.take``: rows in no chunk, one, every one, at the chunks' edges, none, unsorted, one chunk."""
    import pyarrow.compute as pc

    from flows.runtime.label_index import _take_rows

    rng = np.random.default_rng(4)
    values = [f"id-{i}-{'é' * (i % 3)}" for i in range(1000)]
    cols = [pa.chunked_array([pa.array(values[a:b], pa.string()) for a, b in ((0, 300), (300, 300), (300, 700), (700, 1000))]),
            pa.chunked_array([pa.array(values)]), pa.array(values)]
    for col in cols:
        for rows in (np.zeros(0, np.int64), np.array([0]), np.array([299, 300, 699, 700, 999]),
                     np.sort(rng.choice(1000, 50, replace=False)), np.arange(1000), np.array([5, 3, 900]),
                     np.arange(310, 320)):
            got = _take_rows(col, rows)
            want = pc.take(col, pa.array(rows))
            assert got.type == want.type and got.to_pylist() == want.to_pylist()
