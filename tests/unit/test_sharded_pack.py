"""The readers' split and what the shuffle carries (issue 29, round 17): each fast path against the slow obvious
computation it replaces."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.data.frame import LABEL, LABEL_PROB, POLICY, PROMPT, SCORE
from cje_engine.pipeline import sharded
from flows.runtime import sharded_ray

# ids sharing long prefixes (8 and 16 bytes: the words `range_shard` searches by), ties with the splitters, an id
# that is a splitter plus a NUL byte (equal words, different strings), non-ASCII (NFC and decomposed), the empty
# string, ids longer than the 16-byte key
LONG = "prompt-0000000000"  # 17 bytes: its first 16 shared by every id built on it
IDS = ([f"{LONG}{i}" for i in range(40)] + [f"b12-p{i:06d}" for i in range(0, 3000, 37)] +
       ["", "a", "a\0", "a\0b", "é", "e\u0301", "日本", "日本語", "zz", "Z", "b12-p", "b12-p000", "b12-p0000000",
        "prompt-0", "prompt-00000000", LONG, LONG + "\0", LONG[:16], "\x7f", "\U0001f600", "ab" * 30])


def _reference(ids: list[str], cuts: list[str]) -> np.ndarray:
    """The shard the old code gave: a comparison a splitter (`range_shard_reference`), checked against Python's
    own order of `str` (code points, UTF-8 bytes' order)."""
    want = np.searchsorted(np.array(cuts, dtype=object), np.array(ids, dtype=object), side="right")
    assert np.array_equal(sharded.range_shard_reference(pa.array(ids, pa.string()), cuts), want)
    return want


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_range_shard_is_the_comparison_per_splitter(seed):
    rng = np.random.default_rng(seed)
    ids = [IDS[i] for i in rng.permutation(len(IDS))]
    for n_cuts in (1, 3, 17, 60):
        # splitters drawn among the ids (ties) and repeated (empty shards), as `range_splitters` may give them
        cuts = sorted(rng.choice(IDS, n_cuts).tolist())
        want = _reference(ids, cuts)
        assert np.array_equal(sharded.range_shard(pa.array(ids, pa.string()), cuts), want)
        chunked = pa.chunked_array([pa.array(ids[:10], pa.string()), pa.array(ids[10:], pa.large_string()).cast(
            pa.string())])
        assert np.array_equal(sharded.range_shard(chunked, cuts), want)
        sliced = pa.array(["pad", *ids, "pad"], pa.string()).slice(1, len(ids))  # a slice: offsets not from 0
        assert np.array_equal(sharded.range_shard(sliced, cuts), want)
        assert np.array_equal(sharded.range_shard(pa.array(ids, pa.large_string()), cuts), want)


def test_range_shard_edges():
    cuts = ["", LONG, LONG + "\0"]
    ids = ["", LONG, LONG + "\0", LONG + "\0\0", LONG[:16], "a"]
    assert np.array_equal(sharded.range_shard(pa.array(ids), cuts), _reference(ids, cuts))
    assert sharded.range_shard(pa.array([], pa.string()), cuts).size == 0
    assert np.array_equal(sharded.range_shard(pa.array(ids), []), np.zeros(len(ids)))
    nulls = pa.array(["b", None, "a"], pa.string())  # a null below every splitter, as the comparisons gave it
    assert sharded.range_shard(nulls, ["a", "b"]).tolist() == [2, 0, 1]
    with pytest.raises(ValueError):
        sharded.range_shard(pa.array(ids), ["b", "a"])


def test_range_shard_of_many_generated_ids():
    """Ids of the benchmark's shape and random bytes, 50,000 of them, against the comparisons."""
    rng = np.random.default_rng(7)
    ids = [f"b{int(b)}-p{int(p):06d}" for b, p in zip(rng.integers(0, 20, 30_000), rng.integers(0, 10**6, 30_000))]
    alphabet = np.array(list("ab\0é日-0"))
    ids += ["".join(rng.choice(alphabet, int(k))) for k in rng.integers(0, 24, 20_000)]
    cuts = sorted(rng.choice(ids, 25).tolist())
    assert np.array_equal(sharded.range_shard(pa.array(ids), cuts), _reference(ids, cuts))


def _piece(n: int, seed: int, *, scores: str = "judge", labelled: float = 0.05, nulls: bool = True) -> pa.Table:
    """A reader's piece: canonical columns, a covariate, `ROW` increasing with gaps, labels as nulls and NaN."""
    rng = np.random.default_rng(seed)
    score = (rng.integers(0, 21, n) / 20 if scores == "judge" else rng.random(n))
    if scores == "judge" and n > 2:
        score[:2] = [-0.0, 0.0]  # two bit patterns of one value: both kept as they are
    lab = rng.random(n) < labelled
    label = np.where(lab, rng.random(n), np.nan)
    label_arr = pa.array([None if (nulls and not ok and i % 2) else v for i, (ok, v) in enumerate(zip(lab, label))],
                         pa.float64())
    prob = np.where(rng.random(n) < 0.2, np.nan, 0.05)
    row = (3 << 40) + np.cumsum(rng.integers(1, 400, n))
    return pa.table({PROMPT: [f"p{i % 7}" for i in range(n)],
                     POLICY: pa.array(["a", "b"] * (n // 2) + ["a"] * (n % 2)).dictionary_encode(),
                     SCORE: score, "x1": rng.random(n), LABEL: label_arr,
                     LABEL_PROB: pa.array(prob, from_pandas=True), sharded.ROW: row}
                    ).replace_schema_metadata({sharded.RANGE_META: b"1"})


def _read_like_the_passes(t: pa.Table) -> dict:
    """What the passes read of a piece (`shard_rows`, `shard_segments`): every column as they convert it, the
    label probability at the labelled rows only."""
    out = {c: t[c] for c in (PROMPT, POLICY)}
    for c in (SCORE, "x1", LABEL, sharded.ROW):
        out[c] = np.asarray(t[c].to_numpy(zero_copy_only=False), dtype=float if c != sharded.ROW else np.int64)
    lab = ~np.isnan(out[LABEL])
    out[LABEL_PROB] = np.asarray(t[LABEL_PROB].to_numpy(zero_copy_only=False), dtype=float)[lab]
    return out


def _same(a: dict, b: dict) -> None:
    for c, x in a.items():
        if isinstance(x, np.ndarray):
            assert x.dtype == b[c].dtype and x.tobytes() == b[c].tobytes(), c  # bit for bit (NaN, -0.0 too)
        else:
            assert x.equals(b[c]), c


@pytest.mark.parametrize("kind", ["judge", "continuous"])
def test_packed_piece_reads_as_the_piece(kind, monkeypatch):
    monkeypatch.setattr(sharded, "PACK_SCORE_VALUES", 100)  # continuous: 3000 distinct scores, shipped plain
    t = _piece(3000, 1, scores=kind)
    p = sharded.pack_piece(t)
    back = sharded.unpack_piece(p)
    assert back.column_names == t.column_names and back.schema.metadata == t.schema.metadata
    _same(_read_like_the_passes(t), _read_like_the_passes(back))
    assert (p.score_values is not None) == (kind == "judge")
    assert p.lab_pos.size == int((~np.isnan(_read_like_the_passes(t)[LABEL])).sum()) > 0
    # the judge's scores: 1 byte a row; the labels of the labelled rows only; the places 2 bytes
    assert p.nbytes < t.nbytes * (0.5 if kind == "judge" else 0.7)
    # pieces concatenated as a task rebuilds its shard: the same as the plain pieces', empty pieces skipped
    u, v, w = _piece(500, 2, scores=kind), _piece(0, 3, scores=kind), _piece(700, 4, scores=kind, labelled=0.0)
    got = sharded.unpack_pieces(*(sharded.pack_piece(x) for x in (u, v, w)))
    _same(_read_like_the_passes(pa.concat_tables([u, w])), _read_like_the_passes(got))
    assert sharded.unpack_pieces(sharded.pack_piece(v)).num_rows == 0


def test_packed_piece_without_labels_and_wide_steps():
    t = _piece(200, 5).drop_columns([LABEL, LABEL_PROB])
    row = np.arange(200, dtype=np.int64) * (2**33)  # steps wider than 32 bits: the places shipped plain
    t = t.set_column(t.column_names.index(sharded.ROW), sharded.ROW, pa.array(row))
    p = sharded.pack_piece(t)
    assert p.row is not None and p.label is None and p.label_prob is None
    back = sharded.unpack_piece(p)
    assert back.column_names == t.column_names and back[sharded.ROW].to_pylist() == row.tolist()
    assert back[SCORE].equals(t[SCORE])


def test_sharded_pass_on_packed_pieces_gives_the_same_summary():
    """Pass 1 on a shard rebuilt from packed pieces (`flows.runtime.sharded_ray._concat`, what each Ray task does)
    and on the plain pieces: the same summary, bit for bit."""
    rng = np.random.default_rng(3)
    n = 4000
    t = pa.table({PROMPT: [f"q{int(i):04d}" for i in rng.integers(0, 900, n)],
                  POLICY: rng.choice(["base", "new", "x"], n).tolist(), SCORE: rng.integers(0, 11, n) / 10,
                  LABEL: np.where(rng.random(n) < 0.1, rng.random(n), np.nan), LABEL_PROB: np.full(n, 0.1)})
    cuts = sharded.range_splitters([sharded.sample_prompt_ids(t[PROMPT], 40)], 3)
    files = [t.slice(0, 1500), t.slice(1500, 2500)]
    plain = [sharded.split_by_shard(sharded_ray.compact_policy(f), 3, row_offset=o, splitters=cuts)
             for f, o in zip(files, (0, 1500))]
    for s in range(3):
        a = sharded.reduce_shard(sharded_ray._concat(*[p[s] for p in plain]))
        b = sharded.reduce_shard(sharded_ray._concat(*[sharded.pack_piece(p[s]) for p in plain]))
        for f in ("n_rows", "policies", "n_ids", "id_range", "score_min", "score_max"):
            assert getattr(a, f) == getattr(b, f), f
        for f in ("cell_score", "counts", "n_prompts", "score_sum"):
            assert getattr(a, f).tobytes() == getattr(b, f).tobytes(), f
        for k, v in a.labelled.items():
            assert v.tobytes() == b.labelled[k].tobytes(), k
        assert a.kept.prompt.tobytes() == b.kept.prompt.tobytes() and a.kept.cell.tobytes() == b.kept.cell.tobytes()


def _same_bits(a: pa.Table, b: pa.Table) -> None:
    """Two tables alike column for column: type, chunk lengths and values (floats by their bits: NaN too)."""
    assert a.schema.equals(b.schema, check_metadata=True)
    for name in a.column_names:
        x, y = a[name], b[name]
        assert x.type == y.type and [len(c) for c in x.chunks] == [len(c) for c in y.chunks], name
        if pa.types.is_floating(x.type):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), name
        else:
            assert x.to_pylist() == y.to_pylist(), name


def test_table_state_ships_only_the_rows_of_a_slice_and_rebuilds_the_table():
    """A piece is a slice of its file's table: pickled as they are, pyarrow's arrays ship the file's buffers whole;
    `table_state` ships the slice's own rows (strings with offsets from 0, dictionary codes, numbers), and any
    other chunk (nulls, booleans) as Arrow does; the table comes back the same, bit for bit."""
    import pickle

    rng = np.random.default_rng(5)
    n = 20_000
    file = pa.table({PROMPT: pa.array([f"p{i:07d}" for i in range(n)]),
                     "big": pa.array([f"p{i}" for i in range(n)], pa.large_string()),
                     POLICY: pa.DictionaryArray.from_arrays(pa.array(rng.integers(0, 3, n).astype(np.int8)),
                                                            pa.array(["a", "b", "c"])),
                     SCORE: rng.random(n), "code": rng.integers(0, 9, n).astype(np.uint8),
                     "gaps": pa.array([None if i % 7 == 0 else float(i) for i in range(n)]),
                     "flag": pa.array(rng.random(n) < 0.5)},
                    schema=None).replace_schema_metadata({"k": "v"})
    piece = file.slice(1234, 500)
    plain = len(pickle.dumps(piece, protocol=5))
    state = sharded.table_state(piece)
    bufs: list = []
    meta = pickle.dumps(state, protocol=5, buffer_callback=bufs.append)
    shipped = len(meta) + sum(b.raw().nbytes for b in bufs)
    kinds = {name: [c[0] for c in col.chunks] for name, col in zip(piece.column_names, state[1])}
    assert kinds == {PROMPT: ["s"], "big": ["s"], POLICY: ["d"], SCORE: ["p"], "code": ["p"], "gaps": ["a"],
                     "flag": ["a"]}
    _same_bits(sharded.table_of_state(pickle.loads(meta, buffers=bufs)), piece)
    no_parents = sharded.table_state(piece.drop_columns(["gaps", "flag"]))
    small = len(pickle.dumps(no_parents, protocol=5))
    assert small < 500 * 40 < plain / 10  # the slice's ~33 B a row, not the file's buffers (pyarrow's pickle)
    assert shipped > small  # the Arrow chunks (nulls, booleans) ship as pyarrow does: their parents
    chunked = pa.concat_tables([piece, file.slice(0, 0), file.slice(9, 3)])
    _same_bits(sharded.table_of_state(pickle.loads(pickle.dumps(sharded.table_state(chunked)))), chunked)
    assert sharded.table_of_state(piece) is piece  # a plain table (an older pickle) as it is


def test_a_bundle_gives_each_piece_back_and_the_pass_the_same_summary():
    """A reader's pieces of one node's shards in one object (`bundle_pieces`): each piece unpickled alone from its
    views of the bundle's bytes (aligned), unpacked to the same table, and pass 1 on a shard of bundled pieces gives
    the summary of the plain pieces, bit for bit."""
    import pickle

    rng = np.random.default_rng(4)
    n = 3000
    t = pa.table({PROMPT: [f"q{int(i):04d}" for i in rng.integers(0, 700, n)],
                  POLICY: rng.choice(["base", "new"], n).tolist(), SCORE: rng.integers(0, 11, n) / 10,
                  LABEL: np.where(rng.random(n) < 0.1, rng.random(n), np.nan), LABEL_PROB: np.full(n, 0.1)})
    cuts = sharded.range_splitters([sharded.sample_prompt_ids(t[PROMPT], 40)], 3)
    files = [t.slice(0, 1000), t.slice(1000, 2000)]
    plain = [sharded.split_by_shard(sharded_ray.compact_policy(f), 3, row_offset=o, splitters=cuts)
             for f, o in zip(files, (0, 1000))]
    packed = [[sharded.pack_piece(p) for p in ps] for ps in plain]
    bundles = [sharded.bundle_pieces(ps) for ps in packed]
    bundles = [pickle.loads(pickle.dumps(b, protocol=5)) for b in bundles]  # as through the object store
    for ps, b in zip(packed, bundles):
        assert len(b) == len(ps)
        for j, p in enumerate(ps):
            assert all(o % sharded.BUNDLE_ALIGN == 0 for o, _ in b.spans[j])
            _same_bits(sharded.unpack_piece(b.piece(j)), sharded.unpack_piece(p))
    for s in range(3):
        a = sharded.reduce_shard(sharded_ray._concat(*[p[s] for p in plain]))
        layout, args = sharded_ray._flatten((sharded_ray.ShardPieces(bundles, at=[s, s]),))
        c = sharded_ray._with_pieces(sharded.reduce_shard, layout, *args)
        for f in ("cell_score", "counts", "n_prompts", "score_sum"):
            assert getattr(a, f).tobytes() == getattr(c, f).tobytes(), f
        for k, v in a.labelled.items():
            assert v.tobytes() == c.labelled[k].tobytes(), k
        assert a.kept.prompt.tobytes() == c.kept.prompt.tobytes() and a.kept.cell.tobytes() == c.kept.cell.tobytes()
