"""Answers from labelling tools back to ``response_id, oracle_label`` rows.

Formats (`answer_formats`):

* ``table``: CSV, JSONL or Parquet with an id column (default ``response_id``) and an answer
  column (default ``oracle_label``), as the ``csv`` and ``jsonl`` tools write them;
* the format of every registered labelling tool that reads its own answers
  (`flows.integrations.labelling`): ``label-studio`` (a Label Studio JSON export), ``argilla``
  (Argilla records), ...; `parse_answers` hands the document to the tool's ``parse``.

Per item: cancelled (skipped) annotations and answers that are not submitted are ignored (and
counted); two submitted answers with the same value count once; two with different values are an
error naming the item and the values (resolve it in the tool: nothing is ingested, nothing lost).

CSV cells: `flows.integrations.labelling.files.to_csv` prefixes a text cell that a spreadsheet would run
as a formula with ``'`` (`flows.integrations.labelling.files.neutralize_csv_cell`); `restore_csv_table`
strips exactly that prefix again when a filled CSV is read back, so ids and texts round-trip unchanged.

Scales: ``answer_scale`` is the scale the answers were given on (``--label-scale 1-5``); they must
lie in it, and are mapped linearly onto ``target_scale`` (the evaluation's label scale recorded in
the requests) when the two differ.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pyarrow as pa

from cje_engine.errors import CJEInputError

from flows.integrations import labelling
from flows.integrations.labelling import Answers
from flows.integrations.labelling.base import answer_number
from flows.integrations.labelling.files import restore_csv_cell

log = logging.getLogger(__name__)


def answer_formats() -> tuple[str, ...]:
    """``auto``, ``table`` and every registered tool reading its own answers (``cje labels --format``)."""
    return labelling.answer_formats()


def parse_answers(fmt: str, doc: Any, source: str, answer_field: str = "oracle_label",
                  id_field: str = "response_id") -> Answers:
    """Answers of a tool's parsed JSON document, by the registered tool ``fmt`` (e.g. ``label-studio``).

    Raises
    ------
    CJEInputError
        ``fmt`` is no tool reading its own answers, or the document is not valid for it.
    """
    tool = labelling.get(fmt)
    if tool.answers_format != tool.name:
        raise CJEInputError(f"labelling tool {fmt!r} returns a table; read it with --format table")
    return tool.parse(doc, source, answer_field, id_field)


def restore_csv_table(table: pa.Table) -> pa.Table:
    """`restore_csv_cell` on every text column of a CSV read back (ids, texts, metadata)."""
    for i, name in enumerate(table.column_names):
        col = table.column(name)
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            values = [None if v is None else restore_csv_cell(v) for v in col.to_pylist()]
            table = table.set_column(i, name, pa.array(values, col.type))
    return table


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
        y = answer_number(val, f"column '{answer_field}', row {i}", source)
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
    """``table`` for CSV/Parquet/JSONL rows, else the registered tool whose answers the JSON is
    (`flows.integrations.labelling.detect`: ``label-studio``, ``argilla``, ...)."""
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
    return (labelling.detect(first) if isinstance(first, Mapping) else None) or "table"


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


__all__ = ["Answers", "parse_answers", "parse_table", "detect_format", "parse_scale", "rescale",
           "answer_formats", "restore_csv_table"]
