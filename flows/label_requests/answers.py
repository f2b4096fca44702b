"""Answers from labelling tools back to ``response_id, oracle_label`` rows.

Formats:

* ``table``: CSV, JSONL or Parquet with an id column (default ``response_id``) and an answer
  column (default ``oracle_label``), as `flows.label_requests.exports` writes them;
* ``label-studio``: a Label Studio JSON export (a list of tasks with ``data`` and ``annotations``;
  each annotation's ``result`` holds ``{"from_name", "type", "value"}``);
* ``argilla``: Argilla records (a JSON list, a JSONL file, or ``{"records": [...]}``) with
  ``responses[<question>] = [{"value", "user_id", "status"}]``, or the SDK's flattened
  ``<question>.responses`` lists.

Per item: cancelled (skipped) annotations and answers that are not submitted are ignored (and
counted); two submitted answers with the same value count once; two with different values are an
error naming the item and the values (resolve it in the tool: nothing is ingested, nothing lost).

CSV cells: `flows.label_requests.exports.to_csv` prefixes a text cell that a spreadsheet would run as
a formula with ``'`` (`neutralize_csv_cell`); `restore_csv_table` strips exactly that prefix again
when a filled CSV is read back, so ids and texts round-trip unchanged.

Scales: ``answer_scale`` is the scale the answers were given on (``--label-scale 1-5``); they must
lie in it, and are mapped linearly onto ``target_scale`` (the evaluation's label scale recorded in
the requests) when the two differ.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pyarrow as pa

from cje_engine.errors import CJEInputError

log = logging.getLogger(__name__)

ANSWER_FORMATS = ("auto", "table", "label-studio", "argilla")
#: Leading characters a spreadsheet reads as the start of a formula (OWASP, CSV injection).
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
#: A cell `neutralize_csv_cell` changed: one or more quotes, then a formula start (the first quote is ours).
_NEUTRALIZED = re.compile(r"^'+[=+\-@\t\r]")


def neutralize_csv_cell(value: str) -> str:
    """``value`` safe to open in a spreadsheet: prefixed with ``'`` when it starts with a formula character
    (``= + - @``, tab, CR), or with quotes followed by one (so that `restore_csv_cell` is its exact inverse)."""
    if value.startswith(FORMULA_START) or _NEUTRALIZED.match(value):
        return "'" + value
    return value


def restore_csv_cell(value: str) -> str:
    """The inverse of `neutralize_csv_cell`: drop the one ``'`` it added; any other cell is unchanged."""
    return value[1:] if _NEUTRALIZED.match(value) else value


def restore_csv_table(table: pa.Table) -> pa.Table:
    """`restore_csv_cell` on every text column of a CSV read back (ids, texts, metadata)."""
    for i, name in enumerate(table.column_names):
        col = table.column(name)
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            values = [None if v is None else restore_csv_cell(v) for v in col.to_pylist()]
            table = table.set_column(i, name, pa.array(values, col.type))
    return table
_VALUE_KEYS = ("number", "rating", "choices", "text", "textarea")


def parse_scale(text: Any) -> tuple[float, float]:
    """``"1-5"``, ``"0..1"``, ``"1,10"`` or a pair -> ``(lo, hi)`` with ``lo < hi``."""
    if isinstance(text, (list, tuple)) and len(text) == 2:
        lo, hi = text
    else:
        s = str(text).strip()
        for sep in ("..", ",", ":", "-"):
            a, mid, b = s.partition(sep) if sep != "-" else s[1:].partition("-")
            if mid:
                lo, hi = (a, b) if sep != "-" else (s[0] + a, b)
                break
        else:
            raise CJEInputError(f"label scale {text!r} is not like 1-5 or 0..1")
    try:
        lo, hi = float(lo), float(hi)
    except (TypeError, ValueError):
        raise CJEInputError(f"label scale {text!r} is not like 1-5 or 0..1") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise CJEInputError(f"label scale {text!r} must have finite bounds with low < high")
    return lo, hi


@dataclass
class Answers:
    """Parsed answers: one row per item, plus what was ignored and the tool's task ids."""

    ids: list[str] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    source_rows: list[str] = field(default_factory=list)  # where each answer came from, for errors
    task_ids: dict[str, Any] = field(default_factory=dict)  # item id -> the tool's task id
    ignored: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    unanswered: list[str] = field(default_factory=list)

    def table(self) -> pa.Table:
        """The answers as an Arrow table of ``response_id`` and ``oracle_label``."""
        return pa.table({"response_id": pa.array(self.ids, pa.string()),
                         "oracle_label": pa.array(self.values, pa.float64())})


def _number(value: Any, where: str, source: str) -> float:
    if isinstance(value, Mapping):
        for k in _VALUE_KEYS:
            if k in value:
                value = value[k]
                break
        else:
            raise CJEInputError(f"{where}: answer value {value!r} has none of {list(_VALUE_KEYS)}", source=source)
    if isinstance(value, list):
        if len(value) != 1:
            raise CJEInputError(f"{where}: expected one answer, got {value!r}", source=source)
        value = value[0]
    if isinstance(value, bool):
        raise CJEInputError(f"{where}: answer {value!r} is not a number", source=source)
    try:
        y = float(value)
    except (TypeError, ValueError):
        raise CJEInputError(f"{where}: answer {value!r} is not a number", source=source) from None
    if not math.isfinite(y):
        raise CJEInputError(f"{where}: answer {value!r} is not a finite number", source=source)
    return y


def _add(out: Answers, seen: dict[str, int], item: str, values: list[tuple[float, str]], source: str) -> None:
    if not values:
        out.unanswered.append(item)
        return
    distinct = sorted({v for v, _ in values})
    if len(distinct) > 1:
        raise CJEInputError(f"item {item!r} has {len(values)} submitted answers that disagree ("
                            + ", ".join(f"{v:g} in {w}" for v, w in values)
                            + "); resolve them in the labelling tool (delete or fix one) and pull again",
                            source=source)
    out.duplicates += len(values) - 1
    if item in seen:
        raise CJEInputError(f"item {item!r} appears twice ({out.source_rows[seen[item]]} and {values[0][1]})",
                            source=source)
    seen[item] = len(out.ids)
    out.ids.append(item)
    out.values.append(distinct[0])
    out.source_rows.append(values[0][1])


def parse_label_studio(doc: Any, source: str, answer_field: str = "oracle_label",
                       id_field: str = "response_id") -> Answers:
    """Answers of a Label Studio JSON export (see module docs)."""
    if isinstance(doc, Mapping) and "tasks" in doc:
        doc = doc["tasks"]
    if not isinstance(doc, list):
        raise CJEInputError("a Label Studio JSON export is a list of tasks", source=source)
    out, seen = Answers(), {}
    for n, task in enumerate(doc):
        data = task.get("data") if isinstance(task, Mapping) else None
        if not isinstance(data, Mapping) or data.get(id_field) in (None, ""):
            raise CJEInputError(f"task {n} (id {task.get('id') if isinstance(task, Mapping) else '?'}) has no "
                                f"data.{id_field}: not a task pushed by cje", source=source)
        item = str(data[id_field])
        out.task_ids[item] = task.get("id")
        values = []
        for ann in task.get("annotations") or []:
            if ann.get("was_cancelled"):
                out.ignored["cancelled"] = out.ignored.get("cancelled", 0) + 1
                continue
            where = f"task {task.get('id')} ({id_field} {item!r}), annotation {ann.get('id')}"
            got = [r for r in ann.get("result") or [] if r.get("from_name") == answer_field]
            if not got:
                out.ignored["without_answer"] = out.ignored.get("without_answer", 0) + 1
                continue
            values.append((_number(got[0].get("value"), where, source), where))
        _add(out, seen, item, values, source)
    return out


def _argilla_responses(rec: Mapping, question: str) -> list:
    resp = rec.get("responses")
    if isinstance(resp, Mapping):
        return list(resp.get(question) or [])
    if isinstance(resp, list):  # older layout: [{"values": {q: {"value": v}}, "status", "user_id"}]
        return [{"value": (r.get("values") or {}).get(question, {}).get("value"), "status": r.get("status"),
                 "user_id": r.get("user_id")} for r in resp if question in (r.get("values") or {})]
    flat = rec.get(f"{question}.responses")
    if isinstance(flat, list):
        status = rec.get(f"{question}.responses.status") or ["submitted"] * len(flat)
        users = rec.get(f"{question}.responses.users") or [None] * len(flat)
        return [{"value": v, "status": s, "user_id": u} for v, s, u in zip(flat, status, users)]
    return []


def parse_argilla(records: Any, source: str, answer_field: str = "oracle_label") -> Answers:
    """Answers of Argilla records (see module docs); the record ``id`` is the item id."""
    if isinstance(records, Mapping) and "records" in records:
        records = records["records"]
    if not isinstance(records, list):
        raise CJEInputError("Argilla records must be a list (or {'records': [...]})", source=source)
    out, seen = Answers(), {}
    for n, rec in enumerate(records):
        if not isinstance(rec, Mapping) or rec.get("id") in (None, ""):
            raise CJEInputError(f"record {n} has no id", source=source)
        item = str(rec["id"])
        values = []
        for k, r in enumerate(_argilla_responses(rec, answer_field)):
            if str(r.get("status") or "submitted") != "submitted":
                key = f"status_{r.get('status')}"
                out.ignored[key] = out.ignored.get(key, 0) + 1
                continue
            where = f"record {item!r}, response {k} (user {r.get('user_id')})"
            values.append((_number(r.get("value"), where, source), where))
        _add(out, seen, item, values, source)
    return out


def parse_table(table: pa.Table, source: str, answer_field: str = "oracle_label",
                id_field: str = "response_id") -> Answers:
    """Answers of a CSV/JSONL/Parquet table (rows with an empty answer are not answered yet)."""
    for col in (id_field, answer_field):
        if col not in table.column_names:
            raise CJEInputError(f"column is missing (found {table.column_names}); choose it with "
                                f"{'--id-field' if col == id_field else '--answer-field'}", source=source, column=col)
    out, seen = Answers(), {}
    for i, (rid, val) in enumerate(zip(table.column(id_field).to_pylist(), table.column(answer_field).to_pylist())):
        if rid in (None, ""):
            raise CJEInputError("is empty; every row needs it", source=source, column=id_field, row=i)
        if val is None or (isinstance(val, str) and not val.strip()):
            out.unanswered.append(str(rid))
            continue
        where = f"row {i}"
        y = _number(val, f"column '{answer_field}', row {i}", source)
        if str(rid) in seen:
            raise CJEInputError(f"response_id {rid!r} appears twice in the file (rows "
                                f"{out.source_rows[seen[str(rid)]][4:]} and {i}); give one label per response",
                                source=source, column=id_field, row=i)
        seen[str(rid)] = len(out.ids)
        out.ids.append(str(rid))
        out.values.append(y)
        out.source_rows.append(where)
    return out


def detect_format(data: bytes, name: str) -> str:
    """``table`` for CSV/Parquet/JSONL rows, ``label-studio`` or ``argilla`` for their JSON."""
    ext = Path(name).suffix.lower()
    if ext in (".csv", ".parquet", ".pq"):
        return "table"
    head = data.lstrip()[:1]
    try:
        doc = json.loads(data) if head in (b"[", b"{") else None
    except ValueError:
        doc = None
    if doc is None:
        first = next((ln for ln in data.splitlines() if ln.strip()), b"{}")
        try:
            doc = [json.loads(first)]
        except ValueError:
            return "table"
    if isinstance(doc, Mapping):
        doc = doc.get("records") or doc.get("tasks") or [doc]
    first = doc[0] if isinstance(doc, list) and doc else {}
    if isinstance(first, Mapping) and "data" in first and ("annotations" in first or "id" in first):
        return "label-studio"
    if isinstance(first, Mapping) and "fields" in first and "id" in first:
        return "argilla"
    return "table"


def load_json_or_jsonl(data: bytes, source: str) -> Any:
    """Parse ``data`` as one JSON document, else as JSON lines.

    Parameters
    ----------
    data : bytes
        The file's content.
    source : str
        The file's name, for the error.

    Returns
    -------
    Any
        The document, or the list of the lines' documents; neither form raises `CJEInputError` naming ``source``.
    """
    try:
        return json.loads(data)
    except ValueError:
        pass
    try:
        return [json.loads(ln) for ln in data.splitlines() if ln.strip()]
    except ValueError as exc:
        raise CJEInputError(f"is neither JSON nor JSON lines: {exc}", source=source) from None


def rescale(values: Iterable[float], ids: Sequence[str], rows: Sequence[str], source: str,
            answer_scale: Sequence[float], target_scale: Sequence[float]) -> list[float]:
    """Check answers against ``answer_scale`` and map them linearly onto ``target_scale``."""
    lo, hi = float(answer_scale[0]), float(answer_scale[1])
    tlo, thi = float(target_scale[0]), float(target_scale[1])
    out = []
    for v, item, where in zip(values, ids, rows):
        if not (lo <= v <= hi):
            raise CJEInputError(f"{where}: answer {v:g} for {item!r} is outside the label scale [{lo:g}, {hi:g}] "
                                "(declare the tool's scale with --label-scale, e.g. 1-5)", source=source,
                                column="oracle_label")
        out.append(v if (lo, hi) == (tlo, thi) else tlo + (v - lo) * (thi - tlo) / (hi - lo))
    return out


__all__ = ["Answers", "parse_label_studio", "parse_argilla", "parse_table", "detect_format", "parse_scale",
           "rescale", "load_json_or_jsonl", "ANSWER_FORMATS"]
