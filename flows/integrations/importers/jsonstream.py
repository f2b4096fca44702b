"""Streaming JSON for importers: JSON Lines line by line, and the items of a large JSON document.

No whole file is held in memory. `iter_jsonl` decodes one line at a time. `iter_items` walks a JSON
document down a path of keys and ``*`` (every item of an array), decoding each item at the end of the
path on its own with the standard library's C decoder (``json.JSONDecoder.raw_decode``) from a buffer
refilled in chunks; the values met on the way (an OTLP ``resource`` before its ``scopeSpans``) are
decoded too and passed along as the item's context.  Memory is bounded by the largest single item (or
sibling value), not by the file.

Errors are `CJEInputError` naming the file, the line (JSON Lines) or byte offset, and the record.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any, Iterator, Sequence

from cje_engine.errors import CJEInputError

CHUNK = 1 << 20
_WS = " \t\n\r"
_DECODER = json.JSONDecoder()


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of every non-blank line of a JSON Lines file (1-based lines).

    Raises
    ------
    CJEInputError
        A line is not JSON, or the file is not UTF-8 (file and line named).
    """
    try:
        with open(path, "r", encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CJEInputError(f"line {i} is not JSON ({exc.msg} at column {exc.colno}); expected one "
                                        "JSON value per line (JSON Lines)", source=str(path), row=i - 1) from None
    except UnicodeDecodeError as exc:
        raise CJEInputError(f"is not UTF-8 text ({exc.reason} at byte {exc.start})", source=str(path)) from None


def first_char(path: Path) -> str:
    """The first non-blank character of a file ('' when empty): tells a JSON document from JSON Lines."""
    with open(path, "r", encoding="utf-8", errors="replace") as fh:
        while True:
            chunk = fh.read(4096)
            if not chunk:
                return ""
            stripped = chunk.lstrip(_WS + "\ufeff")
            if stripped:
                return stripped[0]


class _Buffer:
    """A text buffer over a file, refilled on demand, compacted as it is consumed."""

    def __init__(self, fh: IO[str], source: str) -> None:
        self.fh = fh
        self.source = source
        self.buf = ""
        self.pos = 0
        self.base = 0  # characters dropped before buf
        self.eof = False

    def more(self, at_least: int = CHUNK) -> bool:
        if self.eof:
            return False
        if self.pos > CHUNK:
            self.base += self.pos
            self.buf = self.buf[self.pos:]
            self.pos = 0
        chunk = self.fh.read(max(at_least, CHUNK))
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        return True

    def skip_ws(self) -> str:
        """The next non-blank character (not consumed); '' at the end."""
        while True:
            n = len(self.buf)
            while self.pos < n and self.buf[self.pos] in _WS:
                self.pos += 1
            if self.pos < n:
                return self.buf[self.pos]
            if not self.more():
                return ""

    def expect(self, chars: str, what: str, record: int) -> str:
        c = self.skip_ws()
        if not c or c not in chars:
            raise self.error(f"expected {what}, found {c!r}" if c else f"expected {what}, found the end of the file",
                             record)
        self.pos += 1
        return c

    def value(self, record: int) -> Any:
        """Decode the JSON value at the cursor (refilling until it is complete)."""
        self.skip_ws()
        while True:
            try:
                val, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                if self.more(len(self.buf)):
                    continue
                raise self.error(f"not valid JSON ({exc.msg})", record, at=exc.pos) from None
            if end >= len(self.buf) and not self.eof and self.more():
                continue  # a number may go on in the next chunk
            self.pos = end
            return val

    def key(self, record: int) -> str:
        c = self.skip_ws()
        if c != '"':
            raise self.error(f"expected an object key, found {c!r}", record)
        return self.value(record)

    def error(self, message: str, record: int, at: int | None = None) -> CJEInputError:
        offset = self.base + (self.pos if at is None else at)
        return CJEInputError(f"record {record}, character {offset}: {message}", source=self.source, row=record)


def iter_items(path: Path, steps: Sequence[str]) -> Iterator[tuple[list[dict[str, Any]], Any]]:
    """Stream the values at ``steps`` in the JSON document ``path``.

    Parameters
    ----------
    path : Path
        The file.
    steps : sequence of str
        Object keys and ``"*"`` (every item of an array), e.g. ``["resourceSpans", "*", "scopeSpans",
        "*", "spans", "*"]`` or ``["*"]`` for a top-level array.  A key absent from its object yields
        nothing below it.

    Yields
    ------
    (list of dict, value)
        The context (for each object on the path, its other keys decoded so far, outermost first; the
        dicts are reused, copy what you keep) and the item.

    Raises
    ------
    CJEInputError
        Invalid JSON or a shape other than ``steps`` (file, character offset and record named).
    """
    counter = [0]
    try:
        with open(path, "r", encoding="utf-8") as fh:
            buf = _Buffer(fh, str(path))
            ctx: list[dict[str, Any]] = []
            yield from _walk(buf, list(steps), 0, ctx, counter)
            if buf.skip_ws():
                raise buf.error("unexpected data after the JSON document", counter[0])
    except UnicodeDecodeError as exc:
        raise CJEInputError(f"is not UTF-8 text ({exc.reason})", source=str(path)) from None


def _walk(buf: _Buffer, steps: list[str], depth: int, ctx: list[dict[str, Any]],
          counter: list[int]) -> Iterator[tuple[list[dict[str, Any]], Any]]:
    step = steps[depth]
    last = depth == len(steps) - 1
    if step == "*":
        buf.expect("[", f"an array at {'.'.join(steps[:depth]) or 'the top level'}", counter[0])
        if buf.skip_ws() == "]":
            buf.pos += 1
            return
        while True:
            if last:
                item = buf.value(counter[0])
                yield ctx, item
                counter[0] += 1
            else:
                yield from _walk(buf, steps, depth + 1, ctx, counter)
            if buf.expect(",]", "',' or ']'", counter[0]) == "]":
                return
    buf.expect("{", f"an object with the key {step!r}", counter[0])
    level: dict[str, Any] = {}
    ctx.append(level)
    try:
        if buf.skip_ws() == "}":
            buf.pos += 1
            return
        while True:
            key = buf.key(counter[0])
            buf.expect(":", "':'", counter[0])
            if key == step:
                if last:
                    yield ctx, buf.value(counter[0])
                    counter[0] += 1
                elif buf.skip_ws() == "n":  # null: nothing below
                    buf.value(counter[0])
                else:
                    yield from _walk(buf, steps, depth + 1, ctx, counter)
            else:
                level[key] = buf.value(counter[0])
            if buf.expect(",}", "',' or '}'", counter[0]) == "}":
                return
    finally:
        ctx.pop()
