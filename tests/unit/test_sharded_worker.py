"""The sharded pass's vectorized worker steps give what the slower steps they replace gave (issue 29, speed)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from cje_engine.data.ints import unique_ints, unique_inverse
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
        assert np.array_equal(unique_ints(values), np.unique(values))


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


def test_prompts_per_policy_and_unique_inverse_are_numpy_unique():
    rng = np.random.default_rng(1)
    for n_pol, n_ids, rows in ((3, 50, 400), (5, 1000, 30), (1, 1, 1), (2, 10, 0)):
        pol, pr = rng.integers(0, n_pol, rows), rng.integers(0, n_ids, rows)
        want = np.array([np.unique(pr[pol == k]).size for k in range(n_pol)])
        assert np.array_equal(sharded._prompts_per_policy(pol, pr, n_pol, n_ids), want)
        u, inv = unique_inverse(pr)
        wu, winv = np.unique(pr, return_inverse=True)
        assert np.array_equal(u, wu) and np.array_equal(inv, winv)


def test_the_shards_evaluation_terms_are_the_estimators_bit_for_bit():
    from cje_engine.direct.estimators import evaluation_terms

    rng = np.random.default_rng(2)
    n, K, P = 5000, 4, 700
    prompt, pol = rng.integers(0, P, n).astype(np.int32), rng.integers(0, K, n)
    f, plug, n_k = rng.random(n), rng.random(K), rng.integers(100, 2000, K).astype(float)
    want = evaluation_terms(prompt.astype(np.int64), pol, f, plug, n_k, P)[:, :K]
    assert np.array_equal(sharded._evaluation_terms(prompt, pol, f, plug, n_k, P), want)


@pytest.mark.parametrize("keep_terms", [True, False])
def test_passes_2_and_3_on_kept_codes_give_the_parts_of_the_shards_read_again(keep_terms):
    """Pass 2 and the bootstrap's pass 3 on pass 1's kept codes (`ShardKept`) return, bit for bit, what they
    return from the shard's table read and coded again (`shard_view` of the table: the slow, obvious path)."""
    from cje_engine.options import EvaluationOptions
    from cje_engine.simulate import simulate

    table = pa.Table.from_pandas(simulate(900, seed=4, oracle_fraction=0.1).frame, preserve_index=False)
    shards = sharded.split_by_shard(table, 3)
    # two days of one shard arrive in the other order: the reader's rows are sorted back into window order
    shards[1] = pa.concat_tables([shards[1].slice(200), shards[1].slice(0, 200)])
    opts = EvaluationOptions.of(None, seed=1, inference="analytic", covariates=("response_length",),
                                calibration_mode="two_stage")
    seen = {}

    def recording(fn, items):
        seen[fn.__name__] = items
        return sharded.serial_map(fn, items)

    sp = sharded.prepare_sharded(shards, opts, mapper=recording, keep_terms=keep_terms)
    assert len(sp.kept) == 3 and all(isinstance(k, sharded.ShardKept) for k in sp.kept)
    for i, item in enumerate(seen["shard_evaluation_terms"]):
        assert item[0] is sp.kept[i]
        fast = sharded.shard_evaluation_terms(*item)
        slow = sharded.shard_evaluation_terms(shards[i], *item[1:])
        for name in ("terms", "count", "total", "gram", "labelled", "labelled_terms"):
            assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
        if not keep_terms:
            for name in ("n", "s", "S", "T"):
                assert np.array_equal(getattr(fast.rest, name), getattr(slow.rest, name)), name
        args = (tuple(opts.covariates), None, sp.codes[i], 11, 0, 7, sp.n_prompts, sp.prep.design.n_policies)
        assert np.array_equal(sharded.shard_histograms(sp.kept[i], *args), sharded.shard_histograms(shards[i], *args))
