"""OpenTelemetry GenAI spans (``cje import otel``): OTLP JSON / JSON Lines, and the SDK's console JSON.

Reads what services export with the OpenTelemetry GenAI semantic conventions:

* **OTLP JSON** (`ExportTraceServiceRequest` / `ExportLogsServiceRequest` in the protobuf JSON
  mapping): one document (``resourceSpans -> scopeSpans -> spans``), or one request a line as the
  Collector's file exporter writes them (``.jsonl``). Trace and span ids in hex (OTLP/JSON) or base64
  (protobuf's generic JSON mapping) alike.
* the **SDK's own JSON** (``ReadableSpan.to_json()``, what ``ConsoleSpanExporter`` writes): span
  objects one after another.

A record is a GenAI operation span: a span with ``gen_ai.operation.name``, ``gen_ai.request.model`` or
``gen_ai.response.model`` (other spans are counted in a note, not records). Scores are
``gen_ai.evaluation.result`` events (``gen_ai.evaluation.name``, ``gen_ai.evaluation.score.value``,
else ``gen_ai.evaluation.score.label`` when it is a number or a boolean): span events on the evaluated
span, and log records of that name (OTLP logs, the events' own signal, in the same file or folder; matched
by their ``spanId``, else by ``gen_ai.response.id``).
The conventions do not say who scored, so every evaluation is of unknown origin: name the human one with
``--label-from score:NAME``.

Fields for selectors: ``attr:NAME`` (span attribute), ``resource:NAME`` (resource attribute, e.g.
``resource:service.version``), ``span:name|trace_id|span_id``, ``scope:name|version``. Defaults: policy
``attr:gen_ai.request.model|attr:gen_ai.response.model|attr:gen_ai.provider.name|attr:gen_ai.system``,
prompt ``attr:cje.prompt_id`` (else a hash of the input messages' text: ``gen_ai.input.messages``, or
the older ``gen_ai.prompt`` attributes). Timestamp: the span's start.

Streaming: JSON Lines line by line; a JSON document one span at a time. When the source holds
log records, a first pass collects their evaluations (in JSON Lines only the lines with ``resourceLogs``;
memory: the scores) and the second pass streams the spans.
"""
from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path
from typing import Any, Iterator

from flows.integrations.importers.base import (UNKNOWN, Note, Score, SourceRecord, bad_record, message_text,
                                               parse_ts)
from flows.integrations.importers.jsonstream import iter_json, iter_jsonl, mentions, source_files

EVAL_EVENT = "gen_ai.evaluation.result"
EVAL_NAME = "gen_ai.evaluation.name"
EVAL_VALUE = "gen_ai.evaluation.score.value"
EVAL_LABEL = "gen_ai.evaluation.score.label"
RESPONSE_ID = "gen_ai.response.id"
_GENAI_KEYS = ("gen_ai.operation.name", "gen_ai.request.model", "gen_ai.response.model")
_SPAN_PATH = ["*", "scopeSpans", "*", "spans", "*"]
_LOG_PATH = ["*", "scopeLogs", "*", "logRecords", "*"]
_PATHS = {"resourceSpans": _SPAN_PATH, "resourceLogs": _LOG_PATH}


# --------------------------------------------------------------------------- OTLP values


def any_value(v: Any) -> Any:
    """The Python value of an OTLP ``AnyValue`` (``{"stringValue": ...}``, ``{"intValue": "3"}``, ...)."""
    if not isinstance(v, dict) or not v:
        return None
    for k, x in v.items():
        if k == "stringValue":
            return x
        if k == "intValue":
            return int(x)
        if k == "doubleValue":
            return float(x)
        if k == "boolValue":
            return bool(x)
        if k == "arrayValue":
            return [any_value(i) for i in (x or {}).get("values", [])]
        if k == "kvlistValue":
            return {kv.get("key"): any_value(kv.get("value")) for kv in (x or {}).get("values", [])}
        if k == "bytesValue":
            return x
    return None


def attributes(items: Any) -> dict[str, Any]:
    """``[{"key": k, "value": AnyValue}, ...]`` -> ``{k: value}`` (a plain dict is returned as is)."""
    if isinstance(items, dict):
        return items
    out = {}
    for kv in items or ():
        v = kv.get("value")
        if not v:
            out[kv["key"]] = None
            continue
        for t, x in v.items():  # one key: the value's type
            break
        if t == "stringValue" or t == "boolValue":
            out[kv["key"]] = x
        elif t == "doubleValue":
            out[kv["key"]] = float(x)
        elif t == "intValue":
            out[kv["key"]] = int(x)
        else:
            out[kv["key"]] = any_value(v)
    return out


_HEX = re.compile(r"[0-9a-fA-F]{16}|[0-9a-fA-F]{32}")


def hex_id(v: Any) -> str:
    """A trace or span id as lower-case hex: hex as is, base64 (protobuf JSON) decoded, ``0x`` dropped."""
    if not v:
        return ""
    s = str(v)
    if _HEX.fullmatch(s):
        return s.lower()
    if s.startswith("0x"):
        return s[2:].lower()
    try:
        return base64.b64decode(s, validate=True).hex()
    except (binascii.Error, ValueError):
        return s


# --------------------------------------------------------------------------- texts


def _legacy_text(attrs: dict[str, Any], prefix: str) -> str | None:
    """``gen_ai.prompt.N.content`` / ``gen_ai.completion.N.content`` (older conventions), or ``gen_ai.prompt``."""
    if f"{prefix}.0.content" in attrs:
        parts, i = [], 0
        while f"{prefix}.{i}.content" in attrs:
            parts.append(str(attrs[f"{prefix}.{i}.content"]))
            i += 1
        return "\n".join(parts)
    v = attrs.get(prefix)
    return v if isinstance(v, str) else None


def _prompt_text(attrs: dict[str, Any]) -> str | None:
    v = attrs.get("gen_ai.input.messages")
    return message_text(v, last_user=True) if v is not None else _legacy_text(attrs, "gen_ai.prompt")


def _response_text(attrs: dict[str, Any]) -> str | None:
    v = attrs.get("gen_ai.output.messages")
    return message_text(v) if v is not None else _legacy_text(attrs, "gen_ai.completion")


def _evaluation(attrs: dict[str, Any]) -> Score | None:
    name = attrs.get(EVAL_NAME)
    if not isinstance(name, str) or not name:
        return None
    value = attrs.get(EVAL_VALUE)
    if value is None:  # a label such as "true" or "4" counts when it is a number or a boolean
        value = attrs.get(EVAL_LABEL)
    return Score(name, value, UNKNOWN)


# --------------------------------------------------------------------------- the importer


class _Fields:
    """The selector view of a span: ``attr:``, ``resource:``, ``span:``, ``scope:`` keys."""

    __slots__ = ("attrs", "resource", "span", "scope")

    def __init__(self, attrs: dict, resource: dict, span: dict, scope: dict) -> None:
        self.attrs, self.resource, self.span, self.scope = attrs, resource, span, scope

    def get(self, key: str, default: Any = None) -> Any:
        kind, _, name = key.partition(":")
        if kind == "attr":
            v = self.attrs.get(name)
        elif kind == "span":  # name, trace_id, span_id (hex) whatever the encoding
            if name in ("trace_id", "span_id"):
                ctx = self.span.get("context") or {}
                v = hex_id(self.span.get("traceId" if name == "trace_id" else "spanId") or ctx.get(name))
            else:
                v = self.span.get(name)
        elif kind == "resource":
            v = self.resource.get(name)
        elif kind == "scope":
            v = self.scope.get(name)
        else:
            v = None
        return default if v is None or v == "" else v


class OtelImporter:
    """OpenTelemetry GenAI spans: OTLP JSON / JSON Lines, or the SDK's console JSON (module docstring)."""

    name = "otel"
    title = "OpenTelemetry GenAI spans (OTLP JSON / JSONL)"
    kinds = ("attr", "resource", "span", "scope")
    default_kind = "attr"
    default_policy = "attr:gen_ai.request.model|attr:gen_ai.response.model|attr:gen_ai.provider.name|attr:gen_ai.system"
    default_prompt = "attr:cje.prompt_id"
    version = "1"

    def records(self, source: Path) -> Iterator[SourceRecord]:
        """Stream the GenAI operation spans of ``source`` (a file, or a folder of ``.json``/``.jsonl``)."""
        files = source_files(source)
        apart = self._evaluations_apart(files)
        pos = 0
        ignored = 0
        for path in files:
            for kind, resource, scope, obj, where in _items(path):
                if kind != "span":
                    continue
                rec = self._record(path, pos, resource, scope, obj, where, apart)
                if rec is None:
                    ignored += 1
                else:
                    yield rec
                pos += 1
        if ignored:
            yield Note("spans without gen_ai operation attributes (not responses)", ignored)

    # -- pass 1: evaluations kept apart from their spans
    def _evaluations_apart(self, files: list[Path]) -> dict[str, list[Score]]:
        """``span id or response id -> scores`` from log-based evaluation events (first pass)."""
        found: dict[str, list[Score]] = {}
        for path in files:
            if not mentions(path, "resourceLogs"):
                continue
            for kind, _res, _scope, obj, _where in _items(path, only_with="resourceLogs"):
                if kind != "log" or not isinstance(obj, dict):
                    continue
                attrs = attributes(obj.get("attributes"))
                if obj.get("eventName") != EVAL_EVENT and attrs.get("event.name") != EVAL_EVENT:
                    continue
                score = _evaluation(attrs)
                key = hex_id(obj.get("spanId")) or attrs.get(RESPONSE_ID)
                if score is not None and key:
                    found.setdefault(str(key), []).append(score)
        return found

    # -- pass 2: the spans
    def _record(self, path: Path, pos: int, resource: dict, scope: dict, span: Any, where: str,
                apart: dict[str, list[Score]]) -> SourceRecord | None:
        if not isinstance(span, dict):
            raise bad_record(path, pos, None, f"a span object ({where})")
        sdk = "context" in span and "spanId" not in span
        attrs = attributes(span.get("attributes"))
        if not isinstance(attrs, dict):
            raise bad_record(path, pos, "attributes", "a list of key/value attributes")
        if not any(k in attrs for k in _GENAI_KEYS):
            return None
        if sdk:
            ctx = span.get("context") or {}
            trace_id, span_id = hex_id(ctx.get("trace_id")), hex_id(ctx.get("span_id"))
            start = span.get("start_time")
            events = span.get("events") or []
        else:
            trace_id, span_id = hex_id(span.get("traceId")), hex_id(span.get("spanId"))
            start = span.get("startTimeUnixNano")
            events = span.get("events") or []
        if not span_id:
            raise bad_record(path, pos, "spanId" if not sdk else "context.span_id", "a span id (hex)")
        try:
            ts = parse_ts(start)
        except (ValueError, TypeError, OverflowError):
            raise bad_record(path, pos, "startTimeUnixNano" if not sdk else "start_time",
                             "a timestamp (epoch nanoseconds, or ISO-8601)") from None
        scores = []
        for ev in events:
            if isinstance(ev, dict) and ev.get("name") == EVAL_EVENT:
                s = _evaluation(attributes(ev.get("attributes")))
                if s is not None:
                    scores.append(s)
        if apart:
            scores += apart.get(span_id, [])
            rid = attrs.get(RESPONSE_ID)
            if rid and str(rid) != span_id:
                scores += apart.get(str(rid), [])
        extra = {"response_id": attrs[RESPONSE_ID]} if RESPONSE_ID in attrs else None
        return SourceRecord(pos, f"{trace_id}:{span_id}", ts, _Fields(attrs, resource, span, scope), scores,
                            prompt=_prompt_text(attrs), response=_response_text(attrs), extra=extra)


def _items(path: Path, only_with: str | None = None) -> Iterator[tuple[str, dict, dict, Any, str]]:
    """``(kind, resource attributes, scope, object, where)`` of every span and log record of a file."""
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        for line, doc in iter_jsonl(path, only_with=only_with):
            yield from _from_document(path, doc, f"line {line}")
        return
    cache: dict[str, Any] = {"res": None, "attrs": {}}
    for key, ctx, item in iter_json(path, _PATHS):
        if key is None:
            if isinstance(item, dict) and ("context" in item or "spanId" in item):  # SDK console JSON span
                res = item.get("resource") or {}
                yield "span", attributes(res.get("attributes") or {}), {}, item, "a span"
                continue
            raise bad_record(path, 0, None, "OTLP JSON (resourceSpans or resourceLogs) or SDK span JSON")
        res_obj = ctx[1].get("resource") if len(ctx) > 1 else None
        if res_obj is not cache["res"]:
            cache["res"], cache["attrs"] = res_obj, attributes((res_obj or {}).get("attributes"))
        scope = (ctx[2].get("scope") if len(ctx) > 2 else None) or {}
        yield ("span" if key == "resourceSpans" else "log"), cache["attrs"], scope, item, key


def _from_document(path: Path, doc: Any, where: str) -> Iterator[tuple[str, dict, dict, Any, str]]:
    if not isinstance(doc, dict):
        raise bad_record(path, 0, None, f"a JSON object ({where})")
    if "resourceSpans" not in doc and "resourceLogs" not in doc:
        if "context" in doc or "spanId" in doc:
            res = doc.get("resource") or {}
            yield "span", attributes(res.get("attributes") or {}), {}, doc, where
            return
        raise bad_record(path, 0, None, f"OTLP JSON with resourceSpans or resourceLogs ({where})")
    for key, kind, scope_key, items_key in (("resourceSpans", "span", "scopeSpans", "spans"),
                                            ("resourceLogs", "log", "scopeLogs", "logRecords")):
        for rs in doc.get(key) or ():
            res = attributes((rs.get("resource") or {}).get("attributes"))
            for ss in rs.get(scope_key) or ():
                scope = ss.get("scope") or {}
                for item in ss.get(items_key) or ():
                    yield kind, res, scope, item, where
