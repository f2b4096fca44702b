"""`cje anchors create | add-scores | list`: anchor sets for the drift monitors, without Python.

    cje anchors create SET anchors.csv --store ./cje-data       a new version of the set
    cje anchors add-scores SET scores.csv --store ./cje-data    judge scores of the anchors
    cje anchors list [SET] --store ./cje-data [--json]          sets, versions and score days

``--store`` is the storage root (a folder or ``s3://bucket/prefix``); ``--monitor NAME`` takes the
root and the set of a drift monitor declared in the evaluations file instead. Files: CSV, JSON
Lines or Parquet. Anchors need ``anchor_id, prompt, response`` (optional ``oracle_label``,
``prompt_id``); scores need ``anchor_id, judge_score`` plus ``judge_id`` and ``ts`` (or
``--judge-id`` and ``--ts``). Identifiers are read as strings. Layout: `flows.storage.anchors`.
"""
from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from cje_engine.errors import CJEInputError

from flows.cli.common import CONFIG_HELP
from flows.cli.exits import EXIT_OK
from flows.cli.terminal import out, out_json

_ID_COLUMNS = ("anchor_id", "prompt_id", "judge_id", "prompt", "response")


def read_table(path: str | Path) -> pa.Table:
    """A CSV, JSON Lines or Parquet file as a table; identifier and text columns as strings."""
    p = Path(path)
    if not p.is_file():
        raise CJEInputError("file not found", source=str(p))
    suffix = p.suffix.lower()
    try:
        if suffix in (".parquet", ".pq", ".parq"):
            import pyarrow.parquet as pq

            return pq.read_table(p)
        if suffix == ".csv":
            head = pd.read_csv(p, nrows=0, encoding="utf-8")
            dtype = {c: str for c in head.columns if c in _ID_COLUMNS}
            frame = pd.read_csv(p, dtype=dtype, keep_default_na=True, encoding="utf-8")
        elif suffix in (".jsonl", ".ndjson"):
            from cje_engine.data.io import read_jsonl_records

            frame = pd.DataFrame.from_records(read_jsonl_records(p))
            for c in _ID_COLUMNS:
                if c in frame.columns:
                    frame[c] = frame[c].map(lambda v: None if v is None or (isinstance(v, float) and v != v) else str(v))
        else:
            raise CJEInputError(f"unsupported file type {suffix or '(none)'}: expected .csv, .jsonl or .parquet",
                                source=str(p))
    except UnicodeDecodeError as exc:
        raise CJEInputError(f"is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8",
                            source=str(p)) from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as exc:
        if isinstance(exc, CJEInputError):
            raise
        raise CJEInputError(f"cannot be read: {exc}", source=str(p)) from None
    if "ts" in frame.columns:
        try:
            frame["ts"] = pd.to_datetime(frame["ts"], utc=True)
        except (ValueError, TypeError) as exc:
            raise CJEInputError(f"ts is not a timestamp: {exc}", source=str(p), column="ts") from None
    return pa.Table.from_pandas(frame, preserve_index=False)


def _store(ns: argparse.Namespace) -> tuple[Any, str | None]:
    """(Storage, the monitor's set name or None) from ``--store`` or ``--monitor``."""
    from flows.storage.objects import Storage

    if ns.store and ns.monitor:
        raise CJEInputError("give either --store or --monitor, not both")
    if ns.monitor:
        from flows.cli.common import find_drift_monitor

        _, spec = find_drift_monitor(ns.monitor, ns.config)
        return Storage.for_uri(spec.anchors_uri), spec.set_name
    if not ns.store:
        raise CJEInputError("give --store ROOT (a folder or s3://bucket/prefix) or --monitor NAME")
    return Storage.for_uri(ns.store), None


def _set_name(ns: argparse.Namespace, from_monitor: str | None) -> str:
    name = getattr(ns, "set", None) or from_monitor
    if not name:
        raise CJEInputError("name the anchor set (or give --monitor)")
    if from_monitor and name != from_monitor:
        raise CJEInputError(f"drift monitor {ns.monitor!r} uses anchor set {from_monitor!r}, not {name!r}")
    return name


def cmd_create(ns: argparse.Namespace) -> int:
    """``cje anchors create``: store a new version of an anchor set from a file; returns the exit code."""
    from flows.storage.anchors import list_versions, write_anchor_set

    st, mon = _store(ns)
    name = _set_name(ns, mon)
    table = read_table(ns.file)
    before = set(list_versions(st, name))
    meta = {"source": str(Path(ns.file).name), "created_with": "cje anchors create"}
    if ns.note:
        meta["note"] = ns.note
    aset = write_anchor_set(st, name, table, metadata=meta)
    new = aset.version not in before
    doc = {"set": name, "version": aset.version, "new": new, "n_anchors": aset.manifest.get("n_anchors"),
           "n_labelled": aset.manifest.get("n_labelled"), "content_sha256": aset.content_sha256,
           "uri": st.url(aset.manifest.get("key", ""))}
    if ns.json:
        from flows.cli.terminal import json_doc

        out_json(json_doc("anchors create", **doc))
    else:
        out(f"anchor set {name} version {aset.version}: {doc['n_anchors']} anchor(s), {doc['n_labelled']} labelled "
            f"({'new version' if new else 'identical to the latest version: nothing written'})")
    return EXIT_OK


def cmd_add_scores(ns: argparse.Namespace) -> int:
    """``cje anchors add-scores``: store a judge's scores of an anchor set version; returns the exit code."""
    from flows.storage.anchors import read_anchor_scores, read_anchor_set, write_anchor_scores

    st, mon = _store(ns)
    name = _set_name(ns, mon)
    table = read_table(ns.file)
    n = table.num_rows
    if "judge_id" not in table.column_names:
        if not ns.judge_id:
            raise CJEInputError("the scores have no judge_id column: give --judge-id (the judge and its version)",
                                source=str(ns.file), column="judge_id")
        table = table.append_column("judge_id", pa.array([ns.judge_id] * n, pa.string()))
    if "ts" not in table.column_names:
        ts = pd.Timestamp(ns.ts, tz="UTC") if ns.ts else pd.Timestamp(datetime.now(timezone.utc))
        table = table.append_column("ts", pa.array([ts.to_pydatetime()] * n, pa.timestamp("us", tz="UTC")))
    aset = read_anchor_set(st, name)
    known = set(aset.anchor_ids)
    ids = [str(a) for a in table.column("anchor_id").to_pylist()]
    unknown = [(i, a) for i, a in enumerate(ids) if a not in known]
    if unknown:
        raise CJEInputError(f"anchor_id {unknown[0][1]!r} is not in anchor set {name!r} version {aset.version} "
                            f"({len(unknown)} unknown id(s))", source=str(ns.file), column="anchor_id",
                            row=unknown[0][0])
    keys = write_anchor_scores(st, name, table)
    read_anchor_scores(st, keys, known_ids=known)  # read back: what the drift flow will see
    if ns.json:
        from flows.cli.terminal import json_doc

        out_json(json_doc("anchors add-scores", set=name, rows=n, keys=[st.url(k) for k in keys]))
    else:
        out(f"anchor set {name}: {n} score row(s) written in {len(keys)} partition(s)")
        for k in keys:
            out(f"  {st.url(k)}")
    return EXIT_OK


def _set_names(st: Any) -> list[str]:
    from flows.storage.anchors import ANCHORS

    names = set()
    for info in st.list(f"{ANCHORS}/"):
        parts = info.key.split("/")
        if len(parts) >= 3 and parts[0] == ANCHORS:
            names.add(parts[1])
    return sorted(names)


def cmd_list(ns: argparse.Namespace) -> int:
    """``cje anchors list``: the anchor sets, their versions and score files; returns the exit code."""
    from flows.storage.anchors import read_manifest, list_versions, score_files  # noqa: PLC2701

    st, mon = _store(ns)
    names = [ns.set or mon] if (ns.set or mon) else _set_names(st)
    rows = []
    for name in names:
        versions = list_versions(st, name)
        if not versions and (ns.set or mon):
            raise CJEInputError(f"no anchor set {name!r} under {st.url('anchors/')}")
        latest = read_manifest(st, name, versions[-1]) if versions else {}
        days = sorted({f.key.split("dt=", 1)[1].split("/", 1)[0] for f in score_files(st, name)})
        rows.append({"set": name, "versions": versions, "latest": versions[-1] if versions else None,
                     "n_anchors": latest.get("n_anchors"), "n_labelled": latest.get("n_labelled"),
                     "created_at": latest.get("created_at"), "score_days": len(days),
                     "first_score_day": days[0] if days else None, "last_score_day": days[-1] if days else None})
    if ns.json:
        from flows.cli.terminal import json_doc

        out_json(json_doc("anchors list", store=st.url(), sets=rows))
        return EXIT_OK
    if not rows:
        out(f"no anchor sets under {st.url('anchors/')}")
        return EXIT_OK
    out(f"{'set':<24}{'version':>8}{'anchors':>9}{'labelled':>9}{'score days':>12}  last score day")
    for r in rows:
        out(f"{r['set'][:23]:<24}{r['latest'] or '-':>8}{r['n_anchors'] or 0:>9}{r['n_labelled'] or 0:>9}"
            f"{r['score_days']:>12}  {r['last_score_day'] or '-'}")
    return EXIT_OK


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="storage root: a folder or s3://bucket/prefix")
    p.add_argument("--monitor", help="use the storage root and set of this declared drift monitor")
    p.add_argument("--config", help=CONFIG_HELP + " (for --monitor)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout (shape in docs/cli.md)")


def register(sub: Any) -> None:
    """Add the ``anchors`` command and its actions to the CLI's subparsers ``sub``."""
    p = sub.add_parser("anchors", help="create anchor sets, add judge scores, list them",
                       description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    asub = p.add_subparsers(dest="anchors_command", required=True, metavar="ACTION", parser_class=type(p))
    c = asub.add_parser("create", help="store a new version of an anchor set from a file")
    c.add_argument("set", help="anchor set name (letters, digits, . _ -)")
    c.add_argument("file", help="CSV, JSONL or Parquet with anchor_id, prompt, response[, oracle_label, prompt_id]")
    c.add_argument("--note", help="free text kept in the version's manifest")
    _common(c)
    c.set_defaults(handler=cmd_create)
    s = asub.add_parser("add-scores", help="add judge scores of the anchors (one partition per UTC day)")
    s.add_argument("set", help="anchor set name")
    s.add_argument("file", help="CSV, JSONL or Parquet with anchor_id, judge_score[, judge_id, ts]")
    s.add_argument("--judge-id", help="judge and version, when the file has no judge_id column")
    s.add_argument("--ts", help="score time (ISO 8601, UTC), when the file has no ts column (default: now)")
    _common(s)
    s.set_defaults(handler=cmd_add_scores)
    ls = asub.add_parser("list", help="anchor sets with their versions and score days")
    ls.add_argument("set", nargs="?", help="only this set")
    _common(ls)
    ls.set_defaults(handler=cmd_list)
