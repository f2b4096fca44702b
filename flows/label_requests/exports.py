"""A label request as work for people: CSV, JSONL, Label Studio tasks, Argilla records.

Each item is one thing to label: a logged response (``kind: response``, id = ``response_id``) or, for a
drift request, an anchor of the anchor set (``kind: anchor``, id = ``anchor_id``).  Items carry the
prompt and response text (joined from the logs by ``response_id``, or from the anchor set; the
text columns are configurable) and, as metadata, the request id, its trigger codes and the row's
inclusion probability (what the label store will record as ``label_probability``).  Labellers are
blind to the policy: its name and the request's reasons (which name it) are not exported, and
answers map back by the item's id.  The judge score is left out unless asked for
(``include_judge_score``): labellers should not be anchored on the score they are checking.

CSV cells that a spreadsheet would run as a formula (starting with ``= + - @``, tab or CR, e.g. a response
``=IMPORTXML(...)``) are prefixed with ``'`` (OWASP's CSV-injection advice;
`flows.label_requests.answers.neutralize_csv_cell`); reading the filled CSV back strips exactly that prefix.

The label goes back under ``oracle_label`` (CSV/JSONL column, Label Studio ``Number`` control,
Argilla question) on the request's label scale; `flows.label_requests.answers` reads it back.
"""
from __future__ import annotations

import csv
import io
import json
import logging
from typing import Any, Mapping, Sequence

import pyarrow as pa

from cje_engine.errors import CJEInputError

from flows.label_requests.answers import neutralize_csv_cell
from flows.storage.anchors import read_anchor_set
from flows.storage.logs import discover_partitions, read_window
from flows.storage.objects import Storage

log = logging.getLogger(__name__)

FORMATS = ("csv", "jsonl", "label-studio", "argilla")
DEFAULT_TEXT_COLUMNS = ("prompt", "response")
ANSWER = "oracle_label"
#: Metadata of every item, in this order (``judge_score`` only when asked for). Labellers are blind to the
#: policy: neither its name nor the request's reasons (which name it) are exported; answers map back by the
#: item's id (``response_id``).
META = ("item_id", "kind", "request_id", "triggers", "dt", "stratum", "selection_probability",
        "inclusion_probability", "label_scale")


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
    src = [c if c in aset.table.column_names else d for c, d in zip(text_columns, DEFAULT_TEXT_COLUMNS)]
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
# formats


def to_csv(items: Sequence[Mapping], text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS) -> bytes:
    """One row per item: ``response_id`` (the item id), the texts, an empty ``oracle_label`` to fill, metadata;
    text cells that would start a spreadsheet formula are prefixed with ``'`` (see the module docs)."""
    extra = ["judge_score"] if any("judge_score" in i for i in items) else []
    header = ["response_id", *text_columns, ANSWER, *[m for m in META if m != "item_id"], *extra]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(header)
    for i in items:
        row = dict(i, response_id=i["item_id"], oracle_label="",
                   label_scale="-".join(f"{x:g}" for x in i["label_scale"]))
        w.writerow([_csv_cell(row.get(h)) for h in header])
    return buf.getvalue().encode()


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    return neutralize_csv_cell(value) if isinstance(value, str) else value


def to_jsonl(items: Sequence[Mapping], text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS) -> bytes:
    """One JSON object per line: ``response_id``, the texts, ``oracle_label: null`` and ``meta``."""
    lines = []
    for i in items:
        meta = {k: v for k, v in i.items() if k not in text_columns and k != "item_id"}
        lines.append(json.dumps({"response_id": i["item_id"], **{c: i.get(c) for c in text_columns},
                                 ANSWER: None, "meta": meta}, sort_keys=False))
    return ("\n".join(lines) + "\n").encode()


def label_studio_config(label_scale: Sequence[float], text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS,
                        show_judge_score: bool = False) -> str:
    """A Label Studio labeling config: the texts, and a required ``Number`` control ``oracle_label``."""
    lo, hi = float(label_scale[0]), float(label_scale[1])
    step = "1" if lo.is_integer() and hi.is_integer() and hi - lo >= 2 else "0.01"
    parts = ["<View>"]
    for c in text_columns:
        parts += [f'  <Header value="{c}"/>', f'  <Text name="{c}" value="${c}"/>']
    if show_judge_score:
        parts += ['  <Header value="judge score"/>', '  <Text name="judge_score" value="$judge_score"/>']
    parts += [f'  <Header value="oracle label ({lo:g} to {hi:g})"/>',
              f'  <Number name="{ANSWER}" toName="{text_columns[-1]}" min="{lo:g}" max="{hi:g}" step="{step}" '
              'required="true"/>', "</View>"]
    return "\n".join(parts)


def to_label_studio(items: Sequence[Mapping], text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS) -> list[dict]:
    """Label Studio tasks (``[{"data": {...}, "meta": {...}}]``): ``data`` holds the id, texts and metadata."""
    tasks = []
    for i in items:
        data = {"response_id": i["item_id"], **{c: i.get(c) for c in text_columns}}
        meta = {k: v for k, v in i.items() if k not in text_columns and k != "item_id"}
        data.update({f"cje_{k}": v for k, v in meta.items() if k != "label_scale"})
        if "judge_score" in i:
            data["judge_score"] = i["judge_score"]
        tasks.append({"data": data, "meta": meta})
    return tasks


def argilla_settings(label_scale: Sequence[float], text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS,
                     include_judge_score: bool = False) -> dict:
    """Argilla dataset settings as plain JSON: text fields, the ``oracle_label`` question, metadata properties.

    A rating question when the scale is whole numbers with at most 11 values (Argilla's rating
    range), else a text question asking for a number in the scale.
    """
    lo, hi = float(label_scale[0]), float(label_scale[1])
    if lo.is_integer() and hi.is_integer() and 0 <= lo < hi <= 10:
        question = {"name": ANSWER, "type": "rating", "values": list(range(int(lo), int(hi) + 1)), "required": True,
                    "title": f"Oracle label ({lo:g} to {hi:g})"}
    else:
        question = {"name": ANSWER, "type": "text", "required": True,
                    "title": f"Oracle label: a number from {lo:g} to {hi:g}"}
    meta = [{"name": "request_id", "type": "terms"}, {"name": "kind", "type": "terms"},
            {"name": "triggers", "type": "terms"},
            {"name": "inclusion_probability", "type": "float"}, {"name": "selection_probability", "type": "float"}]
    if include_judge_score:
        meta.append({"name": "judge_score", "type": "float"})
    return {"fields": [{"name": c, "type": "text", "required": True} for c in text_columns],
            "questions": [question], "metadata": meta}


def to_argilla(items: Sequence[Mapping], text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS) -> list[dict]:
    """Argilla records: ``{"id", "fields": {texts}, "metadata": {...}}`` (``rg.Record`` keyword arguments)."""
    out = []
    for i in items:
        meta = {k: i.get(k) for k in ("request_id", "kind", "triggers", "inclusion_probability",
                                      "selection_probability", "judge_score", "dt") if k in i}
        out.append({"id": i["item_id"], "fields": {c: i.get(c) or "" for c in text_columns},
                    "metadata": {k: v for k, v in meta.items() if v is not None}})
    return out


def export_request(items: Sequence[Mapping], fmt: str, text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS,
                   label_scale: Sequence[float] = (0.0, 1.0)) -> bytes:
    """Serialise items in one of `FORMATS` (Label Studio: a JSON list of tasks; Argilla: a JSON document
    with ``settings`` and ``records``)."""
    if fmt == "csv":
        return to_csv(items, text_columns)
    if fmt == "jsonl":
        return to_jsonl(items, text_columns)
    if fmt == "label-studio":
        return json.dumps(to_label_studio(items, text_columns), indent=1).encode()
    if fmt == "argilla":
        doc = {"settings": argilla_settings(label_scale, text_columns, any("judge_score" in i for i in items)),
               "records": to_argilla(items, text_columns)}
        return json.dumps(doc, indent=1).encode()
    raise CJEInputError(f"unknown export format {fmt!r}; expected one of {list(FORMATS)}")


__all__ = ["FORMATS", "request_items", "read_texts", "read_anchor_texts", "export_request", "to_csv", "to_jsonl",
           "to_label_studio", "to_argilla", "label_studio_config", "argilla_settings"]
