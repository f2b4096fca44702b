"""Append-only store of oracle labels, keyed by ``response_id`` and joined to logs at evaluation time.

Labels arrive after the logs (people or an expensive judge label a sample later), so they are
kept apart from the logs and never rewrite them.  Layout under the storage root::

    labels/v000001-<sha16>.parquet      one immutable object per append (data)
    labels/v000002-<sha16>.parquet
    labels/_commits/v000001.json        commit record of version 1 (created last)
    labels/_commits/v000002.json
    labels/_reevaluated/v000002.json    written once the re-evaluation that version 2 called for completed

An append (1) hashes its normalised content (sha256 over the rows sorted by
``(response_id, oracle_label, label_probability)``, duplicates removed); (2) returns the existing
version if a committed version has the same hash (idempotent re-ingest); (3) creates the data
object ``labels/v{N:06d}-{sha16}.parquet`` with `Storage.put_if_absent` where ``N`` is the
number of committed versions plus one; and (4) commits by creating ``labels/_commits/v{N:06d}.json``
with `Storage.put_if_absent`.  The commit key depends on ``N`` only, so of two concurrent
appends exactly one gets version ``N``; the other removes its data object and retries with
``N + 1`` (or, if its content turns out to be the winner's, returns the winner's version).
Data objects without a commit record (a writer that died between steps 3 and 4) are ignored.
The version is the number of committed objects; versions are contiguous.

Integrity: the commit record holds ``sha256`` (of the content, its first 16 digits in the object's
name), ``rows``, and ``object_sha256`` / ``object_bytes`` (of the object's bytes).  `LabelStore.read`
(every read that feeds an evaluation) verifies each object against its record before using a row;
a swapped object (another valid label table), a changed byte, or a truncated or inconsistent
commit record is a `CJEInputError` naming the object or record (exit 2), never used.  Records
written before ``object_sha256`` existed are verified by their content hash and row count.

Reading: `LabelStore.read` returns every committed row with its ``version`` and a ``flagged``
column.  Identical rows repeated across versions are kept once (earliest version).  A
``response_id`` with two different labels (value or probability) is a *conflict*: all its rows
are kept and flagged.  `join_labels` uses the first label (lowest version, then row order) for
a conflicting id and marks the row in a ``label_conflict`` column, so the conflict is visible
downstream instead of being silently resolved.

Labels written inline in the logs (an ``oracle_label`` column) and labels in the store are
*combined*: a row keeps its inline label unless the store has one for its ``response_id``, in
which case the store's wins; rows where both exist and differ are counted (``cje.inline_overridden``
in the joined table's schema metadata) and logged.  `inline_label_columns` tells a reader which
label columns the log files carry, so that a projected read keeps them.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cje_engine.data.io import canonical_id_array
from cje_engine.data.strings import all_ascii
from cje_engine.errors import CJEInputError

from flows.storage.arrow_threads import read_parquet_bytes
from flows.storage.fingerprints import ids_distinct
from flows.storage.logs import column_kind, log_renames
from flows.storage.objects import NotFoundError, Storage, StorageError

log = logging.getLogger(__name__)

LABEL_SCHEMA = pa.schema([
    ("response_id", pa.string()),
    ("oracle_label", pa.float64()),
    ("label_probability", pa.float64()),
])
READ_SCHEMA = pa.schema(list(LABEL_SCHEMA) + [("version", pa.int64()), ("flagged", pa.bool_())])
_DATA_RE = re.compile(r"^v(\d{6})-([0-9a-f]{16})\.parquet$")
_COMMIT_RE = re.compile(r"^v(\d{6})\.json$")
_MAX_RACES = 50



def normalize_labels(table: pa.Table, source: str) -> pa.Table:
    """Validate a label table and return it in `LABEL_SCHEMA` (sorted, exact duplicates removed).

    ``response_id`` (string or integer, non-null) and ``oracle_label`` (number, non-null, finite)
    are required; ``label_probability`` (number in (0, 1], null allowed) is optional.
    """
    if not isinstance(table, pa.Table):
        try:
            table = pa.Table.from_pandas(table, preserve_index=False)
        except Exception:
            raise CJEInputError(f"labels must be a pyarrow Table or pandas DataFrame, got {type(table).__name__}",
                                source=source) from None
    names = table.column_names
    for col, kinds in (("response_id", ("string", "integer")), ("oracle_label", ("float", "integer", "boolean"))):
        if col not in names:
            raise CJEInputError(f"required label column is missing (found {names})", source=source, column=col)
        if column_kind(table.schema.field(col).type) not in kinds:
            raise CJEInputError(f"has type {table.schema.field(col).type}, expected "
                                f"{'a string' if col == 'response_id' else 'a number'}", source=source, column=col)
    if "label_probability" in names and column_kind(table.schema.field("label_probability").type) not in (
            "float", "integer", "null"):
        raise CJEInputError(f"has type {table.schema.field('label_probability').type}, expected a number",
                            source=source, column="label_probability")
    if table.num_rows == 0:
        raise CJEInputError("no labels to append (empty table)", source=source)

    def col(name: str, typ: pa.DataType) -> pa.ChunkedArray:
        arr = table.column(name)
        if pa.types.is_dictionary(arr.type):
            arr = arr.cast(arr.type.value_type)
        return arr.cast(typ)

    rid = canonical_id_array(col("response_id", pa.string()), source, "response_id")  # NFC, as the engine reads ids
    label = col("oracle_label", pa.float64())
    prob = (col("label_probability", pa.float64()) if "label_probability" in names
            else pa.chunked_array([pa.nulls(table.num_rows, pa.float64())]))
    for name, arr in (("response_id", rid), ("oracle_label", label)):
        if arr.null_count:
            raise CJEInputError("is null; every label row needs it", source=source, column=name,
                                row=pc.index(pc.is_null(arr), True).as_py())
    lab = label.to_numpy()
    bad = ~np.isfinite(lab)
    if bad.any():
        raise CJEInputError(f"value {lab[bad][0]} is not a finite number", source=source, column="oracle_label",
                            row=int(np.flatnonzero(bad)[0]))
    p = prob.to_numpy(zero_copy_only=False)
    badp = ~np.isnan(p) & ~((p > 0) & (p <= 1))
    badp |= np.isnan(p) & ~pc.is_null(prob).to_numpy(zero_copy_only=False)  # NaN (not null) is an error
    if badp.any():
        raise CJEInputError(f"value {p[badp][0]} is not a probability in (0, 1] (or null)", source=source,
                            column="label_probability", row=int(np.flatnonzero(badp)[0]))
    out = pa.Table.from_arrays([rid, label, prob], schema=LABEL_SCHEMA)
    out = out.sort_by([("response_id", "ascending"), ("oracle_label", "ascending"),
                       ("label_probability", "ascending")])
    return _drop_exact_duplicates(out)


def _drop_exact_duplicates(table: pa.Table) -> pa.Table:
    """Keep the first of rows identical in (response_id, oracle_label, label_probability)."""
    if table.num_rows == 0:
        return table
    keep = _first_rows(table.select(LABEL_SCHEMA.names))
    return table.take(pa.array(keep)) if len(keep) < table.num_rows else table


def content_hash(normalized: pa.Table) -> str:
    """sha256 (hex) of a normalised label table (order and duplicates already canonical).

    The same for the table written and the table read back from its object, however Parquet
    split it into row groups (the columns are hashed as one chunk each). The IPC stream is fed to the hash as
    the writer writes it, buffer by buffer (`_HashSink`), never held whole: the same bytes, the same hash
    (`_content_hash_reference`), without the stream's copy (~200 MiB at 5M labels: on a machine where fresh
    memory is dear, ~1.3 s of system CPU of the label index's build, against ~0.15 s hashed as written).
    """
    sink = _HashSink()
    with pa.ipc.new_stream(sink, LABEL_SCHEMA) as writer:
        writer.write_table(normalized.cast(LABEL_SCHEMA).combine_chunks())
    return sink.hexdigest()


class _HashSink:
    """A write-only file that feeds what is written to a sha256 (`content_hash`'s IPC stream): Arrow hands it
    each buffer as it is (no copy)."""

    closed = False

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._h.update(view)
        return view.nbytes

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _content_hash_buffer(normalized: pa.Table) -> str:
    """`content_hash` through an Arrow buffer holding the whole stream (the code it replaced; a test's reference)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, LABEL_SCHEMA) as writer:
        writer.write_table(normalized.cast(LABEL_SCHEMA).combine_chunks())
    return hashlib.sha256(sink.getvalue()).hexdigest()


def _content_hash_reference(normalized: pa.Table) -> str:
    """`content_hash` as first written (through `io.BytesIO`): its reference."""
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, LABEL_SCHEMA) as writer:
        writer.write_table(normalized.cast(LABEL_SCHEMA).combine_chunks())
    return hashlib.sha256(sink.getvalue()).hexdigest()


class LabelStore:
    """Append-only label store under ``<root>/<prefix>/`` (see module docstring).

    Parameters
    ----------
    st : Storage
    prefix : str
        Folder of the store inside the storage root (default ``labels``).
    """

    def __init__(self, st: Storage, prefix: str = "labels") -> None:
        self.st = st
        self.prefix = prefix.strip("/")

    def __repr__(self) -> str:
        return f"LabelStore({self.st.url(self.prefix)!r})"

    # -- keys
    def _data_key(self, version: int, sha: str) -> str:
        return f"{self.prefix}/v{version:06d}-{sha[:16]}.parquet"

    def _commit_key(self, version: int) -> str:
        return f"{self.prefix}/_commits/v{version:06d}.json"

    def _commits(self) -> dict[int, str]:
        out = {}
        for info in self.st.list(f"{self.prefix}/_commits/"):
            m = _COMMIT_RE.match(info.key.rsplit("/", 1)[-1])
            if m:
                out[int(m.group(1))] = info.key
        return out

    def _commit_record(self, version: int) -> dict:
        """The commit record of ``version``, checked (`CJEInputError` naming it if it is damaged)."""
        key = self._commit_key(version)
        try:
            record = json.loads(self.st.read_bytes(key))
        except (ValueError, UnicodeDecodeError):
            raise CJEInputError("label-store commit record is not valid JSON (truncated or corrupted); the "
                                "version it commits cannot be trusted", source=self.st.url(key)) from None
        problem = _record_problem(record, version, self.prefix)
        if problem:
            raise CJEInputError(f"label-store commit record is damaged: {problem}; the version it commits "
                                "cannot be trusted", source=self.st.url(key))
        return record

    def _data_candidates(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for info in self.st.list(f"{self.prefix}/v"):
            name = info.key[len(self.prefix) + 1:]
            m = _DATA_RE.match(name)
            if m:
                out.setdefault(int(m.group(1)), []).append(m.group(2))
        return out

    # -- public
    def version(self) -> int:
        """Number of committed appends (0 for an empty store)."""
        return len(self._commits())

    def history(self) -> list[dict]:
        """Commit records in version order (version, sha256, object, source_name, rows, created_at)."""
        return [self._commit_record(v) for v in sorted(self._commits())]

    def committed_rows(self, threads: int = 8) -> tuple[int, int]:
        """``(version, rows)``: the store's current version and the label rows committed up to it, from the commit
        records alone (read in ``threads`` threads, each checked as `read` checks it; no label object is read):
        what the label index's build asks memory for (`flows.runtime.label_index.index_task_memory`)."""
        from concurrent.futures import ThreadPoolExecutor

        versions = sorted(self._commits())
        if not versions:
            return 0, 0
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(versions)))) as pool:
            records = list(pool.map(self._commit_record, versions))
        return len(versions), int(sum(int(r["rows"]) for r in records))

    def append(self, table: pa.Table, source_name: str) -> int:
        """Append labels; returns the version that holds them.

        Identical content (after normalisation) already committed returns that version and
        writes nothing.  Raises `CJEInputError` for bad label tables.
        """
        norm = normalize_labels(table, source_name)
        sha = content_hash(norm)
        buf = io.BytesIO()
        pq.write_table(norm, buf, compression="zstd")
        data = buf.getvalue()
        for _ in range(_MAX_RACES):
            commits = self._commits()
            existing = self._find_committed(sha, commits)
            if existing is not None:
                log.info("labels from %s already stored as version %d (same content)", source_name, existing)
                return existing
            version = len(commits) + 1
            if version in commits or (commits and max(commits) != len(commits)):
                raise StorageError(f"label store {self.st.url(self.prefix)} has non-contiguous commits "
                                   f"{sorted(commits)[:5]}...", key=self.prefix, operation="append")
            data_key = self._data_key(version, sha)
            stored = data
            if not self.st.put_if_absent(data_key, data):  # a leftover of a crashed writer under this key
                stored = self.st.read_bytes(data_key)
                if _content_sha(stored) != sha:  # not our content (damaged or replaced): ours replaces it
                    self.st.write_bytes(data_key, data)
                    stored = data
            record = {
                "version": version, "sha256": sha, "object": data_key, "source_name": str(source_name),
                "rows": norm.num_rows, "object_sha256": hashlib.sha256(stored).hexdigest(),
                "object_bytes": len(stored), "created_at": datetime.now(timezone.utc).isoformat(),
            }
            if self.st.put_if_absent(self._commit_key(version), json.dumps(record, indent=1).encode()):
                log.info("appended %d labels from %s as version %d", norm.num_rows, source_name, version)
                return version
            # Lost the race for this version number: drop our data object unless it is the winner's.
            winner = self._commit_record(version)
            if winner.get("object") != data_key:
                self.st.delete(data_key)
        raise StorageError(f"label append to {self.st.url(self.prefix)} lost {_MAX_RACES} races in a row",
                           key=self.prefix, operation="append")

    def _reevaluated_key(self, version: int) -> str:
        return f"{self.prefix}/_reevaluated/v{int(version):06d}.json"

    def reevaluated(self, version: int) -> dict | None:
        """The record `mark_reevaluated` wrote for ``version``, or None if its re-evaluation never completed.

        A ``cje labels`` killed after the commit and before (or during) the re-evaluation leaves no record:
        its retry (same labels, "already stored") re-evaluates instead of skipping.
        """
        try:
            raw = self.st.read_bytes(self._reevaluated_key(version))
        except NotFoundError:
            return None
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            log.warning("re-evaluation record %s is unreadable; treating the re-evaluation as not done",
                        self.st.url(self._reevaluated_key(version)))
            return None
        return doc if isinstance(doc, dict) else None

    def mark_reevaluated(self, version: int, summary: Mapping[str, Any]) -> None:
        """Record that the re-evaluation called for by labels of ``version`` completed (``summary``: what ran)."""
        record = {"version": int(version), "completed_at": datetime.now(timezone.utc).isoformat(), **dict(summary)}
        self.st.write_bytes(self._reevaluated_key(version), json.dumps(record, indent=1, default=str).encode())

    def _find_committed(self, sha: str, commits: dict[int, str]) -> int | None:
        for version, shas in sorted(self._data_candidates().items()):
            if sha[:16] in shas and version in commits:
                if self._commit_record(version).get("sha256") == sha:
                    return version
        return None

    def current(self, labels_uri: str) -> tuple[pa.Table | None, dict]:
        """The labels at the store's current version (`read`: every object verified; ``None`` when the store is
        empty) and the run's lineage of them: ``labels_uri``, ``label_store_version``, ``n_label_rows``,
        ``n_flagged``."""
        labels, info, _ = self.current_sorted(labels_uri, reference=True)
        return labels, info

    def current_sorted(self, labels_uri: str, reference: bool = False
                       ) -> tuple[pa.Table | None, dict, "SortedFingerprints | None"]:
        """`current`, and the `SortedFingerprints` of the labels' ids when `read` found them all distinct by
        them (`read_sorted`; None otherwise, or with ``reference``: `read` as first written): what the label
        index sorts the ids by (`flows.runtime.label_index.LabelIndex.build`), computed once."""
        version = int(self.version())
        info = {"labels_uri": labels_uri, "label_store_version": version, "n_label_rows": 0, "n_flagged": 0}
        if version == 0:
            return None, info, None
        if reference:
            labels, fps = self.read(version=version), None
        else:
            labels, fps = self.read_sorted(version=version)
        info["n_label_rows"] = labels.num_rows
        info["n_flagged"] = int(pc.sum(pc.cast(labels["flagged"], pa.int64())).as_py() or 0)
        return labels, info, fps

    def read(self, version: int | None = None) -> pa.Table:
        """All labels committed up to ``version`` (default: latest), each object verified.

        Every version's commit record is read and checked, and the object it names is verified
        against it before any row is used (`_read_verified`): the sha256 of the object's bytes
        (``object_sha256``, commits written since issue 25), the sha256 of its content (the
        ``sha256`` of the record, whose first 16 digits are in the object's name) and its row
        count.  A mismatch, a damaged commit record or a missing object is an error naming the
        object; nothing of it is used.

        Columns: response_id, oracle_label, label_probability, version, flagged.  Rows are in
        version order, then in each version's (sorted) order.
        """
        return self._read(version, reference=True)[0]

    def read_sorted(self, version: int | None = None) -> tuple[pa.Table, "SortedFingerprints | None"]:
        """`read`, the same table, and the `SortedFingerprints` of its ids when no two share a fingerprint (then
        no id repeats: the check `read` makes, here by one sort of the 64-bit fingerprints that the label index
        reuses, instead of `flows.storage.fingerprints.ids_distinct`'s sort of their halves; None when two
        share one: the check then as `read`'s)."""
        return self._read(version, reference=False)

    def _read(self, version: int | None, reference: bool) -> tuple[pa.Table, "SortedFingerprints | None"]:
        commits = self._commits()
        latest = len(commits)
        if version is None:
            version = latest
        if not isinstance(version, (int, np.integer)) or version < 0 or version > latest:
            raise CJEInputError(f"label-store version {version!r} does not exist (latest is {latest})",
                                source=self.st.url(self.prefix))
        if sorted(commits) != list(range(1, latest + 1)):
            raise StorageError(f"label store {self.st.url(self.prefix)} has non-contiguous commits "
                               f"{sorted(commits)[:5]}...", key=self.prefix, operation="read")
        parts = []
        for v in range(1, int(version) + 1):
            t = self._read_verified(v)
            parts.append(t.append_column("version", pa.array(np.full(t.num_rows, v, dtype=np.int64))))
        if not parts:
            return READ_SCHEMA.empty_table(), None
        table = pa.concat_tables(parts)
        fps = None if reference else SortedFingerprints.of(table.column("response_id"))
        if fps is not None or ids_distinct(table.column("response_id")):
            # no id twice (exact: `flows.storage.fingerprints.ids_distinct`, ~0.2 s at 5M labels): no duplicate to
            # drop and no conflict, what the grouping below finds at ~20x the CPU
            return (table.append_column("flagged", pa.array(np.zeros(table.num_rows, dtype=bool))).cast(READ_SCHEMA),
                    fps)
        table = _drop_exact_duplicates(table)
        flagged = pc.is_in(table.column("response_id"), value_set=_conflicting_ids(table))
        return table.append_column("flagged", flagged).cast(READ_SCHEMA), None


    def _read_verified(self, v: int) -> pa.Table:
        """The rows of version ``v``, after checking its object against its commit record."""
        record = self._commit_record(v)
        key = record["object"]
        source = self.st.url(key)
        try:
            raw = self.st.read_bytes(key)
        except NotFoundError:
            raise StorageError(f"label-store version {v} is committed but its object {source} "
                               "is missing", key=key, operation="read") from None
        want = record.get("object_sha256")
        if want is not None:
            got = hashlib.sha256(raw).hexdigest()
            if got != want:
                raise CJEInputError(
                    f"label-store object checksum mismatch: sha256 of its {len(raw)} bytes is {got[:16]}..., its "
                    f"commit record {self._commit_key(v)} says {str(want)[:16]}... ({record.get('object_bytes')} "
                    "bytes); the object was replaced or corrupted and is not used (restore it)", source=source)
        try:
            t = read_parquet_bytes(raw).cast(LABEL_SCHEMA)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OSError, ValueError) as exc:
            raise CJEInputError(f"label object is not readable Parquet with columns {LABEL_SCHEMA.names}: "
                                f"{' '.join(str(exc).split())[:200]}", source=source) from None
        if want is not None and t.num_rows == record["rows"]:
            # its bytes are the committed object's (sha256 above), so its content is the committed content: the
            # content hash (~0.15 s of CPU a 1M labels) is computed only for a record without the bytes' digest
            # (written before it existed) or a count that disagrees (the message names both)
            return t
        got = content_hash(t)
        if got != record["sha256"] or t.num_rows != record["rows"]:
            raise CJEInputError(
                f"label-store object checksum mismatch: its content ({t.num_rows} rows) hashes to sha256 "
                f"{got[:16]}..., its name and commit record {self._commit_key(v)} say {record['sha256'][:16]}... "
                f"({record['rows']} rows); the object was replaced or corrupted and is not used (restore it)",
                source=source)
        return t


class SortedFingerprints:
    """The `flows.storage.fingerprints.id_fingerprint` of every id of a column, sorted (``fp``), and the order that
    sorts them (``order``), made only when no two are equal (`of`): then the ids are distinct, and the order is
    the one a stable sort gives (there is no tie to order)."""

    def __init__(self, fp: np.ndarray, order: np.ndarray) -> None:
        self.fp, self.order = fp, order

    @classmethod
    def of(cls, ids: pa.ChunkedArray | pa.Array) -> "SortedFingerprints | None":
        """The ids' sorted fingerprints, or None when two are equal (or there is no id)."""
        from flows.storage.fingerprints import id_fingerprint

        fp = id_fingerprint(ids)
        if fp.size == 0:
            return None
        order = fingerprint_order(fp)
        fp = fp[order]
        if bool(np.any(fp[1:] == fp[:-1])):
            return None
        return cls(fp, order)


#: Runs of fingerprints sharing their high bits past which `fingerprint_order` sorts by a stable argsort instead.
MAX_HIGH_RUNS = 1 << 14


def fingerprint_order(fp: np.ndarray) -> np.ndarray:
    """``numpy.argsort(fp, kind="stable")`` of 64-bit fingerprints (uint64), the same order, by a sort of values
    instead of an argsort (~40% less CPU at 5M): each fingerprint's high bits with its position in the low
    ``b`` bits (``2^b > len(fp)``) sorted as one integer, then the few runs whose high bits are equal (their
    order by position, not by their low bits; ~n^2 / 2^(65 - b) of them for random fingerprints) sorted again by
    the whole fingerprint, stably. Past `MAX_HIGH_RUNS` such runs: the stable argsort itself."""
    n = fp.size
    if n < 2:
        return np.zeros(n, dtype=np.int64)
    b = int(n - 1).bit_length()
    shift = np.uint64(b)
    key = fp >> shift
    key <<= shift
    key |= np.arange(n, dtype=np.uint64)
    key.sort()
    order = (key & np.uint64((1 << b) - 1)).astype(np.int64)
    key >>= shift  # the high bits, in sorted order
    same = np.flatnonzero(key[1:] == key[:-1])  # i and i + 1 share their high bits
    if same.size == 0:
        return order
    starts = same[np.concatenate([[True], same[1:] != same[:-1] + 1])]
    if starts.size > MAX_HIGH_RUNS:
        return np.argsort(fp, kind="stable")
    ends = np.searchsorted(key, key[starts], side="right")
    for a, e in zip(starts.tolist(), ends.tolist()):
        run = order[a:e]  # in position order: a stable sort of their fingerprints keeps equal ones so
        order[a:e] = run[np.argsort(fp[run], kind="stable")]
    return order


def _content_sha(data: bytes) -> str | None:
    """`content_hash` of a stored label object's bytes (None if they are not a label table)."""
    try:
        return content_hash(read_parquet_bytes(data).cast(LABEL_SCHEMA))
    except (pa.ArrowException, OSError, ValueError):
        return None


def _record_problem(record: Any, version: int, prefix: str) -> str | None:
    """What is wrong with a commit record (None if it is well formed and names its own object)."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    missing = [k for k in ("version", "sha256", "object", "rows") if k not in record]
    if missing:
        return f"missing {missing}"
    sha = record["sha256"]
    if record["version"] != version:
        return f"version {record['version']!r} where {version} was expected"
    if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
        return f"sha256 {sha!r} is not 64 hex digits"
    if record["object"] != f"{prefix}/v{version:06d}-{sha[:16]}.parquet":
        return f"object {record['object']!r} is not {prefix}/v{version:06d}-{sha[:16]}.parquet (its sha256)"
    if not isinstance(record["rows"], int) or isinstance(record["rows"], bool) or record["rows"] < 1:
        return f"rows {record['rows']!r} is not a positive count"
    obj = record.get("object_sha256")
    if obj is not None and not (isinstance(obj, str) and re.fullmatch(r"[0-9a-f]{64}", obj)):
        return f"object_sha256 {obj!r} is not 64 hex digits"
    return None


def _first_rows(labels: pa.Table) -> np.ndarray:
    key = pa.Table.from_arrays(
        [labels.column("response_id"), labels.column("oracle_label"),
         pc.fill_null(labels.column("label_probability"), -1.0), pa.array(np.arange(labels.num_rows))],
        names=["r", "l", "p", "i"])
    first = key.group_by(["r", "l", "p"], use_threads=False).aggregate([("i", "min")])
    return np.sort(first.column("i_min").to_numpy())


def _conflicting_ids(table: pa.Table) -> pa.Array:
    """response_ids that occur more than once after exact duplicates were removed."""
    counts = pc.value_counts(table.column("response_id"))
    return counts.filter(pc.greater(counts.field("counts"), 1)).field("values")


def label_conflicts(label_table: pa.Table) -> list[str]:
    """Sorted response_ids with conflicting labels (``flagged`` rows of `LabelStore.read`)."""
    ids = pc.unique(label_table.filter(label_table.column("flagged")).column("response_id"))
    return sorted(ids.to_pylist())


def join_labels(logs_table: pa.Table, label_table: pa.Table) -> pa.Table:
    """Fill ``oracle_label`` and ``label_probability`` of the logs from the label store.

    Order of the log rows is preserved.  For each ``response_id`` the first label (lowest
    version, then row order of `LabelStore.read`) is used; ids with conflicting labels are
    marked ``True`` in the added boolean column ``label_conflict`` and counted in the schema
    metadata key ``cje.label_conflicts``.  Where the store has no label, an ``oracle_label``
    already in the logs is kept (store labels win where both exist).  Labels whose
    ``response_id`` is not in the logs are ignored.  A label without a ``label_probability``
    gets 1.0 (drawn completely at random within its policy), the engine's convention.
    """
    rid = log_response_ids(logs_table)
    first = first_labels(label_table)
    idx = pc.index_in(rid, value_set=first.column("response_id"))
    return fill_store_labels(logs_table, idx, first)


def log_response_ids(logs_table: pa.Table) -> pa.ChunkedArray:
    """The logs' ``response_id`` column as strings in NFC (the engine's spelling of ids): what a join matches.

    An NFD id in the logs still finds its label; invisible characters are left to the engine, which names
    the object and row.  Raises `CJEInputError` when the logs have no ``response_id``.
    """
    if "response_id" not in logs_table.column_names:
        raise CJEInputError("logs have no response_id column; labels are joined on it", column="response_id")
    return log_response_ids_nfc(logs_table)[0]


def log_response_ids_nfc(logs_table: pa.Table) -> tuple[pa.ChunkedArray, bool]:
    """`log_response_ids` and whether NFC changed them: False when they are the column as read (cast to string),
    whose fingerprints the caller may then have computed already."""
    if "response_id" not in logs_table.column_names:
        raise CJEInputError("logs have no response_id column; labels are joined on it", column="response_id")
    rid = logs_table.column("response_id")
    if not pa.types.is_string(rid.type):
        rid = rid.cast(pa.string())
    if not all_ascii(rid):  # bytes all ASCII: no NFC to apply (`cje_engine.data.strings.all_ascii`)
        return pc.utf8_normalize(rid, form="NFC"), True
    return rid, False


def first_labels(label_table: pa.Table, distinct: bool = False) -> pa.Table:
    """The first label of each ``response_id`` of a label table (lowest version, then row order of
    `LabelStore.read`): columns ``response_id`` (in NFC), ``oracle_label``, ``label_probability`` and
    ``flagged`` (the id has conflicting labels), one row per stored id in order of first appearance.

    Ids stored before ids were normalised are put in NFC after the grouping (two spellings of one id then
    give two rows, the first of which a join uses, as `pyarrow.compute.index_in` does).
    ``distinct``: the caller knows that no ``response_id`` of the table repeats (as stored, before NFC;
    `flows.storage.fingerprints.ids_distinct`): every row is then its id's first and the grouping is skipped: the
    same rows, in the table's order (the grouping's order is Arrow's hash grouping's, which does not keep the
    first appearance of every key: the rows are the same, their order may differ).
    Raises `CJEInputError` when a label column is missing.
    """
    for col in ("response_id", "oracle_label", "label_probability"):
        if col not in label_table.column_names:
            raise CJEInputError(f"label table lacks column {col!r}", column=col)
    labels = label_table
    if distinct:  # one row an id: no conflict, each row its id's first
        flagged = (labels.column("flagged") if "flagged" in labels.column_names
                   else pa.array(np.zeros(labels.num_rows, dtype=bool)))
        cols = {"response_id": labels.column("response_id"), "oracle_label": labels.column("oracle_label"),
                "label_probability": labels.column("label_probability"), "flagged": flagged}
    else:
        if "flagged" not in labels.column_names:
            labels = labels.append_column("flagged", pc.is_in(labels.column("response_id"),
                                                              value_set=_conflicting_ids(labels)))
        # First label per id: group_by without threads keeps the first row's values.
        first = labels.select(["response_id", "oracle_label", "label_probability", "flagged"]).group_by(
            "response_id", use_threads=False).aggregate([
                ("oracle_label", "first", pc.ScalarAggregateOptions(skip_nulls=False)),
                ("label_probability", "first", pc.ScalarAggregateOptions(skip_nulls=False)),
                ("flagged", "max")])
        cols = {"response_id": first.column("response_id"), "oracle_label": first.column("oracle_label_first"),
                "label_probability": first.column("label_probability_first"), "flagged": first.column("flagged_max")}
    stored_ids = cols["response_id"].cast(pa.string())
    if not all_ascii(stored_ids):  # labels stored before ids were normalised
        stored_ids = pc.utf8_normalize(stored_ids, form="NFC")
    return pa.table({**cols, "response_id": stored_ids})


def fill_store_labels(logs_table: pa.Table, idx: pa.Array | pa.ChunkedArray, first: pa.Table) -> pa.Table:
    """The logs with the store's labels filled in: ``idx`` gives, for each log row, its row of ``first``
    (`first_labels`' columns) or null where the store has no label for it (`join_labels`' rules: the store
    wins, inline labels kept elsewhere, a missing probability is 1.0, conflicts marked and counted in the
    schema metadata with the other join counts, `join_counts`)."""
    out = logs_table
    n_inline = n_overridden = 0
    if "oracle_label" not in out.column_names and "label_probability" not in out.column_names:
        # no inline label: the store's labels at the joined rows only (`fill_store_labels_at`), not a take of
        # every row
        return fill_store_labels_at(out, *_joined_rows(idx), first)
    store_label = pc.take(first.column("oracle_label"), idx)
    store_prob = pc.take(first.column("label_probability"), idx)
    conflict = pc.fill_null(pc.take(first.column("flagged"), idx), False)
    has = pc.is_valid(idx)
    if "oracle_label" in out.column_names:
        old_label = out.column("oracle_label").cast(pa.float64())
        label = pc.if_else(has, store_label, old_label)
        n_inline = int(len(old_label) - old_label.null_count)
        both = pc.and_(has, pc.is_valid(old_label))
        differ = pc.and_(both, pc.not_equal(store_label, old_label))
        n_overridden = int(pc.sum(pc.fill_null(differ, False)).as_py() or 0)
    else:
        label = store_label
    if "label_probability" in out.column_names:
        old_prob = out.column("label_probability").cast(pa.float64())
        prob = pc.if_else(has, pc.coalesce(store_prob, old_prob), old_prob)
    else:
        prob = store_prob
    # A label stored without a probability was drawn completely at random within its policy.
    prob = pc.if_else(pc.and_(pc.is_valid(label), pc.is_null(prob)), pa.scalar(1.0, pa.float64()),
                      prob.cast(pa.float64()))
    n_conflicts = int(pc.sum(conflict).as_py() or 0)
    n_joined = int(pc.sum(has).as_py() or 0)
    return _with_label_columns(out, label, prob, conflict, n_joined, n_conflicts, n_inline, n_overridden)


def _valid_values(arr: pa.ChunkedArray | pa.Array, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """(values, validity) of an Arrow column as numpy arrays (a null's value is 0)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks else pa.array([], arr.type)
    valid = np.ones(len(arr), dtype=bool) if arr.null_count == 0 else np.asarray(arr.is_valid())
    values = np.asarray(pc.fill_null(arr, pa.scalar(0, arr.type) if not pa.types.is_boolean(arr.type) else False)
                        .to_numpy(zero_copy_only=False), dtype=dtype)
    return values, valid


def _joined_rows(idx: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(the log rows whose ``idx`` is not null, increasing; their rows of the store's table) of a join's index."""
    if isinstance(idx, pa.ChunkedArray):
        idx = idx.combine_chunks() if idx.num_chunks else pa.array([], pa.int64())
    if idx.null_count == len(idx):
        rows = np.empty(0, dtype=np.int64)
    else:
        rows = np.flatnonzero(np.asarray(idx.is_valid()))
    return rows, np.asarray(pc.fill_null(idx, 0).to_numpy(zero_copy_only=False), dtype=np.int64)[rows]


def _store_columns_at(rows: np.ndarray, at: np.ndarray, n: int, first: pa.Table
                      ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], np.ndarray]:
    """The label, probability (each as (values, validity)) and conflict flag (bool) of each of ``n`` log rows from
    the store alone: ``rows`` hold the labels at rows ``at`` of ``first``, the others none (a null label and
    probability, no conflict); a stored label without a probability has 1.0. What `fill_store_labels`' takes and
    ``if_else`` give without an inline label, computed at the joined rows only (5% of a file: 0.02 s against
    ~0.04 s a 1M-row file)."""
    taken = pa.array(at)  # the joined rows' labels only (a few % of the store's)
    lab_v, lab_ok = _valid_values(first.column("oracle_label").take(taken).cast(pa.float64()), np.float64)
    prob_v, p_ok = _valid_values(first.column("label_probability").take(taken).cast(pa.float64()), np.float64)
    flag_v, flag_ok = _valid_values(first.column("flagged").take(taken), bool)
    label, label_ok = np.zeros(n), np.zeros(n, dtype=bool)
    prob, prob_ok = np.zeros(n), np.zeros(n, dtype=bool)
    conflict = np.zeros(n, dtype=bool)
    label[rows], label_ok[rows] = lab_v, lab_ok
    prob[rows] = np.where(p_ok, prob_v, 1.0)  # a stored label without a probability: 1.0
    prob_ok[rows] = p_ok | lab_ok
    conflict[rows] = flag_v & flag_ok
    return (label, label_ok), (prob, prob_ok), conflict


def fill_store_labels_at(logs_table: pa.Table, rows: np.ndarray, at: np.ndarray, first: pa.Table) -> pa.Table:
    """`fill_store_labels` of the joined rows alone: ``rows`` (increasing) of the logs hold the store's label at
    rows ``at`` of ``first``, the others none (`flows.runtime.label_index.LabelIndex.lookup_rows`). Without an
    inline label the labels are filled from them (no index a log row); else as `fill_store_labels` of their index.
    The same table."""
    n = logs_table.num_rows
    rows = np.asarray(rows, dtype=np.int64)
    at = np.asarray(at, dtype=np.int64)
    if "oracle_label" in logs_table.column_names or "label_probability" in logs_table.column_names:
        idx = np.full(n, -1, dtype=np.int64)
        idx[rows] = at
        return fill_store_labels(logs_table, pa.array(idx, mask=idx < 0), first)
    label, prob, conflict = _store_columns_at(rows, at, n, first)
    n_conflicts = int(np.count_nonzero(conflict))
    label, prob, conflict = _float_array(*label), _float_array(*prob), _bool_array(conflict)
    return _with_label_columns(logs_table, label, prob, conflict, int(rows.size), n_conflicts, 0, 0)


def _float_array(values: np.ndarray, valid: np.ndarray) -> pa.Array:
    """A float64 Arrow array of ``values``, null where ``valid`` is False: the array of `_float_array_reference`, its
    validity bits packed by `numpy.packbits` (~0.14 ms a 1M-row column against ~2 ms of ``pyarrow.array``'s
    mask) and its values ``values`` themselves (not copied: the caller's own array)."""
    values = np.ascontiguousarray(values, dtype=np.float64)
    n_valid = int(np.count_nonzero(valid))
    bitmap = None if n_valid == values.size else pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(pa.float64(), values.size, [bitmap, pa.py_buffer(values)],
                                 null_count=values.size - n_valid)


def _float_array_reference(values: np.ndarray, valid: np.ndarray) -> pa.Array:
    """`_float_array` by ``pyarrow.array`` with a mask (its reference)."""
    return pa.array(values, type=pa.float64(), mask=None if valid.all() else ~valid)


def _bool_array(values: np.ndarray) -> pa.Array:
    """``pyarrow.array(values)`` of a numpy bool array without nulls, its bits packed by `numpy.packbits`."""
    values = np.ascontiguousarray(values, dtype=bool)
    return pa.Array.from_buffers(pa.bool_(), values.size, [None, pa.py_buffer(np.packbits(values, bitorder="little"))],
                                 null_count=0)


def _with_label_columns(out: pa.Table, label: Any, prob: Any, conflict: Any, n_joined: int, n_conflicts: int,
                        n_inline: int, n_overridden: int) -> pa.Table:
    """The logs with their label columns set and the join counts in the schema metadata (`fill_store_labels`)."""
    for name, arr in (("oracle_label", label), ("label_probability", prob), ("label_conflict", conflict)):
        field = pa.field(name, arr.type)
        if name in out.column_names:
            out = out.set_column(out.schema.get_field_index(name), field, arr)
        else:
            out = out.append_column(field, arr)
    meta = dict(out.schema.metadata or {})
    meta[b"cje.label_conflicts"] = str(n_conflicts).encode()
    meta[b"cje.inline_labels"] = str(n_inline).encode()
    meta[b"cje.store_labels"] = str(n_joined).encode()
    meta[b"cje.inline_overridden"] = str(n_overridden).encode()
    out = out.replace_schema_metadata(meta)
    if n_overridden:
        log.warning("%d logged response(s) carry an inline oracle_label that differs from the label store's; the "
                    "store's label is used", n_overridden)
    if n_conflicts:
        log.warning("%d logged responses have conflicting labels in the label store; the first label is used "
                    "and the rows are marked in column label_conflict", n_conflicts)
    log.info("joined %d labels onto %d log rows (%d inline)", n_joined, out.num_rows, n_inline)
    return out


def join_counts(joined: pa.Table) -> dict[str, int]:
    """The counts `join_labels` put in the schema metadata (inline, store, overridden, conflicts)."""
    meta = joined.schema.metadata or {}
    return {name: int(meta.get(f"cje.{key}".encode(), b"0")) for name, key in (
        ("n_inline_labels", "inline_labels"), ("n_store_labels", "store_labels"),
        ("n_inline_overridden", "inline_overridden"), ("n_conflicting_rows", "label_conflicts"))}


LABEL_COLUMNS = ("oracle_label", "label_probability")


def inline_label_columns(st: Storage, keys: Sequence[str], threads: int = 8,
                         mapping: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Which label columns (``oracle_label``, ``label_probability``) the log files carry inline.

    Reads only the Parquet footers (in ``threads`` threads).  Returns ``{"columns": [...],
    "mixed": bool}``: the label columns present in at least one file, and whether some file
    lacks one of them (a projected read per group of files would then fail on the group without
    it: read every column instead).  A file whose footer cannot be read (storage down, not
    Parquet) also gives ``mixed``: the read that follows reads every column and reports the
    failure with its own retries and messages.  ``mapping`` (an evaluation's ``columns:``):
    the files' columns are renamed first (`flows.storage.logs.log_renames`), so an inline label
    under another name counts.
    """
    if not keys:
        return {"columns": [], "mixed": False}
    fs, _ = st.arrow_fs

    def names(key: str) -> set[str] | None:
        try:
            with fs.open_input_file(st.arrow_path(key)) as f:
                names = pq.read_schema(f).names
        except (OSError, pa.ArrowException) as exc:  # left to the read, which retries and names the object
            log.debug("footer of %s not readable (%s); every column will be read", st.url(key), exc)
            return None
        renames = log_renames(names, mapping, st.url(key))
        return {renames.get(n, n) for n in names}

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(keys)))) as pool:
        per_file = list(pool.map(names, list(keys)))
    readable = [n for n in per_file if n is not None]
    present = [c for c in LABEL_COLUMNS if any(c in n for n in readable)]
    mixed = len(readable) < len(per_file) or any(c not in n for c in present for n in readable)
    return {"columns": present, "mixed": bool(mixed)}


def labelled_count_drop(previous: Mapping[str, Any] | None, counts: Mapping[str, Any]) -> dict | None:
    """Compare a run's labelled counts with the previous published run of the same window.

    Parameters
    ----------
    previous : dict or None
        The previous run (`flows.storage.publish.list_runs` item: ``run_key``, ``manifest`` with
        ``rows`` = the evaluate flow's counts).
    counts : dict
        This run's counts: ``n_labelled`` and ``policies`` (``{policy: {"rows", "labelled"}}``).

    Returns
    -------
    dict or None
        ``{"previous_run_key", "previous_n_labelled", "n_labelled", "policies": {p: {"before", "now"}},
        "message"}`` when the total or any policy's labelled count fell; None otherwise.
    """
    if not previous:
        return None
    before = (previous.get("manifest") or {}).get("rows") or {}
    if "n_labelled" not in before:
        return None
    pols = {}
    for p, c in (before.get("policies") or {}).items():
        now_n = int(((counts.get("policies") or {}).get(p) or {}).get("labelled", 0))
        if now_n < int(c.get("labelled", 0)):
            pols[p] = {"before": int(c.get("labelled", 0)), "now": now_n}
    total_before, total_now = int(before["n_labelled"]), int(counts.get("n_labelled", 0))
    if total_now >= total_before and not pols:
        return None
    detail = ", ".join(f"{p} {v['before']} -> {v['now']}" for p, v in sorted(pols.items()))
    return {"previous_run_key": previous.get("run_key"), "previous_n_labelled": total_before,
            "n_labelled": total_now, "policies": pols,
            "message": f"labelled rows dropped against the previous published run {previous.get('run_key')} of this "
                       f"window: {total_before} -> {total_now}" + (f" ({detail})" if detail else "")
                       + "; labels may have been lost (logs rewritten without their oracle_label, or a label "
                         "store pointed elsewhere)"}
