"""Imports from eval and tracing tools (``cje import FORMAT SOURCE --out LOGS_URI``), behind one interface.

An importer (`base.Importer`) streams a tool's records (`base.SourceRecord`); the mapping
(`mapping.map_records`, selectors `base.ImportMapping`) turns them into rows (`base.ImportedRow`) and
counts what it could not map (`base.ImportReport`); the writer (`writer.import_source`) stores the rows in
the service's daily Parquet layout, create-only and idempotent. The registry (`IMPORTERS`, a
`cje_engine.registry.Registry`) is what ``cje import``'s FORMAT choices are built from: a new source is
its module plus one line in `BUILTIN` (docs/imports/README.md).
"""
from __future__ import annotations

from flows.integrations.importers.base import (HUMAN, IMPORTERS, JUDGE, UNKNOWN, ImportedRow, Importer, ImportMapping,
                                               ImportReport, Note, Score, Selector, Skipped, SourceRecord, bad_record, get,
                                               message_text, names, number, parse_ts, register, text_id)
from flows.integrations.importers.mapping import map_records
from flows.integrations.importers.langfuse import LangfuseImporter
from flows.integrations.importers.langsmith import LangSmithImporter
from flows.integrations.importers.otel import OtelImporter
from flows.integrations.importers.promptfoo import PromptfooImporter
from flows.integrations.importers.inspect_logs import InspectImporter
from flows.integrations.importers.writer import import_source

#: The built-in importers: one registration each.
BUILTIN: tuple[Importer, ...] = (OtelImporter(), LangfuseImporter(), LangSmithImporter(), PromptfooImporter(),
                                 InspectImporter())
for _imp in BUILTIN:
    register(_imp, replace=True)

__all__ = ["Importer", "SourceRecord", "Score", "ImportedRow", "ImportReport", "Note", "Skipped", "ImportMapping", "Selector",
           "IMPORTERS", "register", "get", "names", "map_records", "import_source", "bad_record", "message_text", "parse_ts", "number",
           "text_id", "JUDGE", "HUMAN", "UNKNOWN", "BUILTIN"]
