"""The label store's labels as a probe index, built once a run on a Ray worker (issue 29).

`flows.storage.labels.join_labels` groups every label of the store and hashes every stored id at each call:
the sharded row pass joins every log file, so at 5M labels each 1M-row file paid ~3.9 s of CPU for a join
whose rows are the file's. `LabelIndex` does the label-store side once: the first label of each id
(`flows.storage.labels.first_labels`: lowest version, then row order; conflicts flagged; ids in NFC) sorted by
the ids' 64-bit fingerprint (`flows.storage.fingerprints.id_fingerprint`; a store in which no id repeats, told by one
sort of those fingerprints, skips `first_labels`' grouping: every row is then its id's first). A file then probes it with its own
ids (`LabelIndex.lookup_rows`: each id's fingerprint found through the slot of its top bits, `_search_slots`, then
a string comparison of the few ids whose fingerprint is found), so its join costs in proportion to the file (the
reader's fingerprints of its ids taken when it has them: `LabelIndex.join`), and `LabelIndex.join` fills the labels
at the joined rows with `flows.storage.labels.fill_store_labels_at` (`fill_store_labels`, the code `join_labels`
uses, of those rows): the same rows, labels, conflicts and join counts.

A fingerprint is not a hash of every byte (ids equal in length and in the three 8-byte windows it reads share
one): ids of the store sharing a fingerprint sit side by side in the index and a probe compares the file's id
with each of them. Past `MAX_SHARED` ids to a fingerprint the index probes with an exact hash of the stored ids
instead (`pyarrow.compute.index_in`, the per-file cost of `join_labels`): the same numbers, slower, and logged.

`submit_label_index` reads the store and builds the index in a Ray task (`build_label_index`) without waiting for
it (`PendingLabelIndex`): the flow submits it as the sharded pass starts, the readers sample the prompt ids
meanwhile, and every reader takes the index's reference as an argument (Ray starts it once the index is built). The
index stays in the cluster's object store; the flow's driver holds its reference and the store's counts, never the
labels. A reader's probe tests a bit set of the stored fingerprints' top bits first (`filter_bits`), so only the ids
the store may hold are searched.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cje_engine.data.columns import one_chunk
from cje_engine.data.strings import all_ascii
from cje_engine.errors import CJEInputError
from flows.runtime.sharded_ray import id_fingerprint
from flows.storage.labels import (fill_store_labels, fill_store_labels_at, fingerprint_order, first_labels,
                                  log_response_ids_nfc)

log = logging.getLogger(__name__)

#: Most stored ids sharing one fingerprint for which the index probes by fingerprint (beyond: an exact hash).
MAX_SHARED = 8


class LabelIndex:
    """The first label of every stored ``response_id``, sorted by the ids' fingerprints, probed by a file's ids.

    Build it with `LabelIndex.build`; ``table`` has `flows.storage.labels.first_labels`' columns (one row per
    NFC id), ``fp`` the sorted fingerprints of its ids (None when the index probes by exact hash, see the module
    docstring) and ``shared`` the most ids sharing a fingerprint; ``bits``: a bit set of the fingerprints' top
    bits (`filter_bits`; None: none), which lets `lookup` search only the ids that may be stored; ``rows``: the
    row of ``table`` of each sorted fingerprint (None: ``table`` is in the fingerprints' order). Since round 22
    the table is not put in that order (a gather of every stored row, ~1 s of the build's ~2.2 s at 5M labels):
    `lookup_rows` maps the fingerprints it finds to their rows.
    """

    def __init__(self, table: pa.Table, fp: np.ndarray | None, shared: int, bits: np.ndarray | None = None,
                 rows: np.ndarray | None = None) -> None:
        self.table = table
        self.fp = fp
        self.shared = int(shared)
        self.bits = bits if fp is not None else None
        self.starts = None if fp is None else _slot_starts(fp)
        self.rows = rows if fp is not None else None

    def __repr__(self) -> str:
        how = "exact hash" if self.fp is None else f"fingerprints, at most {self.shared} a fingerprint"
        return f"LabelIndex({self.table.num_rows} ids, {how})"

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays."""
        return int(self.table.nbytes + sum(0 if a is None else a.nbytes for a in (self.fp, self.bits, self.starts,
                                                                                   self.rows)))

    def _may_hold(self, q: np.ndarray) -> np.ndarray:
        """Positions of the fingerprints ``q`` whose bit is set in ``bits``: every stored one among them (no false
        negative), and ~1 - exp(-ids / bits) of the others."""
        if self.bits is None:
            return np.arange(len(q))
        if not (np.little_endian and self.bits.dtype.isnative):
            return self._may_hold_reference(q)
        # bit ``top`` of the set is bit ``top & 7`` of its byte ``top >> 3`` (little-endian words): a gather of bytes
        # and byte-wide shifts (~40% less CPU than of words; `_may_hold_reference`); ``top`` shifted once (its low
        # byte the bit's), the bytes gathered by `numpy.take` and their 0/1 searched as booleans (`numpy.flatnonzero`
        # of uint8 costs ~10x that of bool): ~half the CPU of the gather by indexing and the search of bytes
        top = q >> np.uint64(64 - _log2(self.bits.size * 64))
        bit = top.astype(np.uint8)
        top >>= np.uint64(3)
        byte = np.take(self.bits.view(np.uint8), top.view(np.int64))
        bit &= np.uint8(7)
        byte >>= bit
        byte &= np.uint8(1)
        return np.flatnonzero(byte.view(bool))

    def _may_hold_reference(self, q: np.ndarray) -> np.ndarray:
        """`_may_hold` word by word (the code it replaced; the tests' reference)."""
        if self.bits is None:
            return np.arange(len(q))
        top = q >> np.uint64(64 - _log2(self.bits.size * 64))
        word = self.bits[(top >> np.uint64(6)).astype(np.int64)]
        return np.flatnonzero((word >> (top & np.uint64(63))) & np.uint64(1))

    @classmethod
    def build(cls, label_table: pa.Table, sorted_fp: Any = None, reference: bool = False) -> "LabelIndex":
        """The index of a label table (`flows.storage.labels.LabelStore.read`'s columns; ``flagged`` optional).

        ``sorted_fp``: the `flows.storage.labels.SortedFingerprints` of the table's ids when the caller has them
        (`flows.storage.labels.LabelStore.read_sorted`: not computed again). The fingerprints are ordered by
        `flows.storage.labels.fingerprint_order` (the stable argsort's order) and the bit set built by runs of
        its words (`_bit_set`); ``reference``: as first written (a stable argsort, `numpy.bitwise_or.at`, the
        table put in the fingerprints' order, as it still is where ids share a fingerprint). The same labels.
        Raises `CJEInputError` when a label column is missing (`flows.storage.labels.first_labels`).
        """
        for col in ("response_id", "oracle_label", "label_probability"):
            if col not in label_table.column_names:
                raise CJEInputError(f"label table lacks column {col!r}", column=col)
        stored = label_table.column("response_id")
        stored = stored if pa.types.is_string(stored.type) else stored.cast(pa.string())
        sort = _sorted_fingerprints_reference if reference else _sorted_fingerprints
        if sorted_fp is not None and not reference:
            if len(sorted_fp.fp) != len(stored):
                raise ValueError("sorted fingerprints of another table")
            fp, order = sorted_fp.fp, sorted_fp.order
        else:
            fp, order = sort(stored)
        first = None
        if _longest_run(fp) <= 1:
            # no fingerprint twice: no id twice, every row is its id's first label (`first_labels` skips its
            # grouping: 4.1 s of the build's 9.5 at 5M labels)
            first = first_labels(label_table, distinct=True)
            if not all_ascii(stored):  # else the ids in NFC are ``stored``
                fp, order = sort(first.column("response_id"))
                if _longest_run(fp) > 1:  # two spellings of one id (or ids sharing a fingerprint): grouped, so
                    first = None  # that the spelling used is the one the grouping keeps first
        if first is None:
            first = first_labels(label_table)
            fp, order = sort(first.column("response_id"))
        # distinct fingerprints: the sorted table is the same whatever the order of ``first`` (the grouping's is
        # Arrow's hash order, not always the rows')
        shared = _longest_run(fp)
        if shared > MAX_SHARED:
            log.warning("label index: up to %d stored response ids share a fingerprint; the files' labels are "
                        "joined by an exact hash of the %d stored ids instead (slower, same labels)", shared,
                        first.num_rows)
            return cls(first, None, shared)
        if shared <= 1 and not reference:  # the table in its order, each fingerprint's row beside it
            return cls(_compact(first), fp, shared, _bit_set(fp), rows=order)
        table = first.take(pa.array(order))
        if shared > 1:  # two spellings of one id (stored before ids were normalised): the first is the one used
            dup = _repeated_in_runs(table.column("response_id"), fp, shared)
            if dup.any():
                keep = np.flatnonzero(~dup)
                table, fp = table.take(pa.array(keep)), fp[keep]
                shared = _longest_run(fp)
        return cls(table, fp, shared, _bit_set_reference(fp) if reference else _bit_set(fp))

    def lookup(self, rid: pa.ChunkedArray | pa.Array, fp: np.ndarray | None = None) -> pa.Array:
        """For each id of ``rid`` (strings in NFC, `flows.storage.labels.log_response_ids`): its row of
        ``table``, or null where the store has no label for it (as `pyarrow.compute.index_in` against the
        stored ids). ``fp``: the ids' `flows.storage.fingerprints.id_fingerprint` when the caller has it (None:
        computed here)."""
        if self.fp is None:
            return pc.index_in(rid, value_set=self.table.column("response_id"))
        rows, at = self.lookup_rows(rid, fp)
        out = np.full(len(rid), -1, dtype=np.int64)
        out[rows] = at
        return pa.array(out, mask=out < 0)

    def lookup_rows(self, rid: pa.ChunkedArray | pa.Array, fp: np.ndarray | None = None,
                    reference: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """`lookup` as ``(rows, at)``: the rows of ``rid`` (increasing) whose id the store holds and their rows of
        ``table`` (the index probed by fingerprint; not for an index by exact hash, ``fp`` None). The fingerprints
        the bit set passes are found in the sorted ones through the slot of their top bits (`starts`: a direct
        address, then a step or two), not by a binary search of each; ``reference``: by the binary search, the
        queries sorted first (the code it replaced). The same rows."""
        ids = self.table.column("response_id")
        n = len(self.fp)
        q = id_fingerprint(rid) if fp is None else fp
        empty = np.empty(0, dtype=np.int64)
        if n == 0 or len(q) == 0:
            return empty, empty
        # only the ids whose bit is set are searched (the stored ones and a few others: 1M ids of a file with 5%
        # labelled against 5M stored, ~8% searched; the bit test 0.014 s against 0.12 s of sort and search of all)
        cand = self._may_hold(q)
        qc = q[cand]
        pos = (_search_sorted_queries(self.fp, qc) if reference or self.starts is None
               else _search_slots(self.fp, self.starts, qc))
        found = np.flatnonzero(pos < n)
        found = found[self.fp[pos[found]] == qc[found]]  # ids whose fingerprint is stored: compare the strings
        rows, at = cand[found], pos[found]
        hit_rows, hit_at = [], []
        for _ in range(self.shared):
            if rows.size == 0:
                break
            stored = at if self.rows is None else self.rows[at]  # the table's rows of the fingerprints found
            same = pc.fill_null(pc.equal(_take_rows(rid, rows), pc.take(ids, pa.array(stored))), False)
            same = np.asarray(same.to_numpy(zero_copy_only=False), dtype=bool)
            hit_rows.append(rows[same])
            hit_at.append(stored[same])
            rows, at = rows[~same], at[~same] + 1  # the next stored id of the same fingerprint, if any
            more = at < n
            rows, at = rows[more], at[more]
            more = self.fp[at] == q[rows]
            rows, at = rows[more], at[more]
        if not hit_rows:
            return empty, empty
        rows, at = np.concatenate(hit_rows), np.concatenate(hit_at)
        if len(hit_rows) > 1:  # a row is found once: in order of the rows
            order = np.argsort(rows, kind="stable")
            rows, at = rows[order], at[order]
        return rows, at

    def join(self, logs_table: pa.Table) -> pa.Table:
        """`flows.storage.labels.join_labels` of the logs against the labels this index was built from: the same
        table (rows in order, labels, ``label_conflict``) and the same join counts in its schema metadata.

        A `flows.runtime.sharded_ray.FINGERPRINT` column of the logs (`flows.runtime.sharded_ray.split_file` puts
        it: the `flows.storage.fingerprints.id_fingerprint` of each row's ``response_id`` as read, which the
        response-id check uses too) is taken as the ids' fingerprints when NFC leaves the ids as they are (a file's
        ids fingerprinted once, not twice)."""
        from flows.runtime.sharded_ray import FINGERPRINT

        rid, changed = log_response_ids_nfc(logs_table)
        fp = None
        if not changed and FINGERPRINT in logs_table.column_names:
            fp = np.asarray(one_chunk(logs_table.column(FINGERPRINT)).to_numpy(), dtype=np.uint64)  # no copy
        if self.fp is None:
            return fill_store_labels(logs_table, self.lookup(rid, fp), self.table)
        rows, at = self.lookup_rows(rid, fp)
        return fill_store_labels_at(logs_table, rows, at, self.table)


def _compact(table: pa.Table) -> pa.Table:
    """``table`` in one chunk a column of buffers of its own (a copy in order, not a gather): the store's read is in
    chunks that are slices of larger buffers (one an object), each of which pickling (Ray's put) would ship whole
    (1.6 GB for a 0.26 GB table of 5M labels in 39 chunks)."""
    return pa.table({name: pa.concat_arrays([pa.array([], col.type), *col.chunks]) for name, col in
                     zip(table.column_names, table.columns)}, schema=table.schema)


def _take_rows(col: pa.ChunkedArray | pa.Array, rows: np.ndarray) -> pa.Array | pa.ChunkedArray:
    """``pyarrow.compute.take(col, rows)`` (its values): of a column in chunks (a file as read, in batches) and
    ``rows`` increasing, each chunk's rows taken from it, in one array (Arrow's take of a chunked column concatenates
    its chunks first: ~2.4x the CPU at 50k rows of 1M)."""
    if not isinstance(col, pa.ChunkedArray) or col.num_chunks < 2 or (rows.size and (
            rows[0] < 0 or rows[-1] >= len(col) or bool(np.any(rows[1:] < rows[:-1])))):
        return pc.take(col, pa.array(rows))
    starts = np.concatenate([[0], np.cumsum([len(c) for c in col.chunks])])
    cut = np.searchsorted(rows, starts)
    parts = [pc.take(c, pa.array(rows[cut[j]:cut[j + 1]] - starts[j])) for j, c in enumerate(col.chunks)
             if cut[j + 1] > cut[j]]
    return pa.concat_arrays(parts) if parts else pa.array([], col.type)


#: Bits of `LabelIndex.bits` a stored id, at least (a power of two of them): a file's id not stored passes the bit
#: test with a probability of ~1 - exp(-1/16) = 6% at most.
BITS_PER_ID = 16


def filter_bits(n_ids: int) -> int:
    """Bits of the bit set of an index of ``n_ids`` ids: a power of two, at least `BITS_PER_ID` a stored id,
    between 2^12 and 2^34 (2 GiB)."""
    return 1 << int(min(34, max(12, math.ceil(math.log2(max(1, BITS_PER_ID * n_ids))))))


def _log2(n: int) -> int:
    return int(n).bit_length() - 1


def _bit_set(sorted_fp: np.ndarray) -> np.ndarray:
    """The bit set of the fingerprints' top bits (`filter_bits` of them; as uint64 words). The fingerprints are
    sorted, so are their words: each run of one word's bits OR-ed at once (`numpy.bitwise_or.reduceat`), one
    store a word (`_bit_set_reference`: `numpy.bitwise_or.at`, one unbuffered update a fingerprint, ~10x the
    CPU); the same words."""
    nbits = filter_bits(sorted_fp.size)
    words = np.zeros(nbits // 64, dtype=np.uint64)
    if sorted_fp.size == 0:
        return words
    top = sorted_fp >> np.uint64(64 - _log2(nbits))
    word = (top >> np.uint64(6)).astype(np.int64)
    if np.any(word[1:] < word[:-1]):  # not sorted after all: the reference's update a fingerprint
        return _bit_set_reference(sorted_fp)
    starts = np.flatnonzero(np.concatenate([[True], word[1:] != word[:-1]]))
    words[word[starts]] = np.bitwise_or.reduceat(np.uint64(1) << (top & np.uint64(63)), starts)
    return words


def _bit_set_reference(sorted_fp: np.ndarray) -> np.ndarray:
    """`_bit_set` as first written (one `numpy.bitwise_or.at` update a fingerprint): its reference."""
    nbits = filter_bits(sorted_fp.size)
    words = np.zeros(nbits // 64, dtype=np.uint64)
    top = sorted_fp >> np.uint64(64 - _log2(nbits))
    np.bitwise_or.at(words, (top >> np.uint64(6)).astype(np.int64), np.uint64(1) << (top & np.uint64(63)))
    return words


def _slot_bits(n: int) -> int:
    """Bits of a fingerprint's slot in `_slot_starts`: ~1 sorted fingerprint a slot (2^floor(log2 n), at least 2^4,
    at most 2^30)."""
    return int(min(30, max(4, _log2(max(1, n)))))


def _slot_starts(sorted_fp: np.ndarray) -> np.ndarray:
    """Where each slot's fingerprints start in the sorted ones: ``starts[s]`` is the first position whose top
    `_slot_bits` bits are at least ``s`` (``2^bits + 1`` entries, the last one ``len(sorted_fp)``; int32 below 2^31
    fingerprints)."""
    bits = _slot_bits(sorted_fp.size)
    counts = np.bincount((sorted_fp >> np.uint64(64 - bits)).astype(np.int64), minlength=1 << bits)
    starts = np.zeros((1 << bits) + 1, dtype=np.int32 if sorted_fp.size < 2**31 else np.int64)
    np.cumsum(counts, out=starts[1:])
    return starts


def _search_slots(sorted_fp: np.ndarray, starts: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``numpy.searchsorted(sorted_fp, q)`` (the first position whose fingerprint is at least the query's) through the
    slots of `_slot_starts`: every fingerprint before a query's slot is smaller, every one after it larger, so the
    position is in the slot or just past it: a direct address, then a step while the slot's fingerprint is smaller
    (~1 a slot). The same positions as `_search_sorted_queries`."""
    bits = _log2(starts.size - 1)
    slot = (q >> np.uint64(64 - bits)).astype(np.int64)
    pos = starts[slot].astype(np.int64)
    end = starts[slot + 1].astype(np.int64)
    todo = np.flatnonzero(pos < end)
    while todo.size:
        p = pos[todo]
        todo = todo[sorted_fp[p] < q[todo]]  # still smaller: the next one of the slot
        pos[todo] += 1
        todo = todo[pos[todo] < end[todo]]
    return pos


def _search_sorted_queries(sorted_fp: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``numpy.searchsorted(sorted_fp, q)`` with the queries sorted first (a binary search of sorted keys walks the
    index in order: in the file's order, each search misses the cache): `_search_slots`' reference."""
    order = np.argsort(q)
    pos = np.empty(len(q), dtype=np.int64)
    pos[order] = np.searchsorted(sorted_fp, q[order])
    return pos


def _sorted_fingerprints(ids: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(the ids' fingerprints sorted, the order that sorts them); equal fingerprints keep the ids' order
    (`flows.storage.labels.fingerprint_order`: the stable argsort's order by a sort of values)."""
    fp = id_fingerprint(ids)
    order = fingerprint_order(fp)
    return fp[order], order


def _sorted_fingerprints_reference(ids: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """`_sorted_fingerprints` by a stable sort alone: its reference."""
    fp = id_fingerprint(ids)
    order = np.argsort(fp, kind="stable")
    return fp[order], order


def _longest_run(sorted_fp: np.ndarray) -> int:
    """The most equal values in a row of a sorted array (0 when it is empty)."""
    if sorted_fp.size == 0:
        return 0
    starts = np.flatnonzero(np.concatenate([[True], sorted_fp[1:] != sorted_fp[:-1], [True]]))
    return int(np.diff(starts).max())


def _repeated_in_runs(ids: pa.ChunkedArray, sorted_fp: np.ndarray, shared: int) -> np.ndarray:
    """True where an id equals an earlier id of its run of equal fingerprints (runs at most ``shared`` long)."""
    n = len(sorted_fp)
    dup = np.zeros(n, dtype=bool)
    for k in range(1, shared):
        i = np.flatnonzero(sorted_fp[k:] == sorted_fp[:-k]) + k  # i and i - k in one run
        if i.size == 0:
            break
        same = pc.equal(pc.take(ids, pa.array(i)), pc.take(ids, pa.array(i - k)))
        dup[i[np.asarray(same.to_numpy(zero_copy_only=False), dtype=bool)]] = True
    return dup


def build_label_index(labels_uri: str, cfg_dict: dict, delays: Sequence[float] = (), reference: bool = False
                      ) -> tuple[LabelIndex | None, dict]:
    """Read the label store under ``labels_uri`` at its current version (every object verified,
    `flows.storage.labels.LabelStore.read`) and index it: ``(index, info)``, the index None for an empty store;
    ``info``: ``labels_uri``, ``label_store_version``, ``n_label_rows``, ``n_flagged`` (the flow's lineage), and
    the build's ``index_bytes``, ``build_s`` and ``build_cpu_s`` (this process's CPU).

    ``delays``: a storage failure (anything but bad data, `CJEInputError`, or an exception marked
    ``retryable = False``) is retried after each of these pauses (seconds), as the flow's storage tasks are
    (`flows.runtime.retries`); the last one is raised. The ids' fingerprints are computed and sorted once, by the
    store's read (`flows.storage.labels.LabelStore.current_sorted`), and reused by the index; ``reference``: the
    read and the build as first written (each computes them). The same index."""
    from flows.storage.labels import LabelStore
    from flows.storage.objects import Storage, StorageConfig

    t0, c0 = time.perf_counter(), time.process_time()
    for attempt, pause in enumerate([*delays, None]):
        try:
            labels, info, fps = LabelStore(Storage.for_uri(labels_uri, StorageConfig.from_dict(cfg_dict))
                                           ).current_sorted(labels_uri, reference=reference)
            break
        except Exception as exc:  # noqa: BLE001 - retried unless final (`flows.runtime.retries.is_retryable`)
            # imported here: `flows.runtime.retries` imports Prefect, which a Ray worker that joins a file's labels
            # never needs (~1 s of CPU a fresh worker)
            from flows.runtime.retries import is_retryable

            if pause is None or not is_retryable(exc):
                raise
            log.warning("label store %s: %s; retry %d of %d in %g s", labels_uri, exc, attempt + 1, len(delays),
                        pause)
            time.sleep(pause)
    index = None if labels is None else LabelIndex.build(labels, fps, reference=reference)
    del labels, fps
    info.update(index_bytes=0 if index is None else index.nbytes, build_s=round(time.perf_counter() - t0, 3),
                build_cpu_s=round(time.process_time() - c0, 3))
    return index, info


#: Keys of `build_label_index`'s info that describe the build, not the labels (the flow logs them; not lineage).
BUILD_KEYS = ("index_bytes", "build_s", "build_cpu_s")

#: Bytes of task memory a label index build asks Ray for a label row of the store: the objects' bytes, their
#: decoded and verified table (`LabelStore.read`: the content hash's IPC copy, the version and flag columns), the
#: first labels (`first_labels`), the fingerprints and their order and the index's sorted copy; measured peak
#: 317-329 B a label row over the process's baseline at 5M labels (1.63-1.68 GiB; `benchmarks/RESULTS.md`, "The
#: flow around the engine"), rounded up.
INDEX_BYTES_PER_LABEL = 384


def index_task_memory(label_rows: int) -> int:
    """Bytes the label index's task asks Ray for (`submit_label_index`): 64 MiB plus `INDEX_BYTES_PER_LABEL` a
    label row of the store (its committed rows: `flows.storage.labels.LabelStore.committed_rows`)."""
    return int(64 * 2**20 + INDEX_BYTES_PER_LABEL * max(0, int(label_rows)))


class PendingLabelIndex:
    """The label index of a run, its build submitted to Ray and not awaited (`submit_label_index`).

    ``ref``: the reference of the `LabelIndex` (None when there is no build: an empty store), which every reader
    takes as an argument, so Ray starts a reader only once the index is built (and fails it with the build's
    error); `info` waits for the build and returns its information, raising the build's own error (a damaged
    label store: `CJEInputError` naming the object) as itself.
    """

    def __init__(self, ref: Any, info_ref: Any = None, info: dict | None = None) -> None:
        self.ref = ref
        self._info_ref = info_ref
        self._info = info

    def __repr__(self) -> str:
        return f"PendingLabelIndex({'built' if self._info is not None else 'building'})"

    def info(self) -> dict:
        """The build's information (`build_label_index`), once it is done; raises its error as itself."""
        if self._info is None:
            import ray
            from ray.exceptions import RayTaskError

            from flows.runtime.ray_fanout import task_error_cause
            from flows.runtime.timeouts import ray_get_timeout

            try:
                self._info = ray.get(self._info_ref, timeout=ray_get_timeout())
            except RayTaskError as exc:
                cause = task_error_cause(exc)
                if cause is not None:
                    raise cause from None
                raise
            if not self._info["label_store_version"]:
                self.ref = None  # the store was emptied or never written: the readers got None
        return dict(self._info)


def submit_label_index(labels_uri: str, cfg_dict: dict, label_rows: int | None = None, delays: Sequence[float] = (),
                       max_retries: int = 3) -> PendingLabelIndex:
    """`build_label_index` submitted as a Ray task, not awaited: the index stays in the cluster's object store (a
    read task takes its reference as an argument, Ray waits for it there); only its info reaches this process,
    when `PendingLabelIndex.info` is called. ``label_rows``: the store's committed rows, for the task's memory
    request (`index_task_memory`; None: no request). A worker lost mid-task is retried by Ray; a storage failure
    within the task after each of ``delays``."""
    import ray

    opts: dict[str, Any] = dict(num_returns=2, max_retries=max_retries, retry_exceptions=False,
                                name="cje_label_index")
    if label_rows is not None:
        opts["memory"] = index_task_memory(label_rows)
    index_ref, info_ref = ray.remote(build_label_index).options(**opts).remote(labels_uri, cfg_dict, tuple(delays))
    return PendingLabelIndex(index_ref, info_ref)

