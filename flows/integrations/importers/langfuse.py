"""Langfuse exports (``cje import langfuse``): observations with their scores.

Reads a Langfuse export as files (a folder, or one file holding every record): observations
(``/api/public/v2/observations`` records, the blob-storage export's ``OBSERVATIONS_V2`` source: ``id``,
``traceId``, ``type``, ``startTime``, ``model``, ``promptName``, ``promptVersion``, ``input``, ``output``,
``metadata``), scores (``id``, ``traceId``, ``observationId``, ``name``, ``value``/``stringValue``,
``dataType`` NUMERIC/BOOLEAN/CATEGORICAL, ``source`` ANNOTATION/API/EVAL, ``configId``) and score configs
(``id``, ``name``, ``dataType``, ``minValue``, ``maxValue``); and traces that embed their
``observations`` and ``scores`` (the trace API's full-detail records). JSON Lines, JSON arrays and API
pages (``{"data": [...]}``) alike; records are told apart by their fields.

A record is a ``GENERATION`` observation (other observations are counted in a note). Its scores: those
on the observation (``observationId``), and those on its trace when the trace has exactly one
generation (a trace-level score on a trace with several is not attached: a note says how many). Who
scored: ``ANNOTATION`` is a person, ``EVAL`` a judge (LLM-as-a-judge evaluators), ``API`` unknown. A
score config gives the score's scale; a ``BOOLEAN`` score is 0-1.

Fields for selectors: ``obs:NAME`` (an observation field: ``model``, ``name``, ``promptName``,
``promptVersion``, ``version``, ``release``, ``environment``, ``traceName``, ``traceId``, ``userId``,
``sessionId``), ``metadata:NAME``, ``param:NAME`` (``modelParameters``). Defaults: policy ``obs:model``,
prompt ``metadata:prompt_id`` (else a hash of the input's text). ``--policy-from
obs:model+obs:promptVersion`` compares prompt versions too.

Streaming: a first pass reads the scores and configs (in JSON Lines only the lines that look like
them) and counts generations per trace; the second streams the observations.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

from flows.integrations.importers.base import (HUMAN, JUDGE, UNKNOWN, Note, Score, SourceRecord, bad_record,
                                               message_text, parse_ts)
from flows.integrations.importers.jsonstream import iter_objects, source_files

ORIGIN = {"ANNOTATION": HUMAN, "EVAL": JUDGE, "API": UNKNOWN}
_TRACE_ID = re.compile(r'"traceId"\s*:\s*"([^"]+)"')


def _kind(obj: Any) -> str:
    """``score``, ``config``, ``observation``, ``trace`` or ``other`` by the record's fields."""
    if not isinstance(obj, dict):
        return "other"
    if "observations" in obj and isinstance(obj.get("observations"), list):
        return "trace"
    if "type" in obj and "startTime" in obj:
        return "observation"
    if "dataType" in obj and "name" in obj:
        return "score" if ("value" in obj or "stringValue" in obj) and "source" in obj else "config"
    return "other"


class _Fields:
    """Selector view of an observation: ``obs:``, ``metadata:``, ``param:``."""

    __slots__ = ("obs",)

    def __init__(self, obs: dict) -> None:
        self.obs = obs

    def get(self, key: str, default: Any = None) -> Any:
        kind, _, name = key.partition(":")
        if kind == "obs":
            v = self.obs.get(name)
        elif kind == "metadata":
            v = (self.obs.get("metadata") or {}).get(name) if isinstance(self.obs.get("metadata"), dict) else None
        elif kind == "param":
            p = self.obs.get("modelParameters")
            v = p.get(name) if isinstance(p, dict) else None
        else:
            v = None
        return default if v is None else v


class LangfuseImporter:
    """Langfuse exports: GENERATION observations with their scores (module docstring)."""

    name = "langfuse"
    title = "Langfuse export (observations + scores)"
    kinds = ("obs", "metadata", "param")
    default_kind = "obs"
    default_policy = "obs:model"
    default_prompt = "metadata:prompt_id"
    version = "1"

    def records(self, source: Path) -> Iterator[SourceRecord | Note]:
        """Stream the GENERATION observations of ``source`` with their scores attached."""
        files = source_files(source)
        by_obs, by_trace, configs, gens = self._first_pass(files)
        pos = 0
        passed = 0
        unattached = 0
        for path in files:
            for _i, obj, where in iter_objects(path):
                kind = _kind(obj)
                if kind == "trace":
                    embedded = [s for s in obj.get("scores") or () if isinstance(s, dict)]
                    t_gens = [o for o in obj["observations"] if isinstance(o, dict) and o.get("type") == "GENERATION"]
                    for o in obj["observations"]:
                        if not isinstance(o, dict) or o.get("type") != "GENERATION":
                            passed += 1
                            continue
                        o.setdefault("traceId", obj.get("id"))
                        scores = [_score(s, configs) for s in embedded
                                  if s.get("observationId") == o.get("id") or (not s.get("observationId") and len(t_gens) == 1)]
                        yield self._record(path, pos, o, where, [s for s in scores if s] + self._attached(o, by_obs, by_trace, gens, configs))
                        pos += 1
                    continue
                if kind != "observation":
                    continue
                if obj.get("type") != "GENERATION":
                    passed += 1
                    continue
                tid = obj.get("traceId")
                if tid in by_trace and gens.get(tid, 0) > 1:
                    unattached += 1
                yield self._record(path, pos, obj, where, self._attached(obj, by_obs, by_trace, gens, configs))
                pos += 1
        if passed:
            yield Note("observations that are not generations (SPAN, EVENT, ...)", passed)
        if unattached:
            yield Note("generations whose trace-level scores were not attached (the trace has several generations)",
                       unattached)

    @staticmethod
    def _attached(obs: dict, by_obs: dict, by_trace: dict, gens: dict, configs: dict) -> list[Score]:
        out = [_score(s, configs) for s in by_obs.get(obs.get("id"), ())]
        tid = obs.get("traceId")
        if tid in by_trace and gens.get(tid, 0) == 1:
            out += [_score(s, configs) for s in by_trace[tid]]
        return [s for s in out if s is not None]

    def _first_pass(self, files: list[Path]) -> tuple[dict, dict, dict, dict]:
        """Scores by observation and by trace, configs by id, generations per trace."""
        by_obs: dict[str, list[dict]] = {}
        by_trace: dict[str, list[dict]] = {}
        configs: dict[str, dict] = {}
        gens: dict[str, int] = {}
        for path in files:
            if path.suffix.lower() in (".jsonl", ".ndjson"):
                stream = self._jsonl_first(path, gens)
            else:
                stream = (obj for _i, obj, _w in iter_objects(path))
            for obj in stream:
                kind = _kind(obj)
                if kind == "score":
                    slim = {k: obj.get(k) for k in ("name", "value", "stringValue", "dataType", "source", "configId")}
                    if obj.get("observationId"):
                        by_obs.setdefault(obj["observationId"], []).append(slim)
                    elif obj.get("traceId"):
                        by_trace.setdefault(obj["traceId"], []).append(slim)
                elif kind == "config":
                    configs[str(obj.get("id"))] = obj
                elif kind == "observation" and obj.get("type") == "GENERATION" and obj.get("traceId"):
                    gens[obj["traceId"]] = gens.get(obj["traceId"], 0) + 1
        return by_obs, by_trace, configs, gens

    @staticmethod
    def _jsonl_first(path: Path, gens: dict[str, int]) -> Iterator[Any]:
        """JSON Lines, first pass: decode score/config lines; count generations by a text match."""
        import json

        with open(path, "r", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if '"dataType"' in line:
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError:
                        continue  # the second pass names it
                elif '"GENERATION"' in line:
                    m = _TRACE_ID.search(line)
                    if m:
                        gens[m.group(1)] = gens.get(m.group(1), 0) + 1

    def _record(self, path: Path, pos: int, obs: dict, where: str, scores: list[Score]) -> SourceRecord:
        oid = obs.get("id")
        if not isinstance(oid, str) or not oid:
            raise bad_record(path, pos, "id", f"an observation id ({where})")
        try:
            ts = parse_ts(obs.get("startTime"))
        except (ValueError, TypeError):
            raise bad_record(path, pos, "startTime", f"an ISO-8601 timestamp ({where})") from None
        extra = {k: obs[k] for k in ("traceId", "name", "promptName", "promptVersion") if obs.get(k) is not None}
        return SourceRecord(pos, oid, ts, _Fields(obs), scores, prompt=message_text(obs.get("input"), last_user=True),
                            response=message_text(obs.get("output")), extra=extra)


def _score(s: dict, configs: dict) -> Score | None:
    name = s.get("name")
    if not isinstance(name, str):
        return None
    value = s.get("value")
    dtype = s.get("dataType")
    if dtype == "CATEGORICAL" and value is None:
        value = s.get("stringValue")
    scale = None
    cfg = configs.get(str(s.get("configId"))) if s.get("configId") else None
    if dtype == "BOOLEAN":
        scale = (0.0, 1.0)
    elif cfg and cfg.get("minValue") is not None and cfg.get("maxValue") is not None:
        scale = (float(cfg["minValue"]), float(cfg["maxValue"]))
    return Score(name, value, ORIGIN.get(str(s.get("source")), UNKNOWN), scale)

