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

from flows.integrations.labelling.base import ANSWER, DEFAULT_TEXT_COLUMNS, META, ExportOptions, item_meta

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


__all__ = ["CsvTool", "JsonlTool", "to_csv", "to_jsonl", "neutralize_csv_cell", "restore_csv_cell", "FORMULA_START"]
