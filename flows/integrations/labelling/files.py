"""File-only labelling tools: a CSV sheet and JSON lines, filled in and handed back as a table.

CSV cells that a spreadsheet would run as a formula (starting with ``= + - @``, tab or CR, e.g. a response
``=IMPORTXML(...)``) are prefixed with ``'`` (OWASP's CSV-injection advice; `neutralize_csv_cell`);
reading the filled CSV back strips exactly that prefix (`restore_csv_cell`).  Both tools' answers come
back as rows ``response_id, oracle_label`` (``cje labels --format table``).
"""
from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from flows.integrations.labelling.base import (ANSWER, DEFAULT_TEXT_COLUMNS, META, ExportOptions, ToolStatus,
                                               item_meta)

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


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    return neutralize_csv_cell(value) if isinstance(value, str) else value


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


def to_jsonl(items: Sequence[Mapping], text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS) -> bytes:
    """One JSON object per line: ``response_id``, the texts, ``oracle_label: null`` and ``meta``."""
    lines = []
    for i in items:
        lines.append(json.dumps({"response_id": i["item_id"], **{c: i.get(c) for c in text_columns},
                                 ANSWER: None, "meta": item_meta(i, text_columns)}, sort_keys=False))
    return ("\n".join(lines) + "\n").encode()


def _counted(tool: str, ids: list[Any], values: list[Any], source: str) -> ToolStatus:
    """`ToolStatus` of a table's rows: an item is answered when its ``oracle_label`` is not empty."""
    answered = sum(1 for i, v in zip(ids, values) if i not in (None, "") and v not in (None, "")
                   and not (isinstance(v, str) and not v.strip()))
    items = sum(1 for i in ids if i not in (None, ""))
    return ToolStatus(tool, source, items, answered, items - answered, None,
                      "a file cannot tell which items were deleted in the tool")


def csv_status(data: bytes, source: str, tool: str = "csv") -> ToolStatus:
    """Rows, answered and unanswered items of an exported or filled CSV sheet (`restore_csv_cell` on ids)."""
    rows = list(csv.reader(io.StringIO(data.decode("utf-8-sig"))))
    if not rows or "response_id" not in rows[0] or ANSWER not in rows[0]:
        return ToolStatus(tool, source, note=f"no response_id and {ANSWER} columns in the header")
    rid, col = rows[0].index("response_id"), rows[0].index(ANSWER)
    body = [r for r in rows[1:] if any(c.strip() for c in r)]
    return _counted(tool, [restore_csv_cell(r[rid]) if rid < len(r) else "" for r in body],
                    [r[col] if col < len(r) else "" for r in body], source)


def jsonl_status(data: bytes, source: str, tool: str = "jsonl") -> ToolStatus:
    """Lines, answered and unanswered items of an exported or filled JSON lines file."""
    try:
        recs = [json.loads(ln) for ln in data.decode().splitlines() if ln.strip()]
    except ValueError as exc:
        return ToolStatus(tool, source, note=f"not JSON lines: {exc}")
    recs = [r for r in recs if isinstance(r, dict)]
    return _counted(tool, [r.get("response_id") for r in recs], [r.get(ANSWER) for r in recs], source)


class CsvTool:
    """A spreadsheet: one row per item, the labeller fills ``oracle_label`` (formula-safe cells)."""

    name = "csv"
    suffix = ".csv"
    title = "CSV sheet"
    help = "a CSV sheet to fill in (formula-safe cells)"
    answers_format = "table"

    def outputs(self, dest: Path) -> list[Path]:
        """Just ``dest``."""
        return [Path(dest)]

    def export(self, items: Sequence[Mapping], dest: Path, options: ExportOptions) -> dict[Path, bytes]:
        """`to_csv` of the items."""
        return {Path(dest): to_csv(items, options.text_columns)}

    def answered(self, files: Mapping[Path, bytes], answers: Mapping[str, float]) -> bytes:
        """The sheet with ``oracle_label`` filled for the answered rows (others left empty)."""
        (data,) = files.values()
        rows = list(csv.reader(io.StringIO(data.decode())))
        col, rid = rows[0].index(ANSWER), rows[0].index("response_id")
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(rows[0])
        for r in rows[1:]:
            item = restore_csv_cell(r[rid])
            r[col] = f"{answers[item]!r}" if item in answers else ""
            w.writerow(r)
        return buf.getvalue().encode()

    def file_status(self, data: bytes, source: str) -> ToolStatus:
        """`csv_status` of the sheet."""
        return csv_status(data, source, self.name)


class JsonlTool:
    """JSON lines: one object per item with ``oracle_label: null`` to fill."""

    name = "jsonl"
    suffix = ".jsonl"
    title = "JSON lines"
    help = "JSON lines with oracle_label to fill"
    answers_format = "table"

    def outputs(self, dest: Path) -> list[Path]:
        """Just ``dest``."""
        return [Path(dest)]

    def export(self, items: Sequence[Mapping], dest: Path, options: ExportOptions) -> dict[Path, bytes]:
        """`to_jsonl` of the items."""
        return {Path(dest): to_jsonl(items, options.text_columns)}

    def answered(self, files: Mapping[Path, bytes], answers: Mapping[str, float]) -> bytes:
        """The lines with ``oracle_label`` set for the answered items."""
        (data,) = files.values()
        out = []
        for line in data.decode().splitlines():
            if line.strip():
                rec = json.loads(line)
                rec[ANSWER] = answers.get(str(rec["response_id"]))
                out.append(json.dumps(rec))
        return ("\n".join(out) + "\n").encode()

    def file_status(self, data: bytes, source: str) -> ToolStatus:
        """`jsonl_status` of the lines."""
        return jsonl_status(data, source, self.name)


__all__ = ["CsvTool", "JsonlTool", "to_csv", "to_jsonl", "csv_status", "jsonl_status", "neutralize_csv_cell",
           "restore_csv_cell", "FORMULA_START"]
