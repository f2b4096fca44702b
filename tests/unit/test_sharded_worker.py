"""The sharded pass's vectorized worker steps give what the slower steps they replace gave (issue 29, speed)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from cje_engine.data.ints import count_distinct, present_codes, small_unique_inverse, unique_ints, unique_inverse
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


def _collide(middle: str) -> str:
    """A 30-byte id whose first, middle (bytes 11-18) and last 8 bytes are fixed: its fingerprint does not
    depend on ``middle`` (bytes 8-10)."""
    assert len(middle) == 3
    return "AAAAAAAA" + middle + "MMMMMMMM" + "qqq" + "ZZZZZZZZ"


def test_id_fingerprint_depends_on_the_string_alone():
    ids = [f"r{i}" for i in range(300)] + ["", "a", "ab", "abcdefgh", "abcdefghi", "a" * 40, "日本", "é"]
    whole = sharded_ray.id_fingerprint(pa.array(ids))
    chunked = sharded_ray.id_fingerprint(pa.chunked_array([pa.array(ids[:7]), pa.array(ids[7:])]))
    assert np.array_equal(whole, sharded_ray.id_fingerprint(pa.array(ids, pa.large_string())))
    sliced = sharded_ray.id_fingerprint(pa.array(ids).slice(100, 50))
    assert np.array_equal(whole, chunked) and np.array_equal(whole[100:150], sliced)
    # one id at a time (no neighbour's bytes can leak into a short id's loads)
    assert np.array_equal(whole, np.concatenate([sharded_ray.id_fingerprint(pa.array([x])) for x in ids]))
    assert np.unique(whole).size == len(ids)  # distinct here; buckets spread
    assert np.bincount((whole % np.uint64(4)).astype(np.int64)).min() > 40
    nulls = sharded_ray.id_fingerprint(pa.array(["ab", None, "abcdefghi"]))
    assert nulls[1] == sharded_ray.id_fingerprint(pa.array([""]))[0]
    assert np.array_equal(nulls[[0, 2]], whole[[302, 304]])
    assert sharded_ray.id_fingerprint(pa.array([_collide("xyz"), _collide("abc")])).tolist() == \
        [sharded_ray.id_fingerprint(pa.array([_collide("qqq")]))[0]] * 2


def test_response_id_buckets_keep_every_copy_of_an_id_together():
    rid = [f"r{i % 50}" for i in range(200)]
    table = pa.table({"response_id": rid, sharded.ROW: np.arange(200)})
    parts = sharded_ray.response_id_buckets(table, 4)
    where = {}
    for b, part in enumerate(parts):
        for r in part["response_id"].to_pylist():
            where.setdefault(r, set()).add(b)
    assert sum(p.num_rows for p in parts) == 200 and all(len(v) == 1 for v in where.values())
    assert min(p.num_rows for p in parts) > 0


def _slow_check(pieces):
    """The obvious check: every id of the bucket sorted as a string (`first_duplicate`), then its rows."""
    from flows.storage.logs import first_duplicate

    ids = [r for p in pieces for r in p["response_id"].to_pylist()]
    rows = [r for p in pieces for r in p[sharded.ROW].to_pylist()]
    dup = first_duplicate(pa.array(ids))
    if dup is None:
        return None
    at = sorted(r for i, r in zip(ids, rows) if i == dup)
    return {"response_id": dup, "rows": at[:5], "count": len(at)}


@pytest.mark.parametrize("case", ["distinct", "colliding", "repeated", "repeated_and_colliding", "many"])
def test_the_fingerprinted_check_is_the_string_sort(case, monkeypatch):
    """`check_response_ids` sorts fingerprints and compares only the ids whose fingerprint repeats: it finds
    what the sort of every id as a string finds, with ids that share a fingerprint (bytes 8-10 of 30 differ)
    and without, with one repeated id and with several (the smallest is named, with its rows)."""
    rng = np.random.default_rng(7)
    ids = [f"resp-{i:07d}" for i in range(3000)]
    if case in ("colliding", "repeated_and_colliding"):
        ids += [_collide(f"{i:03d}") for i in range(200)]  # 200 different ids, one fingerprint
    if case in ("repeated", "repeated_and_colliding"):
        ids[2500] = ids[17]
        ids[2999] = ids[17]
    if case == "repeated_and_colliding":
        ids[3100] = ids[3050]  # a repeat among the ids that share a fingerprint
    if case == "many":
        for a, b in rng.integers(0, 3000, (20, 2)):
            ids[b] = ids[a]
    order = rng.permutation(len(ids))
    table = pa.table({"response_id": [ids[i] for i in order], sharded.ROW: order.astype(np.int64)})
    pieces = [p for f in (table.slice(0, 1700), table.slice(1700)) for p in [sharded_ray.response_id_buckets(f, 3)]]
    for b in range(3):
        bucket = [pieces[0][b], pieces[1][b]]
        assert sharded_ray.check_response_ids(*bucket) == _slow_check(bucket)
    found = [sharded_ray.check_response_ids(*[p[b] for p in pieces]) for b in range(3)]
    assert (all(f is None for f in found)) == (case in ("distinct", "colliding"))
    if case == "repeated":
        (hit,) = [f for f in found if f]
        assert hit == {"response_id": ids[17], "rows": [17, 2500, 2999], "count": 3}
    if case == "repeated_and_colliding":
        assert {"response_id": ids[3050], "rows": [3050, 3100], "count": 2} in found
    # buckets of fingerprints without their ids (what `split_file` ships): the rows whose fingerprint repeats, then
    # only their ids fetched (`resolve_candidates`) and compared as strings: the same findings
    bare = [sharded_ray.response_id_buckets(f, 3, ids=False) for f in (table.slice(0, 1700), table.slice(1700))]
    assert all(p.column_names == [sharded_ray.FINGERPRINT, sharded.ROW] for b in bare for p in b)
    lookup = dict(zip(table[sharded.ROW].to_pylist(), table["response_id"].to_pylist()))
    fetched = []

    def ids_of(f, positions):
        fetched.extend(positions)
        return [lookup[(f << sharded_ray.ROW_BITS) | p] for p in positions]

    results = [sharded_ray.check_response_ids(*[p[b] for p in bare]) for b in range(3)]
    assert all(set(r) == {"candidates"} for r in results if r is not None)
    candidates = [r["candidates"] for r in results if r is not None]
    resolved = sharded_ray.resolve_candidates(candidates, ids_of)
    assert sorted(map(repr, resolved)) == sorted(repr(f) for f in found if f is not None)
    assert (candidates == []) == (case == "distinct")  # distinct ids of distinct fingerprints: nothing fetched
    assert len(fetched) == sum(map(len, candidates)) and len(fetched) <= 200 + 60
    # a bucket without the fingerprint column (pieces from elsewhere): fingerprinted in the check
    assert sharded_ray.check_response_ids(table) == _slow_check([table])
    # buckets too large to pack the row into the sort: whole fingerprints sorted, then the repeated ones found
    monkeypatch.setattr(sharded_ray, "_PACKED_ROWS", 0)
    for b in range(3):
        bucket = [pieces[0][b], pieces[1][b]]
        assert sharded_ray.check_response_ids(*bucket) == _slow_check(bucket)


def test_repeated_fingerprints_are_the_counted_ones():
    """`repeated_fingerprints` (a sort of the high halves, then the whole fingerprints of the few) finds exactly the
    positions whose whole 64-bit value occurs more than once: against counting every value, with values sharing a
    high half but not the low one, and values equal in both."""
    rng = np.random.default_rng(11)
    for n in (0, 1, 2, 50, 5000):
        high = rng.integers(0, max(n // 3, 1), n).astype(np.uint64) << np.uint64(32)
        fp = high | rng.integers(0, 4, n).astype(np.uint64)  # many shared halves, some whole repeats
        fp[: n // 2] = rng.integers(0, 2**63, n // 2).astype(np.uint64)  # and distinct ones
        values, counts = np.unique(fp, return_counts=True)
        want = np.flatnonzero(np.isin(fp, values[counts > 1]))
        assert np.array_equal(sharded_ray.repeated_fingerprints(fp), want)


def test_split_by_shard_keeps_each_shards_rows_in_order():
    """The split's sort of 1- or 2-byte shard keys (radix) gives each shard its rows in their order, as the
    obvious filter of the table by shard does, for hash and range shards and 300 shards (2-byte keys); and so do
    the slices of a file already in shard order (its ids sorted, split by range: no take)."""
    rng = np.random.default_rng(3)
    ids = [f"p{i}" for i in rng.integers(0, 5000, 20000)]
    table = pa.table({"prompt_id": ids, "x": rng.random(20000)})
    cases = [(table, 5, None), (table, 4, ["p2", "p4", "p7"]), (table, 300, None)]
    ordered = table.take(pa.array(np.argsort(np.array(ids, dtype=object), kind="stable")))
    cases += [(ordered, 4, ["p2", "p4", "p7"]), (ordered, 3, ["p0", "p0"]), (ordered.slice(0, 1), 2, ["p5"])]
    for table, n_shards, splitters in cases:
        ids = table["prompt_id"].to_pylist()
        n = table.num_rows
        parts = sharded.split_by_shard(table, n_shards, splitters=splitters)
        full = table.append_column(sharded.ROW, pa.array(np.arange(n, dtype=np.int64)))
        shard = (sharded.shard_of(ids, n_shards) if splitters is None
                 else np.searchsorted(np.array(splitters, dtype=object), np.array(ids, dtype=object), side="right"))
        assert len(parts) == n_shards
        for s, part in enumerate(parts):
            want = full.filter(pa.array(shard == s))
            assert part.select(want.column_names).equals(want)


def test_shard_pieces_reach_the_task_as_one_table():
    a = pa.table({"x": [1, 2]})
    b = pa.table({"x": [3]})
    layout, args = sharded_ray._flatten(("k", sharded_ray.ShardPieces([a, b]), 5))
    assert layout == (None, (None, None), None)
    assert sharded_ray._with_pieces(lambda k, t, n: (k, t["x"].to_pylist(), n), layout, *args) == ("k", [1, 2, 3], 5)
    # pieces of bundles (a reader's pieces of one node's shards in one object): each task takes its own of each
    c = pa.table({"x": [4, 5]})
    one, two = sharded.bundle_pieces([a, c]), sharded.bundle_pieces([b])
    layout, args = sharded_ray._flatten((sharded_ray.ShardPieces([one, two, one], at=[1, 0, 0]),))
    assert layout == ((1, 0, 0),)
    assert sharded_ray._with_pieces(lambda t: t["x"].to_pylist(), layout, *args) == [4, 5, 3, 1, 2]


def test_bundle_places_keep_each_group_s_pieces_in_order():
    """A bundle a group, in order of its first piece; each piece's place in its bundle (what `split_file` ships and
    `read_shards` reads back)."""
    assert sharded_ray.bundle_places(["b", "a", "b", None, "a"]) == (3, [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1)])
    assert sharded_ray.bundle_places([None, None]) == (1, [(0, 0), (0, 1)])
    assert sharded_ray.bundle_places([]) == (0, [])


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


def test_the_counting_uniques_are_numpy_unique():
    """`small_unique_inverse`, `present_codes` and `count_distinct` (the fit's and the finalize's codes of cells,
    policies and prompts, by counting) give `numpy.unique`'s arrays and sizes, dtype included, on both their
    counting and their sorting paths."""
    rng = np.random.default_rng(3)
    for n, rows, dtype in ((21, 5000, np.int32), (7, 3, np.int64), (1, 1, np.int8), (4, 0, np.int32),
                           (200_000, 50, np.int64), (70_000, 70_000, np.int32)):
        v = rng.integers(0, n, rows).astype(dtype)
        wu, winv = np.unique(v, return_inverse=True)
        u, inv = small_unique_inverse(v, n)
        assert u.dtype == wu.dtype and np.array_equal(u, wu) and np.array_equal(inv, winv)
        assert np.array_equal(present_codes(v, n), wu)
        assert count_distinct(v, n) == wu.size
    with pytest.raises(ValueError):
        small_unique_inverse(np.array([0, 5]), 3)


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
            assert fast.labelled_terms is None and fast.sums is not None  # reduced on the shard
            for name in ("n", "sum", "cross", "cubes"):
                assert np.array_equal(getattr(fast.sums, name), getattr(slow.sums, name)), name
        args = (tuple(opts.covariates), None, sp.codes[i], 11, 0, 7, sp.n_prompts, sp.prep.design.n_policies)
        assert np.array_equal(sharded.shard_histograms(sp.kept[i], *args), sharded.shard_histograms(shards[i], *args))


def test_bootstrap_counts_are_bootstrap_weights_as_small_integers():
    """The counts drawn once per chunk (`bootstrap_counts`) are `bootstrap_weights`' numbers, 1 byte a prompt."""
    from cje_engine.direct.estimators import bootstrap_counts, bootstrap_weights, count_dtype

    for seed, b, n in [(0, 0, 1), (3, 7, 1000), (11, 1999, 123_457)]:
        c = bootstrap_counts(seed, b, n)
        assert c.dtype == np.uint8 and np.array_equal(c.astype(float), bootstrap_weights(seed, b, n))
    assert bootstrap_counts(0, 0, 0).size == 0
    # a prompt drawn more than 255 times needs a wider type (here: a 1-prompt window is drawn once)
    assert [count_dtype(v) for v in (0, 255, 256, 65_535, 65_536, 2**32)] == [
        np.uint8, np.uint8, np.uint16, np.uint16, np.uint32, np.uint64]


def _slow_histograms(key: np.ndarray, prompt: np.ndarray, weights: np.ndarray, n_keys: int) -> np.ndarray:
    """The obvious pass 3: per replicate every row's prompt weight (float64), summed per key."""
    return np.stack([np.bincount(key, weights=w.astype(float)[prompt], minlength=n_keys) for w in weights])


@pytest.mark.parametrize("ranged", [True, False])
def test_layout_histograms_are_the_gather_and_bincount(ranged):
    """`shard_histograms` from a shard's `HistogramLayout` and the chunk's counts of every prompt (drawn once)
    equals the per-row gather and float64 bincount, for a range shard (its slice of the prompts) and a hash
    shard (its prompts' global codes), with a count above 255 (uint16 counts), rows of a policy that is not
    evaluated (code -1) and keys without rows."""
    rng = np.random.default_rng(5)
    n_ids, n_rows, Kl, Gf, K, G, n_prompts = 300, 2000, 3, 9, 2, 4, 1000
    kept = sharded.ShardKept(prompt=rng.integers(0, n_ids, n_rows).astype(np.int32),
                             policy=rng.integers(0, Kl, n_rows).astype(np.int8),
                             cell=rng.integers(0, Gf, n_rows).astype(np.int32),
                             lab_pos=np.zeros(0, np.int64), lab_row=np.zeros(0, np.int64), n_ids=n_ids)
    policy_code = np.array([1, -1, 0])  # the shard's second policy is not evaluated
    cell_code = np.array([0, 0, 1, 1, 3, 3, 3, 0, 1])  # cell 2 has no row: its key stays 0
    offset = 400
    rank = None if ranged else np.sort(rng.choice(n_prompts, n_ids, replace=False))
    codes = sharded.ShardCodes(rank, policy_code, cell_code, G, offset)
    weights = rng.integers(0, 4, (6, n_prompts)).astype(np.uint16)
    weights[2, offset + 5 if ranged else rank[5]] = 300  # more than uint8 holds
    built = sharded.shard_histogram_layout(kept, (), None, codes, K)
    assert built.rows == int((policy_code[kept.policy] >= 0).sum())
    lay = built.layout  # each key's group: its rows' prompts, ascending (a forward sweep through the counts)
    for a, b in zip(lay.starts, [*lay.starts[1:], lay.prompt.size]):
        assert np.all(np.diff(lay.prompt[a:b]) >= 0)
    got = sharded.shard_histograms(built.layout, (), None, codes, 0, 10, 16, n_prompts, K, weights)
    pol = policy_code[kept.policy]
    keep = pol >= 0
    key = (pol * G + cell_code[kept.cell])[keep]
    glob = codes.ranks(kept.prompt[keep])
    want = _slow_histograms(key, glob, weights, K * G)
    assert got.dtype == np.int64 and np.array_equal(got, want)
    assert want[2].max() >= 300 and not want[:, 2].any()
    # the reference path of the same shard (every replicate's weights drawn here) is the same sum
    ref = sharded.shard_histograms(kept, (), None, codes, 3, 0, 4, n_prompts, K)
    from cje_engine.direct.estimators import bootstrap_counts

    drawn = np.stack([bootstrap_counts(3, b, n_prompts) for b in range(4)])
    assert np.array_equal(ref, sharded.shard_histograms(built.layout, (), None, codes, 3, 0, 4, n_prompts, K, drawn))


def test_replicate_weights_and_the_compact_view_give_the_replicates_bit_for_bit():
    """The driver's refits from the counts at the labelled prompts (`compact_view` + `replicate_weights`' driver
    part) are `bootstrap_replicates` drawing every prompt's weights itself, bit for bit."""
    from cje_engine.direct.estimators import bootstrap_replicates, bootstrap_view, compact_view
    from cje_engine.options import EvaluationOptions
    from cje_engine.pipeline import direct
    from cje_engine.simulate import simulate

    table = pa.Table.from_pandas(simulate(700, seed=6, oracle_fraction=0.1).frame, preserve_index=False)
    opts = EvaluationOptions.of(None, seed=2, inference="bootstrap", n_bootstrap=50)
    prep = direct.prepare(table, opts)
    view = bootstrap_view(prep.design, 2)
    small, prompts = compact_view(view)
    assert small.n_prompts == prompts.size < view.n_prompts
    start, stop = 5, 17
    rw = sharded.replicate_weights(2, start, stop, view.n_prompts, prompts)
    assert rw.block.dtype == np.uint8 and rw.block.shape == (stop - start, view.n_prompts)
    assert np.array_equal(rw.driver, rw.block[:, prompts])
    hist = np.stack([np.bincount(view.row_key, weights=w.astype(float)[view.row_prompt],
                                 minlength=prep.design.n_policies * prep.design.cells.cells.size)
                     for w in rw.block])
    want = bootstrap_replicates(view, start, stop)
    assert np.array_equal(bootstrap_replicates(view, start, stop, hist), want, equal_nan=True)
    assert np.array_equal(bootstrap_replicates(small, start, stop, hist, weights=rw.driver), want, equal_nan=True)
    # the refit task of a chunk: the histograms summed over the shards as int64, the counts as drawn
    got = sharded.replicate_refits(small, rw.driver, start, stop, hist.astype(np.int64))
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("put", [False, True])
@pytest.mark.parametrize("n_shards", [1, 3])
def test_replicates_in_many_small_chunks_are_the_single_paths(monkeypatch, n_shards, put):
    """Weights blocks of a few replicates each and windows of two chunks (many `replicate_weights` tasks, the
    refits overlapping the next chunk's histograms): the replicates are the single path's, bit for bit, and those
    of the reference pass 3 (every shard drawing every replicate's weights). The refits are the mapper's tasks,
    one a chunk, each given every shard's block; the refits' view is one task of the mapper for the whole
    bootstrap (not one a call, never one a chunk), and the driver puts nothing itself (a mapper with a ``put``,
    as Ray's, runs two refits at once)."""
    from cje_engine.options import EvaluationOptions
    from cje_engine.pipeline import direct
    from cje_engine.simulate import simulate

    table = pa.Table.from_pandas(simulate(400, seed=8, oracle_fraction=0.1).frame, preserve_index=False)
    opts = EvaluationOptions.of(None, seed=9, inference="bootstrap", n_bootstrap=50)
    expected = direct.bootstrap_chunk(direct.prepare(table, opts), 0, 50)
    n_prompts = len(set(table["prompt_id"].to_pylist()))
    monkeypatch.setattr(sharded, "WEIGHTS_BLOCK_BYTES", 3 * n_prompts)  # 3 replicates a chunk
    monkeypatch.setattr(sharded, "WEIGHTS_IN_FLIGHT", 2)
    calls = []

    def counting(fn, items):
        calls.append((fn.__name__, len(items), [len(item) for item in items]))
        return sharded.serial_map(fn, items)

    puts = []
    if put:
        def putting(obj):
            puts.append(type(obj).__name__)
            return obj

        counting.put = putting
    sp = sharded.prepare_sharded(sharded.split_by_shard(table, n_shards), opts, mapper=counting)
    got = np.vstack([sp.replicates(0, 20), sp.replicates(20, 50)])
    assert np.array_equal(got, expected, equal_nan=True)
    weights = [n for name, n, _ in calls if name == "replicate_weights"]
    assert sum(weights) == 7 + 10 and max(weights) == 2  # ceil(20 / 3) + 30 / 3 chunks, 2 at a time
    refits = [(n, sizes) for name, n, sizes in calls if name == "replicate_refits"]
    assert refits == [(1, [4 + n_shards])] * (7 + 10)  # one task a chunk: view, counts, start, stop, the blocks
    assert [name for name, _, _ in calls].count("refit_view") == 1  # once for both calls
    assert puts == []
    assert [name for name, _, _ in calls].count("shard_histogram_layout") == 1  # built once, kept
    sp.fast_histograms = False
    assert np.array_equal(sp.replicates(0, 50), expected, equal_nan=True)


def _same_arrays(a, b, path="") -> None:
    """``a`` and ``b`` (dataclasses, dicts, tuples of arrays) equal field by field: every array of the same dtype,
    shape and values (NaN equal to NaN)."""
    import dataclasses

    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), path
        fa = {k: v for k, v in vars(a).items() if not k.startswith("_")}
        fb = {k: v for k, v in vars(b).items() if not k.startswith("_")}
        assert fa.keys() == fb.keys(), path
        for k in fa:
            _same_arrays(fa[k], fb[k], f"{path}.{k}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same_arrays(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_arrays(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), path
    else:
        assert a == b, path


@pytest.mark.parametrize("mode, calibration_policies, every_row", [("monotone", None, True), ("two_stage", None, True),
                                                                   ("monotone", ("base", "clone"), False)])
def test_the_refit_view_is_the_drivers(mode, calibration_policies, every_row):
    """`refit_view` of the driver's `refit_rows` (a few narrowed columns, pickled as Ray ships them) is the compact
    view the driver would build from its design (`compact_view(bootstrap_view(...))`): every array of the
    calibration plan and the view of the same dtype and values, the same prompts, in monotone and two-stage
    mode, with and without calibration policies (calibration rows a subset of the labelled rows: sent as such)."""
    import pickle

    from cje_engine.direct.estimators import bootstrap_view, compact_view
    from cje_engine.options import EvaluationOptions
    from cje_engine.simulate import simulate

    table = pa.Table.from_pandas(simulate(600, seed=12, oracle_fraction=0.2).frame, preserve_index=False)
    cov = ("response_length",) if mode == "two_stage" else ()
    opts = EvaluationOptions.of(None, seed=5, inference="bootstrap", n_bootstrap=50, calibration_mode=mode,
                                covariates=cov, calibration_policies=calibration_policies,
                                policies=("base", "clone", "verbose"))  # no source fails its audit
    sp = sharded.prepare_sharded(sharded.split_by_shard(table, 3), opts)
    design = sp.prep.design
    assert not sp.prep.excluded
    rows = sharded.refit_rows(design, 5)
    assert (rows.cal_rows is None) == every_row and rows.lab_rows is None  # the driver holds labelled rows only
    if not every_row:
        assert np.array_equal(rows.cal_rows, design.cal_rows)
    assert rows.prompt.dtype == np.int16 and rows.fold.dtype == np.int8 and rows.policy.dtype == np.int8
    got = sharded.refit_view(pickle.loads(pickle.dumps(rows, protocol=5)))
    want, prompts = compact_view(bootstrap_view(design, 5))
    assert got.n_prompts == prompts.size
    _same_arrays(got.prompts, prompts.astype(np.int32))
    assert got.view.calibration.mode == mode
    _same_arrays(got.view, want)


def test_a_chunk_with_a_count_above_255_is_widened(monkeypatch):
    """`replicate_weights` widens its chunk's block when one replicate holds a count above 255 (the other rows'
    counts kept), so the shards' sums stay exact."""
    from cje_engine.direct import estimators

    real = estimators.bootstrap_counts

    def counts(seed, b, n):
        c = real(seed, b, n)
        if b == 3:
            c = c.astype(np.uint16)
            c[7] = 300
        return c

    monkeypatch.setattr(sharded, "bootstrap_counts", counts)
    rw = sharded.replicate_weights(1, 2, 6, 50, np.array([7, 9]))
    assert rw.block.dtype == np.uint16 and rw.block[1, 7] == 300
    for i, b in enumerate(range(2, 6)):
        assert np.array_equal(rw.block[i], counts(1, b, 50))
    assert np.array_equal(rw.driver, rw.block[:, [7, 9]])


def test_the_weights_task_asks_for_its_draws_and_its_block():
    """A `replicate_weights` task's memory covers one replicate's int64 draws and counts (16 B a prompt) and its
    chunk's block with the driver's part, whatever the rows per shard."""
    for n in (1000, 2_000_000, 20_000_000):
        need = sharded_ray.weights_task_memory(n)
        assert need >= 16 * n + 2 * sharded.WEIGHTS_BLOCK_BYTES
        assert need > sharded_ray.weights_task_memory(n // 2)


class _Ref:
    """A stand-in for a Ray object reference (`_StoreMapper`): a key into the store, a few bytes pickled."""

    def __init__(self, key: int) -> None:
        self.key = key


class _StoreMapper:
    """`flows.runtime.sharded_ray.ray_mapper` in process: each function's ``kept_field`` objects stay in a store and
    the driver gets a `_Ref`, resolved when a later task takes it as an argument (as Ray resolves top-level
    references on the worker). Records the bytes the driver would write for each task (its arguments pickled, the
    references as such) and read back (its result pickled, kept fields as references)."""

    def __init__(self) -> None:
        self.store: dict = {}
        self.sent: list = []
        self.got: list = []
        self.put = lambda obj: obj  # a remote mapper's attribute (two refits in flight)

    def _keep(self, obj):
        ref = _Ref(len(self.store))
        self.store[ref.key] = obj
        return ref

    def __call__(self, fn, items):
        import pickle

        field = getattr(fn, "kept_field", None)
        fields = () if not field else (field,) if isinstance(field, str) else tuple(field)
        for i, item in enumerate(items):
            self.sent.append((fn.__name__, len(pickle.dumps(item, protocol=5))))
            res = fn(*[self.store[a.key] if isinstance(a, _Ref) else a for a in item])
            for name in fields:
                setattr(res, name, self._keep(getattr(res, name)))
            self.got.append((fn.__name__, len(pickle.dumps(res, protocol=5))))
            yield i, res


@pytest.mark.parametrize("n_prompts", [300, 1200])
def test_the_driver_ships_the_labelled_rows_once_and_reads_no_array_of_rows(n_prompts):
    """What a bootstrap writes from the driver and reads into it (on Ray both go through the driver's mapping of the
    object store and stay in its RSS): the labelled rows' `RefitRows` once, at most 30 bytes a labelled row (prompt
    code <= 4, policy 1, cell 4, label 8, label weight 8, fold 1, calibration rows <= 4) beside the cells and
    counts and a pickle's framing (8 KiB); every other task's arguments at most a shard's `ShardCodes` and 4 KiB
    (references and scalars: nothing that grows with the rows or the prompts); every result at most a chunk's
    replicates (3K float64 each) and 4 KiB. The driver caches neither the view nor the calibration plan, and the
    replicates are the single path's."""
    import pickle

    from cje_engine.options import EvaluationOptions
    from cje_engine.pipeline import direct
    from cje_engine.simulate import simulate

    table = pa.Table.from_pandas(simulate(n_prompts, seed=2, oracle_fraction=0.3).frame, preserve_index=False)
    opts = EvaluationOptions.of(None, seed=4, inference="bootstrap", n_bootstrap=50)
    expected = direct.bootstrap_chunk(direct.prepare(table, opts), 0, 50)
    n = 3
    cut = sharded.range_splitters([sharded.sample_prompt_ids(table["prompt_id"], 8 * n)], n)
    mapper = _StoreMapper()
    sp = sharded.prepare_sharded(sharded.split_by_shard(table, n, splitters=cut), opts, mapper=mapper)
    mapper.sent.clear()
    mapper.got.clear()
    got = np.vstack([sp.replicates(0, 30), sp.replicates(30, 50)])
    assert np.array_equal(got, expected, equal_nan=True)
    design = sp.prep.design
    assert "_bootstrap_view" not in design.__dict__ and "_calibration_plan" not in design.__dict__
    L, K = design.data.n_rows, design.n_policies
    ci = design.cells
    fixed = sum(len(pickle.dumps(x, protocol=5)) for x in (ci.cells, ci.counts)) + 8192
    view_items = [b for name, b in mapper.sent if name == "refit_view"]
    assert len(view_items) == 1 and view_items[0] <= 30 * L + fixed
    codes = max(len(pickle.dumps(c, protocol=5)) for c in sp.codes)
    others = [(name, b) for name, b in mapper.sent if name != "refit_view"]
    assert {name for name, _ in others} == {"replicate_weights", "shard_histogram_layout", "shard_histogram_block",
                                            "replicate_refits"}
    assert all(b <= codes + 4096 for _, b in others), others
    assert all(b <= 8 * 3 * K * 30 + 4096 for _, b in mapper.got), mapper.got


def _dict_chunk(values, dictionary):
    """A dictionary array of ``values`` over ``dictionary`` (which may hold values no row uses)."""
    look = {v: i for i, v in enumerate(dictionary)}
    return pa.DictionaryArray.from_arrays(pa.array([look[v] for v in values], pa.int8()),
                                          pa.array(dictionary, pa.string()))


NFC, NFD = "\u00e9", "e\u0301"  # the same letter composed and decomposed: two different strings


@pytest.mark.parametrize("column", [
    pa.array(IDS, pa.string()).dictionary_encode(),
    # chunks with their own dictionaries, in other orders, with values no row of the chunk uses (a slice of a
    # file keeps the file's dictionary)
    pa.chunked_array([_dict_chunk(["b", "a", NFC], ["zz", NFC, "b", "a", "unused"]),
                      _dict_chunk([NFD, "b", "b", "日本"], ["日本", "b", NFD]),
                      _dict_chunk([], ["q"])]),
    pa.chunked_array([_dict_chunk(["x", "y", "x"], ["y", "x", "w"])]).slice(1, 2),
    pa.chunked_array([], pa.dictionary(pa.int8(), pa.string())),
    pa.array(["x", None, "a", "x"]).dictionary_encode(),  # nulls: the pandas path on its strings
    pa.array(["b", "a"], pa.large_string()).dictionary_encode(),
])
def test_dictionary_codes_are_pandas_sorted_factorize_of_the_strings(column):
    """The readers ship the policy dictionary-encoded; pass 1's codes of it are pandas' sorted factorize of its
    strings (not of a categorical, which pandas sorts by its dictionary's order), only the values in use."""
    codes, uniques = sharded.sorted_codes(column)
    strings = column.cast(column.type.value_type)
    want_codes, want_uniques = pd.factorize(strings.to_pandas(), sort=True)
    assert np.array_equal(codes, want_codes)
    assert uniques.type == pa.string() and uniques.to_pylist() == [str(u) for u in want_uniques]


def test_compact_policy_keeps_every_name_in_one_byte_a_row():
    names = ["base", "clone", NFC, NFD]
    rng = np.random.default_rng(1)
    plain = pa.table({"policy": pa.array([names[i] for i in rng.integers(0, 4, 300)]), "x": np.arange(300)})
    for table in (plain, plain.set_column(0, "policy", plain["policy"].cast(pa.large_string()).dictionary_encode())):
        out = sharded_ray.compact_policy(table)
        assert out.schema.field("policy").type == pa.dictionary(pa.int8(), pa.string())
        assert out["policy"].cast(pa.string()).to_pylist() == plain["policy"].to_pylist()
        assert out["x"].equals(table["x"])
    many = pa.table({"policy": [f"p{i}" for i in range(200)]})
    out = sharded_ray.compact_policy(many)
    assert out.schema.field("policy").type.index_type == pa.int16()
    assert out["policy"].cast(pa.string()).to_pylist() == many["policy"].to_pylist()
    assert sharded_ray.compact_policy(pa.table({"x": [1]})).equals(pa.table({"x": [1]}))


@pytest.mark.parametrize("index", [pa.int8(), pa.int16()])
def test_narrow_dictionary_is_arrow_s_cast_of_the_indices(index):
    """The readers' policy (Parquet's dictionary pages: int32 indices, in chunks, some sliced) narrowed by numpy is
    Arrow's cast of it, chunk for chunk: values, dictionaries and type; a chunk with a null by the cast itself."""
    rng = np.random.default_rng(7)
    d = pa.DictionaryArray.from_arrays(pa.array(rng.integers(0, 5, 1000).astype(np.int32)),
                                       pa.array(["a", "b", NFC, NFD, "e"]))
    with_null = pa.array(["a", None, "b"]).dictionary_encode()
    for col in (d, d.slice(3, 500), pa.chunked_array([d.slice(0, 400), d.slice(400)]),
                pa.chunked_array([d.slice(10, 20), with_null]), pa.chunked_array([], d.type)):
        got = sharded_ray.narrow_dictionary(col, index)
        want = sharded_ray.narrow_dictionary_reference(col, index)
        assert got.type == want.type == pa.dictionary(index, pa.string())
        assert got.equals(want)
        assert got.cast(pa.string()).to_pylist() == col.cast(pa.string()).to_pylist()


def test_read_window_returns_the_policy_from_the_dictionary_pages(tmp_path):
    """``dictionary=("policy",)`` (the sharded readers): the same names as the string read, with a column mapping
    and the policy filter in the scan."""
    import pyarrow.parquet as pq

    from flows.storage.logs import read_window
    from flows.storage.objects import Storage, StorageConfig

    rng = np.random.default_rng(2)
    n = 500
    t = pa.table({"pid": [f"p{i % 70}" for i in range(n)], "arm": [["base", "b2", NFD][i] for i in rng.integers(0, 3, n)],
                  "judge_score": rng.random(n), "response_id": [f"r{i}" for i in range(n)],
                  "ts": pa.array([0] * n, pa.timestamp("us", tz="UTC"))})
    (tmp_path / "dt=2026-03-01").mkdir()
    pq.write_table(t, tmp_path / "dt=2026-03-01" / "a.parquet", row_group_size=128)
    st = Storage.for_uri(str(tmp_path), StorageConfig.from_env())
    key = "dt=2026-03-01/a.parquet"
    mapping = {"prompt_id": "pid", "policy": "arm"}
    for policies in (None, ["b2", NFD]):
        plain = read_window(st, [key], columns=["prompt_id", "policy"], policies=policies, mapping=mapping,
                            check_unique=False)
        coded = read_window(st, [key], columns=["prompt_id", "policy"], policies=policies, mapping=mapping,
                            check_unique=False, dictionary=("policy",))
        assert pa.types.is_dictionary(coded.schema.field("policy").type)
        assert coded.schema.field("policy").type.value_type == pa.string()
        assert coded["policy"].cast(pa.string()).to_pylist() == plain["policy"].to_pylist()
        assert coded["prompt_id"].equals(plain["prompt_id"])


@pytest.mark.parametrize("case", ["distinct", "colliding", "two_files", "one_file", "repeated_and_colliding", "many"])
def test_buckets_of_fingerprints_alone_find_what_the_string_sort_finds(case):
    """What `split_file` ships (8 B a row: the fingerprint, no place): `check_response_ids` names each file's
    repeated fingerprints, `resolve_fingerprints` finds those files' rows with them (`response_ids_with`'s part,
    here from the files' ids) and compares their ids as strings: the findings of the string sort of every id of
    the window (`_slow_check`: the smallest repeated id of each bucket, its first 5 rows, its count), with a repeat
    across two files, within one file, among ids sharing a fingerprint, and several."""
    rng = np.random.default_rng(13)
    ids = [f"resp-{i:07d}" for i in range(3000)]
    if case in ("colliding", "repeated_and_colliding"):
        ids += [_collide(f"{i:03d}") for i in range(200)]  # 200 different ids, one fingerprint
    if case == "two_files":
        ids[2500] = ids[17]  # files of 1000 rows: rows 17 (file 0) and 2500 (file 2)
    if case == "one_file":
        ids[999] = ids[3]  # both in file 0
        ids[998] = ids[3]
    if case == "repeated_and_colliding":
        ids[3100] = ids[3050]  # a repeat among the ids that share a fingerprint (file 3)
        ids[1] = ids[3150]
    if case == "many":
        for a, b in rng.integers(0, 3000, (20, 2)):
            ids[b] = ids[a]
    n_buckets, size = 3, 1000
    files = [ids[i:i + size] for i in range(0, len(ids), size)]
    tables = [pa.table({"response_id": f, sharded.ROW: (k << sharded_ray.ROW_BITS) + np.arange(len(f))})
              for k, f in enumerate(files)]
    bare = [sharded_ray.response_id_buckets(t, n_buckets, ids=False, places=False) for t in tables]
    assert all(p.column_names == [sharded_ray.FINGERPRINT] for b in bare for p in b)
    assert sum(p.num_rows for b in bare for p in b) == len(ids)
    full = [sharded_ray.response_id_buckets(t, n_buckets) for t in tables]
    want = [_slow_check([f[b] for f in full]) for b in range(n_buckets)]
    results = [sharded_ray.check_response_ids(*[f[b] for f in bare]) for b in range(n_buckets)]
    assert all(r is None or set(r) == {"candidates"} for r in results)
    asked = []

    def rows_of(f, fps):
        asked.append(f)
        fp = sharded_ray.id_fingerprint(pa.array(files[f]))
        at = np.flatnonzero(np.isin(fp, np.asarray(fps, dtype=np.uint64)))
        return at.tolist(), [files[f][i] for i in at], fp[at].tolist()

    got = sharded_ray.resolve_fingerprints([r["candidates"] for r in results if r is not None], rows_of)
    assert sorted(map(repr, got)) == sorted(repr(w) for w in want if w is not None)
    assert (got == []) == (case in ("distinct", "colliding"))
    assert len(asked) == len(set(asked))  # a file read once at most
    if case == "distinct":
        assert asked == []  # distinct fingerprints: no file read again
    if case == "two_files":
        assert got == [{"response_id": ids[17], "rows": [17, (2 << sharded_ray.ROW_BITS) + 500], "count": 2}]
    if case == "one_file":
        assert got == [{"response_id": ids[3], "rows": [3, 998, 999], "count": 3}]
