"""The sharded pass's vectorized worker steps give what the slower steps they replace gave (issue 29, speed)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from cje_engine.pipeline import sharded
from flows.runtime import sharded_ray

IDS = ["b", "a", "é", "Z", "a", "zz", "", "b0-p10", "b0-p9", "日本", "b0-p10"]


@pytest.mark.parametrize("column", [
    pa.array(IDS, pa.string()),
    pa.chunked_array([pa.array(IDS[:4], pa.string()), pa.array(IDS[4:], pa.string())]),
    pa.chunked_array([pa.array(IDS, pa.large_string())]),
    pa.array(["x", None, "a"], pa.string()),  # nulls: the pandas path
])
def test_sorted_codes_are_pandas_sorted_factorize(column):
    codes, uniques = sharded.sorted_codes(column)
    want_codes, want_uniques = pd.factorize(column.to_pandas(), sort=True)
    assert np.array_equal(codes, want_codes)
    assert uniques.to_pylist() == [str(u) for u in want_uniques]


def test_unique_ints_is_numpy_unique():
    rng = np.random.default_rng(0)
    for values in (rng.integers(-5, 50, 400), np.empty(0, np.int64), np.array([7])):
        assert np.array_equal(sharded.unique_ints(values), np.unique(values))


def test_range_shard_is_searchsorted_right():
    ids = pa.chunked_array([pa.array(IDS[:5]), pa.array(IDS[5:])])
    cuts = sorted({"a", "b0-p10", "zz"})
    want = np.searchsorted(np.array(cuts, dtype=object), np.array(IDS, dtype=object), side="right")
    assert np.array_equal(sharded.range_shard(ids, cuts), want)


def test_string_hash_depends_on_the_string_alone():
    ids = [f"r{i}" for i in range(300)] + ["", "a", "a" * 40]
    whole = sharded_ray.string_hash(pa.array(ids))
    chunked = sharded_ray.string_hash(pa.chunked_array([pa.array(ids[:7]), pa.array(ids[7:])]))
    assert np.array_equal(whole, sharded_ray.string_hash(pa.array(ids, pa.large_string())))
    sliced = sharded_ray.string_hash(pa.array(ids).slice(100, 50))
    assert np.array_equal(whole, chunked) and np.array_equal(whole[100:150], sliced)
    assert np.unique(whole).size == len(ids)  # distinct here; buckets spread
    assert np.bincount((whole % np.uint64(4)).astype(np.int64)).min() > 40


def test_response_id_buckets_keep_every_copy_of_an_id_together():
    rid = [f"r{i % 50}" for i in range(200)]
    table = pa.table({"response_id": rid, sharded.ROW: np.arange(200)})
    for cuts in (None, ["r2", "r31", "r7"]):
        parts = sharded_ray.response_id_buckets(table, 4, cuts)
        where = {}
        for b, part in enumerate(parts):
            for r in part["response_id"].to_pylist():
                where.setdefault(r, set()).add(b)
        assert sum(p.num_rows for p in parts) == 200 and all(len(v) == 1 for v in where.values())


def test_shard_pieces_reach_the_task_as_one_table():
    a = pa.table({"x": [1, 2]})
    b = pa.table({"x": [3]})
    layout, args = sharded_ray._flatten(("k", sharded_ray.ShardPieces([a, b]), 5))
    assert layout == (None, 2, None)
    assert sharded_ray._with_pieces(lambda k, t, n: (k, t["x"].to_pylist(), n), layout, *args) == ("k", [1, 2, 3], 5)


def test_shards_are_a_multiple_of_the_cpus():
    assert sharded_ray.n_shards_for(10_000_000, 2) == 4
    assert sharded_ray.n_shards_for(100_000_000, 2) == 26
    assert sharded_ray.n_shards_for(1_000, 3) == 3
    assert sharded_ray.n_shards_for(0, 0) == 1
