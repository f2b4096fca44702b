"""Argilla, files only: a dataset's settings and records out, its records with responses back.

Out: ``{"settings": {fields, questions, metadata}, "records": [{"id", "fields", "metadata"}]}`` as plain
JSON (``rg.Settings`` / ``rg.Record`` keyword arguments).  Back: Argilla records (a JSON list, a JSONL
file, or ``{"records": [...]}``) with ``responses[<question>] = [{"value", "user_id", "status"}]``, or the
SDK's flattened ``<question>.responses`` lists.  No server round trip: the Argilla server needs Elasticsearch or
OpenSearch, which cannot run here (docs/labelling.md, "Argilla: files only, and why").
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from cje_engine.errors import CJEInputError

from flows.integrations.labelling.base import (ANSWER, DEFAULT_TEXT_COLUMNS, Answers, ExportOptions, add_answers,
                                               answer_number)


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


def parse_argilla(records: Any, source: str, answer_field: str = ANSWER) -> Answers:
    """Answers of Argilla records (see module docs); the record ``id`` is the item id.  Responses that are
    not submitted are ignored and counted; answers that disagree are an error."""
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
            values.append((answer_number(r.get("value"), where, source), where))
        add_answers(out, seen, item, values, source)
    return out


class ArgillaTool:
    """Argilla as a file-based `flows.integrations.labelling.base.LabellingTool` (no server round trip)."""

    name = "argilla"
    suffix = ".json"
    title = "Argilla"
    help = "Argilla dataset settings and records (files only: its server needs Elasticsearch or OpenSearch)"
    answers_format = "argilla"

    def outputs(self, dest: Path) -> list[Path]:
        """Just ``dest`` (settings and records in one document)."""
        return [Path(dest)]

    def export(self, items: Sequence[Mapping], dest: Path, options: ExportOptions) -> dict[Path, bytes]:
        """``{"settings", "records"}`` as JSON."""
        doc = {"settings": argilla_settings(options.label_scale, options.text_columns,
                                            any("judge_score" in i for i in items)),
               "records": to_argilla(items, options.text_columns)}
        return {Path(dest): json.dumps(doc, indent=1).encode()}

    def answered(self, files: Mapping[Path, bytes], answers: Mapping[str, float]) -> bytes:
        """The records with one submitted response each for the answered items."""
        doc = json.loads(next(iter(files.values())))
        recs = [dict(r, responses={ANSWER: [{"value": answers[str(r["id"])], "user_id": "labeller",
                                             "status": "submitted"}]} if str(r["id"]) in answers else {})
                for r in doc["records"]]
        return json.dumps(recs, indent=1).encode()

    def detects(self, first: Mapping) -> bool:
        """A record: ``fields`` and ``id``."""
        return "fields" in first and "id" in first

    def parse(self, doc: Any, source: str, answer_field: str = ANSWER, id_field: str = "response_id") -> Answers:
        """`parse_argilla` (the record ``id`` is the item id; ``id_field`` does not apply)."""
        return parse_argilla(doc, source, answer_field)


__all__ = ["ArgillaTool", "argilla_settings", "to_argilla", "parse_argilla"]
