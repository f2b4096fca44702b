"""The response-id paths made cheaper in round 19 (issue 29) against their slow references: the ASCII test of ids
(`cje_engine.data.strings.all_ascii`), the label index's probe (`flows.runtime.label_index.LabelIndex.lookup`) and the
response-id check (`flows.storage.fingerprints.repeated_fingerprints`, `flows.runtime.sharded_ray.check_response_ids`):
the same answers on ties of fingerprints, non-ASCII ids, NFC/NFD spellings, empty inputs, a repeated id across two
files and ids sharing a half-fingerprint."""
from __future__ import annotations

import unicodedata

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.data.strings import all_ascii, all_ascii_reference


def _strings(rng: np.random.Generator, n: int, non_ascii: float) -> list:
    pool = ["caf\u00e9", unicodedata.normalize("NFD", "caf\u00e9"), "\u65e5\u672c", "plain", "", "x" * 40]
    out = []
    for i in range(n):
        s = f"id-{i}-{rng.integers(1 << 20)}"
        if rng.random() < non_ascii:
            s += pool[int(rng.integers(0, 3))]
        elif rng.random() < 0.1:
            s = pool[int(rng.integers(3, 6))]
        out.append(None if rng.random() < 0.05 else s)
    return out


def test_all_ascii_is_the_per_string_test():
    """`all_ascii` (the character data's bytes tested first) gives `pyarrow.compute.string_is_ascii`'s answer on plain
    and large strings, slices (a non-ASCII id outside the slice), chunked columns, empty and all-null columns, and a
    non-ASCII byte left in a null's slot (the bytes say no, the strings yes)."""
    rng = np.random.default_rng(19)
    cases = []
    for frac in (0.0, 0.001, 0.3):
        for n in (0, 1, 7, 300):
            vals = _strings(rng, n, frac)
            for typ in (pa.string(), pa.large_string()):
                arr = pa.array(vals, typ)
                cases += [arr, arr.slice(1, max(0, n - 2)), pa.chunked_array([arr, arr.slice(3)], typ)]
    cases += [pa.nulls(5, pa.string()), pa.chunked_array([], pa.string()), pa.array(["abc", "d\u00e9f"]).slice(0, 1)]
    # a null whose slot holds non-ASCII bytes: built from buffers (the validity bit of row 1 cleared)
    data = "ab" + "\u00e9" + "cd"
    offsets = np.array([0, 2, 4, 6], dtype=np.int32)
    valid = pa.py_buffer(np.packbits(np.array([1, 0, 1], dtype=bool), bitorder="little").tobytes())
    hidden = pa.Array.from_buffers(pa.string(), 3, [valid, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data.encode())],
                                   null_count=1)
    assert hidden.to_pylist() == ["ab", None, "cd"]
    cases.append(hidden)
    seen = set()
    for c in cases:
        want = all_ascii_reference(c)
        assert all_ascii(c) == want, c
        seen.add(want)
    assert seen == {True, False}


def test_slot_search_is_searchsorted():
    """`_search_slots` (a direct address by the top bits, then steps) gives ``numpy.searchsorted``'s positions: random
    fingerprints, crowded slots (many sharing their top bits, equal ones), the extremes 0 and 2^64 - 1, queries
    before, inside and after the stored ones, and empty sides."""
    from flows.runtime import label_index as li

    rng = np.random.default_rng(23)
    top = np.uint64(2**64 - 1)
    for n in (0, 1, 5, 1000, 70_000):
        fp = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
        if n >= 1000:
            fp[: n // 10] = (fp[: n // 10] & np.uint64(0xFFFF)) | (fp[0] & ~np.uint64(0xFFFF))  # one crowded slot
            fp[n // 10: n // 5] = fp[n // 5: n // 5 + n // 10]  # equal fingerprints
            fp[-2:] = [0, top]
        fp.sort()
        starts = li._slot_starts(fp)
        assert starts[0] == 0 and starts[-1] == n and np.all(np.diff(starts) >= 0)
        q = np.concatenate([fp, fp - np.uint64(1), fp + np.uint64(1),
                            rng.integers(0, 2**64 - 1, 5000, dtype=np.uint64, endpoint=True),
                            np.array([0, 1, top, top - np.uint64(1)], dtype=np.uint64)])
        want = np.searchsorted(fp, q)
        assert np.array_equal(li._search_slots(fp, starts, q), want), n
        assert np.array_equal(li._search_sorted_queries(fp, q), want), n


@pytest.mark.parametrize("case", ["distinct", "colliding", "nfd"])
def test_lookup_rows_by_slots_is_the_reference(case):
    """`LabelIndex.lookup_rows` through the slots gives the rows and stored rows of the binary search it replaced
    (``reference=True``) and of `pyarrow.compute.index_in` against the stored ids: ids sharing a fingerprint
    (stored side by side; a file's id compared with each), ids the store lacks whose fingerprint it holds, NFD
    spellings (the logs' ids in NFC), and a file with no id stored."""
    from flows.runtime.label_index import LabelIndex
    from flows.storage.labels import log_response_ids

    rng = np.random.default_rng(29)
    stored = [f"resp-{i:07d}-{rng.integers(1 << 30)}" for i in range(4000)]
    logged = stored[::3] + [f"other-{i}" for i in range(3000)]
    if case == "colliding":  # ids of one fingerprint (bytes 8-10 are outside the windows read), stored and not
        coll = ["AAAAAAAA" + f"{i:03d}" + "MMMMMMMM" + "qqq" + "ZZZZZZZZ" for i in range(12)]
        stored += coll[:6]
        logged += coll[::2] + coll[1::2]
    if case == "nfd":
        stored += [f"caf\u00e9-{i}" for i in range(50)]
        logged += [unicodedata.normalize("NFD", f"caf\u00e9-{i}") for i in range(0, 80, 2)]
    order = rng.permutation(len(logged))
    logs = pa.table({"response_id": pa.array([logged[i] for i in order], pa.string())})
    labels_t = pa.table({"response_id": pa.array(stored, pa.string()), "oracle_label": rng.random(len(stored)),
                         "label_probability": pa.array(np.full(len(stored), 0.5))})
    index = LabelIndex.build(labels_t)
    assert index.fp is not None
    rid = log_response_ids(logs)
    rows, at = index.lookup_rows(rid)
    ref_rows, ref_at = index.lookup_rows(rid, reference=True)
    assert np.array_equal(rows, ref_rows) and np.array_equal(at, ref_at)
    want = pa.compute.index_in(rid, value_set=index.table.column("response_id")).to_numpy(zero_copy_only=False)
    want = np.where(np.isnan(want.astype(float)), -1, want).astype(np.int64)
    assert np.array_equal(rows, np.flatnonzero(want >= 0)) and np.array_equal(at, want[want >= 0])
    assert rows.size > 1000
    none = index.lookup_rows(pa.chunked_array([pa.array(["nope-1", "nope-2"])]))
    assert none[0].size == 0 and none[1].size == 0


@pytest.mark.parametrize("skip", [0, 3, 6, 32])
def test_repeated_fingerprints_with_skipped_bits_is_the_reference(skip):
    """`repeated_fingerprints` keyed by the 32 bits below the top ``skip`` gives the positions of a sort of the whole
    fingerprints: equal ones within and across parts, ones sharing those 32 bits (not the rest), ones sharing the
    high half only, and fingerprints whose top bits differ (the key is then not the run's: still exact)."""
    from flows.storage import fingerprints

    rng = np.random.default_rng(41 + skip)
    parts = [rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True) for n in (5000, 0, 3000, 8000)]
    if skip:
        top = np.uint64(((1 << skip) - 1) << (64 - skip)) if skip < 64 else np.uint64(0)
        parts = [(a & ~top) | (parts[0][0] & top) for a in parts]  # one run: the top bits equal
    parts[2][7] = parts[0][11]  # across parts
    parts[3][100] = parts[3][2000]  # within a part
    mask = np.uint64(((1 << 32) - 1) << (32 - skip))  # the key's bits
    parts[3][5] = (parts[0][9] & mask) | (~parts[0][9] & ~mask)  # the same key, not the same fingerprint
    parts[3][6] = (parts[0][13] & np.uint64(0xFFFFFFFF00000000)) | np.uint64(12345)  # the same high half
    parts[2][8] = parts[0][17] ^ np.uint64(1 << 63)  # the top bit differs
    whole = np.concatenate(parts)
    want = fingerprints.repeated_fingerprints_reference(whole)
    assert want.size == 4
    assert np.array_equal(fingerprints.repeated_fingerprints(parts, skip_bits=skip), want)
    assert np.array_equal(fingerprints.repeated_fingerprints(whole, skip_bits=skip), want)
    with pytest.raises(ValueError):
        fingerprints.repeated_fingerprints(whole, skip_bits=33)


def test_run_bits_and_pieces_without_them():
    """`run_bits`: the bits that tell the buckets apart plus 6 (64 runs a bucket), at most 24. A bucket's pieces
    (sorted) say the bits in their metadata; pieces without it (runs by `SUB_BITS`) or not in runs at all are
    checked whole: the same repeated fingerprints, by file."""
    from flows.runtime import sharded_ray

    assert [sharded_ray.run_bits(n) for n in (1, 2, 4, 5, 8, 26, 32, 40, 2**18, 2**18 + 1, 2**30)] == \
        [6, 7, 8, 9, 9, 11, 11, 12, 24, 24, 24]
    rng = np.random.default_rng(43)
    files = [rng.integers(0, 2**64 - 1, n, dtype=np.uint64) for n in (3000, 2000, 0)]
    files[1][10] = files[0][3]
    tables = [pa.table({"response_id": pa.array(["r"] * f.size, pa.string()),
                        sharded_ray.FINGERPRINT: pa.array(f, pa.uint64())}) for f in files]
    want = {0: [int(files[0][3])], 1: [int(files[0][3])]}
    for n_buckets in (1, 4, 40):
        buckets = [sharded_ray.response_id_buckets(t, n_buckets, ids=False, places=False) for t in tables]
        b = int(sharded_ray.bucket_of(files[0][3:4], n_buckets)[0])
        assert all(p.schema.metadata[sharded_ray.RUN_BITS_KEY] == str(sharded_ray.run_bits(n_buckets)).encode()
                   for p in (bs[b] for bs in buckets))
        pieces = [bs[b] for bs in buckets]
        assert sharded_ray.check_response_ids(*pieces) == {"candidates": want}
        bare = [p.replace_schema_metadata(None) for p in pieces]  # the bits unknown: `SUB_BITS`, or checked whole
        assert sharded_ray.check_response_ids(*bare) == {"candidates": want}
        shuffled = [p.take(pa.array(rng.permutation(p.num_rows))) if p.num_rows else p for p in pieces]
        assert sharded_ray.check_response_ids(*shuffled) == {"candidates": want}  # not in runs: checked whole
        bits = sharded_ray.run_bits(n_buckets)
        in_runs = []  # in runs by the top bits but not sorted within them: cut by the runs as well
        for p in pieces:
            a = np.asarray(p[sharded_ray.FINGERPRINT].to_numpy())
            order = np.lexsort((rng.permutation(a.size), a >> np.uint64(64 - bits)))
            in_runs.append(p.take(pa.array(order)))
        assert any(p.num_rows > 1 and not np.all(np.diff(p[sharded_ray.FINGERPRINT].to_numpy().astype(float)) >= 0)
                   for p in in_runs)
        assert sharded_ray.check_response_ids(*in_runs) == {"candidates": want}


@pytest.mark.parametrize("n_buckets", [1, 2, 3, 4, 7, 26, 40])
def test_a_files_buckets_are_its_slices_between_the_bucket_starts(n_buckets):
    """`bucket_of` is non-decreasing in the fingerprint and `bucket_starts` gives each bucket's least
    fingerprint, so the buckets of fingerprints alone (`response_id_buckets(..., ids=False, places=False)`: the
    file's fingerprints in order of bucket and run, `bucket_runs`, cut at the starts) hold exactly the fingerprints
    `bucket_of` puts there, at the edges too (0, 2^64 - 1, each start and the fingerprint below it), every one once,
    in runs by their top `run_bits` bits."""
    from flows.runtime import sharded_ray

    starts = sharded_ray.bucket_starts(n_buckets)
    assert starts.size == n_buckets and starts[0] == 0 and np.all(np.diff(starts.astype(object)) > 0)
    edges = np.concatenate([starts[1:], starts[1:] - np.uint64(1)]).astype(np.uint64)
    rng = np.random.default_rng(n_buckets)
    fp = np.concatenate([rng.integers(0, 2**64 - 1, 5000, dtype=np.uint64, endpoint=True), edges,
                         np.array([0, 2**64 - 1], dtype=np.uint64)])
    table = pa.table({"response_id": pa.array(["r"] * fp.size, pa.string()), sharded_ray.FINGERPRINT: pa.array(fp)})
    parts = sharded_ray.response_id_buckets(table, n_buckets, ids=False, places=False)
    assert len(parts) == n_buckets
    got = [np.asarray(p[sharded_ray.FINGERPRINT].to_numpy()) for p in parts]
    assert np.array_equal(np.sort(np.concatenate(got)), np.sort(fp))
    for b, a in enumerate(got):
        top = a >> np.uint64(64 - sharded_ray.run_bits(n_buckets))
        assert np.all(top[1:] >= top[:-1])  # in runs by the top bits
        assert sharded_ray._in_runs(a, np.uint64(64 - sharded_ray.run_bits(n_buckets)))
        assert np.all(sharded_ray.bucket_of(a, n_buckets) == b)
        # the obvious definition, in Python integers: floor(high * n / 2^32)
        assert all(((int(x) >> 32) * n_buckets) >> 32 == b for x in a[:50].tolist() + a[-50:].tolist())


@pytest.mark.parametrize("groups", [[0, 0, 0, 0], ["a", "a", "b", "b"], ["a", "b", "b", "c"], [0, 1, 2, 3],
                                    ["a", "a", "b"], [0, 0, 0, 1, 1, 1], [0, 1, 2, 3, 4]])
def test_a_readers_buckets_of_a_node_in_one_object_check_as_one_a_bucket(groups):
    """A reader ships the buckets of one check node as one object (`response_id_buckets`' ``groups``, a slice of
    its sorted fingerprints between the groups' first and last buckets' starts, `bucket_spans`), and each bucket's
    check takes its own part of it (`check_response_ids`' ``bucket``): the same candidates, bucket by bucket, as
    one object a bucket; a group's part is its buckets' parts joined; the part of a piece not marked sorted is
    found by `bucket_of` (the same fingerprints); groups whose buckets are not consecutive are refused. Bucket
    counts not a power of two too (a bucket's bounds inside a run of `bucket_runs`), a repeated id at a bound."""
    from flows.runtime import sharded_ray

    n_buckets = len(groups)
    rng = np.random.default_rng(61)
    files = [rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True) for n in (4000, 2500, 0, 3000)]
    edges = sharded_ray.bucket_starts(n_buckets)[1:]
    files[0][:edges.size], files[0][edges.size:2 * edges.size] = edges, edges - np.uint64(1)  # at the bounds
    files[1][7], files[3][5], files[3][9] = files[0][11], files[0][2], files[0][2]  # repeats across and within
    tables = [pa.table({"response_id": pa.array(["r"] * f.size, pa.string()),
                        sharded_ray.FINGERPRINT: pa.array(f, pa.uint64())}) for f in files]
    spans, of_bucket = sharded_ray.bucket_spans(groups)
    assert [b for a, z in spans for b in range(a, z)] == list(range(n_buckets))
    assert all(spans[of_bucket[b]][0] <= b < spans[of_bucket[b]][1] for b in range(n_buckets))
    plain = [sharded_ray.response_id_buckets(t, n_buckets, ids=False, places=False) for t in tables]
    grouped = [sharded_ray.response_id_buckets(t, n_buckets, ids=False, places=False, groups=groups) for t in tables]
    assert all(len(g) == len(spans) for g in grouped)
    for g, p in zip(grouped, plain):
        for (a, z), obj in zip(spans, g):
            assert np.array_equal(obj.column(0).to_numpy(), pa.concat_tables(p[a:z]).column(0).to_numpy())
    found = []
    for b in range(n_buckets):
        want = sharded_ray.check_response_ids(*[p[b] for p in plain])
        got = sharded_ray.check_response_ids(*[g[of_bucket[b]] for g in grouped], bucket=(b, n_buckets))
        unsorted = [g[of_bucket[b]].replace_schema_metadata(None) for g in grouped]
        unsorted = [t.take(pa.array(rng.permutation(t.num_rows))) for t in unsorted]
        assert got == want == sharded_ray.check_response_ids(*unsorted, bucket=(b, n_buckets))
        found += [] if got is None else sorted(got["candidates"].items())
    cands = {}
    for f, v in found:
        cands.setdefault(f, set()).update(v)
    assert cands == {0: {int(files[0][11]), int(files[0][2])}, 1: {int(files[0][11])}, 3: {int(files[0][2])}}
    with pytest.raises(ValueError, match="not consecutive"):
        sharded_ray.bucket_spans(["a", "b", "a"])
    with pytest.raises(ValueError, match="bucket 4 not in"):
        sharded_ray.check_response_ids(*grouped[0], bucket=(4, 4))
    with pytest.raises(ValueError, match="fingerprints alone"):  # buckets with ids or places are one a bucket
        sharded_ray.response_id_buckets(tables[0], n_buckets, ids=False, groups=groups)


@pytest.mark.parametrize("n_buckets", [1, 2, 3, 4, 5, 7, 8, 26, 31, 32, 33, 40, 64])
def test_bucket_runs_is_a_stable_sort_by_bucket_and_run(n_buckets):
    """`flows.runtime.sharded_ray.bucket_runs` (a radix order of a 16-bit key, or ``numpy.sort`` above 32 buckets)
    against the obvious order: a stable lexicographic sort by (bucket, top `run_bits` bits), the file's order kept
    within a run; a sort where it sorts. Ties of fingerprints and the buckets' edges included."""
    from flows.runtime import sharded_ray

    rng = np.random.default_rng(100 + n_buckets)
    starts = sharded_ray.bucket_starts(n_buckets)
    fp = np.concatenate([rng.integers(0, 2**64 - 1, 20000, dtype=np.uint64, endpoint=True), starts,
                         starts[1:] - np.uint64(1), np.array([0, 2**64 - 1, 7, 7], dtype=np.uint64)])
    rng.shuffle(fp)
    got = sharded_ray.bucket_runs(fp, n_buckets)
    bits = sharded_ray.run_bits(n_buckets)
    run = fp >> np.uint64(64 - bits)
    want = fp[np.lexsort((run, sharded_ray.bucket_of(fp, n_buckets)))]
    if ((n_buckets - 1) << bits) >> 16:
        want = np.sort(fp)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 65536, 400_000])
def test_radix_sort_uint32_is_numpy_sort(n):
    """`flows.storage.fingerprints.radix_sort_uint32` (two stable passes of 16-bit halves) gives ``numpy.sort``'s
    array: random values with repeats, the extremes, and values equal in one half only."""
    from flows.storage.fingerprints import radix_sort_uint32

    rng = np.random.default_rng(n)
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    if n > 16:
        a[:8] = [0, 2**32 - 1, 0xFFFF, 0x10000, 0xFFFF0000, 0x0000FFFF, a[9], a[9]]
        a[10:n // 2] = a[10:n // 2] & np.uint32(0xFFFF0000)  # ties in the high half: the low pass decides
    got = radix_sort_uint32(a)
    assert got.dtype == np.uint32 and np.array_equal(got, np.sort(a))
    assert got is not a
