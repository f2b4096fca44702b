"""Anchor sets and their periodic judge scores in object storage.

An **anchor set** is a fixed list of (prompt, response) pairs, some with an oracle label, that a
judge re-scores every period so that its drift can be measured (`cje_engine.drift.monitor`). Layout
under a storage root::

    anchors/<set>/v000001.parquet            the anchors, version 1 (create-only, never overwritten)
    anchors/<set>/v000001.manifest.json      its manifest: content hash, file sha256, counts
    anchors/<set>/v000002.parquet            a later version (e.g. more oracle labels)
    ...
    anchor_scores/<set>/dt=YYYY-MM-DD/part-<id>.parquet    judge scores, partitioned by UTC date

Anchor columns: ``anchor_id`` (string, unique), ``prompt`` (string), ``response`` (string),
optional ``oracle_label`` (float, null = unlabelled) and optional ``prompt_id`` (string: the
cluster of an anchor when several anchors share a prompt; used for clustered standard errors).
Other columns are kept as written.

Versions: `write_anchor_set` writes the Parquet object with ``put_if_absent`` (the claim of the
version number) and then its manifest, also create-only. A version exists for readers once its
manifest exists. Writing content identical to the latest version (same content hash) returns
that version instead of creating a new one (idempotent). A writer that loses a race for a version
number takes the next one; a data object left without a manifest by a crashed writer is adopted
if its bytes are exactly the new content, else skipped.

Score rows: ``anchor_id`` (string), ``judge_id`` (string: the judge and its version),
``ts`` (timestamp, UTC), ``judge_score`` (float). A **look** is every score row of one judge
id on one UTC day (``dt`` partition); an anchor scored more than once within a look keeps its
latest score (by ``ts``). Malformed objects (not Parquet, missing or mistyped columns,
null/non-numeric/non-finite scores, anchor ids the anchor set does not have) raise
`CJEInputError` naming the object key and the row.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from typing import Any, Iterable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cje_engine.errors import CJEInputError

from flows.storage.arrow_threads import read_parquet_bytes
from flows.storage.logs import PARTITION, as_date, column_kind, is_work_path, partition_of
from flows.storage.objects import NotFoundError, Storage

log = logging.getLogger(__name__)

ANCHORS = "anchors"
SCORES = "anchor_scores"
ANCHOR_REQUIRED = ("anchor_id", "prompt", "response")
SCORE_REQUIRED = ("anchor_id", "judge_id", "ts", "judge_score")
SCORE_SCHEMA = pa.schema([("anchor_id", pa.string()), ("judge_id", pa.string()),
                          ("ts", pa.timestamp("us", tz="UTC")), ("judge_score", pa.float64())])
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_VERSION_RE = re.compile(r"^v(\d{6})\.parquet$")
_MANIFEST_RE = re.compile(r"^v(\d{6})\.manifest\.json$")
_MAX_RACES = 50


def check_name(name: Any, what: str = "anchor set name") -> str:
    """A name usable as one path segment (letters, digits, ``. _ -``)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise CJEInputError(f"{what} {name!r} must be 1-100 letters, digits, '.', '_' or '-' "
                            "(starting with a letter or digit)")
    return name


def anchor_key(set_name: str, version: int) -> str:
    """Storage key of version ``version`` of anchor set ``set_name`` (Parquet)."""
    return f"{ANCHORS}/{check_name(set_name)}/v{int(version):06d}.parquet"


def manifest_key(set_name: str, version: int) -> str:
    """Storage key of the manifest of version ``version`` of anchor set ``set_name``."""
    return f"{ANCHORS}/{check_name(set_name)}/v{int(version):06d}.manifest.json"


def scores_prefix(set_name: str) -> str:
    """Storage prefix of the judge score files of anchor set ``set_name``."""
    return f"{SCORES}/{check_name(set_name)}/"


# --------------------------------------------------------------------------- anchor sets


@dataclass(frozen=True)
class AnchorSet:
    """One version of an anchor set.

    Attributes
    ----------
    name : str
    version : int
    table : pyarrow.Table
        Canonical anchors (sorted by ``anchor_id``).
    manifest : dict
        ``content_sha256``, ``file_sha256``, ``n_anchors``, ``n_labelled``, ``columns``,
        ``created_at``, ``key`` and the caller's ``metadata``.
    """

    name: str
    version: int
    table: pa.Table = field(repr=False)
    manifest: dict = field(repr=False)

    @property
    def anchor_ids(self) -> list[str]:
        """The anchors' ids, in table order."""
        return self.table.column("anchor_id").to_pylist()

    @property
    def content_sha256(self) -> str:
        """sha256 of the version's content, as its manifest records it."""
        return str(self.manifest["content_sha256"])

    def labels(self) -> pd.Series:
        """Oracle labels by anchor id (NaN where unlabelled; all NaN without the column)."""
        ids = pd.Index(self.anchor_ids, name="anchor_id", dtype=object)
        if "oracle_label" not in self.table.column_names:
            return pd.Series(np.full(len(ids), np.nan), index=ids)
        vals = self.table.column("oracle_label").to_numpy(zero_copy_only=False).astype(float)
        return pd.Series(vals, index=ids)

    def clusters(self) -> pd.Series | None:
        """``prompt_id`` by anchor id when the set has that column, else None."""
        if "prompt_id" not in self.table.column_names:
            return None
        return pd.Series(self.table.column("prompt_id").to_pylist(),
                         index=pd.Index(self.anchor_ids, name="anchor_id", dtype=object), dtype=object)

    def items(self) -> list[dict]:
        """``{"anchor_id", "prompt", "response"}`` per anchor, for a `flows.integrations.scorer.JudgeScorer`."""
        return [{"anchor_id": a, "prompt": p, "response": r} for a, p, r in zip(
            self.table.column("anchor_id").to_pylist(), self.table.column("prompt").to_pylist(),
            self.table.column("response").to_pylist())]



def _col(table: pa.Table, name: str, typ: pa.DataType) -> pa.ChunkedArray:
    arr = table.column(name)
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    return arr if arr.type == typ else arr.cast(typ)


def _first_null(arr: pa.ChunkedArray) -> int | None:
    if not arr.null_count:
        return None
    return int(pc.index(pc.is_null(arr), True).as_py())


def normalize_anchors(table: Any, source: str = "<anchors>") -> pa.Table:
    """Validate anchors and return them canonical: typed columns, sorted by ``anchor_id``.

    Raises `CJEInputError` naming ``source``, the column and the row of the first problem.
    """
    if isinstance(table, pd.DataFrame):
        table = pa.Table.from_pandas(table, preserve_index=False)
    if not isinstance(table, pa.Table):
        raise CJEInputError(f"anchors must be a pyarrow Table or pandas DataFrame, got {type(table).__name__}",
                            source=source)
    names = table.column_names
    for col in ANCHOR_REQUIRED:
        if col not in names:
            raise CJEInputError(f"required anchor column is missing (found {names}; required "
                                f"{list(ANCHOR_REQUIRED)})", source=source, column=col)
    kinds = {"anchor_id": ("string", "integer"), "prompt": ("string",), "response": ("string",),
             "prompt_id": ("string", "integer"), "oracle_label": ("float", "integer", "null")}
    for col, ok in kinds.items():
        if col in names and column_kind(table.schema.field(col).type) not in ok:
            raise CJEInputError(f"has type {table.schema.field(col).type}, expected "
                                f"{'a number' if col == 'oracle_label' else 'a string'}", source=source, column=col)
    if table.num_rows < 1:
        raise CJEInputError("the anchor set is empty", source=source)
    out = table
    for col, typ in (("anchor_id", pa.string()), ("prompt", pa.string()), ("response", pa.string()),
                     ("prompt_id", pa.string()), ("oracle_label", pa.float64())):
        if col in names:
            out = out.set_column(out.schema.get_field_index(col), pa.field(col, typ), _col(out, col, typ))
    for col in ("anchor_id", "prompt", "response", "prompt_id"):
        if col in names and (row := _first_null(out.column(col))) is not None:
            raise CJEInputError("is null; every anchor needs it", source=source, column=col, row=row)
    if "oracle_label" in names:
        lab = out.column("oracle_label").to_numpy(zero_copy_only=False).astype(float)
        nulls = pc.is_null(out.column("oracle_label")).to_numpy(zero_copy_only=False)
        bad = ~np.isfinite(lab) & ~nulls
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise CJEInputError(f"value {lab[i]!r} is not a finite number (use null for unlabelled anchors)",
                                source=source, column="oracle_label", row=i)
    ids = out.column("anchor_id").to_pylist()
    seen: dict[str, int] = {}
    for i, a in enumerate(ids):
        if a in seen:
            raise CJEInputError(f"anchor_id {a!r} appears twice (rows {seen[a]} and {i})", source=source,
                                column="anchor_id", row=i)
        seen[a] = i
    return out.sort_by("anchor_id")


def content_hash(anchors: pa.Table) -> str:
    """sha256 of the canonical anchors (Arrow IPC stream of the sorted, typed table)."""
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, anchors.schema) as writer:
        writer.write_table(anchors)
    return hashlib.sha256(sink.getvalue()).hexdigest()


def list_versions(st: Storage, set_name: str) -> list[int]:
    """Published versions of an anchor set (those with a manifest), ascending."""
    prefix = f"{ANCHORS}/{check_name(set_name)}/"
    out = []
    for info in st.list(prefix):
        m = _MANIFEST_RE.match(info.key[len(prefix):])
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


def _claimed_versions(st: Storage, set_name: str) -> list[int]:
    prefix = f"{ANCHORS}/{check_name(set_name)}/"
    return sorted(int(m.group(1)) for info in st.list(prefix) if (m := _VERSION_RE.match(info.key[len(prefix):])))


def read_manifest(st: Storage, set_name: str, version: int) -> dict:
    """The manifest of one anchor-set version.

    Parameters
    ----------
    st : Storage
    set_name : str
    version : int

    Returns
    -------
    dict
        The manifest (with ``content_sha256`` and ``file_sha256``); a missing, unreadable or incomplete
        manifest is a `CJEInputError` naming its location.
    """
    key = manifest_key(set_name, version)
    try:
        raw = st.read_bytes(key)
    except NotFoundError:
        raise CJEInputError(f"anchor set {set_name!r} has no version {version} (no manifest)",
                            source=st.url(key)) from None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise CJEInputError(f"manifest is not valid JSON: {exc}", source=st.url(key)) from None
    if not isinstance(doc, dict) or "content_sha256" not in doc or "file_sha256" not in doc:
        raise CJEInputError("manifest lacks content_sha256/file_sha256", source=st.url(key))
    return doc


def write_anchor_set(st: Storage, set_name: str, anchors: Any, *, metadata: dict | None = None) -> AnchorSet:
    """Store a new version of an anchor set (create-only); identical content is not re-versioned.

    Parameters
    ----------
    st : Storage
    set_name : str
    anchors : pyarrow.Table or pandas.DataFrame
        Columns ``anchor_id, prompt, response`` and optionally ``oracle_label``, ``prompt_id``.
    metadata : dict, optional
        Free-form JSON kept in the manifest (source, author, ...).

    Returns
    -------
    AnchorSet
        The version written, or the latest version when its content is identical.
    """
    check_name(set_name)
    table = normalize_anchors(anchors, source=f"anchor set {set_name!r}")
    chash = content_hash(table)
    versions = list_versions(st, set_name)
    if versions:
        latest = read_manifest(st, set_name, versions[-1])
        if latest.get("content_sha256") == chash:
            log.info("anchor set %s: content identical to version %d; nothing written", set_name, versions[-1])
            return read_anchor_set(st, set_name, versions[-1])
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    data = buf.getvalue()
    fsha = hashlib.sha256(data).hexdigest()
    labelled = 0
    if "oracle_label" in table.column_names:
        labelled = table.num_rows - table.column("oracle_label").null_count
    claimed = _claimed_versions(st, set_name)
    version = max(claimed + versions + [0]) + 1
    for _ in range(_MAX_RACES):
        key = anchor_key(set_name, version)
        if st.put_if_absent(key, data) or (
                not st.exists(manifest_key(set_name, version)) and st.read_bytes(key) == data):
            manifest = {
                "set_name": set_name, "version": version, "key": key, "content_sha256": chash,
                "file_sha256": fsha, "n_anchors": table.num_rows, "n_labelled": int(labelled),
                "columns": table.column_names, "created_at": datetime.now(timezone.utc).isoformat(),
                "metadata": dict(metadata or {}),
            }
            if st.put_if_absent(manifest_key(set_name, version), json.dumps(manifest, indent=2).encode()):
                log.info("anchor set %s: wrote version %d (%d anchors, %d labelled) to %s", set_name, version,
                         table.num_rows, labelled, st.url(key))
                return AnchorSet(set_name, version, table, manifest)
            if read_manifest(st, set_name, version).get("content_sha256") == chash:
                return read_anchor_set(st, set_name, version)  # a concurrent writer of the same content won
        version += 1
    raise CJEInputError(f"could not claim a version number for anchor set {set_name!r} after {_MAX_RACES} tries",
                        source=st.url(f"{ANCHORS}/{set_name}/"))


def read_anchor_set(st: Storage, set_name: str, version: int | None = None) -> AnchorSet:
    """Read one version (default: the latest) and check it against its manifest's sha256."""
    check_name(set_name)
    if version is None:
        versions = list_versions(st, set_name)
        if not versions:
            raise CJEInputError(f"no anchor set {set_name!r}: no versions under {ANCHORS}/{set_name}/",
                                source=st.url(f"{ANCHORS}/{set_name}/"))
        version = versions[-1]
    manifest = read_manifest(st, set_name, int(version))
    key = anchor_key(set_name, int(version))
    try:
        data = st.read_bytes(key)
    except NotFoundError:
        raise CJEInputError(f"anchor set {set_name!r} version {version}: the data object is missing",
                            source=st.url(key)) from None
    if hashlib.sha256(data).hexdigest() != manifest["file_sha256"]:
        raise CJEInputError("anchor file does not match the sha256 in its manifest (modified after writing?)",
                            source=st.url(key))
    try:
        table = read_parquet_bytes(data)
    except (pa.ArrowInvalid, OSError) as exc:
        raise CJEInputError(f"is not a readable Parquet anchor file: {exc}", source=st.url(key)) from None
    return AnchorSet(set_name, int(version), normalize_anchors(table, st.url(key)), manifest)


# --------------------------------------------------------------------------- scores


def _canonical_scores(table: pa.Table, source: str) -> pa.Table:
    """Check and cast score rows to `SCORE_SCHEMA` (extra columns are dropped)."""
    names = table.column_names
    for col in SCORE_REQUIRED:
        if col not in names:
            raise CJEInputError(f"required score column is missing (found {names}; required "
                                f"{list(SCORE_REQUIRED)})", source=source, column=col)
    kinds = {"anchor_id": ("string", "integer"), "judge_id": ("string", "integer"), "ts": ("timestamp",),
             "judge_score": ("float", "integer", "string", "null")}
    for col, ok in kinds.items():
        if column_kind(table.schema.field(col).type) not in ok:
            want = {"ts": "a timestamp", "judge_score": "a number"}.get(col, "a string")
            raise CJEInputError(f"has type {table.schema.field(col).type}, expected {want}", source=source,
                                column=col)
    cols = {}
    for col in ("anchor_id", "judge_id", "ts"):
        arr = _col(table, col, SCORE_SCHEMA.field(col).type)
        if (row := _first_null(arr)) is not None:
            raise CJEInputError("is null; every score row needs it", source=source, column=col, row=row)
        cols[col] = arr
    raw = table.column("judge_score")
    if pa.types.is_dictionary(raw.type):
        raw = raw.cast(raw.type.value_type)
    if (row := _first_null(raw)) is not None:
        raise CJEInputError("judge_score is null; expected a number", source=source, column="judge_score", row=row)
    if column_kind(raw.type) == "string":
        values = raw.to_pylist()
        conv = pd.to_numeric(pd.Series(values, dtype=object), errors="coerce").to_numpy(dtype=float)
        bad = np.flatnonzero(np.isnan(conv))
        if bad.size:
            i = int(bad[0])
            raise CJEInputError(f"judge_score {values[i]!r} is not a number", source=source, column="judge_score",
                                row=i)
        score = pa.chunked_array([pa.array(conv, pa.float64())])
    else:
        score = raw.cast(pa.float64())
    vals = score.to_numpy()
    bad = np.flatnonzero(~np.isfinite(vals))
    if bad.size:
        i = int(bad[0])
        raise CJEInputError(f"judge_score {vals[i]!r} is not a finite number", source=source,
                            column="judge_score", row=i)
    cols["judge_score"] = score
    return pa.table(cols, schema=SCORE_SCHEMA)


def write_anchor_scores(st: Storage, set_name: str, scores: Any, *, basename: str | None = None) -> list[str]:
    """Write judge score rows under ``anchor_scores/<set>/dt=YYYY-MM-DD/part-<basename>.parquet``.

    One object per UTC date of ``ts`` (naive timestamps are taken as UTC). ``basename``
    defaults to a random id (repeated calls append). Returns the keys written.
    """
    check_name(set_name)
    if isinstance(scores, pd.DataFrame):
        scores = pa.Table.from_pandas(scores, preserve_index=False)
    if not isinstance(scores, pa.Table):
        raise CJEInputError(f"scores must be a pyarrow Table or pandas DataFrame, got {type(scores).__name__}")
    table = _canonical_scores(scores, "<scores>")
    if table.num_rows == 0:
        raise CJEInputError("no score rows to write", source="<scores>")
    name = basename or uuid.uuid4().hex
    if not re.fullmatch(r"[A-Za-z0-9._=-]+", name):
        raise CJEInputError(f"basename {name!r} may only contain letters, digits and . _ = -")
    days = table.column("ts").cast(pa.date32())
    written = []
    for day in sorted(pc.unique(days).to_pylist()):
        part = table.filter(pc.equal(days, pa.scalar(day, pa.date32())))
        key = f"{scores_prefix(set_name)}{PARTITION}={day.isoformat()}/part-{name}.parquet"
        with st.open_output(key) as out:
            pq.write_table(part, out, compression="zstd")
        written.append(key)
    log.info("wrote %d anchor score row(s) of set %s in %d partition(s)", table.num_rows, set_name, len(written))
    return written


def score_files(st: Storage, set_name: str, start: date | str | None = None,
                end: date | str | None = None) -> list:
    """Score objects (``ObjectInfo``) of a set with ``start <= dt <= end`` (bounds optional)."""
    lo = as_date(start, "start date") if start is not None else None
    hi = as_date(end, "end date") if end is not None else None
    out = []
    for info in st.list(scores_prefix(set_name)):
        name = info.key.rsplit("/", 1)[-1]
        dt = partition_of(info.key)
        if dt is None or not name.endswith(".parquet") or is_work_path(info.key[len(scores_prefix(set_name)):]):
            continue
        d = date.fromisoformat(dt)
        if (lo is None or d >= lo) and (hi is None or d <= hi):
            out.append(info)
    return out


def read_anchor_scores(st: Storage, files: Iterable, known_ids: Iterable[str] | None = None) -> pa.Table:
    """Read score objects into one table with a ``dt`` column (from the key).

    ``known_ids``: the anchor set's ids; a row naming another anchor raises `CJEInputError`
    with the object and row. Rows are returned in file then row order.
    """
    known = set(known_ids) if known_ids is not None else None
    parts = []
    for f in files:
        key = f if isinstance(f, str) else f.key
        source = st.url(key)
        try:
            data = st.read_bytes(key)
        except NotFoundError:
            raise CJEInputError("score object disappeared after listing", source=source) from None
        try:
            raw = read_parquet_bytes(data)
        except (pa.ArrowInvalid, OSError) as exc:
            raise CJEInputError(f"is not a readable Parquet score file: {exc}", source=source) from None
        table = _canonical_scores(raw, source)
        dt = partition_of(key)
        if dt is None:
            raise CJEInputError("object is not under a dt=YYYY-MM-DD/ partition folder", source=source)
        if known is not None:
            ids = table.column("anchor_id").to_pylist()
            for i, a in enumerate(ids):
                if a not in known:
                    raise CJEInputError(f"anchor_id {a!r} is not in the anchor set", source=source,
                                        column="anchor_id", row=i)
        parts.append(table.append_column(PARTITION, pa.array([dt] * table.num_rows, pa.string())))
    if not parts:
        return pa.table({**{f.name: pa.array([], f.type) for f in SCORE_SCHEMA},
                         PARTITION: pa.array([], pa.string())})
    return pa.concat_tables(parts)


@dataclass(frozen=True)
class Look:
    """The scores of one look: one judge id on one UTC day.

    Attributes
    ----------
    key : str
        ``"<dt>/<judge_id>"``.
    dt : str
    judge_id : str
    scores : pandas.Series
        Latest score per anchor, indexed by ``anchor_id`` (sorted).
    ts_min, ts_max : str
        ISO timestamps of the look's first and last row.
    n_rows : int
        Rows before keeping the latest score per anchor.
    """

    key: str
    dt: str
    judge_id: str
    scores: pd.Series = field(repr=False)
    ts_min: str
    ts_max: str
    n_rows: int

    def fingerprint(self) -> str:
        """sha256 of the (anchor_id, score) pairs: detects rewritten reference data."""
        blob = json.dumps([[a, float(v)] for a, v in self.scores.items()]).encode()
        return hashlib.sha256(blob).hexdigest()


def split_looks(table: pa.Table) -> list[Look]:
    """Group score rows into looks, ordered by (dt, first ts, judge id)."""
    if table.num_rows == 0:
        return []
    df = table.select(["anchor_id", "judge_id", "ts", "judge_score", PARTITION]).to_pandas()
    df["_row"] = np.arange(len(df))
    out = []
    for (dt, judge), g in df.groupby([PARTITION, "judge_id"], sort=False):
        g = g.sort_values(["ts", "_row"], kind="stable")
        latest = g.drop_duplicates("anchor_id", keep="last").sort_values("anchor_id")
        s = pd.Series(latest["judge_score"].to_numpy(dtype=float),
                      index=pd.Index(latest["anchor_id"].astype(str).to_numpy(), name="anchor_id", dtype=object))
        out.append(Look(f"{dt}/{judge}", str(dt), str(judge), s, g["ts"].min().isoformat(),
                        g["ts"].max().isoformat(), int(len(g))))
    out.sort(key=lambda lk: (lk.dt, lk.ts_min, lk.judge_id))
    return out


__all__ = ["AnchorSet", "Look", "write_anchor_set", "read_anchor_set", "list_versions", "normalize_anchors",
           "write_anchor_scores", "read_anchor_scores", "score_files", "split_looks", "anchor_key",
           "manifest_key", "scores_prefix", "check_name", "SCORE_SCHEMA"]


def label_anchors(st: Storage, set_name: str, labels: dict[str, float], *, source: str,
                  request_ids: list[str] | None = None) -> AnchorSet:
    """A new version of an anchor set with returned oracle labels (the earlier versions stay as they were).

    ``labels`` maps anchor ids of the latest version to labels; an unknown id is a `CJEInputError`.
    The version's metadata records the source, the requests and which anchors were labelled
    (``labelled``) and relabelled (``relabelled``: they had a different label before).
    """
    latest = read_anchor_set(st, set_name)
    ids = latest.anchor_ids
    unknown = sorted(set(labels) - set(ids))
    if unknown:
        raise CJEInputError(f"anchor id(s) {unknown[:5]} are not in anchor set {set_name!r} version {latest.version}",
                            source=st.url(anchor_key(set_name, latest.version)), column="anchor_id")
    old = latest.labels()
    new = old.copy()
    for a, y in labels.items():
        new[a] = float(y)
    relabelled = sorted(a for a in labels if not np.isnan(old[a]) and float(old[a]) != float(labels[a]))
    table = latest.table
    col = pa.array(new.reindex(ids).to_numpy(), pa.float64(), from_pandas=True)
    table = (table.set_column(table.schema.get_field_index("oracle_label"), "oracle_label", col)
             if "oracle_label" in table.column_names else table.append_column("oracle_label", col))
    meta = {"source": source, "request_ids": sorted(request_ids or []), "labelled": sorted(labels),
            "relabelled": relabelled, "from_version": latest.version}
    return write_anchor_set(st, set_name, table, metadata=meta)


def labelled_since(st: Storage, set_name: str, since: str | None = None) -> set[str]:
    """Anchor ids labelled by `label_anchors` versions created at or after ``since`` (ISO time)."""
    out: set[str] = set()
    for v in list_versions(st, set_name):
        m = read_manifest(st, set_name, v)
        if since is None or str(m.get("created_at", "")) >= since:
            out.update((m.get("metadata") or {}).get("labelled") or [])
    return out
