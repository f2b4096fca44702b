"""Labelling tools behind one interface (`base.LabellingTool`), and the registry of them.

The built-in tools, in the order the CLI lists them: ``csv`` and ``jsonl`` (files filled in and read back
as a table), ``label-studio`` (files, or push/pull over its REST API) and ``argilla`` (files).  A new tool
is its module plus one line in `BUILTIN` (or a `register` call from a plug-in); docs/labelling.md,
"Adding a labelling tool".
"""
from __future__ import annotations

from flows.integrations.labelling.argilla import ArgillaTool
from flows.integrations.labelling.base import (ANSWER, DEFAULT_TEXT_COLUMNS, META, AnswerReader, Answers,
                                               Destination, ExportOptions, LabellingTool, PullResult, PushResult,
                                               ServerTool, ToolStatus, ToolUnavailable, answer_formats, detect, get,
                                               help_lines, is_server, names, register, server_names, tool_status,
                                               unregister)
from flows.integrations.labelling.files import CsvTool, JsonlTool
from flows.integrations.labelling.label_studio import LabelStudioTool

#: The built-in tools: one registration each.
BUILTIN = (CsvTool(), JsonlTool(), LabelStudioTool(), ArgillaTool())
for _tool in BUILTIN:
    register(_tool, replace=True)

__all__ = ["LabellingTool", "AnswerReader", "ServerTool", "ExportOptions", "Destination", "PushResult", "PullResult",
           "Answers", "ToolStatus", "tool_status", "ToolUnavailable", "register", "unregister", "get", "names",
           "server_names", "answer_formats",
           "detect", "is_server", "help_lines", "BUILTIN", "ANSWER", "META", "DEFAULT_TEXT_COLUMNS"]
