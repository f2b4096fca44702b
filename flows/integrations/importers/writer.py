"""Imported rows -> the service's daily Parquet logs (``dt=YYYY-MM-DD/part-<id>.parquet``), create-only.

`import_source` is ``cje import``: it names the import (`import_id`: the source's bytes, the format and
its version, the mapping), then

1. if the logs root already holds the import's manifest (``_imports/<import_id>.json``), checks every
   object it lists against its sha256 and says "already imported": nothing is read or written again;
2. else streams the importer's records through the mapping (`flows.integrations.importers.mapping`)
   into one staging Parquet file per UTC day (in a temporary folder: memory holds one batch of rows);
3. checks the response ids are unique within the import (a repeated id is an error naming both records)
   and leaves out rows whose ``response_id`` the day's existing objects already hold (a re-import of an
   overlapping export: counted as ``already_present``, never written twice);
4. writes each day as ``dt=<day>/part-<format>-<import_id>.parquet``: never over an object of other
   content (an object of that key from an interrupted run of the same import is adopted when its sha256
   is the staged file's), each object checked by its size after the upload;
5. writes the manifest last (``put_if_absent``): objects with rows, size and sha256, the mapping, the
   report. The ``_imports/`` folder starts with ``_``, so readers of the logs skip it.

Nothing partial is published as a finished import: until the manifest exists, a rerun completes it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cje_engine.errors import CJEInputError

from flows.integrations.importers.base import Importer, ImportedRow, ImportMapping, ImportReport
from flows.integrations.importers.mapping import map_records
from flows.storage.logs import PARTITION, first_duplicate, is_log_object
from flows.storage.objects import NotFoundError, Storage

log = logging.getLogger(__name__)

#: Prefix of the import manifests under the logs root (skipped by every reader: it starts with ``_``).
MANIFESTS = "_imports/"
#: Rows buffered before they are written to the staging files.
BATCH_ROWS = 65_536
#: The columns of an imported log file.
SCHEMA = pa.schema([
    ("prompt_id", pa.string()), ("policy", pa.string()), ("response_id", pa.string()),
    ("judge_score", pa.float64()), ("ts", pa.timestamp("us", tz="UTC")), ("oracle_label", pa.float64()),
    ("judge_name", pa.string()), ("prompt", pa.string()), ("response", pa.string()),
    ("source_record", pa.int64()), ("extra", pa.string()),
])
_FIELDS = tuple(SCHEMA.names)
_HASH_CHUNK = 1 << 20


# --------------------------------------------------------------------------- ids


def source_sha256(source: Path) -> str:
    """sha256 of a source file's bytes (a folder: of its files' relative names and bytes, sorted)."""
    h = hashlib.sha256()
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    for p in files:
        if source.is_dir():
            h.update(str(p.relative_to(source)).encode() + b"\0")
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(_HASH_CHUNK), b""):
                h.update(chunk)
    return h.hexdigest()


def import_id(importer: Importer, mapping: ImportMapping, source_digest: str) -> str:
    """The stable id of an import: 16 hex digits over the format, its version, the mapping and the source."""
    blob = json.dumps({"format": importer.name, "version": importer.version, "mapping": mapping.declared(),
                       "source": source_digest}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def manifest_key(iid: str) -> str:
    """Key of an import's manifest under the logs root."""
    return f"{MANIFESTS}{iid}.json"


# --------------------------------------------------------------------------- staging


class _Stager:
    """Rows -> one staging Parquet file per UTC day, in batches."""

    def __init__(self, folder: Path, batch_rows: int) -> None:
        self.folder = folder
        self.batch_rows = batch_rows
        self.cols: dict[date, dict[str, list]] = {}
        self.buffered = 0
        self.writers: dict[date, pq.ParquetWriter] = {}
        self.rows: dict[date, int] = {}

    def add(self, row: ImportedRow) -> None:
        ts = row.ts
        if ts.tzinfo is not timezone.utc:
            ts = ts.astimezone(timezone.utc) if ts.tzinfo else ts.replace(tzinfo=timezone.utc)
        day = ts.date()
        cols = self.cols.get(day)
        if cols is None:
            cols = self.cols[day] = {f: [] for f in _FIELDS}
        cols["prompt_id"].append(row.prompt_id)
        cols["policy"].append(row.policy)
        cols["response_id"].append(row.response_id)
        cols["judge_score"].append(row.judge_score)
        cols["ts"].append(ts)
        cols["oracle_label"].append(row.oracle_label)
        cols["judge_name"].append(row.judge_name)
        cols["prompt"].append(row.prompt)
        cols["response"].append(row.response)
        cols["source_record"].append(row.source_record)
        cols["extra"].append(row.extra)
        self.buffered += 1
        if self.buffered >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        for day, cols in self.cols.items():
            if not cols["response_id"]:
                continue
            batch = pa.record_batch([pa.array(cols[f], SCHEMA.field(f).type) for f in _FIELDS], schema=SCHEMA)
            w = self.writers.get(day)
            if w is None:
                w = self.writers[day] = pq.ParquetWriter(self.path(day), SCHEMA, compression="zstd")
            w.write_batch(batch)
            self.rows[day] = self.rows.get(day, 0) + batch.num_rows
        self.cols = {}
        self.buffered = 0

    def close(self) -> None:
        self.flush()
        for w in self.writers.values():
            w.close()

    def path(self, day: date) -> Path:
        return self.folder / f"{day.isoformat()}.parquet"


# --------------------------------------------------------------------------- checks against the logs


def _check_unique(stager: _Stager, source: str) -> None:
    days = sorted(stager.rows)
    if not days:
        return
    ids = pa.chunked_array([c for d in days for c in pq.read_table(stager.path(d), columns=["response_id"])
                            .column(0).chunks], pa.string())
    dup = first_duplicate(ids)
    if dup is None:
        return
    records = []
    for d in days:
        t = pq.read_table(stager.path(d), columns=["response_id", "source_record"])
        hit = pc.equal(t.column("response_id"), dup)
        records += t.column("source_record").filter(hit).to_pylist()
    raise CJEInputError(f"records {records[:5]} have the same response id {dup!r}; each response must appear "
                        "once in an import", source=source, column="response_id", row=records[1])


def _existing_ids(st: Storage, day: date, own: str) -> pa.Array | None:
    """The response ids the day's log objects (other than ``own``) hold, or None when there are none."""
    parts = []
    for info in st.list(f"{PARTITION}={day.isoformat()}/"):
        if info.key == own or not is_log_object(info.key):
            continue
        fs, _ = st.arrow_fs
        try:
            t = pq.read_table(st.arrow_path(info.key), columns=["response_id"], filesystem=fs)
        except (pa.ArrowInvalid, KeyError) as exc:
            raise CJEInputError(f"cannot read its response_id column to check for responses already imported: {exc}",
                                source=st.url(info.key), column="response_id") from None
        parts.append(t.column(0).cast(pa.string()).combine_chunks())
    return pa.concat_arrays(parts) if parts else None


# --------------------------------------------------------------------------- writing


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _object_sha256(st: Storage, key: str) -> str:
    fs, _ = st.arrow_fs
    h = hashlib.sha256()
    with fs.open_input_stream(st.arrow_path(key)) as fh:
        while True:
            chunk = fh.read(_HASH_CHUNK)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


def _put_file(st: Storage, key: str, path: Path) -> dict[str, Any]:
    """Create ``key`` from the staged ``path`` (create-only; adopt an identical object); its manifest entry."""
    digest, size = _file_sha256(path), path.stat().st_size
    if st.exists(key):
        if _object_sha256(st, key) != digest:
            raise CJEInputError("exists with other content (an import with the same id wrote other rows?); "
                                "not overwritten", source=st.url(key))
        log.info("%s already holds this import's rows (an interrupted run): kept", st.url(key))
    else:
        with st.open_output(key) as out, open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(_HASH_CHUNK), b""):
                out.write(chunk)
        got = st.info(key).size
        if got != size:
            raise CJEInputError(f"was stored with {got} bytes, {size} were written", source=st.url(key))
    return {"key": key, "size": size, "sha256": digest}


def _verify_manifest(st: Storage, manifest: dict[str, Any]) -> None:
    for obj in manifest.get("objects", []):
        key = obj["key"]
        try:
            digest = _object_sha256(st, key)
        except (FileNotFoundError, NotFoundError, OSError):
            raise CJEInputError(f"is listed by the import manifest {manifest_key(manifest['import_id'])} but is "
                                "missing; delete the manifest to import again", source=st.url(key)) from None
        if digest != obj["sha256"]:
            raise CJEInputError(f"does not match the sha256 its import manifest records ({obj['sha256'][:16]}...); "
                                "the logs were changed after the import", source=st.url(key))


def write_rows(rows: Iterable[ImportedRow], st: Storage, *, importer: Importer, report: ImportReport,
               batch_rows: int = BATCH_ROWS) -> list[dict[str, Any]]:
    """Stream ``rows`` into the daily layout of ``st``; returns the manifest entries of the objects written.

    ``report.import_id`` names the objects (``dt=<day>/part-<format>-<import_id>.parquet``); ``report``
    gets ``written``, ``already_present``, ``days`` and ``objects``.

    Raises
    ------
    CJEInputError
        A response id repeated within the rows, or an object of this import's key with other content.
    """
    with tempfile.TemporaryDirectory(prefix="cje-import-") as tmp:
        stager = _Stager(Path(tmp), batch_rows)
        for row in rows:
            stager.add(row)
        stager.close()
        _check_unique(stager, report.source)
        entries = []
        for day in sorted(stager.rows):
            key = f"{PARTITION}={day.isoformat()}/part-{importer.name}-{report.import_id}.parquet"
            path = stager.path(day)
            existing = _existing_ids(st, day, key)
            if existing is not None and len(existing):
                table = pq.read_table(path)
                present = pc.is_in(table.column("response_id"), value_set=existing)
                n_present = pc.sum(present).as_py() or 0
                if n_present:
                    report.already_present += n_present
                    table = table.filter(pc.invert(present))
                    if table.num_rows == 0:
                        continue
                    path = Path(tmp) / f"{day.isoformat()}.new.parquet"
                    pq.write_table(table, path, compression="zstd")
            n = pq.ParquetFile(path).metadata.num_rows
            entry = _put_file(st, key, path)
            entry["rows"] = n
            entries.append(entry)
            report.written += n
            report.objects.append(key)
            report.days.append(day.isoformat())
        return entries


def import_source(importer: Importer, source: str | os.PathLike, st: Storage, mapping: ImportMapping,
                  *, batch_rows: int = BATCH_ROWS) -> ImportReport:
    """Import ``source`` with ``importer`` into the logs root ``st`` (``cje import``).

    Parameters
    ----------
    importer : Importer
        The format.
    source : path
        The tool's file (or folder).
    st : Storage
        The logs root (`flows.storage.objects.Storage.for_uri` of ``--out``).
    mapping : ImportMapping
        The selectors.
    batch_rows : int
        Rows held in memory before they go to the staging files.

    Returns
    -------
    ImportReport
        What was mapped, left out (per reason) and written; ``already_imported`` when the same source
        was imported with the same mapping before (then nothing was read or written).

    Raises
    ------
    CJEInputError
        The source is missing or not the format (file, record and field named), several judges and no
        ``--judge-from``, a repeated response id, a stored object that does not match its manifest.
    """
    path = Path(source)
    if not path.exists():
        raise CJEInputError("not found", source=str(path))
    report = ImportReport(format=importer.name, source=str(path))
    iid = import_id(importer, mapping, source_sha256(path))
    report.import_id = iid
    mkey = manifest_key(iid)
    try:
        manifest = json.loads(st.read_bytes(mkey))
    except NotFoundError:
        manifest = None
    if manifest is not None:
        _verify_manifest(st, manifest)
        old = ImportReport.from_dict(manifest["report"])
        old.already_imported = True
        old.source = str(path)
        log.info("%s was imported before as %s (%s): nothing to do", path, iid, st.url(mkey))
        return old
    rows = map_records(importer.records(path), mapping, report)
    entries = write_rows(rows, st, importer=importer, report=report, batch_rows=batch_rows)
    if not entries and report.mapped == 0:
        raise CJEInputError(f"no record could be mapped ({report.records} read: "
                            + "; ".join(f"{s.count} {r}" for r, s in report.skipped.items()) + ")", source=str(path))
    doc = {"import_id": iid, "format": importer.name, "version": importer.version, "source": path.name,
           "mapping": mapping.declared(), "created_at": datetime.now(timezone.utc).isoformat(),
           "objects": entries, "report": report.to_dict()}
    if not st.put_if_absent(mkey, json.dumps(doc, indent=1, sort_keys=True).encode()):
        log.info("%s was written by a concurrent import of the same source", st.url(mkey))
    log.info("imported %s: %d row(s) written in %d object(s) under %s", path, report.written, len(entries), st.url())
    return report
