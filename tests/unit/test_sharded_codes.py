"""Pass 1's fast paths (issue 29, round 18) against the slow obvious computations they replace: the prompt ids'
integer keys (`sorted_codes`) against Arrow's hash (`sorted_codes_reference`) and pandas, the shard read from its
packed pieces (`packed_rows`) against the table rebuilt from them (`table_rows`), the folds from the ids' bytes
against `fold_of` of Python strings. Every comparison is exact (codes, bytes of the ids, bits of every float)."""
from __future__ import annotations

import dataclasses
import unicodedata

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from cje_engine.data.frame import LABEL, LABEL_PROB, POLICY, PROMPT, SCORE
from cje_engine.pipeline import sharded
from flows.runtime import sharded_ray

LONG = "prompt-0000000000"  # 17 bytes: its first 16 shared by the ids built on it
# ties of the 8- and 16-byte words, an id and itself plus NUL bytes, non-ASCII (NFC and NFD), the empty id, ids
# longer than the 16-byte key (equal first 16 bytes), 8 and 16 bytes exactly
IDS = ([f"{LONG}{i}" for i in range(12)] + [f"b12-p{i:06d}" for i in range(0, 3000, 37)] +
       ["", "a", "a\0", "a\0\0", "a\0b", "é", unicodedata.normalize("NFD", "é"), "日本", "日本語", "zz", "Z",
        "b12-p", "b12-p000", "b12-p0000000", "12345678", "1234567890abcdef", "1234567890abcdef\0",
        "1234567890abcde\0", LONG, LONG + "\0", LONG[:16], "\x7f", "\U0001f600", "ab" * 30, "\0", "\0\0"])


def _pandas(values: list[str]) -> tuple[np.ndarray, list[str]]:
    codes, uniq = pd.factorize(pd.Series(values, dtype=object), sort=True)
    return codes, list(uniq)


def _check(col: pa.Array | pa.ChunkedArray) -> None:
    codes, ids = sharded.sorted_codes(col)
    ref_codes, ref_ids = sharded.sorted_codes_reference(col)
    want_codes, want_ids = _pandas(col.to_pylist())
    assert codes.dtype == np.int64 and ids.type == pa.string()
    assert np.array_equal(codes, ref_codes) and np.array_equal(codes, want_codes)
    assert ids.equals(ref_ids) and ids.to_pylist() == want_ids
    # the ids kept as their keys (`KeyIds`, pass 1's way): the same codes, the same ids wherever read
    kcodes, kids = sharded.sorted_codes(col, keys=True)
    assert kcodes.dtype == np.int64 and np.array_equal(kcodes, codes) and len(kids) == len(ids)
    assert kids.take(pa.array(np.arange(len(ids)))).equals(ids)
    if isinstance(kids, sharded.KeyIds):
        assert kids.array().equals(ids)
        at = np.random.default_rng(len(ids)).integers(0, len(ids), 7) if len(ids) else np.empty(0, np.int64)
        for pos in (at, np.sort(np.unique(at)), np.array([0, len(ids) - 1]) if len(ids) else at):
            got = kids.take(pa.array(pos, pa.int64()))
            assert got.type == pa.string() and got.equals(ids.take(pa.array(pos, pa.int64())))


def test_key_ids_past_2_gib_are_the_columns(monkeypatch):
    """`KeyIds` whose bytes would pass 2 GiB (`_ids_of_keys` None) take each id from a row of the column."""
    col = pa.chunked_array([pa.array(["b", "a\0", "a", "é"]), pa.array(["a", "zz", "b"])])
    codes, ids = sharded.sorted_codes(col)
    monkeypatch.setattr(sharded, "_ids_of_keys", lambda *a: None)
    kcodes, kids = sharded.sorted_codes(col, keys=True)
    assert isinstance(kids, sharded.KeyIds) and np.array_equal(kcodes, codes)
    assert kids.array().equals(ids) and kids.take(np.array([3, 0])).equals(ids.take(pa.array([3, 0])))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sorted_codes_are_pandas_codes(seed):
    rng = np.random.default_rng(seed)
    ids = [IDS[i] for i in rng.integers(0, len(IDS), 400)]
    short = [x for x in ids if len(x.encode()) <= 16]
    _check(pa.array(ids))
    _check(pa.array(ids, pa.large_string()))
    _check(pa.array(short))
    _check(pa.array(["pad", *ids, "pad"]).slice(1, len(ids)))  # offsets not from 0
    _check(pa.chunked_array([pa.array(ids[:150]), pa.array([], pa.string()), pa.array(ids[150:])]))
    # chunks of one width (read as a matrix of bytes), of other widths, ending in NUL, and empty ids only
    for width in (1, 7, 8, 9, 11, 15, 16):
        fixed = ["".join(rng.choice(list("ab\0c"), width)) for _ in range(300)]
        _check(pa.array(fixed))
        _check(pa.chunked_array([pa.array(fixed), pa.array(short), pa.array([f"b2-p{i:06d}" for i in range(50)])]))
        _check(pa.array(["pad" * 10, *fixed]).slice(1, len(fixed)))  # a slice whose buffer ends at its last id
    _check(pa.chunked_array([pa.array(["", "", ""]), pa.array(["b", "", "a"])]))
    # chunks of one width each, told apart by a NUL byte only: "ab" < "ab\0" < "ab\0\0" < "ab\1"
    _check(pa.chunked_array([pa.array(["ab\0", "cd\0", "ab\0"]), pa.array(["ab", "ab", "cd"]),
                             pa.array(["ab\0\0", "ab\1\0", "cd\0\0"])]))
    _check(pa.chunked_array([pa.array(["12345678abcdefg\0"[:16]]), pa.array(["12345678abcdefg"])]))


def test_sorted_codes_edges():
    _check(pa.array(["x"]))  # one row
    _check(pa.array([""]))
    _check(pa.array(["a", "a\0", "", "a\0\0", "b", "a"]))
    _check(pa.array(["12345678", "12345678\0", "1234567"]))  # a tie of both words
    _check(pa.array([LONG + "b", LONG + "a", LONG[:16], LONG + "a", "z"] + [f"q{i}" for i in range(40)]))
    _check(pa.array([LONG + str(i % 9) for i in range(50)]))  # mostly longer ids: Arrow's hash
    codes, ids = sharded.sorted_codes(pa.array([], pa.string()))
    assert codes.size == 0 and len(ids) == 0 and ids.type == pa.string()
    codes, ids = sharded.sorted_codes(pa.chunked_array([], pa.string()))
    assert codes.size == 0 and len(ids) == 0
    # nulls and dictionaries keep the reference's way
    _check(pa.array(["b", None, "a"]))
    _check(pa.array(["y", "x", "y"]).dictionary_encode())


def test_sorted_codes_of_many_generated_ids():
    """50,000 ids of the benchmark's shape and of random bytes, in chunks of different widths."""
    rng = np.random.default_rng(7)
    ids = [f"b{int(b)}-p{int(p):06d}" for b, p in zip(rng.integers(0, 20, 30_000), rng.integers(0, 10**6, 30_000))]
    alphabet = np.array(list("ab\0é日-0"))
    ids += ["".join(rng.choice(alphabet, int(k))) for k in rng.integers(0, 24, 20_000)]
    _check(pa.array(ids))
    _check(pa.chunked_array([pa.array(ids[i:i + 7000]) for i in range(0, len(ids), 7000)]))


def test_dense_rank_is_pandas_factorize(monkeypatch):
    rng = np.random.default_rng(3)
    for values in (rng.integers(0, 50, 1000), rng.integers(0, 2**40, 1000), np.array([5]), np.arange(7)[::-1]):
        want_codes, want_uniq = pd.factorize(values, sort=True)
        for span in (None, int(values.max()) + 1):
            codes, uniq = sharded.dense_rank(values, span)
            assert np.array_equal(codes, want_codes) and np.array_equal(uniq, want_uniq)
    words = rng.integers(0, 2**63, 500, dtype=np.uint64) * np.uint64(2)  # high bit set: unsigned order
    codes, uniq = sharded.dense_rank(words)
    assert np.array_equal(uniq[codes], words) and np.all(np.diff(uniq.astype(object)) > 0)
    # the prompt codes by a hash of the combined key instead of the flags: the same
    monkeypatch.setattr(sharded, "DENSE_RANK_SPAN", 0)
    _check(pa.array([IDS[i] for i in rng.integers(0, len(IDS), 300)]))


@pytest.mark.parametrize("n", [0, 1, 7, 300])
def test_folds_from_the_ids_bytes_are_fold_of(n, monkeypatch):
    ids = pa.array([IDS[i % len(IDS)] + str(i) for i in range(n)])
    monkeypatch.setattr(sharded, "FOLD_CHUNK", 64)
    for k in (2, 5, 7):
        got = sharded._folds(ids, k)
        assert got.dtype == np.int64 and np.array_equal(got, sharded.folds_reference(ids, k))


def _piece(n: int, seed: int, *, policies=("a", "b"), labelled: float = 0.1, ids: int = 60, first: int = 0,
           label: bool = True, prob: bool = True, zeros: bool = True) -> pa.Table:
    """A reader's piece of a range shard: ids ``q<number>`` of a block, judge scores (both zeros), labels."""
    rng = np.random.default_rng(seed)
    score = rng.integers(0, 21, n) / 20
    if zeros and n > 2:
        score[rng.integers(0, n, 2)] = [-0.0, 0.0]  # one class, two bit patterns: the first row's is the cell's
    lab = rng.random(n) < labelled
    cols = {PROMPT: pa.array([f"q{int(i):05d}" for i in rng.integers(first, first + ids, n)], pa.string()),
            POLICY: pa.array(rng.choice(list(policies), n).tolist(), pa.string()).dictionary_encode(),
            SCORE: score}
    if label:
        cols[LABEL] = pa.array(np.where(lab, rng.random(n), np.nan), from_pandas=True)
    if prob:
        cols[LABEL_PROB] = pa.array(np.where(rng.random(n) < 0.3, np.nan, 0.1), from_pandas=True)
    cols[sharded.ROW] = (seed << 40) + np.cumsum(rng.integers(1, 300, n))
    t = pa.table(cols).replace_schema_metadata({sharded.RANGE_META: b"1"})
    return sharded_ray.compact_policy(t)


def _same_summary(a, b) -> None:
    for f in ("n_rows", "policies", "n_ids", "id_range"):
        assert getattr(a, f) == getattr(b, f), f
    for f in ("score_min", "score_max"):  # bits: NaN and -0.0 too
        assert np.float64(getattr(a, f)).tobytes() == np.float64(getattr(b, f)).tobytes(), f
    assert (a.prompt_ids is None) == (b.prompt_ids is None)
    if a.prompt_ids is not None:
        assert a.prompt_ids.equals(b.prompt_ids)
    for f in ("cell_score", "cell_X", "counts", "n_prompts", "score_sum"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), f
    assert a.labelled.keys() == b.labelled.keys()
    for k, x in a.labelled.items():
        y = b.labelled[k]
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k
    for f in ("prompt", "policy", "cell", "lab_pos", "lab_row"):
        x, y = getattr(a.kept, f), getattr(b.kept, f)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f
    assert a.kept.n_ids == b.kept.n_ids


def _both(pieces: list, fast: bool = True, **kw) -> None:
    """Pass 1 on the packed pieces as they are and on the table rebuilt from them: the same summary, bit for bit;
    ``fast``: the pieces are read as they are (`packed_rows` took them)."""
    packed = [sharded.pack_piece(p) for p in pieces]
    shard = sharded.reduce_shard.from_pieces(*packed)
    assert (sharded.packed_rows(shard, kw.get("covariates", ()), kw.get("policies")) is not None) == fast
    _same_summary(sharded.reduce_shard(sharded.unpack_pieces(*packed), **kw), sharded.reduce_shard(shard, **kw))
    _same_summary(sharded.reduce_shard(pa.concat_tables(pieces, promote_options="default"), **kw),
                  sharded.reduce_shard(shard, **kw))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pass1_on_packed_pieces_is_pass1_on_their_table(seed):
    pieces = [_piece(400, seed * 10 + 1, first=0), _piece(0, seed * 10 + 2), _piece(300, seed * 10 + 3, first=40),
              _piece(500, seed * 10 + 4, policies=("c",), first=70), _piece(250, seed * 10 + 5, labelled=0.0)]
    _both(pieces)
    _both(pieces, n_folds=7)
    _both(pieces, policies=["a", "b", "c", "zz"])  # a filter keeping every row: no table needed
    _both(pieces, fast=False, policies=["a", "c"])  # rows dropped: the table path
    _both(pieces[:1])
    _both([_piece(1, 9)])  # one row
    _both([_piece(300, 9, zeros=False), _piece(300, 10, zeros=False)])  # every class of one bit pattern
    plain = [p.replace_schema_metadata(None) for p in pieces]  # not a range shard: its ids returned, all built
    _both(plain)
    _both(plain[:1])


def _permuted(piece: sharded.PackedPiece, seed: int) -> sharded.PackedPiece:
    """``piece`` with its score values in another order (the codes mapped along): the same scores."""
    perm = np.random.default_rng(seed).permutation(piece.score_values.size)
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(perm.size)
    codes = np.asarray(piece.table[SCORE].combine_chunks().to_numpy())
    table = piece.table.set_column(piece.table.column_names.index(SCORE), SCORE,
                                   pa.array(inverse[codes].astype(codes.dtype)))
    return dataclasses.replace(piece, table=table, score_values=piece.score_values[perm])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_pass1_cells_whatever_the_order_of_the_pieces_values(seed):
    """A class of two bit patterns (``-0.0``, ``0.0``): its cell's score is its first row's, not its first value's."""
    pieces = [sharded.pack_piece(_piece(300, seed * 10 + k, first=20 * k)) for k in range(3)]
    packed = [_permuted(p, seed + k) for k, p in enumerate(pieces)]
    back = [sharded.unpack_piece(p) for p in packed]
    for p, q in zip(pieces, back):  # the same scores, bit for bit
        assert np.asarray(q[SCORE]).tobytes() == np.asarray(sharded.unpack_piece(p)[SCORE]).tobytes()
    shard = sharded.reduce_shard.from_pieces(*packed)
    assert sharded.packed_rows(shard) is not None
    got = sharded.reduce_shard(shard)
    _same_summary(sharded.reduce_shard(sharded.unpack_pieces(*packed)), got)
    first = np.concatenate([np.asarray(q[SCORE]) for q in back])
    first = first[first == 0][0]
    assert np.float64(got.cell_score[got.cell_score == 0][0]).tobytes() == np.float64(first).tobytes()


def test_pass1_on_packed_pieces_without_labels_or_probabilities():
    _both([_piece(300, 1, label=False, prob=False), _piece(300, 2, label=False, prob=False)])
    _both([_piece(300, 1, prob=False), _piece(300, 2)])  # a piece without LABEL_PROB: weight 1 there
    _both([_piece(300, 1), _piece(300, 2, label=False, prob=False)])


def test_pass1_on_packed_pieces_falls_back_to_the_table():
    a, b = _piece(300, 1), _piece(300, 2)
    _both([b, a], fast=False)  # out of window order: the table path sorts the rows
    wide = a.set_column(a.column_names.index(sharded.ROW), sharded.ROW,
                        pa.array(np.arange(300, dtype=np.int64) * 2**33))  # places shipped plain
    _both([wide, b.set_column(b.column_names.index(sharded.ROW), sharded.ROW,
                              pa.array(2**43 + np.arange(300, dtype=np.int64)))])
    nan = a.set_column(a.column_names.index(SCORE), SCORE, pa.array(np.where(np.arange(300) == 5, np.nan, 0.5)))
    _both([nan, b], fast=False)  # a NaN score: the reference decides
    _both([a.append_column("x1", pa.array(np.arange(300.0))), b.append_column("x1", pa.array(np.ones(300)))],
          fast=False, covariates=("x1",))
    _both([_piece(0, 1), _piece(0, 2)], fast=False)  # an empty shard
    with pytest.raises(Exception, match="prompt_id"):  # a missing column: the table path names it
        sharded.reduce_shard(sharded.reduce_shard.from_pieces(sharded.pack_piece(a.drop_columns([PROMPT]))))


def test_ray_tasks_hand_pass1_the_pieces():
    """`flows.runtime.sharded_ray._with_pieces`: pass 1 gets its shard as pieces, every other function the table."""
    pieces = [sharded.pack_piece(_piece(200, 1)), sharded.pack_piece(_piece(200, 2, first=30))]
    seen = []

    def probe(shard):
        seen.append(type(shard))
        return shard

    got = sharded_ray._with_pieces(sharded.reduce_shard, ((None, None), None), *pieces, ())
    _same_summary(got, sharded.reduce_shard(sharded.unpack_pieces(*pieces)))
    sharded_ray._with_pieces(probe, ((None, None),), *pieces)
    assert seen == [pa.Table]


def test_span_rank_is_pandas_factorize():
    """Integers ranked by flags past the low bits they share (`_span_rank`): pandas' codes and sorted uniques,
    for unsigned words with the high bit set, negative and extreme signed values, and values sharing no bit."""
    rng = np.random.default_rng(11)
    cases = [
        (np.uint64(0x3030300000000000) + rng.integers(0, 10, 5000).astype(np.uint64) * np.uint64(1 << 40)),
        np.uint64(2**63) + rng.integers(0, 300, 2000).astype(np.uint64) * np.uint64(1 << 12),  # high bit set
        rng.integers(-500, 500, 3000) * 8,  # negative, three shared low bits
        np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).min + 4, np.iinfo(np.int64).min]),
        np.array([np.iinfo(np.int64).max, np.iinfo(np.int64).max - 2]),
        rng.permutation(np.arange(1000, dtype=np.int64)),  # no shared bit
        np.array([7, 7, 7], dtype=np.int64), rng.integers(0, 50, 400).astype(np.int32),
        (rng.integers(-500, 500, 3000) * 16)[::3],  # a strided int64 view: its bits read in place
        np.uint64(2**64 - 2**20) + rng.integers(0, 99, 700).astype(np.uint64)[::2],  # strided, near 2^64
        rng.integers(-2**31, 2**31 - 1, 500).astype(np.int32) // 2**20 * 2**20,  # narrower: widened first
        (np.uint32(2**31) + rng.integers(0, 3000, 500).astype(np.uint32) * np.uint32(256)), rng.integers(-99, 99, 50).astype(np.int16),
    ]
    for values in cases:
        want_codes, want_uniq = pd.factorize(values, sort=True)
        got = sharded._span_rank(values)
        assert got is not None
        codes, uniq = got
        assert codes.dtype == np.int64 and uniq.dtype == values.dtype
        assert np.array_equal(codes, want_codes) and np.array_equal(uniq, want_uniq)
        codes, uniq = sharded.dense_rank(values)  # whatever way it takes
        assert np.array_equal(codes, want_codes) and np.array_equal(uniq, want_uniq)
    # too wide a range once shifted: left to the hash
    assert sharded._span_rank(rng.integers(0, 2**40, 1000)) is None
    assert sharded._span_rank(np.array([0, 1, 2**63], dtype=np.uint64)) is None
    codes, uniq = sharded._span_rank(np.array([2**63, 0, 2**63], dtype=np.uint64))  # 63 shared low bits
    assert codes.tolist() == [1, 0, 1] and uniq.tolist() == [0, 2**63]


def test_policy_sums_are_the_masks_sums(monkeypatch):
    """Each policy's score sum over its runs' slices: the bits of the sum over its mask, whatever the runs."""
    rng = np.random.default_rng(5)
    score = rng.standard_normal(50_000) * np.exp(rng.standard_normal(50_000) * 4)
    runs = np.repeat(rng.integers(0, 4, 40), rng.integers(1, 3000, 40))[:score.size]
    for policy in (runs, rng.integers(0, 4, runs.size), np.zeros(runs.size, dtype=np.int8), runs[:0]):
        s = score[:policy.size]
        want = sharded._policy_sums(s, policy, 5, reference=True)
        assert want.tobytes() == np.array([s[policy == k].sum() for k in range(5)]).tobytes()
        assert sharded._policy_sums(s, policy, 5).tobytes() == want.tobytes()
    monkeypatch.setattr(sharded, "POLICY_RUNS", 0)  # every run count through the masks: the same
    assert sharded._policy_sums(score[:runs.size], runs, 5).tobytes() == \
        sharded._policy_sums(score[:runs.size], runs, 5, reference=True).tobytes()


@pytest.mark.parametrize("seed", [0, 1])
def test_rows_at_are_the_pieces_rows(seed):
    """The labelled rows' places from the piece's steps summed between them: ``_piece_rows(p)[pos]``."""
    rng = np.random.default_rng(seed)
    for n in (1, 2, 300):
        t = _piece(n, seed + 3)
        p = sharded.pack_piece(t)
        assert p.row_step is not None
        for pos in (np.arange(n), np.array([0]), np.array([n - 1]), np.flatnonzero(rng.random(n) < 0.2)):
            got = sharded._rows_at(p, pos.astype(np.int64))
            assert got.dtype == np.int64
            assert np.array_equal(got, sharded._piece_rows(p)[pos])
            assert np.array_equal(got, np.asarray(t[sharded.ROW])[pos])


def test_dictionary_codes_of_one_value_chunks():
    """Chunks whose dictionary holds one value (a piece of one policy) coded by a fill: the reference's codes."""
    chunks = [pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int8)), pa.array([v]))
              for n, v in ((5, "b"), (3, "a"), (0, "z"), (4, "b"))]
    chunks.append(pa.DictionaryArray.from_arrays(pa.array([1, 0, 1], pa.int8()), pa.array(["a", "c"])))
    col = pa.chunked_array(chunks)
    codes, ids = sharded.dictionary_codes(col)
    want_codes, want_ids = _pandas([str(x) for x in col.to_pylist()])
    assert np.array_equal(codes, want_codes) and ids.to_pylist() == want_ids  # "z" used by no row: not kept


def test_contributions_by_runs_are_the_gathers(monkeypatch):
    """Pass 2's ``(f - plug[k]) / n_k[k]`` a run of one policy at a time: the bits of the two gathers."""
    rng = np.random.default_rng(9)
    f = rng.standard_normal(40_000) * np.exp(rng.standard_normal(40_000) * 3)
    plug, n_k = rng.standard_normal(4), rng.integers(1, 10**6, 4).astype(float)
    runs = np.repeat(rng.integers(0, 4, 30), rng.integers(1, 3000, 30))[:f.size].astype(np.int8)
    for policy in (runs, rng.integers(0, 4, runs.size), np.full(runs.size, 3, dtype=np.int8)):
        x = f[:policy.size]
        want = sharded._contributions(x, policy, plug, n_k, reference=True)
        assert want.tobytes() == ((x - plug[policy]) / n_k[policy]).tobytes()
        assert sharded._contributions(x, policy, plug, n_k).tobytes() == want.tobytes()
    assert sharded._contributions(f[:0], runs[:0], plug, n_k).size == 0
    monkeypatch.setattr(sharded, "POLICY_RUNS", 0)
    assert sharded._contributions(f[:runs.size], runs, plug, n_k).tobytes() == \
        sharded._contributions(f[:runs.size], runs, plug, n_k, reference=True).tobytes()


def test_row_policies_are_the_tables_gather():
    """Pass 2's global policy a row: the table's gather (as values), and whether every row is evaluated."""
    rng = np.random.default_rng(4)
    local = rng.integers(0, 3, 500).astype(np.int8)
    for table in (np.arange(3), np.array([2, 0, 1]), np.array([0, -1, 1]), np.array([4, 3, 2])):
        want, every = sharded._row_policies(local, table, reference=True)
        assert np.array_equal(want, table[local]) and every == bool((table[local] >= 0).all())
        got, fast_every = sharded._row_policies(local, table)
        assert np.array_equal(got, want) and fast_every == every


def test_gram_rows_of_is_fancy_indexing():
    from cje_engine.inference import gram

    a = np.arange(60.0).reshape(20, 3)
    for idx in ([0, 5, 10, 15], [3], [1, 2, 3], [4, 2, 0], [0, 1, 5], [19, 19]):
        idx = np.asarray(idx)
        got = gram._rows_of(a, idx)
        assert np.array_equal(got, a[idx])
    assert np.shares_memory(gram._rows_of(a, np.array([0, 5, 10, 15])), a)  # evenly forward: a view


def test_pass1_counts_by_runs_are_the_per_row_counts(monkeypatch):
    """Counts, distinct prompts and score sums a run of one policy at a time: pass 1's summary with every run
    count forced through the per-row keys (`POLICY_RUNS` 0) is the same, bit for bit."""
    rng = np.random.default_rng(2)
    policy = np.repeat(rng.integers(0, 3, 25), rng.integers(1, 400, 25))
    prompt = rng.integers(0, 500, policy.size)
    runs = sharded._policy_runs(policy)
    assert sum(b - a for _, a, b in runs) == policy.size and all(np.all(policy[a:b] == k) for k, a, b in runs)
    assert np.array_equal(sharded._prompts_per_policy(policy, prompt, 3, 500, runs),
                          sharded._prompts_per_policy(policy, prompt, 3, 500))
    pieces = [sharded.pack_piece(_piece(400, 1, policies=("a",))), sharded.pack_piece(_piece(300, 2, policies=("b",))),
              sharded.pack_piece(_piece(300, 3, policies=("a",), first=30))]
    fast = sharded.reduce_shard(sharded.reduce_shard.from_pieces(*pieces))
    monkeypatch.setattr(sharded, "POLICY_RUNS", 0)
    assert sharded._policy_runs(policy) is None
    _same_summary(fast, sharded.reduce_shard(sharded.reduce_shard.from_pieces(*pieces)))


def test_a_piece_score_code_outside_its_values_is_refused():
    """`_piece_cells` looks the cells up with ``mode="clip"`` only after the scores' gather (``mode="raise"``) has
    refused any code outside the piece's values: a damaged piece raises, never a wrong cell."""
    import dataclasses

    import numpy as np
    import pyarrow as pa
    import pytest

    from cje_engine.data.frame import POLICY, PROMPT, SCORE
    from cje_engine.pipeline import sharded

    t = pa.table({PROMPT: ["a", "b", "c"], POLICY: ["p", "p", "p"], SCORE: [0.1, 0.2, 0.1],
                  sharded.ROW: np.arange(3, dtype=np.int64)})
    piece = sharded.pack_piece(t)
    assert piece.score_values is not None
    sharded._piece_cells([piece], 3)  # the piece as packed: fine
    codes = np.asarray(piece.table[SCORE].combine_chunks()).copy()
    codes[1] = len(piece.score_values)  # one past its values
    bad = dataclasses.replace(piece, table=piece.table.set_column(
        piece.table.schema.get_field_index(SCORE), SCORE, pa.array(codes)))
    with pytest.raises(IndexError):
        sharded._piece_cells([bad], 3)


def test_row_terms_by_cell_tables_are_the_reference(monkeypatch):
    """Pass 2's per-prompt terms with every row's contribution gathered from its policy's table over the cells
    (and the calibration rows' written over): `_row_terms_reference`'s bits, for runs few or many, a NaN score's
    cell (-1), float32 or float64 fits, whole-number or float row counts, calibration rows or none, some policy
    not evaluated, one row, no row."""
    rng = np.random.default_rng(12)

    def case(n, n_ids, K, G, runs, fit_dtype=float, nk_int=False, n_cal=0, drop=False, nan_cell=False):
        policy = np.repeat(rng.integers(0, K, runs), np.diff(np.linspace(0, n, runs + 1).astype(int)))
        policy = policy.astype(np.int8)
        cell = rng.integers(-1 if nan_cell else 0, G, n).astype(np.int32)
        prompt = rng.integers(0, n_ids, n).astype(np.int32)
        lab_pos = np.flatnonzero(rng.random(n) < 0.3)
        lab_row = lab_pos.astype(np.int64) * 3 + 7
        v = sharded.ShardView(prompt, policy, cell, lab_pos, lab_row, n_ids)
        table = np.arange(K)
        if drop:
            table = np.where(table == K - 1, -1, table)
        codes = sharded.ShardCodes(None, table, rng.permutation(G + 2)[:G], G + 2)
        F_all = (rng.standard_normal(G + 2) * np.exp(rng.standard_normal(G + 2) * 3)).astype(fit_dtype)
        plug = rng.standard_normal(K)
        n_k = rng.integers(1, 10**6, K)
        n_k = n_k if nk_int else n_k * 1.0 + rng.random(K)
        cal = np.sort(rng.choice(lab_row, min(n_cal, lab_row.size), replace=False)) if n_cal else lab_row[:0]
        cal_f = rng.standard_normal(cal.size)
        pol, every = sharded._row_policies(v.policy, codes.policy_code)
        keep = None if every else pol >= 0
        at = sharded._cal_positions(v, cal) if cal.size else None
        got = sharded._row_terms(v, pol, keep, codes, F_all, at, cal_f, plug, n_k)
        want = sharded._row_terms_reference(v, pol, keep, codes, F_all, at, cal_f, plug, n_k)
        assert got.dtype == want.dtype and got.shape == want.shape == (n_ids, K)
        assert got.tobytes() == want.tobytes()

    case(50_000, 3000, 5, 21, 7, n_cal=2000)
    case(50_000, 3000, 5, 21, 7, n_cal=2000, nan_cell=True)
    case(50_000, 3000, 4, 300, 40, fit_dtype=np.float32, nk_int=True, n_cal=500)
    case(50_000, 70_000, 3, 21, 2, n_cal=0)
    case(20_000, 2000, 5, 21, 9, n_cal=100, drop=True)  # a policy not evaluated: the reference's way
    case(1, 1, 2, 1, 1, n_cal=1)
    case(1, 1, 2, 1, 1)
    case(0, 0, 3, 2, 1)
    with pytest.raises(ValueError, match="not in it"):
        v = sharded.ShardView(np.zeros(3, np.int32), np.zeros(3, np.int8), np.zeros(3, np.int32), np.array([1]),
                              np.array([5]), 1)
        sharded._cal_positions(v, np.array([6]))
    monkeypatch.setattr(sharded, "POLICY_RUNS", 0)  # many runs: the reference's way
    case(20_000, 2000, 5, 21, 300, n_cal=100)


def test_places_are_searchsorted():
    """`_places` (pass 2's labelled and calibration rows' places in the shard's labelled prompts, taken from the
    shard's hint where the hint holds): ``numpy.searchsorted``'s positions whatever the hint."""
    rng = np.random.default_rng(21)
    P = np.unique(rng.integers(0, 10**6, 5000)).astype(np.int64)
    right = rng.integers(0, P.size, 8000)
    values = P[right].astype(np.int32)
    want = np.searchsorted(P, values)
    bad = right.copy()
    bad[5] = (bad[5] + 1) % P.size
    for hint in (right, None, bad, right[:-1], right.astype(np.int32), right - 1, right + 1, np.full_like(right, -1)):
        got = sharded._places(P, values, hint)
        assert got.dtype == np.int64 and np.array_equal(got, want)
    stranger = np.append(values, P[-1] + 1)  # a value not in P: the search's place (past the end)
    assert np.array_equal(sharded._places(P, stranger, np.append(right, P.size)), np.searchsorted(P, stranger))
    assert np.array_equal(sharded._places(P, values, right), right)  # the hint itself, no search
    ties = np.array([1, 1, 2])  # not strictly increasing: the search
    assert np.array_equal(sharded._places(ties, np.array([1]), np.array([1])), np.searchsorted(ties, [1]))
    assert sharded._places(P, values[:0], right[:0]).size == 0
    assert np.array_equal(sharded._places(P[:1], values[:0], None), np.searchsorted(P[:1], values[:0]))


def test_dense_rank_of_a_full_span_is_pandas_factorize():
    """Every value of the span present (each value its own rank, no gather): pandas' codes and uniques, int64,
    in place or not, whatever the integer type; a span with a gap ranks as before."""
    rng = np.random.default_rng(8)
    for values in (np.arange(7)[::-1], rng.permutation(1000), np.repeat(np.arange(50), 3), np.array([0]),
                   np.append(rng.permutation(300), 301)):  # the last: 300 missing
        want_codes, want_uniq = pd.factorize(values, sort=True)
        for dtype in (np.int64, np.int32, np.uint16):
            for inplace in (False, True):
                x = values.astype(dtype)
                codes, uniq = sharded.dense_rank(x, int(values.max()) + 1, inplace=inplace)
                assert codes.dtype == np.int64 and uniq.dtype == np.int64
                assert np.array_equal(codes, want_codes) and np.array_equal(uniq, want_uniq)
                assert np.array_equal(x, values.astype(dtype)) or (inplace and dtype == np.int64)
