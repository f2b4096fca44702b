"""The sharded readers' fast paths of round 18 (issue 29) against the slow obvious computation they replace.

* `cje_engine.data.strings.fixed_width`: ids all of one length read as strided words of the data buffer, so
  `flows.storage.fingerprints.id_fingerprint` of fixed-width ids must be bit for bit the general path's
  (`_fingerprint`: the label index, fingerprinted by the general path from ids of many lengths, and a reader of
  fixed-width ids must agree);
* `cje_engine.pipeline.sharded.range_shard` (its prefix words of fixed-width ids, and the search a splitter among
  keys in order) against `range_shard_reference`;
* `flows.runtime.label_index.LabelIndex._may_hold` by bytes against its word-by-word reference;
* `flows.storage.fingerprints.repeated_fingerprints` (the high halves by view, the flags of 16 bits) against a sort
  of the whole fingerprints.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.data.strings import fixed_width
from cje_engine.pipeline import sharded
from flows.runtime.label_index import LabelIndex
from flows.storage import fingerprints


def _fixed_ids(rng: np.random.Generator, n: int, width: int, alphabet: str = "ab-:0123456789") -> list[str]:
    chars = np.array(list(alphabet))
    return ["".join(row) for row in chars[rng.integers(0, len(chars), (n, width))]]


@pytest.mark.parametrize("width", [8, 9, 15, 16, 17, 36])
def test_fixed_width_fingerprints_are_the_general_paths(width):
    rng = np.random.default_rng(width)
    ids = _fixed_ids(rng, 2000, width)
    for arr in (pa.array(ids, pa.string()), pa.array(ids, pa.large_string()),
                pa.array(["x" * (width + 3)] + ids, pa.string()).slice(1)):  # an offset into the buffers
        assert fixed_width(arr) is not None
        got = fingerprints.id_fingerprint(arr)
        want = fingerprints._fingerprint(arr)
        assert got.dtype == np.uint64 and np.array_equal(got, want)
    # a chunked column, and each string alone (a function of the string, not of its neighbours or chunk)
    chunked = pa.chunked_array([pa.array(ids[:700]), pa.array(ids[700:])])
    assert np.array_equal(fingerprints.id_fingerprint(chunked), fingerprints._fingerprint(pa.array(ids)))
    one = np.concatenate([fingerprints._fingerprint(pa.array([s])) for s in ids[:50]])
    assert np.array_equal(fingerprints.id_fingerprint(pa.array(ids[:50])), one)


@pytest.mark.parametrize("block", [1, 7, 1000, 1 << 15])
def test_fixed_width_fingerprints_by_blocks_are_the_general_paths(monkeypatch, block):
    """`_fixed_fingerprint` runs its steps a block of `BLOCK_ROWS` at a time: any block size, a last block cut
    short and a column of one block give the general path's fingerprints, bit for bit."""
    monkeypatch.setattr(fingerprints, "BLOCK_ROWS", block)
    rng = np.random.default_rng(block)
    ids = _fixed_ids(rng, 2003, 20)
    arr = pa.array(["y" * 20] + ids, pa.string()).slice(1)  # an offset into the buffers
    assert np.array_equal(fingerprints.id_fingerprint(arr), fingerprints._fingerprint(arr))


def test_fixed_width_is_none_unless_every_string_has_the_same_length_of_8_bytes_or_more():
    assert fixed_width(pa.array(["abcdefgh", "abcdefghi"])) is None
    assert fixed_width(pa.array(["abcdefg", "hijklmn"])) is None  # 7 bytes: the general path's masks
    assert fixed_width(pa.array([], pa.string())) is None
    assert fixed_width(pa.array(["abcdefgh", None])) is None  # a null of no byte
    fw = fixed_width(pa.array(["abcdefghij", "klmnopqrst"]))
    assert fw is not None and fw.width == 10
    assert fw.word(2).tolist() == [int.from_bytes(b"cdefghij", "little"), int.from_bytes(b"mnopqrst", "little")]
    with pytest.raises(ValueError):
        fw.word(3)


def test_fixed_width_multibyte_and_nulls_with_bytes_fingerprint_as_the_general_path():
    ids = ["caf\u00e9-0001", "caf\u00e9-0002", "cafe\u0301-003"]  # 11 bytes each in UTF-8
    arr = pa.array(ids)
    assert fixed_width(arr) is not None
    assert np.array_equal(fingerprints.id_fingerprint(arr), fingerprints._fingerprint(arr))
    # a null slot holding the bytes of a string of the same width: fingerprinted as the empty string
    base = pa.array(["abcdefghij", "klmnopqrst", "uvwxyzabcd"])
    _, offsets, data = base.buffers()
    validity = pa.array([True, False, True]).buffers()[1]
    nulled = pa.Array.from_buffers(pa.string(), 3, [validity, offsets, data], null_count=1)
    assert fixed_width(nulled) is not None
    got = fingerprints.id_fingerprint(nulled)
    empty = fingerprints.id_fingerprint(pa.array([""]))[0]
    assert got[1] == empty and got[0] == fingerprints._fingerprint(base)[0] and got[2] == fingerprints._fingerprint(base)[2]


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("kind", ["fixed", "mixed"])
def test_range_shard_is_the_reference(order, kind):
    rng = np.random.default_rng(18)
    if kind == "fixed":  # ids of one pattern (the benchmark's), some tying a splitter on 8 and 16 bytes
        ids = [f"b{rng.integers(10, 20)}-p{rng.integers(0, 10**6):06d}" for _ in range(5000)]
    else:
        ids = [f"p{rng.integers(0, 10**rng.integers(1, 12))}" for _ in range(5000)] + ["", "p", "p0\u00e9"]
    pool = sorted(set(ids))
    cuts = [pool[j * len(pool) // 9] for j in range(1, 9)]
    cuts[3] = cuts[3] + "\x00"  # a splitter no id equals, prefix of none
    cuts = sorted(cuts)
    if order == "sorted":
        ids = sorted(ids)
    arr = pa.array(ids, pa.string())
    assert np.array_equal(sharded.range_shard(arr, cuts), sharded.range_shard_reference(arr, cuts))


@pytest.mark.parametrize("keys_sorted", [True, False])
def test_count_at_most_is_searchsorted(keys_sorted):
    rng = np.random.default_rng(3)
    cut = np.sort(rng.integers(0, 50, 12).astype(np.uint64))  # repeated cuts too
    key = rng.integers(0, 60, 4000).astype(np.uint64)
    if keys_sorted:
        key = np.sort(key)
    got, tied = sharded._count_at_most(cut, key)
    assert np.array_equal(got, np.searchsorted(cut, key, side="right"))
    ref_count, ref_tied = sharded._count_at_most_reference(cut, key)
    assert np.array_equal(got, ref_count) and np.array_equal(tied, ref_tied)
    # the definition: the keys equal to their greatest cut at or below them (keys 0 below every cut too)
    assert np.array_equal(tied, [i for i, k in enumerate(key.tolist()) if any(c == k for c in cut.tolist())])
    assert tied.size and tied.size < key.size  # both kinds present
    count, none = sharded._count_at_most(cut[:0], key)
    assert np.array_equal(count, np.zeros(key.size, dtype=np.int64)) and none.size == 0
    with_zero = np.concatenate([[np.uint64(0)], key])  # a key 0 below every cut: not tied to the sentinel
    if keys_sorted:
        with_zero = np.sort(with_zero)
    cut1 = cut[cut > 0]
    _, t = sharded._count_at_most(cut1, with_zero)
    assert np.array_equal(t, sharded._count_at_most_reference(cut1, with_zero)[1])


def test_the_bit_test_by_bytes_is_the_word_by_word_test():
    rng = np.random.default_rng(29)
    stored = [f"r-{i}-{rng.integers(1 << 40)}" for i in range(20000)]
    table = pa.table({"response_id": pa.array(stored), "oracle_label": pa.array(rng.random(len(stored))),
                      "label_probability": pa.array(np.full(len(stored), 0.5))})
    index = LabelIndex.build(table)
    assert index.bits is not None
    q = np.concatenate([fingerprints.id_fingerprint(pa.array(stored[:3000])),
                        rng.integers(0, 2**63, 50000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)])
    got = index._may_hold(q)
    assert np.array_equal(got, index._may_hold_reference(q))
    assert np.all(np.isin(np.arange(3000), got))  # every stored id passes


def test_repeated_fingerprints_is_the_sort_of_the_whole():
    rng = np.random.default_rng(7)
    fp = rng.integers(0, 2**64 - 1, 200000, dtype=np.uint64)
    # equal high halves with different low halves (compared whole: not repeated), and true repeats
    fp[10:20] = (fp[10:20] & np.uint64(0xFFFFFFFF)) | (fp[5] & np.uint64(0xFFFFFFFF00000000))
    fp[1000] = fp[77]
    fp[150000] = fp[77]
    fp[-1] = fp[12]
    got = fingerprints.repeated_fingerprints(fp)
    want = fingerprints.repeated_fingerprints_reference(fp)
    assert np.array_equal(got, want)
    assert {77, 1000, 150000, 12, fp.size - 1} <= set(got.tolist())
    assert fingerprints.repeated_fingerprints(np.unique(fp)).size == 0
    assert fingerprints.repeated_fingerprints(fp[::-1].copy()[::2]).size == \
        fingerprints.repeated_fingerprints_reference(fp[::-1][::2]).size  # a strided input


def test_repeated_fingerprints_of_parts_is_of_their_concatenation():
    rng = np.random.default_rng(11)
    parts = [rng.integers(0, 2**64 - 1, n, dtype=np.uint64) for n in (0, 5000, 1, 20000, 0, 7000)]
    parts[3][100] = parts[1][4]  # a repeat across parts
    parts[5][6999] = parts[5][0]  # one within a part
    parts[3][7:9] = (parts[3][7:9] & np.uint64(0xFFFFFFFF)) | (parts[2][0] & np.uint64(0xFFFFFFFF00000000))
    whole = np.concatenate(parts)
    got = fingerprints.repeated_fingerprints(parts)
    assert np.array_equal(got, fingerprints.repeated_fingerprints_reference(whole))
    assert np.array_equal(got, fingerprints.repeated_fingerprints(whole)) and got.size == 4


@pytest.mark.parametrize("n_buckets", [1, 4, 26, 40])
def test_buckets_in_runs_find_every_repeated_fingerprint_by_file(n_buckets):
    """The readers' buckets (in runs by the top bits for up to 32 buckets, plain beyond) checked run by run name the
    same repeated fingerprints, by file, as a sort of the whole bucket."""
    from flows.runtime import sharded_ray

    rng = np.random.default_rng(n_buckets)
    files = [rng.integers(0, 2**64 - 1, n, dtype=np.uint64) for n in (4000, 0, 2500, 6000)]
    files[2][10] = files[0][3]  # across files
    files[3][5] = files[3][4000]  # within a file
    files[3][6] = (files[0][9] & np.uint64(0xFFFFFFFF)) ^ np.uint64(1) | (files[0][9] & ~np.uint64(0xFFFFFFFF))
    # the buckets take the reader's fingerprints (its ``_fp`` column), not the ids'
    tables = [pa.table({"response_id": pa.array([f"r{i}" for i in range(f.size)], pa.string()),
                        sharded_ray.FINGERPRINT: pa.array(f, pa.uint64())}) for f in files]
    buckets = [sharded_ray.response_id_buckets(t, n_buckets, ids=False, places=False) for t in tables]
    want: dict[int, set] = {}
    every = np.concatenate(files)
    rep = every[fingerprints.repeated_fingerprints_reference(every)]
    for f, arr in enumerate(files):
        hit = set(np.intersect1d(arr, rep).tolist())
        if hit:
            want[f] = hit
    got: dict[int, set] = {}
    for b in range(n_buckets):
        res = sharded_ray.check_response_ids(*[bs[b] for bs in buckets])
        for f, fps in (res or {}).get("candidates", {}).items():
            got.setdefault(f, set()).update(fps)
    assert got == want and set(want) == {0, 2, 3}
    assert sum(t.num_rows for bs in buckets for t in bs) == every.size
