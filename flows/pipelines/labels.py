"""The ``labels`` flow: returned oracle labels into the label store, then re-evaluation.

Steps (Prefect tasks):

1. ``read_labels``   a Parquet, CSV or JSONL file (local path, ``file://`` or ``s3://`` URI);
2. ``locate``        find every ``response_id``: first in the label requests' manifests
                     (which record its policy, log date and inclusion probability), then, for
                     the rest, in the logs (``response_id`` and ``dt`` only, ids pushed down);
3. ``validate``      unknown ids, values outside the label scale, duplicate ids within the
                     file and probabilities disagreeing with the request are errors naming the
                     file, column and row; ``label_probability`` is filled from the request
                     (its ``inclusion_probability``) where the file has none;
4. ``append``        `flows.storage.labels.LabelStore.append`: append-only, idempotent (same content
                     -> same version), a conflicting second label is kept and flagged;
5. ``fulfil``        requests whose every row now has a label get a fulfilment marker;
6. re-evaluation     for every declared (or passed-in) evaluation that uses this label store,
                     every *published* window containing a touched log date is evaluated
                     again with `flows.pipelines.audit.evaluate_and_audit` (never a window
                     nobody published; a window with days that have no logs is skipped and
                     named, unless ``partial_windows``);
7. ``refresh_pages`` the results index and trend pages of the evaluations whose requests
                     received labels (`flows.pipelines.pages`).  The label-store version is
                     part of the run key, so the new result is published beside the old one,
                     which stays readable (`list_runs` / `read_run`); ``latest.json`` moves.
                     Once it completed, the label store records it for that version
                     (`LabelStore.mark_reevaluated`); a retry of the same labels ("already
                     stored") whose version has no such record re-evaluates (a ``kill -9``
                     between the commit and the re-evaluation loses nothing).
"""
from __future__ import annotations

import logging
import os
from datetime import date
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.utilities.annotations import quote

from cje_engine.errors import CJEInputError

from flows.integrations.labelling.base import load_document
from flows.label_requests.answers import (answer_formats, detect_format, parse_answers,
                                          parse_table, rescale, restore_csv_table)
from flows.label_requests.config import RequestConfig
from flows.label_requests.manifests import list_requests, mark_fulfilled
from flows.pipelines.audit import evaluate_and_audit
from flows.pipelines.pages import refresh_pages
from flows.storage.anchors import label_anchors
from flows.storage.arrow_threads import arrow_buffer, read_parquet_bytes
from flows.storage.objects import NotFoundError, StorageConfig
from flows.storage.publish import list_runs
from flows.runtime.guard import checked_flow
from flows.runtime.retries import TASK_TIMEOUT, retry_unless_bad_input
from flows.reports.artifacts import labels_artifacts

log = logging.getLogger(__name__)

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl",
           ".json": "jsonl"}
_RETRY = dict(retries=2, retry_delay_seconds=[1.0, 5.0], cache_policy=NO_CACHE, **TASK_TIMEOUT)


_STORAGE_TASK = dict(_RETRY, retry_condition_fn=retry_unless_bad_input)


def _storage(uri: str, cfg: Any):
    from flows.storage.objects import Storage

    return Storage.for_uri(uri, cfg)


# --------------------------------------------------------------------------------------
# reading and validating (plain functions; the tasks wrap them)


def _split_uri(path: str) -> tuple[str, str]:
    """(root URI, object name) of a file path or URI."""
    p = str(path)
    if "://" in p and not p.startswith("file://"):
        root, _, name = p.rstrip("/").rpartition("/")
        return root, name
    local = Path(p[len("file://"):] if p.startswith("file://") else p).expanduser().resolve()
    return str(local.parent), local.name


def parse_labels(data: bytes, name: str, source: str) -> pa.Table:
    """Parse a label file by its extension (``.parquet``, ``.csv``, ``.jsonl``/``.ndjson``/``.json``)."""
    ext = Path(name).suffix.lower()
    fmt = FORMATS.get(ext)
    if fmt is None:
        raise CJEInputError(f"unknown label file type {ext or '(none)'!r}; expected one of {sorted(FORMATS)}",
                            source=source)
    try:
        if fmt == "parquet":
            return read_parquet_bytes(data)
        if fmt == "csv":
            opts = pacsv.ConvertOptions(column_types={"response_id": pa.string()})
            return restore_csv_table(pacsv.read_csv(pa.BufferReader(arrow_buffer(data)), convert_options=opts))
        schema = pa.schema([("response_id", pa.string())])
        return pajson.read_json(pa.BufferReader(arrow_buffer(data)),
                                parse_options=pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="infer"))
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError, ValueError) as exc:
        raise CJEInputError(f"is not a readable {fmt} label file: {' '.join(str(exc).split())[:200]}",
                            source=source) from None


def read_label_file(path: str, cfg: Any = None, answers_format: str = "auto", answer_field: str = "oracle_label",
                    id_field: str = "response_id") -> tuple[pa.Table, str, dict]:
    """Read returned labels: a table file, a Label Studio JSON export or Argilla records.

    Returns ``(table, display name (URL), info)``: the table has ``response_id``, ``oracle_label``
    (as given, on the answers' scale) and ``label_probability`` when the file has it; ``info``
    says the format, the answers ignored (cancelled, not submitted), duplicates counted once and
    items without an answer (`flows.label_requests.answers`).
    """
    root, name = _split_uri(path)
    st = _storage(root, cfg)
    try:
        data = st.read_bytes(name)
    except NotFoundError:
        raise CJEInputError("label file not found", source=st.url(name)) from None
    source = st.url(name)
    if answers_format not in answer_formats():
        raise CJEInputError(f"unknown answers format {answers_format!r}; expected one of {list(answer_formats())}")
    fmt = detect_format(data, name) if answers_format == "auto" else answers_format
    if fmt == "table":
        table = parse_labels(data, name if Path(name).suffix.lower() in FORMATS else name + ".jsonl", source)
        if (id_field, answer_field) == ("response_id", "oracle_label"):
            return table, source, {"format": "table"}
        parsed = parse_table(table, source, answer_field=answer_field, id_field=id_field)
    else:  # a registered labelling tool's own answers (label-studio, argilla, ...)
        parsed = parse_answers(fmt, load_document(data, source), source, answer_field, id_field)
    info = {"format": fmt, "ignored": parsed.ignored, "duplicates": parsed.duplicates,
            "unanswered": len(parsed.unanswered), "task_ids": parsed.task_ids}
    if not parsed.ids:
        raise CJEInputError(f"no answers in the {fmt} file ({len(parsed.unanswered)} item(s) without one, "
                            f"ignored: {parsed.ignored or 'none'})", source=source)
    return parsed.table(), source, info


def _column(table: pa.Table, name: str, typ: pa.DataType, source: str) -> pa.ChunkedArray:
    arr = table.column(name)
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    try:
        return arr.cast(typ)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        raise CJEInputError(f"has type {arr.type}, expected {'a string' if typ == pa.string() else 'a number'}",
                            source=source, column=name) from None


def validate_labels(table: pa.Table, source: str, known: Mapping[str, Mapping[str, Any]],
                    label_scale: Sequence[float] = (0.0, 1.0)) -> pa.Table:
    """Check a returned label file and give it the label store's columns.

    Parameters
    ----------
    table : pyarrow.Table
        Needs ``response_id`` and ``oracle_label``; ``label_probability`` is optional.
    source : str
        File name used in errors.
    known : dict
        ``response_id -> {"inclusion_probability": float | None, ...}`` for every id the logs
        (or a request) know.
    label_scale : (lo, hi)
        Labels must lie in ``[lo, hi]``.

    Raises
    ------
    CJEInputError
        Naming the file, the column and the (zero-based) row.
    """
    for col in ("response_id", "oracle_label"):
        if col not in table.column_names:
            raise CJEInputError(f"required label column is missing (found {table.column_names})", source=source,
                                column=col)
    if table.num_rows == 0:
        raise CJEInputError("the label file has no rows", source=source)
    rid = _column(table, "response_id", pa.string(), source)
    lab = _column(table, "oracle_label", pa.float64(), source)
    for name, arr in (("response_id", rid), ("oracle_label", lab)):
        if arr.null_count:
            raise CJEInputError("is empty; every row needs it", source=source, column=name,
                                row=pc.index(pc.is_null(arr), True).as_py())
    ids = rid.to_pylist()
    y = lab.to_numpy()
    lo, hi = float(label_scale[0]), float(label_scale[1])
    bad = ~np.isfinite(y) | (y < lo) | (y > hi)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CJEInputError(f"label {float(y[i])!r} is outside the label scale [{lo:g}, {hi:g}]", source=source,
                            column="oracle_label", row=i)
    seen: dict[str, int] = {}
    for i, r in enumerate(ids):
        if r in seen:
            raise CJEInputError(f"response_id {r!r} appears twice in the file (rows {seen[r]} and {i}); give one "
                                "label per response", source=source, column="response_id", row=i)
        seen[r] = i
    for i, r in enumerate(ids):
        if r not in known:
            raise CJEInputError(f"unknown response_id {r!r}: not in any label request nor in the logs",
                                source=source, column="response_id", row=i)
    if "label_probability" in table.column_names:
        given = _column(table, "label_probability", pa.float64(), source).to_numpy(zero_copy_only=False)
    else:
        given = np.full(len(ids), np.nan)
    prob = np.empty(len(ids))
    for i, r in enumerate(ids):
        req = known[r].get("inclusion_probability")
        if req is not None and np.isfinite(given[i]) and not np.isclose(given[i], req, rtol=1e-9, atol=0):
            raise CJEInputError(f"label_probability {float(given[i])!r} disagrees with the inclusion probability {req!r} "
                                f"recorded by request {known[r].get('request_id')} (leave it empty to use the "
                                "request's)", source=source, column="label_probability", row=i)
        prob[i] = req if req is not None else given[i]
    badp = np.isfinite(prob) & ~((prob > 0) & (prob <= 1))
    if badp.any():
        i = int(np.flatnonzero(badp)[0])
        raise CJEInputError(f"label_probability {float(prob[i])!r} is not in (0, 1]", source=source,
                            column="label_probability", row=i)
    return pa.table({"response_id": pa.array(ids, pa.string()), "oracle_label": pa.array(y, pa.float64()),
                     "label_probability": pa.array(prob, pa.float64(), from_pandas=True)})


def _from_requests(requests: Sequence[Mapping], ids: set[str]) -> dict[str, dict]:
    """What the requests know about these ids (the latest request wins)."""
    out: dict[str, dict] = {}
    for m in requests:
        for row in m.get("rows", []):
            if row["response_id"] in ids:
                out[row["response_id"]] = {"inclusion_probability": row.get("inclusion_probability"),
                                           "dt": row.get("dt"), "policy": row.get("policy"),
                                           "logs_uri": m.get("logs_uri"), "request_id": m["request_id"],
                                           "evaluation": m.get("evaluation"), "label_scale": m.get("label_scale")}
    return out


def _scan_logs(logs_uri: str, cfg: Any, ids: set[str], lookback: tuple[date, date] | None,
               mapping: dict[str, str] | None = None) -> dict[str, dict]:
    """Look ids up in the logs: ``response_id`` and ``dt`` only, the id filter pushed into the scan
    (``mapping``: the evaluation's ``columns:``, the logs' own names)."""
    from flows.storage.logs import PARTITION, discover_partitions, is_log_object, read_window

    st = _storage(logs_uri, cfg)
    if lookback is not None:
        files = discover_partitions(st, *lookback)
    else:
        files = [f for f in st.list(f"{PARTITION}=") if is_log_object(f.key)]
    if not files or not ids:
        return {}
    wanted = pa.array(sorted(ids), pa.string())
    table = read_window(st, files, columns=["response_id", PARTITION], check_unique=False, mapping=mapping,
                        row_filter=lambda field: field("response_id").isin(wanted))
    return {r: {"inclusion_probability": None, "dt": d, "logs_uri": logs_uri}
            for r, d in zip(table.column("response_id").to_pylist(), table.column(PARTITION).to_pylist())}


# --------------------------------------------------------------------------------------
# tasks


@task(name="read_labels", **_STORAGE_TASK)
def read_labels_task(path: str, cfg: Any, answers_format: str, answer_field: str,
                     id_field: str) -> tuple[pa.Table, str, dict]:
    """Task: read a label file into a table (`read_label_file`); returns the table, its source name and details."""
    return read_label_file(path, cfg, answers_format, answer_field, id_field)


@task(name="locate", **_STORAGE_TASK)
def locate_task(table: pa.Table, source: str, requests_uri: str, logs_uris: list[str], cfg: Any,
                lookback: tuple[date, date] | None,
                mappings: dict[str, dict] | None = None) -> tuple[dict, list[dict]]:
    """Where every id of the file comes from (requests first, then the logs; ``mappings``: logs URI
    -> the column mapping of the evaluation reading it)."""
    mappings = mappings or {}
    if "response_id" not in table.column_names:
        raise CJEInputError(f"required label column is missing (found {table.column_names})", source=source,
                            column="response_id")
    ids = {str(x) for x in _column(table, "response_id", pa.string(), source).to_pylist() if x is not None}
    requests = list_requests(_storage(requests_uri, cfg))
    known = _from_requests(requests, ids)
    for uri in logs_uris:
        missing = ids - set(known)
        if not missing:
            break
        for r, v in _scan_logs(uri, cfg, missing, lookback, mappings.get(uri)).items():
            known.setdefault(r, v)
    # A request row without a log date: take it from the logs when they have it.
    undated = {r for r, v in known.items() if v.get("dt") is None}
    for uri in logs_uris:
        if not undated:
            break
        for r, v in _scan_logs(uri, cfg, undated, lookback, mappings.get(uri)).items():
            known[r]["dt"] = v["dt"]
            known[r].setdefault("logs_uri", uri)
        undated = {r for r, v in known.items() if v.get("dt") is None}
    return known, requests


@task(name="validate_labels", cache_policy=NO_CACHE, **TASK_TIMEOUT)
def validate_task(table: pa.Table, source: str, known: dict, label_scale: list[float]) -> pa.Table:
    """Task: check the labels against the known ids and the label scale (`validate_labels`)."""
    return validate_labels(table, source, known, label_scale)


@task(name="append_labels", **_STORAGE_TASK)
def append_task(labels_uri: str, cfg: Any, table: pa.Table, source_name: str) -> dict:
    """Append to the label store; report the version, whether it is new, and flagged conflicts."""
    from flows.storage.labels import LabelStore, label_conflicts

    store = LabelStore(_storage(labels_uri, cfg))
    before = store.version()
    version = store.append(table, source_name)
    stored = store.read(version=store.version())
    mine = set(table.column("response_id").to_pylist())
    conflicts = [r for r in label_conflicts(stored) if r in mine]
    if conflicts:
        get_run_logger().warning("%d label(s) conflict with earlier labels of the same response (kept and flagged): "
                                 "%s", len(conflicts), conflicts[:5])
    labelled = set(stored.column("response_id").to_pylist())
    return {"version": int(version), "new": bool(version > before), "version_before": int(before),
            "rows": table.num_rows, "conflicts": conflicts, "labelled_ids": labelled}


@task(name="fulfil_requests", **_STORAGE_TASK)
def fulfil_task(requests_uri: str, cfg: Any, requests: list[dict], labelled: set, version: int,
                source: str, anchors_done: set | None = None) -> list[dict]:
    """Mark requests whose every row (and anchor) has a label as fulfilled (``late`` when past the deadline)."""
    st = _storage(requests_uri, cfg)
    out = []
    for m in requests:
        set_name = str((m.get("drift") or {}).get("set_name"))
        ids = [r["response_id"] for r in m.get("rows", [])]
        got = sum(1 for r in ids if r in labelled)
        anchors = [str(a["anchor_id"]) for a in m.get("anchors") or []]
        got += sum(1 for a in anchors if (set_name, a) in (anchors_done or set()))
        ids += anchors
        entry = {"request_id": m["request_id"], "status": m.get("status"), "received": got, "requested": len(ids)}
        if m.get("status") in ("pending", "expired") and ids and got == len(ids):
            late = m.get("status") == "expired"
            mark_fulfilled(st, m["request_id"], {"label_store_version": version, "received": got, "source": source,
                                                 "late": late})
            entry.update(status="fulfilled", late=late)
        out.append(entry)
    return out



# --------------------------------------------------------------------------------------
# anchors and scales


def split_anchors(table: pa.Table, known: Mapping[str, Any], requests: Sequence[Mapping]
                  ) -> tuple[pa.Table, dict[str, float], dict[str, dict]]:
    """Separate anchor labels (ids of anchors that drift requests asked for) from response labels.

    Returns the response rows, ``{anchor_id: label}`` and ``{anchor_id: {"set_name", "request_id",
    "label_scale"}}``.  An id the logs or a request's rows know stays a response id.
    """
    anchor_map: dict[str, dict] = {}
    for m in requests:
        set_name = (m.get("drift") or {}).get("set_name")
        for a in m.get("anchors") or []:
            anchor_map[str(a["anchor_id"])] = {"set_name": set_name, "request_id": m["request_id"],
                                               "label_scale": m.get("label_scale")}
    ids = [str(x) for x in table.column("response_id").to_pylist()]
    is_anchor = [i not in known and i in anchor_map for i in ids]
    if not any(is_anchor):
        return table, {}, {}
    lab = table.column("oracle_label").cast(pa.float64()).to_pylist()
    anchors = {}
    for i, flag, y in zip(ids, is_anchor, lab):
        if flag:
            if y is None:
                raise CJEInputError(f"anchor {i!r} has an empty label", column="oracle_label")
            anchors[i] = float(y)
    keep = pa.array([not f for f in is_anchor])
    return table.filter(keep), anchors, {a: anchor_map[a] for a in anchors}


def scale_answers(table: pa.Table, anchors: dict[str, float], known: Mapping[str, Any], anchor_map: Mapping,
                  answer_scale: Sequence[float] | None, source: str
                  ) -> tuple[pa.Table, dict[str, float], list[float]]:
    """Map answers given on ``answer_scale`` onto the requests' label scale (see the flow's docs)."""
    scales = {tuple(v["label_scale"]) for v in list(known.values()) + list(anchor_map.values())
              if v.get("label_scale")}
    if len(scales) > 1:
        raise CJEInputError(f"the requests behind these labels use different label scales {sorted(scales)}; "
                            "ingest them separately", source=source)
    target = list(scales.pop()) if scales else None
    given = list(answer_scale) if answer_scale is not None else None
    if given is None or target is None or [float(x) for x in given] == [float(x) for x in target]:
        return table, anchors, list(given or target or [0.0, 1.0])
    ids = [str(x) for x in table.column("response_id").to_pylist()]
    vals = table.column("oracle_label").cast(pa.float64()).to_pylist()
    if any(v is None for v in vals):
        raise CJEInputError("is empty; every row needs it", source=source, column="oracle_label",
                            row=vals.index(None))
    mapped = rescale(vals, ids, [f"row {i}" for i in range(len(ids))], source, given, target)
    table = table.set_column(table.schema.get_field_index("oracle_label"), "oracle_label",
                             pa.array(mapped, pa.float64()))
    a_ids = list(anchors)
    a_vals = rescale([anchors[a] for a in a_ids], a_ids, [f"anchor {a}" for a in a_ids], source, given, target)
    log.info("answers on [%g, %g] mapped linearly onto the requests' label scale [%g, %g]", *given, *target)
    return table, dict(zip(a_ids, a_vals)), target


def _anchors_uri_for(set_name: str, anchors_uri: str | None, evaluations_file: str | None) -> str:
    if anchors_uri:
        return anchors_uri
    if evaluations_file:
        from flows.pipelines.drift_config import load_drift_monitors

        for spec in load_drift_monitors(evaluations_file).values():
            if spec.set_name == set_name:
                return spec.anchors_uri
    raise CJEInputError(f"labels for anchors of anchor set {set_name!r} (asked for by a drift request), but its "
                        "storage is unknown: pass --anchors-uri (anchors_uri) or declare the drift monitor in the "
                        "evaluations file")


@task(name="label_anchors", **_STORAGE_TASK)
def anchor_task(anchors: dict[str, float], anchor_map: dict[str, dict], anchors_uri: str | None,
                evaluations_file: str | None, cfg: Any, source: str) -> dict:
    """Write each anchor set's returned labels as a new version (`flows.storage.anchors.label_anchors`)."""
    by_set: dict[str, dict[str, float]] = {}
    for a, y in anchors.items():
        by_set.setdefault(str(anchor_map[a]["set_name"]), {})[a] = y
    out: dict[str, Any] = {"versions": [], "labelled": set()}
    for set_name, labs in sorted(by_set.items()):
        st = _storage(_anchors_uri_for(set_name, anchors_uri, evaluations_file), cfg)
        reqs = sorted({anchor_map[a]["request_id"] for a in labs})
        aset = label_anchors(st, set_name, labs, source=source, request_ids=reqs)
        out["versions"].append({"set_name": set_name, "version": aset.version, "labels": len(labs),
                                "relabelled": len(aset.manifest.get("metadata", {}).get("relabelled") or [])})
        out["labelled"] |= {(set_name, a) for a in labs}
        get_run_logger().info("anchor set %s: %d label(s) stored as version %d", set_name, len(labs), aset.version)
    return out


# --------------------------------------------------------------------------------------
# which windows to re-evaluate


def _specs(evaluations_file: str | None, evaluations: Sequence[Mapping] | None) -> list:
    from flows.config import validate_entry
    from flows.runtime.schedules import EvaluationSpec, load_evaluations

    specs = list(load_evaluations(evaluations_file).values()) if evaluations_file else []
    specs += [validate_entry(EvaluationSpec, dict(e) if isinstance(e, Mapping) else e, f"evaluations[{i}]")
              for i, e in enumerate(evaluations or [])]
    return specs


def affected_windows(dates: set[str], published: Sequence[str], max_windows: int) -> list[str]:
    """Published windows (``YYYY-MM-DD_YYYY-MM-DD``) of an evaluation that hold a touched log date.

    Only windows that exist as published runs are candidates: labels never create a window (the
    evaluation's declared window as of today may overlap a published one, or lack days); the newest
    ``max_windows`` (by end date) are returned, oldest first.
    """
    days = {date.fromisoformat(d) for d in dates if d}
    hit = []
    for w in set(published):
        a, b = w.split("_", 1)
        start, end = date.fromisoformat(a), date.fromisoformat(b)
        if any(start <= d <= end for d in days):
            hit.append(w)
    hit.sort(key=lambda w: (w.split("_", 1)[1], w), reverse=True)
    return sorted(hit[:max_windows])


def missing_days(logs_uri: str, cfg: Any, window: str) -> list[str]:
    """Days of ``window`` (``YYYY-MM-DD_YYYY-MM-DD``) without a log partition under ``logs_uri``."""
    from flows.storage.logs import discover_partitions, window_days

    a, b = window.split("_", 1)
    files = discover_partitions(_storage(logs_uri, cfg), a, b)
    return window_days([f.key for f in files], a, b)["missing_days"]


# --------------------------------------------------------------------------------------
# the flow


def _mappings(specs: Sequence[Any]) -> dict[str, dict]:
    """Logs URI -> the column mapping (``columns:``) of the evaluation reading it."""
    return {s.logs_uri: dict(s.columns) for s in specs if getattr(s, "columns", None)}


def _scope(labels_uri: str, logs_uri: str | None, evaluations_file: str | None, evaluations: Sequence[Mapping] | None,
           lookback_start: str | None, lookback_end: str | None) -> tuple[list, list[str], tuple[date, date] | None]:
    """The evaluations using this label store, the logs to look ids up in, the lookback range."""
    specs = [s for s in _specs(evaluations_file, evaluations)
             if os.path.normpath(s.labels_uri or s.logs_uri) == os.path.normpath(labels_uri)
             or (s.labels_uri or s.logs_uri) == labels_uri]
    logs_uris = list(dict.fromkeys(([logs_uri] if logs_uri else []) + [s.logs_uri for s in specs]))
    lookback = None
    if lookback_start or lookback_end:
        if not (lookback_start and lookback_end):
            raise CJEInputError("give both lookback_start and lookback_end (or neither)")
        lookback = (date.fromisoformat(lookback_start), date.fromisoformat(lookback_end))
    return specs, logs_uris, lookback


def _ingest(table: pa.Table, source: str, known: dict, label_scale: Sequence[float], labels_uri: str, cfg: Any,
            source_name: str) -> tuple[pa.Table, dict]:
    """Validate the response labels and append them to the label store (nothing when there are none)."""
    if not table.num_rows:
        return table.slice(0, 0), {"version": None, "new": False, "conflicts": [], "labelled_ids": set()}
    clean = validate_task(quote(table), source, known, list(label_scale))
    appended = append_task(labels_uri, quote(cfg), quote(clean), source_name)
    get_run_logger().info("labels from %s: %d row(s), label-store version %d (%s)", source, clean.num_rows,
                          appended["version"], "new" if appended["new"] else "already stored")
    return clean, appended


def reevaluate_windows(specs: Sequence[Any], touched: Sequence[str], cfg: Any, max_windows: int,
                       label_requests: Mapping | None,
                       partial_windows: bool = False) -> tuple[list[dict], list[dict], list[dict]]:
    """Run `evaluate_and_audit` on every published window of every evaluation holding a touched date.

    A window with days that have no logs is skipped (named in the third list, with its
    ``missing_days``) unless ``partial_windows``.  Returns (summaries, superseded runs, skipped windows).
    """
    reevaluations: list[dict] = []
    superseded: list[dict] = []
    skipped: list[dict] = []
    res_st = {}
    logger = get_run_logger()
    for spec in specs:
        spec_results = spec.results_uri or spec.logs_uri
        st = res_st.setdefault(spec_results, _storage(spec_results, cfg))
        published = sorted({r["window"] for r in list_runs(st, spec.name)})
        for w in affected_windows(set(touched), published, max_windows):
            gaps = missing_days(spec.logs_uri, cfg, w)
            if gaps and not partial_windows:
                reason = (f"{len(gaps)} day(s) of the window have no logs ({', '.join(gaps)}); not re-evaluated "
                          "(pass --partial-windows to publish it without them)")
                logger.warning("evaluation %s window %s: %s", spec.name, w, reason)
                skipped.append({"evaluation": spec.name, "window": w, "missing_days": gaps, "reason": reason})
                continue
            earlier = list_runs(st, spec.name, w)
            before = earlier[-1] if earlier else None
            params = spec.flow_parameters()
            params["window"] = w.replace("_", "..")
            if label_requests is not None:
                params["label_requests"] = label_requests
            run = evaluate_and_audit(**params)
            summary = {k: run.get(k) for k in ("evaluation", "window", "run_key", "published", "path", "reason",
                                               "report")}
            summary["missing_days"] = gaps
            summary["label_requests"] = [m["request_id"] for m in run.get("label_requests", [])]
            summary["level_claims"] = {p: v["level_claim"] for p, v in run["result"]["policies"].items()}
            reevaluations.append(summary)
            if before is not None and run.get("published") and before["run_key"] != run["run_key"]:
                superseded.append({"evaluation": spec.name, "window": before["window"],
                                   "run_key": before["run_key"], "path": before["path"]})
    return reevaluations, superseded, skipped


def reevaluation_done(labels_uri: str, cfg: Any, version: int) -> bool:
    """Whether the re-evaluation called for by label-store ``version`` completed (see `record_reevaluation`)."""
    from flows.storage.labels import LabelStore

    done = LabelStore(_storage(labels_uri, cfg)).reevaluated(version) is not None
    if not done:
        get_run_logger().warning("labels already stored as version %d, but their re-evaluation never completed "
                                 "(an earlier run was interrupted): re-evaluating now", version)
    return done


def record_reevaluation(labels_uri: str, cfg: Any, version: int, reevaluations: Sequence[Mapping],
                        skipped: Sequence[Mapping] = ()) -> None:
    """Record in the label store that ``version``'s re-evaluation completed (written after every window;
    ``skipped``: windows left out for days without logs)."""
    from flows.storage.labels import LabelStore

    runs = [{k: r.get(k) for k in ("evaluation", "window", "run_key", "published")} for r in reevaluations]
    LabelStore(_storage(labels_uri, cfg)).mark_reevaluated(version, {"runs": runs, "skipped": list(skipped)})


def refresh_request_pages(specs: Sequence[Any], requests: Sequence[Mapping], statuses: Sequence[Mapping],
                          results_uri: str, requests_uri: str, labels_uri: str, cfg: Any) -> None:
    """Rebuild the pages of every evaluation whose requests received labels (and of the evaluations using
    this label store): their open requests changed (`flows.pipelines.pages.refresh_pages`)."""
    received = {s["request_id"] for s in statuses if s.get("received")}
    names = {str(m["evaluation"]) for m in requests if m.get("request_id") in received and m.get("evaluation")}
    roots = {s.name: s.results_uri or s.logs_uri for s in specs}
    for name in sorted(names | set(roots)):
        refresh_pages(roots.get(name, results_uri), cfg, name, requests_uri=requests_uri, labels_uri=labels_uri,
                      why="labels received for its requests")


def check_parameters(p: dict[str, Any]) -> None:
    """Checks before a run is created: the answers format and the label-request settings."""
    if p["answers_format"] not in answer_formats():
        raise CJEInputError(f"unknown answers format {p['answers_format']!r}; expected one of {list(answer_formats())}",
                            option="answers_format")
    RequestConfig.from_dict(p["label_requests"])


@checked_flow(name="labels", log_prints=False, validate_parameters=True, check=check_parameters)
def labels(
    path: str,
    labels_uri: str,
    logs_uri: str | None = None,
    results_uri: str | None = None,
    requests_uri: str | None = None,
    evaluations_file: str | None = None,
    evaluations: list[dict[str, Any]] | None = None,
    label_scale: list[float] | None = None,
    lookback_start: str | None = None,
    lookback_end: str | None = None,
    reevaluate: bool = True,
    as_of: str | None = None,
    max_windows: int = 10,
    partial_windows: bool = False,
    source_name: str | None = None,
    label_requests: dict[str, Any] | None = None,
    answers_format: str = "auto",
    answer_field: str = "oracle_label",
    id_field: str = "response_id",
    anchors_uri: str | None = None,
) -> dict:
    """Ingest returned oracle labels and re-evaluate the windows they touch.

    Parameters
    ----------
    path : str
        The returned labels: Parquet, CSV or JSONL (``response_id``, ``oracle_label``, optional
        ``label_probability``); a local path or a ``file://`` / ``s3://`` URI.
    labels_uri : str
        Root of the label store.
    logs_uri : str, optional
        Logs to look unknown ids up in (default: the logs of the evaluations using this store).
    results_uri, requests_uri : str, optional
        Where results are published / label requests live (default: ``labels_uri``; for
        requests, the results URI).
    evaluations_file, evaluations : optional
        Declared evaluations (``evaluations.yaml``) and/or evaluations passed in (mappings with
        ``name``, ``logs_uri`` and the other `EvaluationSpec` fields).  Those whose label store
        is ``labels_uri`` are re-evaluated.
    label_scale : [lo, hi], optional
        The scale the answers are on (default: the requests' scale, else [0, 1]).  Answers outside
        it are errors; when the requests' scale differs, answers are mapped linearly onto it.
    lookback_start, lookback_end : str, optional
        Only log partitions in this date range are searched for ids (default: all).
    reevaluate : bool
        Re-run the affected evaluations (only when the labels are new to the store).
    as_of : str, optional
        Unused (kept for callers): only published windows are re-evaluated, never a window computed
        from the evaluation's declared window.
    max_windows : int
        At most this many windows per evaluation (newest first).
    partial_windows : bool
        Re-evaluate (and publish) a window even when some of its days have no logs (default: such a
        window is skipped and listed in ``skipped_windows``; ``cje labels --partial-windows``).
    source_name : str, optional
        Name recorded in the label store (default: the file's URL).
    label_requests : dict, optional
        `RequestConfig` settings for the re-evaluations' automatic requests.
    answers_format : str
        Format of the file, one of `flows.label_requests.answers.answer_formats` (``auto``, ``table``,
        ``label-studio``, ``argilla`` and any registered labelling tool's); ``auto`` detects it.
    answer_field, id_field : str
        The tool's answer field (a column, a Label Studio control name or an Argilla question)
        and the id column of a table.
    anchors_uri : str, optional
        Storage of the anchor sets that drift requests asked labels for (default: the drift
        monitor declared with that set in ``evaluations_file``).  Anchor labels become a new
        version of their anchor set.

    Returns
    -------
    dict
        ``source``, ``format``, ``rows``, ``version``, ``new``, ``conflicts``, ``anchors`` (anchor-set
        versions written), ``ignored`` / ``duplicates`` / ``unanswered`` (tool answers), ``requests`` (status per
        request), ``touched_dates``, ``reevaluations`` (the `evaluate_and_audit` outputs, without
        the full result), ``superseded`` (run keys replaced as latest) and ``skipped_windows`` (published
        windows holding the labels that were not re-evaluated: ``evaluation``, ``window``,
        ``missing_days``, ``reason``).
    """
    cfg = StorageConfig.from_env()
    results_uri = results_uri or labels_uri
    requests_uri = requests_uri or results_uri
    specs, logs_uris, lookback = _scope(labels_uri, logs_uri, evaluations_file, evaluations, lookback_start,
                                        lookback_end)

    table, source, read_info = read_labels_task(path, quote(cfg), answers_format, answer_field, id_field)
    known, requests = locate_task(quote(table), source, requests_uri, logs_uris, quote(cfg), lookback, _mappings(specs))
    table, anchor_rows, anchor_map = split_anchors(table, known, requests)
    table, anchor_rows, label_scale = scale_answers(table, anchor_rows, known, anchor_map, label_scale, source)
    anchors_out = (anchor_task(quote(anchor_rows), anchor_map, anchors_uri, evaluations_file, quote(cfg),
                               source_name or source) if anchor_rows else {"versions": [], "labelled": set()})
    clean, appended = _ingest(table, source, known, label_scale, labels_uri, cfg, source_name or source)
    statuses = fulfil_task(requests_uri, quote(cfg), quote(requests), quote(appended["labelled_ids"]),
                           appended["version"], source, quote(anchors_out["labelled"]))
    ingested = set(clean.column("response_id").to_pylist())
    touched = sorted({v["dt"] for r, v in known.items() if v.get("dt") and r in ingested})
    out: dict[str, Any] = {
        "source": source, "format": read_info.get("format"), "rows": clean.num_rows, "version": appended["version"],
        "new": appended["new"], "conflicts": appended["conflicts"], "requests": [s for s in statuses if s["received"]],
        "touched_dates": touched, "reevaluations": [], "superseded": [], "skipped_windows": [],
        "label_scale": list(label_scale),
        "anchors": anchors_out["versions"], **{k: read_info.get(k, d) for k, d in (
            ("ignored", {}), ("duplicates", 0), ("unanswered", 0))}}
    if reevaluate and appended["version"] is not None and (
            appended["new"] or not reevaluation_done(labels_uri, cfg, appended["version"])):
        out["reevaluations"], out["superseded"], out["skipped_windows"] = reevaluate_windows(
            specs, touched, cfg, max_windows, label_requests, partial_windows)
        record_reevaluation(labels_uri, cfg, appended["version"], out["reevaluations"], out["skipped_windows"])
    refresh_request_pages(specs, requests, statuses, results_uri, requests_uri, labels_uri, cfg)
    return labels_artifacts(out)  # Prefect artifacts: flows/reports/artifacts.py


__all__ = ["labels", "validate_labels", "read_label_file", "parse_labels", "affected_windows"]
