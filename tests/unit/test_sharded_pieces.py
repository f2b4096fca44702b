"""A reader returns the pieces of the shards its file's prompt-id range touches only (issue 29, round 19):
`cje_engine.pipeline.sharded.file_shards` and `split_by_shard`'s ``shards`` against the reference, every reader
returning a piece of every shard: the same non-empty pieces in the same order, so the same shard tables, bit for
bit, and the same pass-1 summaries."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.data.frame import LABEL, LABEL_PROB, POLICY, PROMPT, SCORE
from cje_engine.data.strings import fixed_width
from cje_engine.pipeline import sharded
from flows.runtime import sharded_ray

ROW_BITS = sharded_ray.ROW_BITS


def _file(ids: list, seed: int) -> pa.Table:
    """A log file's rows with the given prompt ids (in that order), three policies, a judge score and 10% labels."""
    rng = np.random.default_rng(seed)
    n = len(ids)
    return sharded_ray.compact_policy(pa.table({
        PROMPT: pa.array(ids, pa.string()), POLICY: rng.choice(["base", "new", "x"], n).tolist(),
        SCORE: rng.integers(0, 21, n) / 20, LABEL: np.where(rng.random(n) < 0.1, rng.random(n), np.nan),
        LABEL_PROB: np.full(n, 0.1)}))


def _both(files: list[pa.Table], n_shards: int, splitters: list[str] | None):
    """(reference pieces per shard, pruned pieces per shard): every reader's every piece, in file order; and the
    pieces of `file_shards`' shards only."""
    old = [sharded.split_by_shard(f, n_shards, row_offset=i << ROW_BITS, splitters=splitters)
           for i, f in enumerate(files)]
    if splitters is None:
        touched = [sorted(set(sharded.shard_of(f[PROMPT], n_shards).tolist()) | ({0} if i == 0 else set()))
                   for i, f in enumerate(files)]
    else:
        touched = sharded.file_shards([sharded.id_bounds(f[PROMPT]) for f in files], splitters, n_shards)
    new = [sharded.split_by_shard(f, n_shards, row_offset=i << ROW_BITS, splitters=splitters, shards=touched[i])
           for i, f in enumerate(files)]
    for t, p in zip(touched, new):
        assert len(p) == len(t)
    ref = [[old[i][s] for i in range(len(files))] for s in range(n_shards)]
    got = [[new[i][touched[i].index(s)] for i in range(len(files)) if s in touched[i]] for s in range(n_shards)]
    return ref, got, touched


def _same_table(a: pa.Table, b: pa.Table) -> bool:
    """The same schema (metadata included) and the same values, floats bit for bit (`pyarrow.Table.equals` holds
    NaN unequal to itself)."""
    if not a.schema.equals(b.schema, check_metadata=True) or a.num_rows != b.num_rows:
        return False
    for x, y in zip(a.columns, b.columns):
        x, y = x.combine_chunks(), y.combine_chunks()
        if pa.types.is_floating(x.type):
            if x.null_count or y.null_count:
                if not x.is_null().equals(y.is_null()):
                    return False
                x, y = x.fill_null(0.0), y.fill_null(0.0)
            if x.to_numpy().tobytes() != y.to_numpy().tobytes():
                return False
        elif not x.equals(y):
            return False
    return True


def _assert_same_shards(ref, got, reduce: bool = True):
    """The same non-empty pieces in the same order (the dropped ones empty), at least one piece a shard, and the
    same shard: its table (`unpack_pieces` of the packed pieces, metadata included) and (``reduce``) its pass-1
    summary."""
    for s, (a, b) in enumerate(zip(ref, got)):
        assert b, f"shard {s} has no piece"
        full_a = [p for p in a if p.num_rows]
        full_b = [p for p in b if p.num_rows]
        assert len(full_a) == len(full_b), s
        for x, y in zip(full_a, full_b):
            assert _same_table(x, y), s
        packed_a = [sharded.pack_piece(p) for p in a]
        packed_b = [sharded.pack_piece(p) for p in b]
        ta, tb = sharded.unpack_pieces(*packed_a), sharded.unpack_pieces(*packed_b)
        assert _same_table(ta, tb), s
        if not reduce:
            continue
        ra = sharded.reduce_shard(sharded.packed_shard(*packed_a))
        rb = sharded.reduce_shard(sharded.packed_shard(*packed_b))
        for f in ("n_rows", "policies", "n_ids", "id_range", "score_min", "score_max"):
            assert getattr(ra, f) == getattr(rb, f), (s, f)
        for f in ("cell_score", "counts", "n_prompts", "score_sum"):
            assert getattr(ra, f).tobytes() == getattr(rb, f).tobytes(), (s, f)
        for k, v in ra.labelled.items():
            assert v.tobytes() == rb.labelled[k].tobytes(), (s, k)
        assert ra.kept.prompt.tobytes() == rb.kept.prompt.tobytes() and ra.kept.cell.tobytes() == rb.kept.cell.tobytes()


def _blocks(n_files: int, per: int, seed: int) -> list[pa.Table]:
    """Files of blocks of prompts (the benchmark's layout): file ``i`` holds prompts ``b{i//2}-p...`` (two policies'
    files a block), shuffled within the file."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_files):
        ids = [f"b{i // 2:02d}-p{int(p):05d}" for p in rng.integers(0, 2000, per)]
        out.append(_file(ids, seed + i))
    return out


def test_prompt_blocks_touch_few_shards_and_give_the_same_shards():
    files = _blocks(10, 600, 1)
    n = 7
    cuts = sharded.range_splitters([sharded.sample_prompt_ids(f[PROMPT], 16 * n) for f in files], n)
    ref, got, touched = _both(files, n, cuts)
    assert sum(len(t) for t in touched) < 10 * n / 2  # most readers return 1-2 pieces, not 7
    assert all(len(t) <= 3 for t in touched)
    _assert_same_shards(ref, got)


def test_unsorted_files_touch_every_shard_as_before():
    rng = np.random.default_rng(2)
    files = [_file([f"q{int(p):04d}" for p in rng.integers(0, 5000, 500)], i) for i in range(4)]
    cuts = sharded.range_splitters([sharded.sample_prompt_ids(f[PROMPT], 64) for f in files], 5)
    ref, got, touched = _both(files, 5, cuts)
    assert touched == [list(range(5))] * 4
    _assert_same_shards(ref, got)


def test_a_prompt_at_a_splitter_an_empty_file_and_a_single_prompt():
    """A file whose least id is a splitter exactly (its rows start that shard), one whose greatest is (its last rows
    open the next shard), an empty file, a file of a single prompt, and a shard no file's range touches (4): it gets
    the first file's empty piece, as it had it before; shard 2 ([d, d), repeated splitters) is empty whatever the
    files, but within the range of the last file, whose empty piece it gets."""
    cuts = ["b", "d", "d", "f"]
    files = [_file(["b", "b", "c", "a0"], 0),  # shards 0..1; its least id "a0" below the first splitter
             _file([], 1),  # no rows: no piece
             _file(["c"] * 5, 2),  # one prompt: one shard (1), no search
             _file(["d", "dd", "e", "d"], 3),  # least id at a splitter: shard 3 only
             _file(["cz", "d"], 4)]  # greatest id at a splitter: shards 1..3
    ref, got, touched = _both(files, 5, cuts)
    assert touched == [[0, 1, 4], [], [1], [3], [1, 2, 3]]
    _assert_same_shards(ref, got)
    # an empty window: every shard is the first file's empty piece
    ref, got, touched = _both([_file([], 0), _file([], 1)], 3, ["m", "t"])
    assert touched == [[0, 1, 2], []]
    _assert_same_shards(ref, got)


def test_non_ascii_ids_and_nulls_follow_range_shards_order():
    """The bounds in `range_shard`'s order (UTF-8 bytes = code points, not UTF-16's or the locale's): a file of
    non-ASCII ids, one with null ids (null is below every splitter: shard 0) and one of nulls only."""
    ids = ["é", "e\u0301", "\U0001f600", "\uffff", "z", "日本", "a\0"]
    assert sharded.id_bounds(pa.array(ids)) == (min(ids), max(ids), False)  # Python's str order: code points
    cuts = ["e", "\uffff"]
    files = [_file(ids, 0), _file(["z", None, "y"], 1), _file([None, None], 2), _file(["\U0001f600"], 3)]
    assert sharded.id_bounds(files[2][PROMPT]) == (None, None, True)
    ref, got, touched = _both(files, 3, cuts)
    assert touched == [[0, 1, 2], [0, 1], [0], [2]]
    _assert_same_shards(ref, got, reduce=False)  # (pass 1 takes no null prompt id, either way)


@pytest.mark.parametrize("n_shards", [1, 3, 17])
def test_shard_counts_and_hash_sharding(n_shards):
    files = _blocks(6, 300, 5)
    cuts = sharded.range_splitters([sharded.sample_prompt_ids(f[PROMPT], 16 * n_shards) for f in files], n_shards)
    _assert_same_shards(*_both(files, n_shards, cuts)[:2])
    _assert_same_shards(*_both(files, n_shards, None)[:2])  # by hash: each file's shards given as they are


def test_a_row_outside_the_shards_asked_is_refused():
    t = _file(["a", "c", "e"], 0)
    with pytest.raises(ValueError, match=r"shard\(s\) \[1\]"):
        sharded.split_by_shard(t, 3, splitters=["b", "d"], shards=[0, 2])
    with pytest.raises(ValueError, match="outside"):
        sharded.split_by_shard(t, 3, splitters=None, shards=[])
    with pytest.raises(ValueError, match="not increasing"):
        sharded.split_by_shard(t, 3, splitters=["b", "d"], shards=[1, 0])


def test_rows_outside_the_shards_asked_raise_their_own_type_naming_the_shards():
    """The refusal is a `RowsOutsideShards` (a `ValueError`) carrying the shards of the rows outside and those
    asked, for shards by range and by hash and from the reference: its caller (`sharded_ray.split_file`) catches
    the type, not the message's text; other bad arguments stay plain `ValueError`s."""
    t = _file(["a", "c", "e"], 0)
    for split in (sharded.split_by_shard, sharded.split_by_shard_reference):
        with pytest.raises(sharded.RowsOutsideShards) as err:
            split(t, 3, splitters=["b", "d"], shards=[0, 2])
        assert isinstance(err.value, ValueError)
        assert err.value.outside == [1] and err.value.asked == [0, 2]
        assert "shard(s) [1]" in str(err.value) and "[0, 2]" in str(err.value)
    hashed = sharded.shard_of(pa.array(["a", "c", "e"]), 3).tolist()
    with pytest.raises(sharded.RowsOutsideShards) as err:
        sharded.split_by_shard(t, 3, splitters=None, shards=[])
    assert err.value.outside == sorted(set(hashed)) and err.value.asked == []
    with pytest.raises(ValueError) as err:
        sharded.split_by_shard(t, 3, splitters=["b", "d"], shards=[1, 0])
    assert not isinstance(err.value, sharded.RowsOutsideShards)


def test_shard_nodes_cut_consecutive_runs_in_proportion_to_cpus():
    assert sharded_ray.shard_nodes(26, [("a", 1), ("b", 1)]) == ["a"] * 13 + ["b"] * 13
    assert sharded_ray.shard_nodes(5, [("a", 1), ("b", 1)]) == ["a"] * 3 + ["b"] * 2  # shard 2 centred on the cut: the first
    assert sharded_ray.shard_nodes(8, [("a", 1), ("b", 3)]) == ["a"] * 2 + ["b"] * 6
    assert sharded_ray.shard_nodes(3, [("a", 2)]) == ["a"] * 3
    assert sharded_ray.shard_nodes(1, [("a", 1), ("b", 1)]) == ["a"]
    got = sharded_ray.shard_nodes(7, [("a", 1), ("b", 1), ("c", 1)])
    assert got == sorted(got) and set(got) == {"a", "b", "c"}  # runs of consecutive shards, every node used


def test_shard_homes_is_the_node_with_most_bytes_of_the_shards_pieces():
    touched = [[0, 1], [1, 2], [2], []]
    infos = [{"node": "a", "piece_bytes_of": [10, 5]}, {"node": "b", "piece_bytes_of": [6, 0]},
             {"node": None, "piece_bytes_of": [99]}, {"node": "b", "piece_bytes_of": []}]
    # shard 0: a only; 1: b's 6 bytes over a's 5; 2: b's empty piece and a piece of no node: no home
    assert sharded_ray.shard_homes(touched, infos, 4) == ["a", "b", None, None]
    assert sharded_ray.shard_homes([[0], [0]], [{"node": "b", "piece_bytes_of": [3]},
                                               {"node": "a", "piece_bytes_of": [3]}], 1) == ["a"]  # a tie: the first id


def _bounds_cases():
    """Prompt-id columns for `id_bounds`: of one width (in order, shuffled, sharing their first 8 or 16 bytes, ties
    decided past byte 16, NUL bytes, multi-byte UTF-8), of mixed widths, with nulls, over several chunks."""
    rng = np.random.default_rng(29)
    ordered = [f"b3-p{i:06d}" for i in range(5000)]
    shuffled = [ordered[i] for i in rng.permutation(len(ordered))]
    shared8 = [f"prompt-x{i:05d}" for i in rng.permutation(3000)]  # every id shares its first 8 bytes
    past16 = ["abcdefghijklmnop" + s for s in ("b", "a", "c", "ab")] + [f"zz{i:014d}" for i in range(200)]
    nul = ["aaaaaaaa\0", "aaaaaaaa", "aaaaaaaa\0\0", "zzzzzzzz", "zzzzzzzz\0"] + [f"m{i:07d}" for i in range(300)]
    utf8 = ["é" * 4, "e\u0301" * 4, "\U0001f600" * 2, "\uffff" * 3 + "ab", "日本語です"[:4]] + [f"k{i:07d}" for i in range(99)]
    mixed = ["b", "a" * 30, "", "zz", "m" * 9] + [f"{i:x}" for i in rng.permutation(4000)]
    # a few ids tied with the least / greatest in their first 8 bytes among many others
    few_tied = [f"q{i:07d}" for i in rng.permutation(4000)] + ["q0000000\x01", "q0003999~", "q0000000"]
    # one width, a few tied with the least / greatest in 8 bytes (decided by bytes 8-9, NUL included), or in 16
    fixed_tied = [f"q{i:07d}xx" for i in rng.permutation(4000)] + ["q0000000\0\x01", "q0000000\0\0", "q0003999~~"]
    fixed_tied16 = [f"r{i:015d}yyyy" for i in rng.permutation(4000)] + ["r000000000000000\0zzz", "r000000000003999zzzz"]
    cases = [ordered, shuffled, shared8, past16, nul, utf8, mixed, few_tied, fixed_tied, fixed_tied16, [ordered[7]]]
    arrays = [pa.array(c, pa.string()) for c in cases]
    arrays.append(pa.array(ordered[:100] + [None] + ordered[100:], pa.string()))
    arrays.append(pa.chunked_array([pa.array(ordered[:2000]), pa.array([], pa.string()),
                                    pa.array([None, None], pa.string()), pa.array(shuffled[:50]),
                                    pa.array(few_tied)]))
    arrays.append(pa.array(ordered, pa.large_string()))
    arrays.append(pa.array(ordered).slice(123, 3000))  # an offset into the buffers
    arrays.append(pa.array([None, None], pa.string()))
    arrays.append(pa.array([], pa.string()))
    return arrays


@pytest.mark.parametrize("case", range(len(_bounds_cases())))
def test_id_bounds_is_the_plain_min_max(case):
    """The bounds from the ids' words equal Arrow's ``min_max`` of every id (`id_bounds_reference`), whatever the
    widths, ties, NUL bytes, UTF-8, nulls and chunks; and Python's order of the strings."""
    ids = _bounds_cases()[case]
    if case in (0, 1, 8, 9):  # the words' path is taken: ids of one width, few sharing their first 8 bytes
        assert all(fixed_width(c) is not None for c in (ids.chunks if isinstance(ids, pa.ChunkedArray) else [ids]))
    got = sharded.id_bounds(ids)
    assert got == sharded.id_bounds_reference(ids)
    plain = [x for x in ids.to_pylist() if x is not None]
    if len(ids) and plain:
        assert got == (min(plain), max(plain), ids.null_count > 0)


def _same_pieces(a: list[pa.Table], b: list[pa.Table]) -> None:
    """The same pieces: schemas (metadata included), values (floats bit for bit) and chunk layouts."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert _same_table(x, y)
        assert [c.num_chunks for c in x.columns] == [c.num_chunks for c in y.columns]
        assert [[len(k) for k in c.chunks] for c in x.columns] == [[len(k) for k in c.chunks] for c in y.columns]


def _split_both(t: pa.Table, n: int, splitters, shards=None, row_offset: int = 0) -> None:
    """`split_by_shard` and `split_by_shard_reference` give the same pieces, or the same error."""
    try:
        ref = sharded.split_by_shard_reference(t, n, row_offset=row_offset, splitters=splitters, shards=shards)
    except ValueError as exc:
        with pytest.raises(ValueError) as got:
            sharded.split_by_shard(t, n, row_offset=row_offset, splitters=splitters, shards=shards)
        assert str(got.value) == str(exc)
        return
    _same_pieces(sharded.split_by_shard(t, n, row_offset=row_offset, splitters=splitters, shards=shards), ref)


def test_split_by_shard_is_its_reference():
    """Every row's shard searched among every splitter (not the span of the file's `id_bounds` first): the same
    pieces as `split_by_shard_reference`, for files in prompt-id order and not, chunked, of one shard, empty, of one
    row, with nulls, non-ASCII ids, ids longer than 16 bytes, ids equal to splitters and sharing their first 16
    bytes, repeated splitters, every shard or the file's only, and the same errors."""
    rng = np.random.default_rng(11)
    long = [f"prompt-{'x' * 12}-{int(i):05d}" for i in rng.integers(0, 3000, 800)]  # 16 bytes shared
    cases = [
        [f"b{i // 2:02d}-p{int(p):05d}" for i, p in enumerate(sorted(rng.integers(0, 9000, 900)))],
        [f"q{int(p):04d}" for p in rng.integers(0, 5000, 700)], sorted(long), long,
        ["é", "e\u0301", "\U0001f600", "\uffff", "z", "日本", "a\0", "a"],
        ["z", None, "y", None], [None, None], ["c"], [], ["c"] * 5, ["b", "b", "c", "a0", "d", "dd", "e", "d", "f"],
    ]
    for ids in cases:
        t = _file(ids, len(ids))
        pool = pa.array([x for x in ids if x is not None], pa.string())
        for n in (1, 2, 3, 7, 26):
            cut_sets = [sharded.range_splitters([sharded.sample_prompt_ids(pool, 16 * n)], n)]
            if n == 3:
                cut_sets += [["b", "d"], ["d", "d"]]
            for cuts in cut_sets:
                _split_both(t, n, cuts)
                bounds = sharded.id_bounds(t[PROMPT])
                touched = sharded.file_shards([bounds], cuts, n)[0]
                _split_both(t, n, cuts, shards=touched, row_offset=3 << ROW_BITS)
                _split_both(t, n, cuts, shards=touched[1:])  # a row outside: the same error
                if t.num_rows > 4:
                    chunked = pa.concat_tables([t.slice(0, 3), t.slice(3)])
                    _split_both(chunked, n, cuts, shards=touched)
        for n in (1, 4):
            _split_both(t, n, None)
    t = _file(["a", "c", "e", "d", "d", "dd"], 0)
    _split_both(t, 5, ["b", "d", "d", "f"])
    _split_both(t, 5, ["b", "d", "d", "f"], shards=[0, 1, 3])
    _split_both(t, 5, ["b", "d", "d"], shards=[0, 1, 3])  # too few splitters: the same error
