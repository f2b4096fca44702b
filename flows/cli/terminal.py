"""Everything the `cje` command writes to a terminal goes through here.

`escape` makes a user string (a policy name, a file name, an error message quoting data) safe to
print: control characters (C0, DEL, C1; so newlines, carriage returns and ANSI escape sequences)
and the Unicode bidirectional controls (U+202A..U+202E, U+2066..U+2069, U+200E, U+200F, U+061C)
are shown as visible escapes (``\\n``, ``\\x1b``, ``\\u202e``) instead of acting on the terminal.
Every other character, accents included, is kept.

`out` and `err` write text to stdout and stderr with each line escaped (the line breaks of the
layout are kept); `out_json` writes one JSON document (ASCII-only, so nothing in it can act on a
terminal either). `progress` shows a `rich` progress bar on stderr only when stderr is a
terminal and the user did not ask for quiet or JSON output.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import sys
from typing import Any, Iterator

#: Characters that act on a terminal or reorder the text around them.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _visible(m: re.Match) -> str:
    ch = m.group(0)
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(value: Any) -> str:
    """``str(value)`` with every control or bidi-control character shown as a visible escape.

    Parameters
    ----------
    value : Any
        A user string (or anything with a ``str``).

    Returns
    -------
    str
        One line of text that cannot move the cursor, change colours or reorder text.

    Examples
    --------
    >>> escape("evil\\x1b[31m\\nname\\u202e")
    'evil\\\\x1b[31m\\\\nname\\\\u202e'
    """
    return _UNSAFE.sub(_visible, str(value))


def escape_lines(text: str) -> str:
    """Escape each line of ``text`` and keep its line breaks (for text laid out by the CLI)."""
    return "\n".join(escape(line) for line in str(text).split("\n"))


def out(text: str = "") -> None:
    """Write ``text`` and a newline to stdout, each line escaped."""
    sys.stdout.write(escape_lines(text.rstrip("\n")) + "\n")
    sys.stdout.flush()


def err(text: str) -> None:
    """Write ``text`` and a newline to stderr, each line escaped."""
    sys.stderr.write(escape_lines(text.rstrip("\n")) + "\n")
    sys.stderr.flush()


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float (in dicts, lists, tuples) replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


#: Version of the ``--json`` envelope (``cje_json``) of every command.
JSON_SCHEMA_VERSION = 1


def json_doc(command: str, **fields: Any) -> dict:
    """The envelope of every ``--json`` document: ``{"cje_json": version, "command": ..., **fields}``."""
    return {"cje_json": JSON_SCHEMA_VERSION, "command": command, **fields}


def out_json(doc: Any) -> None:
    """Write one JSON document to stdout (ASCII-only; NaN and infinities as ``null``)."""
    sys.stdout.write(json.dumps(finite(doc), indent=2, allow_nan=False, ensure_ascii=True, default=str) + "\n")
    sys.stdout.flush()


#: Set by `flows.cli.main` from ``-q`` / ``--json``: no progress display at all.
_progress_enabled = True


def enable_progress(enabled: bool) -> None:
    """Turn the terminal progress lines on or off (``-q``)."""
    global _progress_enabled
    _progress_enabled = bool(enabled)


def progress_wanted() -> bool:
    """Progress is shown only when both stdout and stderr are terminals and it is not switched off."""
    return _progress_enabled and sys.stderr.isatty() and sys.stdout.isatty()


class _Task:
    """Handle of one progress task (`advance`, `update`); a no-op without a display."""

    def __init__(self, bar: Any = None, task: Any = None) -> None:
        self._bar, self._task = bar, task

    def advance(self, steps: float = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, steps)

    def update(self, description: str | None = None, total: float | None = None) -> None:
        if self._bar is not None:
            kw: dict[str, Any] = {}
            if description is not None:
                kw["description"] = escape(description)
            if total is not None:
                kw["total"] = total
            self._bar.update(self._task, **kw)


@contextlib.contextmanager
def progress(description: str, total: float | None = None) -> Iterator[_Task]:
    """A progress bar (``total`` given) or a spinner with elapsed time, on stderr.

    Off (a no-op handle) when stdout or stderr is not a terminal, or with ``-q`` / ``--json``.
    """
    if not progress_wanted():
        yield _Task()
        return
    # rich comes with Prefect; imported here so that non-terminal runs never pay for it.
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [BarColumn(), TaskProgressColumn()]
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        yield _Task(bar, bar.add_task(escape(description), total=total))
