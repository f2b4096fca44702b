"""Inspect eval logs (``cje import inspect``): one record per sample (and epoch) of each model's log.

Reads the logs ``inspect eval`` writes: the default ``.eval`` format (a zip archive: ``header.json`` or
``_journal/start.json`` with the eval spec, one ``samples/<id>_epoch_<n>.json`` member per sample;
members compressed with zstd, as Inspect writes them, deflate or stored) and ``--log-format json`` (one
document: ``eval``, then ``samples``), plain or ``.gz``; a file or a folder of logs (one log per task
and model, as Inspect writes them).

Scores: the sample's ``scores`` (scorer name -> ``value``). Letter grades of the model-graded scorers
(``model_graded_qa``, ``model_graded_fact``: ``C``/``P``/``I``/``N``) become 1 / 0.5 / 0 / 0 on a
declared 0-1 scale, Inspect's own ``value_to_float``; numeric values and numeric text (a ``grade_pattern``
such as ``GRADE: 7``) are kept as numbers; a dict value gives one score per key (``scorer.key``); an
unscored sample (NaN) has no value. Who scored: a score created by an edit with provenance (Inspect's
``edit_score``, a person's review) is a person's; a scorer's is a judge's (a scorer's score a person
edited keeps the edited value, and a note counts them).

Fields for selectors: ``eval:NAME`` (``model``, ``task``, ``task_id``, ``task_version``, ``run_id``,
``eval_id``, ``created``, and ``model_role.ROLE``), ``sample:id|epoch|uuid`` and ``metadata:NAME`` (the
sample's metadata; the default kind). Defaults: policy ``eval:model``, prompt ``eval:task+sample:id``
(``capitals_qa/q007``: the same sample under every model). Response id: ``eval_id/sample id/epoch``.
Timestamp: the sample's ``started_at``, else the eval's ``created``.

Samples that ended in an error are passed over and counted in a note; the samples a cancelled or failed
run logged are imported, and a note says how many such logs there were. Streaming: one sample member at a
time from an ``.eval`` archive; one sample at a time from a JSON log (the ``eval`` spec, written before
the samples, is read on the way).
"""
from __future__ import annotations

import json
import math
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, Iterator

from cje_engine.errors import CJEInputError

from flows.integrations.importers.base import (HUMAN, JUDGE, Note, Score, SourceRecord, bad_record, message_text,
                                               parse_ts)
from flows.integrations.importers.jsonstream import base_suffix, iter_json

#: Inspect's letter grades (inspect_ai.scorer.value_to_float): correct, partial, incorrect, no answer.
GRADES = {"C": 1.0, "P": 0.5, "I": 0.0, "N": 0.0}
ZSTD = 93
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_SUFFIXES = (".eval", ".json")


def files_of(source: Path) -> list[Path]:
    """The logs of a source: the file, or a folder's ``.eval`` and ``.json`` logs (sorted)."""
    if source.is_dir():
        return sorted(p for p in source.rglob("*") if p.is_file() and base_suffix(p) in _SUFFIXES
                      and not any(part.startswith((".", "_")) for part in p.relative_to(source).parts))
    if not source.exists():
        raise CJEInputError("does not exist; expected an Inspect log (.eval or .json) or a folder of them",
                            source=str(source))
    return [source]


# --------------------------------------------------------------------------- .eval archives


def read_member(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """The bytes of one archive member: stored, deflate, or zstd (Inspect's default; decoded with pyarrow's codec).

    The CRC-32 the archive records is checked.

    Raises
    ------
    CJEInputError
        A truncated or corrupt member, a compression method other than these, a CRC mismatch.
    """
    where = f"member {info.filename}"
    try:
        if info.compress_type != ZSTD:
            return zf.read(info)
        with open(path, "rb") as fh:
            fh.seek(info.header_offset)
            head = fh.read(_LOCAL_HEADER.size)
            if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
                raise CJEInputError(f"{where}: no local file header (a truncated or corrupt .eval archive)",
                                    source=str(path))
            fields = _LOCAL_HEADER.unpack(head)
            fh.seek(fields[9] + fields[10], 1)
            raw = fh.read(info.compress_size)
        if len(raw) < info.compress_size:
            raise CJEInputError(f"{where}: ends early (a truncated .eval archive)", source=str(path))
        import pyarrow as pa

        data = pa.Codec("zstd").decompress(raw, decompressed_size=info.file_size).to_pybytes()
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError) as exc:
        if isinstance(exc, CJEInputError):
            raise
        raise CJEInputError(f"{where}: cannot be read ({exc}); expected an Inspect .eval archive",
                            source=str(path)) from None
    except Exception as exc:  # pyarrow raises ArrowException (an OSError subclass for IO, else its own)
        if isinstance(exc, CJEInputError):
            raise
        raise CJEInputError(f"{where}: is not valid zstd data ({exc}); a corrupt .eval archive",
                            source=str(path)) from None
    if zlib.crc32(data) & 0xFFFFFFFF != info.CRC:
        raise CJEInputError(f"{where}: CRC-32 does not match the archive's (a corrupt .eval archive)",
                            source=str(path))
    return data


def _member_json(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> Any:
    try:
        return json.loads(read_member(path, zf, info))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CJEInputError(f"member {info.filename}: not JSON ({exc}); expected an Inspect log member",
                            source=str(path)) from None


# --------------------------------------------------------------------------- records


class _Fields:
    """Selector view of a sample: ``eval:``, ``sample:``, ``metadata:``."""

    __slots__ = ("spec", "sample")

    def __init__(self, spec: dict, sample: dict) -> None:
        self.spec = spec
        self.sample = sample

    def get(self, key: str, default: Any = None) -> Any:
        kind, _, name = key.partition(":")
        v: Any = None
        if kind == "eval":
            if name.startswith("model_role."):
                roles = self.spec.get("model_roles")
                role = roles.get(name.split(".", 1)[1]) if isinstance(roles, dict) else None
                v = role.get("model") if isinstance(role, dict) else role
            else:
                v = self.spec.get(name)
                if isinstance(v, (dict, list)):
                    v = None
        elif kind == "sample":
            v = self.sample.get(name)
        elif kind == "metadata":
            m = self.sample.get("metadata")
            v = m.get(name) if isinstance(m, dict) else None
        return default if v is None else v


def _value(v: Any) -> tuple[Any, tuple[float, float] | None]:
    """A score value as the mapping takes it, and the scale it implies (letter grades: 0-1)."""
    if isinstance(v, str) and v.strip().upper() in GRADES:
        return GRADES[v.strip().upper()], (0.0, 1.0)
    if isinstance(v, float) and not math.isfinite(v):
        return None, None
    return v, None


def _origin(sc: dict) -> tuple[str, bool]:
    """(origin, edited by a person): a score whose first edit has provenance was made by a person."""
    hist = sc.get("history")
    if not isinstance(hist, list) or not hist:
        return JUDGE, False
    first = hist[0] if isinstance(hist[0], dict) else {}
    if first.get("provenance"):
        return HUMAN, False
    return JUDGE, any(isinstance(h, dict) and h.get("provenance") for h in hist)


def sample_scores(path: Path, pos: int, where: str, scores: Any) -> tuple[list[Score], int]:
    """The scores of a sample, and how many of them are a scorer's that a person edited."""
    if scores is None:
        return [], 0
    if not isinstance(scores, dict):
        raise bad_record(path, pos, "scores", f"an object of scorer name -> score ({where})")
    out: list[Score] = []
    edited = 0
    for name, sc in scores.items():
        if not isinstance(sc, dict) or "value" not in sc:
            raise bad_record(path, pos, f"scores.{name}", f"a score object with a value ({where})")
        origin, was_edited = _origin(sc)
        edited += was_edited
        val = sc["value"]
        if isinstance(val, dict):
            for k, item in val.items():
                v, scale = _value(item)
                out.append(Score(f"{name}.{k}", v, origin, scale))
        elif isinstance(val, list):
            raise bad_record(path, pos, f"scores.{name}.value", f"a number, a grade or an object ({where}; found a list)")
        else:
            v, scale = _value(val)
            out.append(Score(str(name), v, origin, scale))
    return out, edited


class InspectImporter:
    """Inspect eval logs (.eval archives, JSON logs): samples with their scores (module docstring)."""

    name = "inspect"
    title = "Inspect eval logs (.eval or --log-format json; a log or a folder of logs)"
    kinds = ("metadata", "eval", "sample")
    default_kind = "metadata"
    default_policy = "eval:model"
    default_prompt = "eval:task+sample:id"
    version = "1"

    def records(self, source: Path) -> Iterator[SourceRecord | Note]:
        """Stream the samples of ``source`` (an Inspect log, or a folder of logs) as records."""
        pos = 0
        errors = edited = 0
        for path in files_of(Path(source)):
            stream = self._eval(path) if base_suffix(path) == ".eval" else self._json(path)
            for item in stream:
                if isinstance(item, Note):
                    yield item
                    continue
                spec, sample, where = item
                if not isinstance(sample, dict):
                    raise bad_record(path, pos, None, f"an Inspect sample object ({where})")
                if sample.get("error"):
                    errors += 1
                    pos += 1
                    continue
                rec, n_edited = self._record(path, pos, spec, sample, where)
                edited += n_edited
                yield rec
                pos += 1
        if errors:
            yield Note("samples that ended in an error: not responses", errors)
        if edited:
            yield Note("scorer scores a person edited (edit_score): the edited value used", edited)

    def _eval(self, path: Path) -> Iterator[tuple[dict, Any, str] | Note]:
        """``(eval spec, sample, where)`` of an ``.eval`` archive, one sample member at a time."""
        try:
            zf = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise CJEInputError(f"is not an Inspect .eval log ({exc}); expected the zip archive inspect eval "
                                "writes (truncated?)", source=str(path)) from None
        with zf:
            names = {i.filename: i for i in zf.infolist()}
            head = names.get("header.json") or names.get("_journal/start.json")
            if head is None:
                raise CJEInputError("is not an Inspect .eval log: neither header.json nor _journal/start.json",
                                    source=str(path))
            header = _member_json(path, zf, head)
            spec = header.get("eval")
            status = header.get("status")
            if head.filename != "header.json" or status not in (None, "success"):
                yield Note(f"logs of runs that did not finish (status {status or 'started'}): their logged samples "
                           "imported")
            if not isinstance(spec, dict):
                raise CJEInputError(f"member {head.filename}: field 'eval' is not the eval spec object",
                                    source=str(path))
            members = sorted((n for n in names if n.startswith("samples/") and n.endswith(".json")))
            if not members:
                yield Note(f"{path.name}: no samples (a log written with log_samples=False, or a run that "
                           "stopped before its first sample)")
                return
            for n in members:
                yield spec, _member_json(path, zf, names[n]), f"member {n}"

    def _json(self, path: Path) -> Iterator[tuple[dict, Any, str] | Note]:
        """``(eval spec, sample, where)`` of a JSON log, one sample at a time."""
        seen = False
        spec: dict | None = None
        for i, (key, ctx, item) in enumerate(iter_json(path, {"samples": ["*"]})):
            if key != "samples":
                raise CJEInputError("is not an Inspect log with samples: no 'samples' list (expected inspect "
                                    "eval --log-format json, with log_samples on)", source=str(path))
            seen = True
            if spec is None:
                spec = ctx[0].get("eval") if ctx else None
                status = ctx[0].get("status") if ctx else None
                if status not in (None, "success"):
                    yield Note(f"logs of runs that did not finish (status {status}): their logged samples imported")
                if not isinstance(spec, dict):
                    raise CJEInputError("is not an Inspect log: no 'eval' spec before its samples",
                                        source=str(path))
            yield spec, item, f"samples[{i}]"
        if not seen:
            raise CJEInputError("is not an Inspect log with samples: no 'samples' list (expected inspect eval "
                                "--log-format json, with log_samples on)", source=str(path))

    def _record(self, path: Path, pos: int, spec: dict, s: dict, where: str) -> tuple[SourceRecord, int]:
        sid = s.get("id")
        if sid is None or isinstance(sid, bool) or not isinstance(sid, (str, int)):
            raise bad_record(path, pos, "id", f"a sample id (text or integer) ({where})")
        epoch = s.get("epoch", 1)
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise bad_record(path, pos, "epoch", f"an integer ({where})")
        scores, edited = sample_scores(path, pos, where, s.get("scores"))
        try:
            ts = parse_ts(s.get("started_at")) or parse_ts(spec.get("created"))
        except (ValueError, TypeError):
            raise bad_record(path, pos, "started_at", f"an ISO-8601 timestamp ({where})") from None
        eval_id = spec.get("eval_id") or spec.get("run_id") or spec.get("task_id")
        rid = f"{eval_id}/{sid}/{epoch}" if eval_id else None
        out = s.get("output")
        response = out.get("completion") if isinstance(out, dict) else None
        extra = {k: v for k, v in (("eval_id", spec.get("eval_id")), ("task", spec.get("task")),
                                   ("epoch", epoch), ("target", s.get("target"))) if v is not None}
        rec = SourceRecord(pos, rid, ts, _Fields(spec, s), scores, prompt=message_text(s.get("input"), last_user=True),
                           response=response if isinstance(response, str) else None, extra=extra)
        return rec, edited
