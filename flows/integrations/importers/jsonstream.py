"""Streaming JSON for importers: JSON Lines line by line, and the items of a large JSON document.

No whole file is held in memory. `iter_jsonl` decodes one line at a time. `iter_json` reads a JSON
document (or several one after another, or a top-level array) and walks it down a path of keys and ``*``
(every item of an array), decoding each record at the end of the path on its own with the standard library's C decoder (``json.JSONDecoder.raw_decode``) from a buffer
refilled in chunks; the values met on the way (an OTLP ``resource`` before its ``scopeSpans``) are
decoded too and passed along as the item's context.  Memory is bounded by the largest single item (or
sibling value), not by the file.

Errors are `CJEInputError` naming the file, the line (JSON Lines) or byte offset, and the record.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Sequence

from cje_engine.errors import CJEInputError

CHUNK = 1 << 20
_WS = " \t\n\r"
_DECODER = json.JSONDecoder()


def open_text(path: Path, errors: str = "strict") -> IO[str]:
    """Open a file as UTF-8 text; a ``.gz`` file is decompressed as it is read (streamed, not in memory)."""
    if str(path).lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors=errors)
    return open(path, "r", encoding="utf-8", errors=errors)


def base_suffix(path: Path) -> str:
    """The suffix that tells the format, below a ``.gz`` (``results.jsonl.gz`` -> ``.jsonl``), lower case."""
    p = Path(path)
    if p.suffix.lower() == ".gz":
        p = p.with_suffix("")
    return p.suffix.lower()


def iter_jsonl(path: Path, only_with: str | None = None) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of every non-blank line of a JSON Lines file (1-based lines).

    ``only_with``: decode only the lines containing this text (a cheap pre-filter for a first pass).

    Raises
    ------
    CJEInputError
        A line is not JSON, or the file is not UTF-8 (file and line named).
    """
    try:
        with open_text(path) as fh:
            for i, line in enumerate(fh, 1):
                if not line.strip() or (only_with is not None and only_with not in line):
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CJEInputError(f"line {i} is not JSON ({exc.msg} at column {exc.colno}); expected one "
                                        "JSON value per line (JSON Lines)", source=str(path), row=i - 1) from None
    except UnicodeDecodeError as exc:
        raise CJEInputError(f"is not UTF-8 text ({exc.reason} at byte {exc.start})", source=str(path)) from None
    except (gzip.BadGzipFile, EOFError) as exc:
        raise CJEInputError(f"is not a complete gzip file ({exc}); expected gzip-compressed JSON Lines",
                            source=str(path)) from None


def first_char(path: Path) -> str:
    """The first non-blank character of a file ('' when empty): tells a JSON document from JSON Lines."""
    with open_text(path, errors="replace") as fh:
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


def iter_json(path: Path, paths: Mapping[str, Sequence[str]] | None = None) -> Iterator[tuple[str | None, list[dict[str, Any]], Any]]:
    """Stream the records of a JSON file: one document, several documents one after the other, or an array.

    Parameters
    ----------
    path : Path
        The file: a JSON document, a top-level array, or JSON values one after another (JSON Lines,
        or pretty-printed objects as the OpenTelemetry SDK's console exporter writes them).
    paths : mapping of str to sequence of str, optional
        For a top-level object with one of these keys, the path below the key to the records: keys and
        ``"*"`` (every item of an array), e.g. ``{"resourceSpans": ["*", "scopeSpans", "*", "spans",
        "*"]}``.  The records are decoded one at a time; the values met on the way (an OTLP
        ``resource`` before its ``scopeSpans``) are decoded too and passed as context.

    Yields
    ------
    (str or None, list of dict, value)
        The top-level key whose path led to the record (None: the record is a whole top-level object
        without any of those keys, or an item of a top-level array), the context (for each object on
        the path, its other keys decoded so far, outermost first; reused, copy what you keep) and the
        record.

    Raises
    ------
    CJEInputError
        Invalid JSON or another shape (file, character offset and record named).
    """
    paths = dict(paths or {})
    counter = [0]
    try:
        with open_text(path) as fh:
            buf = _Buffer(fh, str(path))
            if buf.skip_ws() == "\ufeff":
                buf.pos += 1
            while True:
                c = buf.skip_ws()
                if not c:
                    return
                if c == "[":
                    for _, item in _walk(buf, ["*"], 0, [], counter):
                        yield None, [], item
                    continue
                if c != "{":
                    raise buf.error(f"expected a JSON object or array, found {c!r}", counter[0])
                yield from _top(buf, paths, counter)
    except UnicodeDecodeError as exc:
        raise CJEInputError(f"is not UTF-8 text ({exc.reason})", source=str(path)) from None
    except (gzip.BadGzipFile, EOFError) as exc:
        raise CJEInputError(f"is not a complete gzip file ({exc}); expected gzip-compressed JSON", source=str(path)) from None


def _top(buf: _Buffer, paths: Mapping[str, Sequence[str]], counter: list[int]) -> Iterator[tuple[str | None, list[dict[str, Any]], Any]]:
    """One top-level object: descend the keys of ``paths``, else yield it whole."""
    buf.pos += 1
    level: dict[str, Any] = {}
    ctx = [level]
    found = False
    if buf.skip_ws() == "}":
        buf.pos += 1
    else:
        while True:
            key = buf.key(counter[0])
            buf.expect(":", "':'", counter[0])
            steps = paths.get(key)
            if steps is not None:
                found = True
                if buf.skip_ws() == "n":
                    buf.value(counter[0])
                else:
                    for c, item in _walk(buf, list(steps), 0, ctx, counter):
                        yield key, c, item
            else:
                level[key] = buf.value(counter[0])
            if buf.expect(",}", "',' or '}'", counter[0]) == "}":
                break
    if not found:
        yield None, [], level
        counter[0] += 1


def _walk(buf: _Buffer, steps: list[str], depth: int, ctx: list[dict[str, Any]],
          counter: list[int]) -> Iterator[tuple[list[dict[str, Any]], Any]]:
    step = steps[depth]
    last = depth == len(steps) - 1
    if step == "*":
        buf.expect("[", "an array", counter[0])
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


#: Suffixes of the files a folder source is read from.
SUFFIXES = (".json", ".jsonl", ".ndjson")


def source_files(source: Path) -> list[Path]:
    """The files of a source: the file itself, or a folder's ``.json``/``.jsonl``/``.ndjson`` files (sorted)."""
    if source.is_dir():
        return sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
                      and not any(part.startswith((".", "_")) for part in p.relative_to(source).parts))
    return [source]


def iter_objects(path: Path, only_with: str | None = None) -> Iterator[tuple[int, Any, str]]:
    """``(record number, value, where)`` of every record of one export file, streamed.

    JSON Lines line by line (``only_with`` pre-filters lines by text); otherwise a JSON document: a
    top-level array, an API page ``{"data": [...]}``, or objects one after another. ``where`` says
    ``line N`` or ``record N`` for messages.
    """
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        for i, (line, obj) in enumerate(iter_jsonl(path, only_with=only_with)):
            yield i, obj, f"line {line}"
        return
    for i, (_key, _ctx, obj) in enumerate(iter_json(path, {"data": ["*"]})):
        yield i, obj, f"record {i}"


def mentions(path: Path, text: str) -> bool:
    """Whether the file contains ``text`` (a byte scan in chunks: decides whether a first pass is needed)."""
    needle = text.encode()
    tail = b""
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            if needle in tail + chunk:
                return True
            tail = chunk[-len(needle):]
    return False
