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
                     every published window containing a touched log date (and the
                     evaluation's current window, if it does) is evaluated again with
                     `flows.label_requests.requests.evaluate_and_audit`.  The label-store version is
                     part of the run key, so the new result is published beside the old one,
                     which stays readable (`list_runs` / `read_run`); ``latest.json`` moves.
"""
from __future__ import annotations

import io
import logging
import os
from dataclasses import fields
from datetime import date
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.utilities.annotations import quote

from cje_engine.errors import CJEInputError

from flows.reports.artifacts import labels_artifacts

log = logging.getLogger(__name__)

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl",
           ".json": "jsonl"}
_RETRY = dict(retries=2, retry_delay_seconds=[1.0, 5.0], cache_policy=NO_CACHE)


def _retry_unless_bad_input(task_: Any, task_run: Any, state: Any) -> bool:
    try:
        exc = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001
        return True
    return not isinstance(exc, CJEInputError)


_STORAGE_TASK = dict(_RETRY, retry_condition_fn=_retry_unless_bad_input)


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
            return pq.read_table(io.BytesIO(data))
        if fmt == "csv":
            opts = pacsv.ConvertOptions(column_types={"response_id": pa.string()})
            return pacsv.read_csv(io.BytesIO(data), convert_options=opts)
        schema = pa.schema([("response_id", pa.string())])
        return pajson.read_json(io.BytesIO(data), parse_options=pajson.ParseOptions(explicit_schema=schema,
                                                                                    unexpected_field_behavior="infer"))
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError, ValueError) as exc:
        raise CJEInputError(f"is not a readable {fmt} label file: {' '.join(str(exc).split())[:200]}",
                            source=source) from None


def read_label_file(path: str, cfg: Any = None) -> tuple[pa.Table, str]:
    """Read a returned label file; returns the table and its display name (URL)."""
    root, name = _split_uri(path)
    st = _storage(root, cfg)
    from flows.storage.objects import NotFoundError

    try:
        data = st.read_bytes(name)
    except NotFoundError:
        raise CJEInputError("label file not found", source=st.url(name)) from None
    return parse_labels(data, name, st.url(name)), st.url(name)


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


def _scan_logs(logs_uri: str, cfg: Any, ids: set[str], lookback: tuple[date, date] | None) -> dict[str, dict]:
    """Look ids up in the logs: ``response_id`` and ``dt`` only, the id filter pushed into the scan."""
    from flows.storage.logs import PARTITION, discover_partitions, partition_of, read_window

    st = _storage(logs_uri, cfg)
    if lookback is not None:
        files = discover_partitions(st, *lookback)
    else:
        files = [f for f in st.list(f"{PARTITION}=") if f.key.endswith(".parquet") and partition_of(f.key)]
    if not files or not ids:
        return {}
    flt = pc.field("response_id").isin(pa.array(sorted(ids), pa.string()))
    table = read_window(st, files, columns=["response_id", PARTITION], check_unique=False, row_filter=flt)
    return {r: {"inclusion_probability": None, "dt": d, "logs_uri": logs_uri}
            for r, d in zip(table.column("response_id").to_pylist(), table.column(PARTITION).to_pylist())}


# --------------------------------------------------------------------------------------
# tasks


@task(name="read_labels", **_STORAGE_TASK)
def read_labels_task(path: str, cfg: Any) -> tuple[pa.Table, str]:
    return read_label_file(path, cfg)


@task(name="locate", **_STORAGE_TASK)
def locate_task(table: pa.Table, source: str, requests_uri: str, logs_uris: list[str], cfg: Any,
                lookback: tuple[date, date] | None) -> tuple[dict, list[dict]]:
    """Where every id of the file comes from (requests first, then the logs)."""
    from flows.label_requests.requests import list_requests

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
        for r, v in _scan_logs(uri, cfg, missing, lookback).items():
            known.setdefault(r, v)
    # A request row without a log date: take it from the logs when they have it.
    undated = {r for r, v in known.items() if v.get("dt") is None}
    for uri in logs_uris:
        if not undated:
            break
        for r, v in _scan_logs(uri, cfg, undated, lookback).items():
            known[r]["dt"] = v["dt"]
            known[r].setdefault("logs_uri", uri)
        undated = {r for r, v in known.items() if v.get("dt") is None}
    return known, requests


@task(name="validate_labels", cache_policy=NO_CACHE)
def validate_task(table: pa.Table, source: str, known: dict, label_scale: list[float]) -> pa.Table:
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
                source: str) -> list[dict]:
    """Mark requests whose every row has a label as fulfilled (``late`` when past the deadline)."""
    from flows.label_requests.requests import mark_fulfilled

    st = _storage(requests_uri, cfg)
    out = []
    for m in requests:
        ids = [r["response_id"] for r in m.get("rows", [])]
        got = sum(1 for r in ids if r in labelled)
        entry = {"request_id": m["request_id"], "status": m.get("status"), "received": got, "requested": len(ids)}
        if m.get("status") in ("pending", "expired") and ids and got == len(ids):
            late = m.get("status") == "expired"
            mark_fulfilled(st, m["request_id"], {"label_store_version": version, "received": got, "source": source,
                                                 "late": late})
            entry.update(status="fulfilled", late=late)
        out.append(entry)
    return out


# --------------------------------------------------------------------------------------
# which windows to re-evaluate


def _specs(evaluations_file: str | None, evaluations: Sequence[Mapping] | None) -> list:
    from flows.runtime.schedules import EvaluationSpec, load_evaluations

    specs = list(load_evaluations(evaluations_file).values()) if evaluations_file else []
    allowed = {f.name for f in fields(EvaluationSpec)}
    for i, e in enumerate(evaluations or []):
        if not isinstance(e, Mapping) or "name" not in e or "logs_uri" not in e:
            raise CJEInputError(f"evaluations[{i}] must be a mapping with at least 'name' and 'logs_uri'")
        unknown = sorted(set(e) - allowed)
        if unknown:
            raise CJEInputError(f"evaluations[{i}] has unknown key(s) {unknown}; expected some of {sorted(allowed)}")
        d = dict(e)
        if d.get("policies") is not None:
            d["policies"] = tuple(d["policies"])
        specs.append(EvaluationSpec(**d))
    return specs


def affected_windows(spec: Any, dates: set[str], published: Sequence[str], as_of: str | None,
                     max_windows: int) -> list[str]:
    """Windows (``YYYY-MM-DD_YYYY-MM-DD``) of an evaluation that contain a touched log date.

    Candidates: every published window of the evaluation plus its declared window as of
    ``as_of``; the newest ``max_windows`` (by end date) are returned.
    """
    from flows.pipelines.evaluate import parse_window

    cands = set(published)
    try:
        cands.add(parse_window(spec.window, as_of).label)
    except CJEInputError:
        pass
    days = {date.fromisoformat(d) for d in dates if d}
    hit = []
    for w in cands:
        a, b = w.split("_", 1)
        start, end = date.fromisoformat(a), date.fromisoformat(b)
        if any(start <= d <= end for d in days):
            hit.append(w)
    hit.sort(key=lambda w: (w.split("_", 1)[1], w), reverse=True)
    return sorted(hit[:max_windows])


# --------------------------------------------------------------------------------------
# the flow


@flow(name="labels", log_prints=False, validate_parameters=True)
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
    source_name: str | None = None,
    label_requests: dict[str, Any] | None = None,
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
        Allowed label values (default: the requests' scale, else [0, 1]).
    lookback_start, lookback_end : str, optional
        Only log partitions in this date range are searched for ids (default: all).
    reevaluate : bool
        Re-run the affected evaluations (only when the labels are new to the store).
    as_of : str, optional
        Reference date for the evaluations' relative windows.
    max_windows : int
        At most this many windows per evaluation (newest first).
    source_name : str, optional
        Name recorded in the label store (default: the file's URL).
    label_requests : dict, optional
        `RequestConfig` settings for the re-evaluations' automatic requests.

    Returns
    -------
    dict
        ``source``, ``rows``, ``version``, ``new``, ``conflicts``, ``requests`` (status per
        request), ``touched_dates``, ``reevaluations`` (the `evaluate_and_audit` outputs, without
        the full result) and ``superseded`` (run keys replaced as latest).
    """
    from flows.storage.objects import StorageConfig

    logger = get_run_logger()
    cfg = StorageConfig.from_env()
    results_uri = results_uri or labels_uri
    requests_uri = requests_uri or results_uri
    specs = [s for s in _specs(evaluations_file, evaluations)
             if os.path.normpath(s.labels_uri or s.logs_uri) == os.path.normpath(labels_uri)
             or (s.labels_uri or s.logs_uri) == labels_uri]
    logs_uris = list(dict.fromkeys(([logs_uri] if logs_uri else []) + [s.logs_uri for s in specs]))
    lookback = None
    if lookback_start or lookback_end:
        if not (lookback_start and lookback_end):
            raise CJEInputError("give both lookback_start and lookback_end (or neither)")
        lookback = (date.fromisoformat(lookback_start), date.fromisoformat(lookback_end))

    table, source = read_labels_task(path, quote(cfg))
    known, requests = locate_task(quote(table), source, requests_uri, logs_uris, quote(cfg), lookback)
    if label_scale is None:
        scales = {tuple(v["label_scale"]) for v in known.values() if v.get("label_scale")}
        if len(scales) > 1:
            raise CJEInputError(f"the requests behind these labels use different label scales {sorted(scales)}; "
                                "pass label_scale", source=source)
        label_scale = list(scales.pop()) if scales else [0.0, 1.0]
    clean = validate_task(quote(table), source, known, list(label_scale))
    appended = append_task(labels_uri, quote(cfg), quote(clean), source_name or source)
    logger.info("labels from %s: %d row(s), label-store version %d (%s)", source, clean.num_rows,
                appended["version"], "new" if appended["new"] else "already stored")
    statuses = fulfil_task(requests_uri, quote(cfg), quote(requests), quote(appended["labelled_ids"]),
                           appended["version"], source)
    ingested = set(clean.column("response_id").to_pylist())
    touched = sorted({v["dt"] for r, v in known.items() if v.get("dt") and r in ingested})
    out: dict[str, Any] = {
        "source": source, "rows": clean.num_rows, "version": appended["version"], "new": appended["new"],
        "conflicts": appended["conflicts"], "requests": [s for s in statuses if s["received"]],
        "touched_dates": touched, "reevaluations": [], "superseded": [],
    }
    if not (reevaluate and appended["new"]):
        return labels_artifacts(out)  # Prefect artifacts: flows/reports/artifacts.py

    from flows.label_requests.requests import evaluate_and_audit
    from flows.storage.publish import list_runs

    res_st = {}
    for spec in specs:
        spec_results = spec.results_uri or spec.logs_uri
        st = res_st.setdefault(spec_results, _storage(spec_results, cfg))
        published = sorted({r["window"] for r in list_runs(st, spec.name)})
        windows = affected_windows(spec, set(touched), published, as_of, max_windows)
        for w in windows:
            earlier = list_runs(st, spec.name, w)
            before = earlier[-1] if earlier else None
            params = spec.flow_parameters()
            params["window"] = w.replace("_", "..")
            if label_requests is not None:
                params["label_requests"] = label_requests
            run = evaluate_and_audit(**params)
            summary = {k: run.get(k) for k in ("evaluation", "window", "run_key", "published", "path", "reason",
                                               "report")}
            summary["label_requests"] = [m["request_id"] for m in run.get("label_requests", [])]
            summary["level_claims"] = {p: v["level_claim"] for p, v in run["result"]["policies"].items()}
            out["reevaluations"].append(summary)
            if before is not None and run.get("published") and before["run_key"] != run["run_key"]:
                out["superseded"].append({"evaluation": spec.name, "window": before["window"],
                                          "run_key": before["run_key"], "path": before["path"]})
    return labels_artifacts(out)


__all__ = ["labels", "validate_labels", "read_label_file", "parse_labels", "affected_windows"]
