"""The importer interface: records of an eval or tracing tool's output -> rows of the service's logs.

An importer reads one tool's files (promptfoo results, Inspect logs, OpenTelemetry spans, Langfuse and
LangSmith exports) and yields `SourceRecord` objects: one logged response each, with its stable id, its
timestamp, the fields that may identify the policy and the prompt (``KIND:NAME`` keys such as
``attr:gen_ai.request.model``) and every score attached to it (`Score`: name, value, whether a judge or a
person gave it, its scale when the tool declares one).  The framework does the rest in one place, the
same for every tool (`map_records`):

* the policy, the prompt and the judge and human scores are chosen by an `ImportMapping` (the
  ``--policy-from``, ``--prompt-from``, ``--judge-from`` and ``--label-from`` selectors of ``cje import``,
  each defaulting to the importer's own rule);
* what cannot be mapped is counted per reason with the first examples and their record numbers
  (`ImportReport`), never dropped silently: a human label on a record without a judge score is its own
  reason;
* `ImportedRow` is the typed row the writer (`flows.integrations.importers.writer`) streams into the
  daily Parquet layout.

Bad input (a file that is not the tool's format, a record missing a field the format requires) raises
`cje_engine.errors.CJEInputError` naming the file, the record and the field (`bad_record`): exit 2.

A new source is its module, an object following `Importer`, and one `register` call
(`flows.integrations.importers.BUILTIN`); docs/imports/README.md.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, runtime_checkable

from cje_engine.errors import CJEInputError
from cje_engine.registry import Registry

#: Who gave a score.
JUDGE, HUMAN, UNKNOWN = "judge", "human", "unknown"
ORIGINS = (JUDGE, HUMAN, UNKNOWN)
#: Examples kept per reason in a report.
EXAMPLES = 3
_NAME = re.compile(r"^[a-z][a-z0-9-]*$")
_KIND = re.compile(r"^[a-z][a-z0-9_]*$")


# --------------------------------------------------------------------------------------
# what an importer yields


@dataclass(slots=True)
class Score:
    """One score attached to a record.

    Parameters
    ----------
    name : str
        The scorer's name as the tool records it (Langfuse score name, LangSmith feedback key,
        ``gen_ai.evaluation.name``, promptfoo assertion, Inspect scorer).
    value : float, int, bool, str or None
        As recorded; the mapping converts it (booleans to 0/1, numeric text to a number).
    origin : str
        ``"judge"`` (a model or a program scored it), ``"human"`` (a person did) or ``"unknown"``.
    scale : (float, float), optional
        The scale the tool declares for this score (e.g. a boolean is 0-1), when it declares one.
    """

    name: str
    value: Any
    origin: str = UNKNOWN
    scale: tuple[float, float] | None = None


@dataclass(slots=True)
class SourceRecord:
    """One logged response as an importer read it, before the mapping.

    Parameters
    ----------
    position : int
        Zero-based record number in the source (what messages name).
    response_id : str
        A stable id of the response (span id, observation id, run id, ...): the same on every import.
    ts : datetime, optional
        When it was produced (timezone-aware; naive is taken as UTC).
    fields : mapping of str to object
        ``"KIND:NAME" -> value`` the policy and prompt selectors read (kinds are the importer's own,
        listed in its ``kinds``).
    scores : list of Score
        Every score attached.
    prompt, response : str, optional
        The input and output text when the source has them.
    extra : dict, optional
        Anything else kept with the row (stored as a JSON text column ``extra``).
    """

    position: int
    response_id: str | None
    ts: datetime | None
    fields: Mapping[str, Any]
    scores: list[Score] = field(default_factory=list)
    prompt: str | None = None
    response: str | None = None
    extra: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Note:
    """Something an importer passed over that is not a record (spans that are not responses), to report.

    Parameters
    ----------
    text : str
        What (the report counts it under this text).
    count : int
        How many.
    """

    text: str
    count: int = 1


@dataclass(frozen=True, slots=True)
class ImportedRow:
    """One row of the service's logs, as the writer stores it.

    Parameters
    ----------
    prompt_id, policy, response_id : str
        The cluster, the policy and the response's stable id.
    judge_score : float
        The judge's score, as recorded (its scale in ``judge_scale`` when declared; `ImportReport`
        gives the observed range).
    ts : datetime
        UTC timestamp (the day partition).
    judge_name : str
        Which scorer gave ``judge_score``.
    judge_scale : (float, float), optional
        The scale the source declares for the judge.
    oracle_label : float, optional
        A human score, when the record has one.
    prompt, response : str, optional
        Texts (for labelling requests).
    source_record : int
        Record number in the source.
    extra : str, optional
        JSON text of anything else kept.
    """

    prompt_id: str
    policy: str
    response_id: str
    judge_score: float
    ts: datetime
    judge_name: str
    judge_scale: tuple[float, float] | None = None
    oracle_label: float | None = None
    prompt: str | None = None
    response: str | None = None
    source_record: int = -1
    extra: str | None = None


# --------------------------------------------------------------------------------------
# the report


@dataclass
class Skipped:
    """Records left out for one reason: how many, and the first examples ``(record, detail)``."""

    count: int = 0
    examples: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class ImportReport:
    """What an import mapped and what it could not.

    Parameters
    ----------
    format, source : str
        The importer and the file read.
    records : int
        Records read from the source.
    mapped : int
        Rows the mapping produced.
    skipped : dict of str to Skipped
        Records not mapped, per reason (``no policy``, ``no judge score``, ``label without judge
        score``, ``judge score not numeric``, ...), with the first examples and their record numbers.
    notes : Counter
        Things mapped with a choice worth knowing (``several scores named X: kept the first``).
    policies, judges, labels : Counter
        Rows per policy; scores per judge name and per label name among mapped rows.
    unused_scores : Counter
        Scores present on mapped records that were neither the judge nor the label, per name.
    judge_range, label_range : (float, float) or None
        Observed range of the mapped judge scores and labels.
    judge_scale, label_scale : (float, float) or None
        The scale the source declares for the judge and for the label, when it does.
    written, already_present : int
        Rows written; rows whose ``response_id`` the logs already held (a re-import).
    objects : list of str
        Objects written (keys under the logs root).
    days : list of str
        The ``dt`` partitions the rows fall in.
    import_id : str
        Stable id of this import (source bytes, format, mapping).
    already_imported : bool
        The same source was imported before with the same mapping: nothing was written.
    """

    format: str
    source: str
    records: int = 0
    mapped: int = 0
    skipped: dict[str, Skipped] = field(default_factory=dict)
    notes: Counter = field(default_factory=Counter)
    policies: Counter = field(default_factory=Counter)
    judges: Counter = field(default_factory=Counter)
    labels: Counter = field(default_factory=Counter)
    unused_scores: Counter = field(default_factory=Counter)
    judge_range: tuple[float, float] | None = None
    label_range: tuple[float, float] | None = None
    judge_scale: tuple[float, float] | None = None
    label_scale: tuple[float, float] | None = None
    written: int = 0
    already_present: int = 0
    objects: list[str] = field(default_factory=list)
    days: list[str] = field(default_factory=list)
    import_id: str = ""
    already_imported: bool = False

    def skip(self, reason: str, record: int, detail: str = "") -> None:
        """Count one record left out for ``reason`` (the first `EXAMPLES` kept with ``detail``)."""
        s = self.skipped.get(reason)
        if s is None:
            s = self.skipped[reason] = Skipped()
        s.count += 1
        if len(s.examples) < EXAMPLES:
            s.examples.append((record, detail))

    @property
    def n_skipped(self) -> int:
        """Records left out, over every reason."""
        return sum(s.count for s in self.skipped.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``cje import --json``, the import manifest)."""
        return {
            "format": self.format, "source": self.source, "import_id": self.import_id,
            "already_imported": self.already_imported, "records": self.records, "mapped": self.mapped,
            "written": self.written, "already_present": self.already_present,
            "skipped": {r: {"count": s.count, "examples": [{"record": i, "detail": d} for i, d in s.examples]}
                        for r, s in sorted(self.skipped.items())},
            "notes": dict(self.notes), "policies": dict(self.policies), "judges": dict(self.judges),
            "labels": dict(self.labels), "unused_scores": dict(self.unused_scores),
            "judge_range": list(self.judge_range) if self.judge_range else None,
            "label_range": list(self.label_range) if self.label_range else None,
            "judge_scale": list(self.judge_scale) if self.judge_scale else None,
            "label_scale": list(self.label_scale) if self.label_scale else None,
            "objects": list(self.objects), "days": list(self.days),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ImportReport":
        """The report `to_dict` wrote (read back from an import manifest)."""
        rep = cls(format=str(data["format"]), source=str(data["source"]))
        for k in ("records", "mapped", "written", "already_present"):
            setattr(rep, k, int(data.get(k, 0)))
        rep.import_id = str(data.get("import_id", ""))
        rep.already_imported = bool(data.get("already_imported", False))
        rep.skipped = {r: Skipped(int(s["count"]), [(int(e["record"]), str(e["detail"])) for e in s["examples"]])
                       for r, s in (data.get("skipped") or {}).items()}
        for k in ("notes", "policies", "judges", "labels", "unused_scores"):
            setattr(rep, k, Counter(data.get(k) or {}))
        for k in ("judge_range", "label_range", "judge_scale", "label_scale"):
            v = data.get(k)
            setattr(rep, k, (float(v[0]), float(v[1])) if v else None)
        rep.objects = [str(o) for o in data.get("objects") or []]
        rep.days = [str(d) for d in data.get("days") or []]
        return rep

    def scale_hint(self) -> str:
        """The ``--score-scale``/``--label-scale`` flags `cje evaluate` needs for these rows ('' for 0-1).

        A scale the source declares is given as is; an undeclared one outside 0-1 is left for the user to
        declare (``--label-scale LO-HI``, with the observed range): scales are declared, never guessed.
        """
        flags = []
        for flag, declared, seen in (("--score-scale", self.judge_scale, self.judge_range),
                                     ("--label-scale", self.label_scale, self.label_range)):
            if declared is not None:
                if tuple(declared) != (0.0, 1.0):
                    flags.append(f"{flag} {_num(declared[0])}-{_num(declared[1])}")
            elif seen is not None and (seen[0] < 0.0 or seen[1] > 1.0):
                flags.append(f"{flag} LO-HI (observed {_num(seen[0])}..{_num(seen[1])}; declare the scale)")
        return " ".join(flags)

    def lines(self) -> list[str]:
        """The report for a terminal, one fact a line."""
        if self.already_imported:
            head = [f"{self.source}: already imported ({self.import_id}); nothing written",
                    f"  {self.written} row(s) in {len(self.objects)} object(s) from the first import"]
            return head
        out = [f"{self.source}: {self.records} record(s) read, {self.mapped} mapped, {self.written} written"
               + (f", {self.already_present} already in the logs (not written again)" if self.already_present else "")]
        if self.policies:
            out.append("  policies: " + ", ".join(f"{p} ({n})" for p, n in sorted(self.policies.items())))
        if self.judges:
            rng = f", range {_num(self.judge_range[0])}..{_num(self.judge_range[1])}" if self.judge_range else ""
            out.append("  judge: " + ", ".join(f"{j} ({n})" for j, n in self.judges.items()) + rng)
        if self.labels:
            rng = f", range {_num(self.label_range[0])}..{_num(self.label_range[1])}" if self.label_range else ""
            out.append("  labels: " + ", ".join(f"{j} ({n})" for j, n in self.labels.items()) + rng)
        if self.unused_scores:
            out.append("  scores not used: " + ", ".join(f"{j} ({n})" for j, n in sorted(self.unused_scores.items())))
        for reason, s in sorted(self.skipped.items()):
            ex = "; ".join(f"record {i}" + (f": {d}" if d else "") for i, d in s.examples)
            out.append(f"  not mapped: {s.count} record(s), {reason} (e.g. {ex})")
        for note, n in sorted(self.notes.items()):
            out.append(f"  note: {note} ({n})")
        if self.days:
            out.append(f"  days: {self.days[0]}..{self.days[-1]} ({len(self.days)}), {len(self.objects)} object(s) written")
        return out


def _num(x: float) -> str:
    return f"{x:g}"


# --------------------------------------------------------------------------------------
# the mapping (--policy-from, --prompt-from, --judge-from, --label-from)


@dataclass(frozen=True)
class Selector:
    """Which fields of a record give a value: ``KIND:NAME`` terms, ``+`` joins, ``|`` falls back.

    ``attr:gen_ai.request.model|attr:gen_ai.system`` takes the first present;
    ``attr:gen_ai.request.model+metadata:prompt_version`` joins both with ``/``
    (policy = model and prompt version).  A term without ``KIND:`` takes the importer's default kind.

    Parameters
    ----------
    text : str
        As given.
    alternatives : tuple of tuple of str
        ``((key, key, ...), ...)``: alternatives in order, each the ``KIND:NAME`` keys joined.
    """

    text: str
    alternatives: tuple[tuple[str, ...], ...]

    @classmethod
    def parse(cls, text: str, kinds: Iterable[str], default_kind: str, flag: str) -> "Selector":
        """Parse ``text``; an unknown kind or an empty term raises `CJEInputError` naming ``flag``."""
        kinds = tuple(kinds)
        alts = []
        for alt in str(text).split("|"):
            keys = []
            for term in alt.split("+"):
                term = term.strip()
                kind, sep, name = term.partition(":")
                if not sep:
                    kind, name = default_kind, term
                if not name or kind not in kinds:
                    raise CJEInputError(f"{flag} {text!r}: term {term!r} is not KIND:NAME with KIND one of "
                                        f"{list(kinds)}", option=flag.lstrip("-").replace("-", "_"))
                keys.append(f"{kind}:{name}")
            alts.append(tuple(keys))
        return cls(str(text), tuple(alts))

    def resolve(self, fields: Mapping[str, Any]) -> str | None:
        """The value in ``fields`` (text), or None when no alternative is complete."""
        for keys in self.alternatives:
            if len(keys) == 1:
                v = fields.get(keys[0])
                if v is not None and v != "":
                    return v if isinstance(v, str) else _text(v)
                continue
            parts = []
            for k in keys:
                v = fields.get(k)
                if v is None or v == "":
                    break
                parts.append(v if isinstance(v, str) else _text(v))
            else:
                return "/".join(parts)
        return None

    def names(self, kind: str) -> tuple[str, ...]:
        """The NAMEs of kind ``kind`` this selector reads (score names for ``--judge-from``)."""
        return tuple(k.split(":", 1)[1] for keys in self.alternatives for k in keys if k.split(":", 1)[0] == kind)


def _text(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


@dataclass(frozen=True)
class ImportMapping:
    """How records become rows: the selectors of policy, prompt, judge and label.

    Parameters
    ----------
    policy, prompt : Selector
        Fields giving the policy and the prompt id (the prompt falls back on a hash of the prompt text
        when the selector finds nothing and the record has one).
    judge : Selector or None
        The judge score: ``score:NAME`` names a score, another kind a numeric field. None: the one
        score the source marks as a judge's (more than one such name is an error asking for
        ``--judge-from``).
    label : Selector or None
        The human score, the same way; None: the one score the source marks as a person's (none: no
        labels).
    """

    policy: Selector
    prompt: Selector
    judge: Selector | None = None
    label: Selector | None = None

    @classmethod
    def build(cls, importer: "Importer", policy_from: str | None = None, prompt_from: str | None = None,
              judge_from: str | None = None, label_from: str | None = None) -> "ImportMapping":
        """The mapping of ``importer`` with the flags given (None: the importer's default)."""
        kinds = tuple(importer.kinds) + ("score",)
        fk = importer.default_kind

        def sel(text: str | None, default: str | None, flag: str, kind: str) -> Selector | None:
            t = text if text else default
            return None if not t else Selector.parse(t, kinds, kind, flag)

        return cls(policy=sel(policy_from, importer.default_policy, "--policy-from", fk),  # type: ignore[arg-type]
                   prompt=sel(prompt_from, importer.default_prompt, "--prompt-from", fk),  # type: ignore[arg-type]
                   judge=sel(judge_from, None, "--judge-from", "score"),
                   label=sel(label_from, None, "--label-from", "score"))

    def declared(self) -> dict[str, str | None]:
        """The selectors as text (what names an import, with the source bytes)."""
        return {"policy": self.policy.text, "prompt": self.prompt.text,
                "judge": self.judge.text if self.judge else None, "label": self.label.text if self.label else None}


# --------------------------------------------------------------------------------------
# the protocol and the registry


@runtime_checkable
class Importer(Protocol):
    """A source of logged responses with scores.

    Attributes
    ----------
    name : str
        The ``FORMAT`` of ``cje import`` (lower case, digits, ``-``).
    title : str
        One line for ``--help`` and the docs.
    kinds : tuple of str
        The field kinds its records carry (``attr``, ``resource``, ``metadata``, ...), for selectors.
    default_kind : str
        The kind of a selector term written without ``KIND:``.
    default_policy, default_prompt : str
        The selectors used without ``--policy-from`` / ``--prompt-from``.
    version : str
        Changes when the same file would map to other rows (part of the import id).
    """

    name: str
    title: str
    kinds: tuple[str, ...]
    default_kind: str
    default_policy: str
    default_prompt: str
    version: str

    def records(self, source: Path) -> Iterator[SourceRecord | Note]:
        """Stream the records of ``source`` (a file, or a folder when the tool exports several files).

        `Note` items (things passed over that are not records) go to the report's notes.

        Raises
        ------
        CJEInputError
            The file is not this tool's format, or a record lacks a required field (`bad_record`).
        """
        ...


def _check_importer(imp: Any) -> None:
    name = getattr(imp, "name", None)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"importer name {name!r}: lower case letters, digits and '-'")
    if not isinstance(imp, Importer):
        missing = [a for a in ("title", "kinds", "default_kind", "default_policy", "default_prompt", "version",
                               "records") if not hasattr(imp, a)]
        raise TypeError(f"importer {name!r} lacks {missing} (flows.integrations.importers.Importer)")
    if not callable(imp.records):
        raise TypeError(f"importer {name!r}: records must be a method")
    bad = [k for k in imp.kinds if not isinstance(k, str) or not _KIND.match(k) or k == "score"]
    if bad or imp.default_kind not in imp.kinds:
        raise ValueError(f"importer {name!r}: kinds {list(imp.kinds)} must be lower-case words other than 'score', "
                         f"default_kind {imp.default_kind!r} among them")
    for flag, text in (("default_policy", imp.default_policy), ("default_prompt", imp.default_prompt)):
        Selector.parse(text, tuple(imp.kinds) + ("score",), imp.default_kind, flag)


#: The family: ``cje import FORMAT`` choices.
IMPORTERS: Registry[Importer] = Registry("importer", check=_check_importer, option="format")


def register(importer: Importer, *, replace: bool = False) -> Importer:
    """Add an importer; its name becomes a ``cje import`` FORMAT. Returns it.

    Raises
    ------
    ValueError, TypeError
        A bad name, a name taken, or an object that does not follow `Importer`.
    """
    return IMPORTERS.register(importer, replace=replace)


def get(name: str) -> Importer:
    """The importer ``name``; an unknown name raises `CJEInputError` naming the choices."""
    return IMPORTERS.get(name)


def names() -> tuple[str, ...]:
    """The registered importers' names, in registration order."""
    return IMPORTERS.names()


# --------------------------------------------------------------------------------------
# helpers for importers


def bad_record(source: str | Path, record: int, field_name: str | None, expected: str, *,
               line: int | None = None) -> CJEInputError:
    """The error of a record that does not follow its format: file, record, field and what was expected.

    Parameters
    ----------
    source : str or Path
        The file.
    record : int
        Zero-based record number.
    field_name : str, optional
        The field (dotted path in the record).
    expected : str
        What was expected ("a string", "an object with traceId and spanId").
    line : int, optional
        The line (1-based) when the file is JSON Lines.

    Returns
    -------
    CJEInputError
        To raise.
    """
    where = f"record {record}" + (f" (line {line})" if line is not None else "")
    what = f"field '{field_name}'" if field_name else "the record"
    err = CJEInputError(f"{where}: {what} is not {expected}", source=str(source))
    err.column, err.row = field_name, record  # named in the message already, kept for callers
    return err


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def parse_ts(value: Any) -> datetime | None:
    """A timestamp from ISO-8601 text, epoch nanoseconds (int or digit text) or a datetime; UTC-aware.

    Returns None for None/empty; raises `ValueError` for anything else.
    """
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if isinstance(value, (int, float)) and not isinstance(value, bool) or (isinstance(value, str) and value.isdigit()):
        ns = int(value)
        if ns <= 0:
            return None  # OTLP: 0 means unset
        return _EPOCH + timedelta(microseconds=ns // 1000)
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("Z"):
            text = text[:-1] + "+00:00"
        dt = datetime.fromisoformat(text)
        return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)
    raise ValueError(f"not a timestamp: {value!r}")


def number(value: Any) -> float | None:
    """A score as a finite float: numbers, booleans (0/1) and numeric text; None when it is not one."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)):
        v = float(value)
    elif isinstance(value, str):
        t = value.strip().lower()
        if t in ("true", "false"):
            return 1.0 if t == "true" else 0.0
        try:
            v = float(t)
        except ValueError:
            return None
    else:
        return None
    return v if math.isfinite(v) else None


def text_id(text: str) -> str:
    """A stable prompt id from the prompt text: ``sha1:`` and 16 hex digits of its SHA-1."""
    return "sha1:" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def message_text(v: Any, last_user: bool = False) -> str | None:
    """The text of chat messages, a string, or ``{"content": ...}``/``{"parts": [...]}`` objects.

    Parameters
    ----------
    v : object
        Messages as the tools record them (a JSON string of them is decoded first).
    last_user : bool
        Keep only the last ``user`` message when there is one (the prompt, without a system message
        that every prompt shares).
    """
    if v is None:
        return None
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except (json.JSONDecodeError, ValueError):
            return v
    if last_user and isinstance(v, list):
        users = [m for m in v if isinstance(m, dict) and m.get("role") in ("user", "human")]
        if users:
            v = users[-1]
    if isinstance(v, dict) and isinstance(v.get("messages"), list):
        v = v["messages"]
        if last_user:
            users = [m for m in v if isinstance(m, dict) and m.get("role") in ("user", "human")]
            v = users[-1] if users else v
    parts: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, str):
            parts.append(x)
        elif isinstance(x, list):
            for i in x:
                walk(i)
        elif isinstance(x, dict):
            for key in ("content", "parts", "text", "message", "choices", "generations", "output"):
                if isinstance(x.get(key), (str, list, dict)):
                    walk(x[key])
                    return
    walk(v)
    return "\n".join(parts) if parts else None
