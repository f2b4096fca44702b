"""promptfoo result files (``cje import promptfoo``): one record per test case x prompt x provider.

Reads what ``promptfoo eval -o results.json`` (one document: ``evalId``, ``results.timestamp``,
``results.prompts``, ``results.results``) and ``-o results.jsonl`` (one result a line) write, plain or
gzip-compressed (``.gz``), a file or a folder of them. Each result carries ``provider`` (``id``,
``label``), ``prompt`` (``raw``, ``label``), ``promptId``, ``testIdx``/``promptIdx``, ``testCase``
(``description``, ``vars``, ``metadata``), ``response.output`` and ``gradingResult.componentResults``: one
entry per assertion (``assertion.type``, ``assertion.metric``, ``score``).

Scores: one per component result, named by the assertion's ``metric`` (else its ``type``). Model-graded
assertions (``llm-rubric``, ``g-eval``, ``factuality``, ...) are judges on 0-1; ``human`` ratings (the
viewer's manual grades) are a person's; programmatic assertions (``python``, ``javascript``,
``contains``, ...) are of unknown origin (``--label-from score:METRIC`` names the one that holds a human or
oracle rating, e.g. an expert's rating kept as a ``python`` assertion with ``metric: expert``).

Fields for selectors: ``provider:id|label``, ``prompt:label|id|raw``, ``var:NAME`` (the test's vars; the
default kind), ``test:description|idx``, ``metadata:NAME`` (the test's metadata), ``eval:id`` and
``auto:policy`` / ``auto:prompt``. Defaults: policy ``auto:policy`` (the provider's label, else its id,
joined with the prompt's label when the eval ran several prompts: ``careful/qa-v2``); prompt
``auto:prompt`` (``pf:`` and a hash of the test's description and vars: the same test case under every
provider and prompt, and across runs). Response id: the result's ``id``, else
``evalId:testIdx:promptIdx``. Timestamp: the eval's (``results.timestamp``); JSON Lines carry none, so
the file's modification time stands in (a note says so).

Results with an error instead of a response (``failureReason`` 2, ``response.error``) are passed over
and counted in a note. Streaming: JSON Lines line by line; the JSON document one result at a time (the
prompts list, written before the results, is read on the way); for JSON Lines a first pass counts the
prompts with a text scan (``promptId``), decoding nothing.
"""
from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from cje_engine.errors import CJEInputError

from flows.integrations.importers.base import (HUMAN, JUDGE, UNKNOWN, Note, Score, SourceRecord, bad_record,
                                               message_text, parse_ts)
from flows.integrations.importers.jsonstream import base_suffix, iter_json, iter_jsonl, open_text

#: Model-graded assertion types (promptfoo docs, "Model-graded metrics"): judges, scored 0-1.
MODEL_GRADED = frozenset({
    "llm-rubric", "g-eval", "model-graded-closedqa", "model-graded-factuality", "factuality", "answer-relevance",
    "context-faithfulness", "context-recall", "context-relevance", "conversation-relevance", "select-best",
    "search-rubric", "pi", "classifier", "moderation", "similar", "max-score"})
#: Manual grades given in promptfoo's viewer.
HUMAN_TYPES = frozenset({"human"})
ERROR_REASON = 2  # ResultFailureReason.ERROR
_PROMPT_ID = re.compile(r'"promptId"\s*:\s*"([^"]+)"')
_SUFFIXES = (".json", ".jsonl", ".ndjson")


def files_of(source: Path) -> list[Path]:
    """The result files of a source: the file, or a folder's ``.json``/``.jsonl`` files (also ``.gz``)."""
    if source.is_dir():
        return sorted(p for p in source.rglob("*") if p.is_file() and base_suffix(p) in _SUFFIXES
                      and not any(part.startswith((".", "_")) for part in p.relative_to(source).parts))
    if not source.exists():
        raise CJEInputError("does not exist; expected a promptfoo results file (promptfoo eval -o results.json)",
                            source=str(source))
    return [source]


def _short(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:8]


def prompt_name(prompt: Any, prompt_id: Any) -> str:
    """A prompt's name in a policy: its label, unless promptfoo filled the label with the whole text."""
    label = prompt.get("label") if isinstance(prompt, dict) else None
    raw = prompt.get("raw") if isinstance(prompt, dict) else None
    if isinstance(label, str) and label and (label != raw or len(label) <= 40):
        return label
    return "prompt-" + (str(prompt_id)[:8] if prompt_id else _short(str(raw)))


def case_key(test: dict[str, Any], vars_: Any) -> str:
    """The stable id of a test case: ``pf:`` and 16 hex digits of SHA-1 over its description and vars."""
    body = json.dumps({"description": test.get("description"), "vars": vars_}, sort_keys=True, default=str,
                      separators=(",", ":"))
    return "pf:" + hashlib.sha1(body.encode("utf-8")).hexdigest()[:16]


class _Fields:
    """Selector view of one result: ``provider:``, ``prompt:``, ``var:``, ``test:``, ``metadata:``, ``eval:``, ``auto:``."""

    __slots__ = ("r", "eval_id", "several_prompts")

    def __init__(self, result: dict, eval_id: str | None, several_prompts: bool) -> None:
        self.r = result
        self.eval_id = eval_id
        self.several_prompts = several_prompts

    def _provider(self, name: str) -> Any:
        p = self.r.get("provider")
        if isinstance(p, str):
            return p if name == "id" else None
        return p.get(name) if isinstance(p, dict) else None

    def _test(self) -> dict:
        t = self.r.get("testCase")
        return t if isinstance(t, dict) else {}

    def _vars(self) -> dict:
        v = self.r.get("vars")
        if not isinstance(v, dict):
            v = self._test().get("vars")
        return v if isinstance(v, dict) else {}

    def get(self, key: str, default: Any = None) -> Any:
        kind, _, name = key.partition(":")
        v: Any = None
        if kind == "provider":
            v = self._provider(name)
        elif kind == "prompt":
            p = self.r.get("prompt") if isinstance(self.r.get("prompt"), dict) else {}
            v = self.r.get("promptId") if name == "id" else p.get(name)
        elif kind == "var":
            v = self._vars().get(name)
        elif kind == "test":
            v = self.r.get("testIdx") if name == "idx" else self._test().get(name)
        elif kind == "metadata":
            m = self._test().get("metadata")
            v = m.get(name) if isinstance(m, dict) else None
        elif kind == "eval":
            v = self.eval_id if name == "id" else None
        elif kind == "auto":
            v = self._auto(name)
        return default if v is None else v

    def _auto(self, name: str) -> str | None:
        if name == "prompt":
            return case_key(self._test(), self._vars())
        if name != "policy":
            return None
        prov = self._provider("label") or self._provider("id")
        if not prov:
            return None
        if self.several_prompts:
            return f"{prov}/{prompt_name(self.r.get('prompt'), self.r.get('promptId'))}"
        return str(prov)


def _origin(atype: Any) -> str:
    if atype in MODEL_GRADED:
        return JUDGE
    if atype in HUMAN_TYPES:
        return HUMAN
    return UNKNOWN


def _scores(path: Path, pos: int, where: str, grading: Any) -> list[Score]:
    """The component results of ``gradingResult`` as scores (nested assert-sets flattened)."""
    if grading is None:
        return []
    if not isinstance(grading, dict):
        raise bad_record(path, pos, "gradingResult", f"an object ({where})")
    out: list[Score] = []

    def walk(comps: Any, field: str) -> None:
        if comps is None:
            return
        if not isinstance(comps, list):
            raise bad_record(path, pos, field, f"a list of assertion results ({where})")
        for i, c in enumerate(comps):
            f = f"{field}[{i}]"
            if not isinstance(c, dict):
                raise bad_record(path, pos, f, f"an assertion result object ({where})")
            a = c.get("assertion") if isinstance(c.get("assertion"), dict) else {}
            if isinstance(c.get("componentResults"), list) and a.get("type") == "assert-set":
                walk(c["componentResults"], f + ".componentResults")
                continue
            score = c.get("score")
            if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
                raise bad_record(path, pos, f + ".score", f"a number ({where}; found {json.dumps(score)[:40]})")
            atype = a.get("type")
            name = a.get("metric") or atype or "assertion"
            origin = _origin(atype)
            out.append(Score(str(name), score, origin, (0.0, 1.0) if origin == JUDGE else None))

    walk(grading.get("componentResults"), "gradingResult.componentResults")
    return out


def _is_error(result: dict) -> bool:
    resp = result.get("response")
    return result.get("failureReason") == ERROR_REASON or (isinstance(resp, dict) and bool(resp.get("error"))
                                                            and resp.get("output") is None)


def _response_text(resp: Any) -> str | None:
    if not isinstance(resp, dict):
        return None
    out = resp.get("output")
    if out is None or isinstance(out, str):
        return out
    return json.dumps(out, sort_keys=True, default=str)


class PromptfooImporter:
    """promptfoo ``results.json`` / ``results.jsonl``: results with their assertion scores (module docstring)."""

    name = "promptfoo"
    title = "promptfoo results (promptfoo eval -o results.json | results.jsonl)"
    kinds = ("var", "provider", "prompt", "test", "metadata", "eval", "auto")
    default_kind = "var"
    default_policy = "auto:policy"
    default_prompt = "auto:prompt"
    version = "1"

    def records(self, source: Path) -> Iterator[SourceRecord | Note]:
        """Stream the results of ``source`` (a results file or a folder of them) as records."""
        pos = 0
        errors = 0
        for path in files_of(Path(source)):
            if base_suffix(path) in (".jsonl", ".ndjson"):
                stream = self._jsonl(path)
            else:
                stream = self._json(path)
            for item in stream:
                if isinstance(item, Note):
                    yield item
                    continue
                result, eval_id, ts, several, where = item
                if not isinstance(result, dict):
                    raise bad_record(path, pos, None, f"a promptfoo result object ({where})")
                if _is_error(result):
                    errors += 1
                    pos += 1
                    continue
                yield self._record(path, pos, result, eval_id, ts, several, where)
                pos += 1
        if errors:
            yield Note("results with an error instead of a response (failureReason ERROR): not responses", errors)

    def _json(self, path: Path) -> Iterator[Any]:
        """``(result, evalId, ts, several prompts, where)`` of a results.json, one result at a time."""
        seen = False
        i = 0
        for key, ctx, item in iter_json(path, {"results": ["results", "*"]}):
            if key != "results":
                raise CJEInputError("is not a promptfoo results file: no 'results.results' list (expected the "
                                    "output of promptfoo eval -o results.json)", source=str(path))
            seen = True
            top, res = ctx[0], ctx[1]
            if i == 0:  # the eval's header (read before the first result) holds for every result
                try:
                    ts = parse_ts(res.get("timestamp"))
                except (ValueError, TypeError):
                    raise bad_record(path, i, "results.timestamp", "an ISO-8601 timestamp") from None
                prompts = res.get("prompts")
                ids = ({p.get("id") or p.get("raw") for p in prompts if isinstance(p, dict)}
                       if isinstance(prompts, list) else set())
            yield item, top.get("evalId"), ts, len(ids) > 1, f"results.results[{i}]"
            i += 1
        if not seen:
            raise CJEInputError("is not a promptfoo results file: no 'results' (expected the output of promptfoo "
                                "eval -o results.json)", source=str(path))

    def _jsonl(self, path: Path) -> Iterator[Any]:
        """``(result, None, mtime, several prompts, where)`` of a results.jsonl, line by line."""
        several = len(self._prompt_ids(path)) > 1
        mtime = datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc).replace(microsecond=0)
        yield Note(f"promptfoo JSON Lines carry no timestamp: {path.name}'s modification time "
                   f"({mtime.isoformat()}) used")
        for line, obj in iter_jsonl(path):
            yield obj, None, mtime, several, f"line {line}"

    @staticmethod
    def _prompt_ids(path: Path) -> set[str]:
        ids: set[str] = set()
        with open_text(path, errors="replace") as fh:
            for line in fh:
                m = _PROMPT_ID.search(line)
                if m:
                    ids.add(m.group(1))
        return ids

    def _record(self, path: Path, pos: int, r: dict, eval_id: str | None, ts: datetime | None, several: bool,
                where: str) -> SourceRecord:
        prov = r.get("provider")
        if not (isinstance(prov, str) and prov) and not (isinstance(prov, dict) and (prov.get("id") or prov.get("label"))):
            raise bad_record(path, pos, "provider", f"an object with an id or a label ({where})")
        test = r.get("testCase")
        if test is not None and not isinstance(test, dict):
            raise bad_record(path, pos, "testCase", f"an object ({where})")
        for fld, val in (("vars", r.get("vars")), ("testCase.vars", (test or {}).get("vars"))):
            if val is not None and not isinstance(val, dict):
                raise bad_record(path, pos, fld, f"an object of test variables ({where})")
        for fld in ("testIdx", "promptIdx"):
            v = r.get(fld)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise bad_record(path, pos, fld, f"an integer ({where})")
        scores = _scores(path, pos, where, r.get("gradingResult"))
        rid = r.get("id")
        if not isinstance(rid, str) or not rid:
            rid = f"{eval_id}:{r.get('testIdx')}:{r.get('promptIdx')}" if eval_id and r.get("testIdx") is not None else None
        prompt = r.get("prompt")
        prompt_text = message_text(prompt.get("raw"), last_user=True) if isinstance(prompt, dict) else None
        extra = {k: v for k, v in (("eval_id", eval_id), ("test_idx", r.get("testIdx")),
                                   ("prompt_idx", r.get("promptIdx")),
                                   ("description", (test or {}).get("description"))) if v is not None}
        return SourceRecord(pos, rid, ts, _Fields(r, eval_id, several), scores, prompt=prompt_text,
                            response=_response_text(r.get("response")), extra=extra)
