"""LangSmith exports (``cje import langsmith``): runs with their feedback.

Reads runs as ``Client.list_runs`` returns them (``id``, ``trace_id``, ``run_type``, ``start_time``,
``inputs``, ``outputs``, ``extra.metadata``, ``extra.invocation_params``, ``reference_example_id``,
``feedback_stats``) and feedback as ``Client.list_feedback`` returns it (``run_id``, ``trace_id``,
``key``, ``score``/``value``, ``feedback_source.type``): a folder of files or one file holding both,
JSON Lines or JSON arrays; records are told apart by their fields.

A record is an ``llm`` run, or any run with feedback (other runs are counted in a note). Its scores: the
feedback whose ``run_id`` is the run (feedback on a whole trace, without ``run_id``, goes to the trace's
root run), else the run's own ``feedback_stats`` where a key has exactly one score. Who scored:
``feedback_source.type`` ``model`` is a judge (evaluators), ``app`` a person (annotations in the app),
``api`` unknown.

Fields for selectors: ``run:NAME`` (``name``, ``run_type``, ``session_id``, ``reference_example_id``,
``trace_id``, ``parent_run_id``), ``metadata:NAME`` (``extra.metadata``: ``ls_model_name``,
``ls_provider``, ``revision_id``, ...), ``invocation:NAME`` (``extra.invocation_params``), ``input:NAME``
(a top-level key of ``inputs``). Defaults: policy
``metadata:ls_model_name|invocation:model|invocation:model_name``, prompt
``run:reference_example_id|metadata:prompt_id`` (else a hash of the input's text).

Streaming: a first pass reads the feedback (in JSON Lines only the lines that look like feedback); the
second streams the runs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from flows.integrations.importers.base import (HUMAN, JUDGE, UNKNOWN, Note, Score, SourceRecord, bad_record,
                                               message_text, parse_ts)
from flows.integrations.importers.jsonstream import iter_objects, source_files

ORIGIN = {"model": JUDGE, "app": HUMAN, "api": UNKNOWN}


def _kind(obj: Any) -> str:
    if not isinstance(obj, dict):
        return "other"
    if "run_type" in obj and "start_time" in obj:
        return "run"
    if "key" in obj and ("score" in obj or "value" in obj) and ("run_id" in obj or "trace_id" in obj):
        return "feedback"
    return "other"


class _Fields:
    """Selector view of a run: ``run:``, ``metadata:``, ``invocation:``, ``input:``."""

    __slots__ = ("run",)

    def __init__(self, run: dict) -> None:
        self.run = run

    def get(self, key: str, default: Any = None) -> Any:
        kind, _, name = key.partition(":")
        extra = self.run.get("extra") if isinstance(self.run.get("extra"), dict) else {}
        src: Any = {"run": self.run, "metadata": extra.get("metadata"), "invocation": extra.get("invocation_params"),
                    "input": self.run.get("inputs")}.get(kind)
        v = src.get(name) if isinstance(src, dict) else None
        return default if v is None else v


def _score(fb: dict) -> Score | None:
    key = fb.get("key")
    if not isinstance(key, str):
        return None
    value = fb.get("score")
    if value is None:
        value = fb.get("value")
    src = fb.get("feedback_source") if isinstance(fb.get("feedback_source"), dict) else {}
    origin = ORIGIN.get(str(src.get("type")), UNKNOWN)
    if origin == UNKNOWN and isinstance(src.get("metadata"), dict) and "__run" in src["metadata"]:
        origin = JUDGE  # an evaluator's run scored it
    return Score(key, value, origin)


class LangSmithImporter:
    """LangSmith exports: llm runs (and runs with feedback) with their feedback (module docstring)."""

    name = "langsmith"
    title = "LangSmith export (runs + feedback)"
    kinds = ("run", "metadata", "invocation", "input")
    default_kind = "run"
    default_policy = "metadata:ls_model_name|invocation:model|invocation:model_name"
    default_prompt = "run:reference_example_id|metadata:prompt_id"
    version = "1"

    def records(self, source: Path) -> Iterator[SourceRecord | Note]:
        """Stream the runs of ``source`` that are responses, with their feedback attached."""
        files = source_files(source)
        by_run, by_trace = self._feedback(files)
        pos = 0
        passed = 0
        for path in files:
            for _i, obj, where in iter_objects(path):
                if _kind(obj) != "run":
                    continue
                rid = str(obj.get("id") or "")
                scores = [s for s in (_score(f) for f in by_run.get(rid, ())) if s is not None]
                if rid and rid == str(obj.get("trace_id") or ""):
                    scores += [s for s in (_score(f) for f in by_trace.get(rid, ())) if s is not None]
                keys = {s.name for s in scores}
                for key, st in (obj.get("feedback_stats") or {}).items():
                    if key not in keys and isinstance(st, dict) and st.get("n") == 1 and st.get("avg") is not None:
                        scores.append(Score(key, st["avg"], UNKNOWN))
                if obj.get("run_type") != "llm" and not scores:
                    passed += 1
                    continue
                yield self._record(path, pos, obj, where, scores)
                pos += 1
        if passed:
            yield Note("runs that are neither llm runs nor scored (chains, retrievers, tools)", passed)

    @staticmethod
    def _feedback(files: list[Path]) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
        by_run: dict[str, list[dict]] = {}
        by_trace: dict[str, list[dict]] = {}
        for path in files:
            jsonl = path.suffix.lower() in (".jsonl", ".ndjson")
            for _i, obj, _w in iter_objects(path, only_with='"key"' if jsonl else None):
                if _kind(obj) != "feedback":
                    continue
                slim = {k: obj.get(k) for k in ("key", "score", "value", "feedback_source")}
                if obj.get("run_id"):
                    by_run.setdefault(str(obj["run_id"]), []).append(slim)
                elif obj.get("trace_id"):
                    by_trace.setdefault(str(obj["trace_id"]), []).append(slim)
        return by_run, by_trace

    def _record(self, path: Path, pos: int, run: dict, where: str, scores: list[Score]) -> SourceRecord:
        rid = run.get("id")
        if not isinstance(rid, str) or not rid:
            raise bad_record(path, pos, "id", f"a run id ({where})")
        try:
            ts = parse_ts(run.get("start_time"))
        except (ValueError, TypeError):
            raise bad_record(path, pos, "start_time", f"an ISO-8601 timestamp ({where})") from None
        extra = {k: run[k] for k in ("trace_id", "name", "session_id") if run.get(k) is not None}
        outputs = run.get("outputs")
        return SourceRecord(pos, rid, ts, _Fields(run), scores, prompt=message_text(run.get("inputs"), last_user=True),
                            response=message_text(outputs) if outputs is not None else None, extra=extra)
