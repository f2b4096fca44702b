"""The labelling-tool interface and its registry.

A labelling tool turns a label request's items into work for people and reads their answers back:

* every tool **exports** items to files (`LabellingTool.export`) and can produce an answered file as
  its labellers would hand it back (`LabellingTool.answered`, what the conformance test reads back);
* a tool whose answers come back in its own format (not a plain ``response_id, oracle_label`` table)
  **parses** them (`AnswerReader`: ``detects`` for ``cje labels --format auto``, ``parse`` into `Answers`);
* a tool with a server **pushes** a request into it and **pulls** the answers (`ServerTool`); what a
  pull returns is stored and ingested by ``cje labels`` exactly like a file (same validation).

The registry (`register`, `get`, `names`, `server_names`, `answer_formats`) is what the CLI's
``--format``, ``--to`` and ``--from`` choices and the label reader's formats are built from: a new
tool is its module plus one `register` call (`flows.integrations.labelling`), docs/labelling.md
"Adding a labelling tool".
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import pyarrow as pa

from cje_engine.errors import CJEInputError
from cje_engine.registry import Registry

#: The answer every tool asks for (CSV/JSONL column, Label Studio ``Number`` control, Argilla question).
ANSWER = "oracle_label"
DEFAULT_TEXT_COLUMNS = ("prompt", "response")
#: Metadata of every item, in this order (``judge_score`` only when asked for). Labellers are blind to the
#: policy: neither its name nor the request's reasons (which name it) are exported; answers map back by the
#: item's id (``response_id``).
META = ("item_id", "kind", "request_id", "triggers", "dt", "stratum", "selection_probability",
        "inclusion_probability", "label_scale")
#: Answers formats that are not tools: ``auto`` (detect) and ``table`` (CSV/JSONL/Parquet rows).
RESERVED = ("auto", "table")
_NAME = re.compile(r"^[a-z][a-z0-9-]*$")
_VALUE_KEYS = ("number", "rating", "choices", "text", "textarea")


class ToolUnavailable(RuntimeError):
    """A labelling tool's server does not answer (the CLI exits 69)."""


# --------------------------------------------------------------------------------------
# what goes in and out of a tool


@dataclass(frozen=True)
class ExportOptions:
    """How items are shown to labellers.

    Parameters
    ----------
    text_columns : tuple of str
        Log columns shown (default ``prompt, response``).
    label_scale : (float, float)
        The request's label scale (bounds of the answer control).
    include_judge_score : bool
        Show the judge score (default: labellers stay blind to it).
    """

    text_columns: tuple[str, ...] = DEFAULT_TEXT_COLUMNS
    label_scale: tuple[float, float] = (0.0, 1.0)
    include_judge_score: bool = False


@dataclass(frozen=True)
class Destination:
    """Where a server tool's project lives.

    Parameters
    ----------
    url : str
        The server's base URL.
    project : str, optional
        An existing project (the tool says what an id looks like).
    new_project : str, optional
        Title of a project to create (instead of ``project``).
    token_env : str, optional
        Environment variable holding the token (default: the tool's `ServerTool.token_env`).
    description : str
        What labellers read about the request (never the policy).
    """

    url: str
    project: str | None = None
    new_project: str | None = None
    token_env: str | None = None
    description: str = ""


@dataclass(frozen=True)
class PushResult:
    """Outcome of `ServerTool.push`: the project, tasks imported now and already there, item -> task id."""

    project: str
    imported: int
    already: int
    tasks: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PullResult:
    """Outcome of `ServerTool.pull`: the tool's answers document as pulled (stored create-only, then read
    by the tool's `AnswerReader.parse` through ``cje labels``), its file suffix, and the pushed items
    whose task is gone from the tool."""

    document: bytes
    suffix: str = ".json"
    deleted: Sequence[str] = ()
    n_tasks: int = 0


@dataclass(frozen=True)
class ToolStatus:
    """What a labelling tool can say about the items it holds (``cje requests status --tool``).

    Attributes
    ----------
    tool : str
        The tool's name.
    where : str
        What was asked: a file, or a server's project (``URL project P``).
    pushed : int or None
        Items handed to the tool (pushed into the project, or rows of the exported file).
    answered : int or None
        Items with a submitted answer.
    unanswered : int or None
        Items still without one (pushed, present, not answered).
    deleted : int or None
        Pushed items whose task is gone from the tool; None when the tool cannot tell (a file).
    note : str
        What the tool cannot say, or why a count is missing.
    """

    tool: str
    where: str
    pushed: int | None = None
    answered: int | None = None
    unanswered: int | None = None
    deleted: int | None = None
    note: str = ""

    def to_dict(self) -> dict:
        """Plain JSON data (the ``tool`` block of ``cje requests status --json``)."""
        return {"tool": self.tool, "where": self.where, "pushed": self.pushed, "answered": self.answered,
                "unanswered": self.unanswered, "deleted": self.deleted, "note": self.note}

    def line(self) -> str:
        """One line for people: counts, ``?`` for what the tool cannot tell."""
        def n(v: int | None) -> str:
            return "?" if v is None else str(v)
        text = (f"{self.tool} {self.where}: {n(self.pushed)} pushed, {n(self.answered)} answered, "
                f"{n(self.unanswered)} unanswered, {n(self.deleted)} deleted")
        return text + (f" ({self.note})" if self.note else "")


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
        """``response_id, oracle_label`` rows of the answers."""
        return pa.table({"response_id": pa.array(self.ids, pa.string()),
                         "oracle_label": pa.array(self.values, pa.float64())})


def answer_number(value: Any, where: str, source: str) -> float:
    """One answer as a finite number (``{"number": 3}``, ``{"choices": ["3"]}``, ``[3]`` or ``3``);
    `CJEInputError` naming ``where`` (item, annotation) and ``source`` otherwise."""
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


def add_answers(out: Answers, seen: dict[str, int], item: str, values: list[tuple[float, str]], source: str) -> None:
    """Record one item's submitted answers: none -> unanswered; equal ones count once (duplicates); answers
    that disagree, or an item seen twice, are a `CJEInputError` naming both (nothing is dropped silently)."""
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


def item_meta(item: Mapping, text_columns: Sequence[str]) -> dict:
    """An item's metadata: everything but its id and texts."""
    return {k: v for k, v in item.items() if k not in text_columns and k != "item_id"}


# --------------------------------------------------------------------------------------
# the protocols


@runtime_checkable
class LabellingTool(Protocol):
    """A labelling tool: items out as files, answers back.

    Attributes
    ----------
    name : str
        The ``--format`` / ``--to`` / ``--from`` value (lower case, digits, ``-``).
    title : str
        The tool's name for people (``"Label Studio"``).
    help : str
        One line for the CLI's help.
    answers_format : str
        The ``cje labels --format`` that reads its answered files back: ``"table"`` (rows with
        ``response_id, oracle_label``) or the tool's own ``name`` (then it is an `AnswerReader`).
    suffix : str
        The suffix of its main file (``.csv``, ``.json``, ...): answered files are read by it.
    """

    name: str
    title: str
    help: str
    answers_format: str
    suffix: str

    def outputs(self, dest: Path) -> list[Path]:
        """The files `export` writes for ``dest`` (``dest`` first); checked before any work."""

    def export(self, items: Sequence[Mapping], dest: Path, options: ExportOptions) -> dict[Path, bytes]:
        """The request's items (`flows.label_requests.exports.request_items`) as ``{path: content}``
        for exactly `outputs` ``(dest)``; nothing is written here."""

    def answered(self, files: Mapping[Path, bytes], answers: Mapping[str, float]) -> bytes:
        """The exported files with ``answers`` (item id -> value) filled in, as the tool hands them back
        (what a labeller's submit produces; used by the conformance test and the docs' examples)."""

    # Optional: ``file_status(data, source) -> ToolStatus``, what an exported or returned file says (items,
    # answered, unanswered); without it `file_status` below parses the file with the tool's `AnswerReader`.


@runtime_checkable
class AnswerReader(Protocol):
    """A tool whose answers come back in its own format (``answers_format == name``)."""

    def detects(self, first: Mapping) -> bool:
        """Whether ``first`` (the first record of a JSON/JSONL document) is this tool's answer format."""

    def parse(self, doc: Any, source: str, answer_field: str = ANSWER, id_field: str = "response_id") -> Answers:
        """Answers of a parsed JSON document (`add_answers` per item: nothing dropped silently)."""


@runtime_checkable
class ServerTool(Protocol):
    """A tool with a server: push a request into a project, pull its answers back."""

    token_env: str

    def push(self, items: Sequence[Mapping], manifest: Mapping, dest: Destination, options: ExportOptions,
             storage: Any | None = None) -> PushResult:
        """Create tasks for the items (idempotent: items already there are not pushed again); with a requests
        ``storage``, a create-only record of which task holds which item. `ToolUnavailable` when the
        server does not answer."""

    def pull(self, dest: Destination, storage: Any | None = None) -> PullResult:
        """The project's answers document and the pushed items whose task is gone (from the push records
        in ``storage``). `ToolUnavailable` when the server does not answer."""

    def status(self, dest: Destination, storage: Any | None = None) -> ToolStatus:
        """What the project holds: items pushed, answered, unanswered, deleted in the tool (`ToolStatus`);
        `pulled_status` computes it from a `pull`. `ToolUnavailable` when the server does not answer."""


# --------------------------------------------------------------------------------------
# status: what a tool can say about the items it holds


def load_document(data: bytes, source: str) -> Any:
    """``data`` as one JSON document, else as JSON lines (`CJEInputError` naming ``source`` and the error)."""
    try:
        return json.loads(data)
    except ValueError:
        pass
    try:
        return [json.loads(ln) for ln in data.splitlines() if ln.strip()]
    except ValueError as exc:
        raise CJEInputError(f"is neither JSON nor JSON lines: {exc}", source=source) from None


def _parsed(tool: Any, data: bytes, source: str) -> tuple[Answers | None, str]:
    """The tool's answers of ``data``, or None and why (answers that disagree are named, not raised: a
    status reports them)."""
    try:
        return tool.parse(load_document(data, source), source), ""
    except CJEInputError as exc:
        return None, f"answers not counted: {exc}"


def file_status(tool: Any, data: bytes, source: str) -> ToolStatus:
    """What an exported or returned file of ``tool`` says: its items, answered and unanswered ones.

    The tool's own ``file_status`` when it has one (the table tools), else its `AnswerReader.parse`.
    A file cannot tell which items were deleted in the tool (``deleted`` is None).
    """
    own = getattr(tool, "file_status", None)
    if callable(own):
        return own(data, source)
    if not isinstance(tool, AnswerReader):
        return ToolStatus(tool.name, source, note=f"{tool.title} files cannot be read back here")
    got, why = _parsed(tool, data, source)
    if got is None:
        return ToolStatus(tool.name, source, note=why)
    return ToolStatus(tool.name, source, len(got.ids) + len(got.unanswered), len(got.ids), len(got.unanswered),
                      None, "a file cannot tell which items were deleted in the tool")


def pulled_status(tool: Any, dest: Destination, storage: Any | None = None, pushed: int | None = None) -> ToolStatus:
    """A server tool's `ToolStatus` from a `ServerTool.pull` of ``dest.project``: answered items of the pulled
    document, unanswered = tasks present without an answer, deleted = pushed items whose task is gone (None
    without the push records in ``storage``); ``pushed`` (items the push records hand to the project) defaults
    to present + deleted."""
    got = tool.pull(dest, storage)
    where = f"{dest.url} project {dest.project}"
    present = int(got.n_tasks)
    # without the push records nothing says which tasks were deleted in the tool
    deleted = len(got.deleted) if storage is not None else None
    answers, why = _parsed(tool, got.document, where)
    answered = None if answers is None else len(answers.ids)
    unanswered = None if answered is None else max(present - answered, 0)
    if deleted is None:
        why = "; ".join(x for x in (why, "deleted tasks need the push records: give --evaluation or --requests-uri")
                        if x)
    return ToolStatus(tool.name, where, present + (deleted or 0) if pushed is None else pushed, answered, unanswered,
                      deleted, why)


# --------------------------------------------------------------------------------------
# the registry




def is_server(tool: Any) -> bool:
    """Whether ``tool`` has a server (`ServerTool`: ``push`` and ``pull``)."""
    return callable(getattr(tool, "push", None)) and callable(getattr(tool, "pull", None))


def _check_tool(tool: Any) -> None:
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or not _NAME.match(name) or name in RESERVED:
        raise ValueError(f"labelling tool name {name!r}: lower case letters, digits and '-', not one of {RESERVED}")
    if not isinstance(tool, LabellingTool):
        missing = [a for a in ("title", "help", "answers_format", "suffix", "outputs", "export", "answered")
                   if not hasattr(tool, a)]
        raise TypeError(f"labelling tool {name!r} lacks {missing} (flows.integrations.labelling.LabellingTool)")
    if tool.answers_format not in ("table", name):
        raise ValueError(f"labelling tool {name!r}: answers_format must be 'table' or {name!r}, "
                         f"not {tool.answers_format!r}")
    if tool.answers_format == name and not isinstance(tool, AnswerReader):
        raise TypeError(f"labelling tool {name!r} reads its own answers but has no detects/parse (AnswerReader)")
    if callable(getattr(tool, "push", None)) != callable(getattr(tool, "pull", None)):
        raise TypeError(f"labelling tool {name!r}: a server tool has both push and pull (ServerTool)")
    if is_server(tool) and not isinstance(getattr(tool, "token_env", None), str):
        raise TypeError(f"labelling tool {name!r}: a server tool names its token variable (token_env)")


#: The family (`cje_engine.registry.Registry`); the functions below are its public face.
TOOLS: Registry[LabellingTool] = Registry("labelling tool", check=_check_tool)


def register(tool: LabellingTool, *, replace: bool = False) -> LabellingTool:
    """Add a labelling tool; it becomes a ``--format`` choice (and ``--to``/``--from`` with a server).

    Parameters
    ----------
    tool : LabellingTool
        The tool (checked against the protocols here, not at its first use).
    replace : bool
        Replace a tool of the same name (default: that is an error).

    Returns
    -------
    LabellingTool
        ``tool`` (so that ``register`` can be used as a decorator of an instance factory).

    Raises
    ------
    ValueError, TypeError
        A bad name, a name taken, or a tool that does not follow the protocols.
    """
    return TOOLS.register(tool, replace=replace)


def unregister(name: str) -> None:
    """Remove a registered tool (tests register toys and remove them again)."""
    TOOLS.unregister(name)


def names() -> tuple[str, ...]:
    """Every registered tool's name, in registration order (the ``requests export --format`` choices)."""
    return TOOLS.names()


def server_names() -> tuple[str, ...]:
    """Names of the tools with a server (the ``requests push --to`` and ``labels --from`` choices)."""
    return tuple(n for n, t in TOOLS.items() if is_server(t))


def answer_formats() -> tuple[str, ...]:
    """``auto``, ``table`` and every tool reading its own answers (the ``cje labels --format`` choices)."""
    return (*RESERVED, *(n for n, t in TOOLS.items() if t.answers_format == n))


def get(name: str, *, server: bool = False) -> LabellingTool:
    """The registered tool ``name`` (with ``server``: one with push and pull).

    Raises
    ------
    CJEInputError
        Unknown name (or no server), naming the choices and the closest one.
    """
    if server:
        return TOOLS.get(name, server_names(), "labelling tool with a server")
    return TOOLS.get(name)


def detect(first: Mapping) -> str | None:
    """The tool whose answer format ``first`` (a document's first record) is, or None (a table)."""
    for name, tool in TOOLS.items():
        if tool.answers_format == name and tool.detects(first):
            return name
    return None


def tool_status(name: str, *, data: bytes | None = None, source: str = "", dest: Destination | None = None,
                storage: Any | None = None) -> ToolStatus:
    """What the registered tool ``name`` says about its items: with ``dest``, its server's project
    (the tool's ``status``, else `pulled_status`); else the file ``data`` (`file_status`).

    Raises
    ------
    CJEInputError
        Unknown tool (or, with ``dest``, a tool without a server).
    ToolUnavailable
        The server does not answer.
    """
    if dest is not None:
        tool = get(name, server=True)
        own = getattr(tool, "status", None)
        return own(dest, storage) if callable(own) else pulled_status(tool, dest, storage)
    return file_status(get(name), data or b"", source)


def help_lines(server: bool = False) -> str:
    """``name: help`` of each (server) tool, for the CLI's help texts."""
    chosen = server_names() if server else names()
    return "; ".join(f"{n}: {TOOLS.get(n).help}" for n in chosen)


__all__ = ["LabellingTool", "AnswerReader", "ServerTool", "ExportOptions", "Destination", "PushResult",
           "PullResult", "Answers", "ToolStatus", "file_status", "pulled_status", "tool_status", "load_document",
           "ToolUnavailable", "TOOLS", "register", "unregister", "get", "names", "server_names",
           "answer_formats", "detect", "is_server", "help_lines", "answer_number", "add_answers", "item_meta",
           "ANSWER", "META", "DEFAULT_TEXT_COLUMNS", "RESERVED"]
