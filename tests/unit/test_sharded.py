"""The sharded row pass (`cje_engine.pipeline.sharded`) gives the single-process numbers.

Estimates, SEs and intervals agree to 1e-12 (relative) with `cje_engine.pipeline.direct` under any number
of shards; bootstrap replicates are bit-identical under any sharding and any order of arrival.
"""
from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.errors import CJEInputError
from cje_engine.options import EvaluationOptions
from cje_engine.pipeline import direct, sharded
from cje_engine.simulate import simulate

TOL = 1e-12


@pytest.fixture(scope="module")
def table() -> pa.Table:
    return pa.Table.from_pandas(simulate(1500, seed=1, oracle_fraction=0.05).frame, preserve_index=False)


def _numbers(x, path=""):
    """Every number of a result dict with its path (strings kept for exact comparison)."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")
    else:
        yield path, x


def assert_same_result(a: dict, b: dict) -> None:
    """``b`` (sharded) has ``a``'s (single-process) numbers to `TOL`, and says it took the sharded path."""
    b = {**b, "inference": dict(b["inference"])}
    row_pass = b["inference"].pop("row_pass")
    assert row_pass["path"] == "sharded" and row_pass["influence"] == "per_prompt"
    na, nb = dict(_numbers(a)), dict(_numbers(b))
    assert na.keys() == nb.keys()
    for k, x in na.items():
        y = nb[k]
        if isinstance(x, float) and isinstance(y, float):
            if np.isnan(x):
                assert np.isnan(y), k
            else:
                assert abs(x - y) <= TOL * max(abs(x), abs(y), 1e-300) or abs(x - y) < 1e-15, (k, x, y)
        else:
            assert x == y, (k, x, y)


@pytest.mark.parametrize("n_shards", [1, 3, 17])
@pytest.mark.parametrize("kw", [dict(inference="analytic"),
                                dict(inference="analytic", covariates=("response_length",),
                                     calibration_mode="two_stage")], ids=["monotone", "two_stage"])
def test_shard_counts_give_the_single_process_numbers(table, n_shards, kw):
    opts = EvaluationOptions.of(None, seed=3, **kw)
    single = direct.evaluate(table, opts).to_dict()
    sp = sharded.prepare_sharded(sharded.split_by_shard(table, n_shards), opts)
    assert len(sp.shards) == n_shards
    assert_same_result(single, sp.finalize([]).to_dict())
    # the Gram form of the evaluation terms is the per-prompt terms' (any contrast's variance is a merge)
    K = sp.prep.design.n_policies
    e = sp.prep.infl["total"][:, :K] - sp.prep.infl["calibration"][:, :K]
    np.testing.assert_allclose(sp.gram["gram"], e.T @ e, rtol=1e-10, atol=1e-18)
    assert sp.gram["count"] == sp.n_prompts


def test_bootstrap_replicates_are_bit_identical_in_any_order_of_arrival(table):
    opts = EvaluationOptions.of(None, seed=5, inference="bootstrap", n_bootstrap=60)
    prep = direct.prepare(table, opts)
    expected = direct.bootstrap_chunk(prep, 0, 60)

    def shuffled(fn, items):
        out = [(i, fn(*item)) for i, item in enumerate(items)]
        random.Random(7).shuffle(out)
        return out

    for n in (3, 17):
        sp = sharded.prepare_sharded(sharded.split_by_shard(table, n), opts, mapper=shuffled)
        got = np.vstack([sp.replicates(0, 25), sp.replicates(25, 60)])  # any chunking too
        assert np.array_equal(got, expected, equal_nan=True)
        assert_same_result(direct.finalize(prep, [expected]).to_dict(), sp.finalize([got]).to_dict())


def test_a_shard_without_labels(table):
    parts = sharded.split_by_shard(table, 17)
    lab = np.asarray(table["oracle_label"].is_valid())
    # drop the labels of one shard's rows: that shard holds none; the single path sees the same rows
    drop_prompts = set(parts[4]["prompt_id"].to_pylist())
    keep = np.array([p not in drop_prompts for p in table["prompt_id"].to_pylist()]) | ~lab
    label = np.where(keep, table["oracle_label"].to_numpy(zero_copy_only=False), np.nan)
    t2 = table.set_column(table.column_names.index("oracle_label"), "oracle_label", pa.array(label))
    parts2 = sharded.split_by_shard(t2, 17)
    assert parts2[4].num_rows > 0 and parts2[4]["oracle_label"].null_count + int(
        np.isnan(parts2[4]["oracle_label"].to_numpy(zero_copy_only=False)).sum()) >= parts2[4].num_rows
    opts = EvaluationOptions.of(None, seed=3, inference="analytic")
    assert_same_result(direct.evaluate(t2, opts).to_dict(),
                       sharded.prepare_sharded(parts2, opts).finalize([]).to_dict())


def test_a_prompt_spread_over_two_files_of_different_days(table):
    """The rows of one prompt come from two daily files: both readers send them to the same shard, and the
    window order (file, row) is kept, so the numbers are the single-process ones on the two files."""
    n = table.num_rows
    day1, day2 = table.slice(0, n // 2), table.slice(n // 2)
    # the simulator writes policy after policy: every prompt of day1 also has rows in day2
    assert set(day1["prompt_id"].to_pylist()) & set(day2["prompt_id"].to_pylist())
    n_shards = 3
    a = sharded.split_by_shard(day1, n_shards, row_offset=0)
    b = sharded.split_by_shard(day2, n_shards, row_offset=day1.num_rows)
    shards = [pa.concat_tables([b[s], a[s]]) for s in range(n_shards)]  # arrival order does not matter
    opts = EvaluationOptions.of(None, seed=3, inference="analytic")
    single = direct.evaluate(pa.concat_tables([day1, day2]), opts).to_dict()
    assert_same_result(single, sharded.prepare_sharded(shards, opts).finalize([]).to_dict())


def test_a_prompt_in_two_shards_is_refused(table):
    parts = sharded.split_by_shard(table, 3)
    wrong = [pa.concat_tables([parts[0], parts[1].slice(0, 1)]), parts[1], parts[2]]
    with pytest.raises(CJEInputError, match="is in two shards"):
        sharded.prepare_sharded(wrong, EvaluationOptions.of(None, inference="analytic"))


def test_shard_of_is_stable_and_independent_of_the_folds():
    ids = [f"p{i}" for i in range(2000)]
    s = sharded.shard_of(ids, 5)
    assert np.array_equal(s, sharded.shard_of(np.array(ids, dtype=object), 5))
    assert list(sharded.shard_of(["p0", "p1", "p2"], 7)) == list(sharded.shard_of(["p0", "p1", "p2"], 7))
    from cje_engine.data.frame import fold_of
    assert (s == fold_of(np.array(ids, dtype=object), 5)).mean() < 0.5


def test_per_prompt_terms_over_the_driver_budget_are_refused_before_pass_2(table):
    calls = []

    def counting(fn, items):
        calls.append(fn.__name__)
        return sharded.serial_map(fn, items)

    opts = EvaluationOptions.of(None, inference="analytic")
    with pytest.raises(CJEInputError, match="per-prompt influence terms of 1,500 prompts"):
        sharded.prepare_sharded(sharded.split_by_shard(table, 3), opts, mapper=counting, terms_budget=1000)
    assert calls == ["reduce_shard"]  # refused after the merge, before the evaluation-terms pass
