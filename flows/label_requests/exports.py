"""A label request as work for people: its items, exported by a registered labelling tool.

Each item is one thing to label: a logged response (``kind: response``, id = ``response_id``) or, for a
drift request, an anchor of the anchor set (``kind: anchor``, id = ``anchor_id``).  Items carry the
prompt and response text (joined from the logs by ``response_id``, or from the anchor set; the
text columns are configurable) and, as metadata, the request id, its trigger codes and the row's
inclusion probability (what the label store will record as ``label_probability``).  Labellers are
blind to the policy: its name and the request's reasons (which name it) are not exported, and
answers map back by the item's id.  The judge score is left out unless asked for
(``include_judge_score``): labellers should not be anchored on the score they are checking.

The formats are the labelling tools of `flows.integrations.labelling` (CSV, JSONL, Label Studio tasks,
Argilla records, and any tool registered there); each tool's module says what it writes (CSV cells that a
spreadsheet would run as a formula are neutralised: `flows.integrations.labelling.files`).

The label goes back under ``oracle_label`` (CSV/JSONL column, Label Studio ``Number`` control,
Argilla question) on the request's label scale; `flows.label_requests.answers` reads it back.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa

from cje_engine.errors import CJEInputError

from flows.integrations import labelling
from flows.integrations.labelling import DEFAULT_TEXT_COLUMNS, ExportOptions
from flows.storage.anchors import read_anchor_set
from flows.storage.logs import discover_partitions, read_window
from flows.storage.objects import Storage

log = logging.getLogger(__name__)


#: Log columns never shown to labellers as text: ids, the policy, scores, labels, times.
NOT_TEXT = frozenset({"response_id", "prompt_id", "policy", "judge_score", "oracle_label", "label_probability", "ts",
                      "dt", "draw_idx", "judge_id"})
#: Words in a column name that say it holds text a labeller reads (prompt-like first, then response-like).
TEXT_HINTS = (("prompt", "question", "input", "query", "instruction", "conversation", "context"),
              ("response", "answer", "output", "completion", "reply", "text", "message"))


def _log_schema(st: Storage, files: Sequence[Any], mapping: Mapping[str, str] | None) -> pa.Schema:
    """The first log file's schema with canonical names (the evaluation's ``columns:`` applied)."""
    import pyarrow.dataset as ds

    from flows.storage.logs import log_renames, renamed_schema

    key = files[0].key if hasattr(files[0], "key") else str(files[0])
    fs, _ = st.arrow_fs
    schema = ds.dataset(st.arrow_path(key), filesystem=fs, format="parquet").schema
    renames = {f: c for f, c in log_renames(schema.names, mapping, st.url(key)).items() if f != c}
    return renamed_schema(schema, renames)


def default_text_columns(logs_uri: str, storage_cfg: Any, rows: Sequence[Mapping],
                         mapping: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The text columns shown to labellers when ``--text-columns`` is not given, from the logs' own columns.

    ``prompt`` and ``response`` (after the evaluation's ``columns:`` mapping, e.g. ``{response:
    response_text}``), those of the two the logs have; else the logs' text columns whose names say they
    hold text (`TEXT_HINTS`: ``question``, ``answer``, ``output``, ...; never an id, the policy or a score).

    Raises
    ------
    CJEInputError
        The logs have no such column: the message lists their columns and the flag to use.
    """
    st = Storage.for_uri(logs_uri, storage_cfg)
    dates = sorted({r.get("dt") for r in rows if r.get("dt")})
    files = [f for d in dates for f in discover_partitions(st, d, d)] if dates else \
        discover_partitions(st, "1970-01-01", "2999-12-31")
    if not files:
        raise CJEInputError("no log files for the request's days", source=st.url())
    schema = _log_schema(st, files, mapping)
    names = [f.name for f in schema]
    plain = tuple(c for c in DEFAULT_TEXT_COLUMNS if c in names)
    if plain:
        return plain
    text = [f.name for f in schema if (pa.types.is_string(f.type) or pa.types.is_large_string(f.type))
            and f.name not in NOT_TEXT and not f.name.endswith("_id")]
    hinted = [c for hints in TEXT_HINTS for c in text if any(h in c.lower() for h in hints)]
    chosen = tuple(dict.fromkeys(hinted))
    if not chosen:
        raise CJEInputError(f"the logs have no text column to show labellers (columns: {names}); name them with "
                            "--text-columns COL[,COL] or map your response text with columns: "
                            "{response: <your column>}",
                            source=st.url(files[0].key if hasattr(files[0], "key") else str(files[0])))
    log.info("text columns shown to labellers: %s (from the logs' columns; --text-columns to choose)",
             ", ".join(chosen))
    return chosen


def read_texts(logs_uri: str, storage_cfg: Any, rows: Sequence[Mapping],
               text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS,
               mapping: Mapping[str, str] | None = None) -> dict[str, dict]:
    """Text of the requested responses from the logs: ``response_id -> {column: text}``.

    Only the partitions of the rows' log dates are read, with the id filter pushed into the scan.
    Raises `CJEInputError` naming the column when the logs lack a text column, and the ids the
    logs do not have.  ``mapping``: the evaluation's ``columns:`` (the logs' own names).
    """
    if not rows:
        return {}
    st = Storage.for_uri(logs_uri, storage_cfg)
    dates = sorted({r.get("dt") for r in rows if r.get("dt")})
    ids = sorted({str(r["response_id"]) for r in rows})
    if dates:
        files = [f for d in dates for f in discover_partitions(st, d, d)]
    else:
        files = discover_partitions(st, "1970-01-01", "2999-12-31")
    wanted = pa.array(ids, pa.string())
    table = read_window(st, files, columns=["response_id", *text_columns], check_unique=False, mapping=mapping,
                        row_filter=lambda field: field("response_id").isin(wanted))
    out = {}
    for rec in table.to_pylist():
        rid = str(rec.pop("response_id"))  # popped first: the value of `out[k] = v` is evaluated before k
        out[rid] = {k: (None if v is None else str(v)) for k, v in rec.items()}
    missing = [i for i in ids if i not in out]
    if missing:
        raise CJEInputError(f"{len(missing)} requested response(s) are not in the logs (first: {missing[:3]}); the "
                            "logs were moved or rewritten since the request was raised", source=st.url(),
                            column="response_id")
    return out


def read_anchor_texts(anchors_uri: str, storage_cfg: Any, set_name: str, version: int | None,
                      text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS) -> dict[str, dict]:
    """Text of the anchors of a set version: ``anchor_id -> {column: text}`` (anchors have
    ``prompt`` and ``response``; other text columns map onto them by position)."""
    aset = read_anchor_set(Storage.for_uri(anchors_uri, storage_cfg), set_name, version)
    by_place = DEFAULT_TEXT_COLUMNS if len(text_columns) > 1 else DEFAULT_TEXT_COLUMNS[-1:]  # one column: the response
    src = [c if c in aset.table.column_names else d for c, d in zip(text_columns, by_place)]
    cols = {c: aset.table.column(s).to_pylist() for c, s in zip(text_columns, src)}
    return {a: {c: cols[c][i] for c in text_columns} for i, a in enumerate(aset.anchor_ids)}


def request_items(manifest: Mapping, texts: Mapping[str, Mapping], anchor_texts: Mapping[str, Mapping] | None = None,
                  *, text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS,
                  include_judge_score: bool = False) -> list[dict]:
    """The request's items (responses, then anchors) with text and metadata (see module docs)."""
    triggers = ",".join(str(r.get("trigger")) for r in manifest.get("reasons") or [])
    scale = list(manifest.get("label_scale") or [0.0, 1.0])
    items = []
    for r in manifest.get("rows") or []:
        rid = str(r["response_id"])
        if rid not in texts:
            raise CJEInputError(f"no text for response {rid!r} of request {manifest.get('request_id')}",
                                column="response_id")
        item = {"item_id": rid, "kind": "response", "request_id": manifest["request_id"],
                "triggers": triggers, "dt": r.get("dt"), "stratum": r.get("stratum"),
                "selection_probability": r.get("selection_probability"),
                "inclusion_probability": r.get("inclusion_probability"), "label_scale": scale}
        if include_judge_score:
            item["judge_score"] = r.get("judge_score")
        item.update({c: texts[rid].get(c) for c in text_columns})
        items.append(item)
    for a in manifest.get("anchors") or []:
        aid = str(a["anchor_id"])
        if anchor_texts is None or aid not in anchor_texts:
            raise CJEInputError(f"no text for anchor {aid!r} of request {manifest.get('request_id')} (give the "
                                "anchor set's storage, --anchors-uri)", column="anchor_id")
        drift = manifest.get("drift") or {}
        item = {"item_id": aid, "kind": "anchor", "request_id": manifest["request_id"],
                "triggers": triggers, "dt": None, "stratum": None,
                "selection_probability": a.get("selection_probability"), "inclusion_probability": None,
                "label_scale": scale, "anchor_set": drift.get("set_name")}
        item.update({c: anchor_texts[aid].get(c) for c in text_columns})
        items.append(item)
    return items


# --------------------------------------------------------------------------------------
# formats: the registered labelling tools (`flows.integrations.labelling`)


def formats() -> tuple[str, ...]:
    """The export formats: every registered labelling tool (``cje requests export --format``)."""
    return labelling.names()


def export_files(items: Sequence[Mapping], fmt: str, dest: Path, options: ExportOptions) -> dict[Path, bytes]:
    """The files tool ``fmt`` exports the items to (``{path: content}``, ``dest`` first; nothing written).

    Raises
    ------
    CJEInputError
        ``fmt`` is no registered tool (the choices and the closest are named).
    """
    return labelling.get(fmt).export(items, Path(dest), options)


def export_request(items: Sequence[Mapping], fmt: str, text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS,
                   label_scale: Sequence[float] = (0.0, 1.0)) -> bytes:
    """Serialise items with one registered tool (`formats`); its main file only (Label Studio: a JSON list
    of tasks; Argilla: a JSON document with ``settings`` and ``records``)."""
    options = ExportOptions(tuple(text_columns), (float(label_scale[0]), float(label_scale[1])),
                            any("judge_score" in i for i in items))
    dest = Path("export")
    return export_files(items, fmt, dest, options)[dest]


__all__ = ["formats", "request_items", "read_texts", "default_text_columns", "NOT_TEXT", "TEXT_HINTS",
           "read_anchor_texts", "export_request", "export_files"]
