"""Gated, atomic, idempotent publishing of evaluation results.

Layout under the storage root::

    results/<evaluation>/latest.json                          pointer to the newest published run
    results/<evaluation>/<window>/<run_key>/manifest.json     the commit: written last, create-only
    results/<evaluation>/<window>/<run_key>/<attempt>/        the artifacts of the committed attempt
        result.json  policies.parquet  report.html

Why an attempt folder: object stores have no atomic rename, so a multi-object result cannot be
moved into place.  Each publisher writes its artifacts under its own attempt id
(``<UTC time>-<random>``) and then *commits* by creating ``manifest.json`` with
`Storage.put_if_absent` (an ``If-None-Match: *`` PUT on S3, a hard link locally).  The manifest
lists every artifact with its key, size and sha256, plus the caller's lineage.  Consequences:

* A reader never sees a partial result: a run exists only once its manifest exists, and the
  manifest is created after every artifact it names.  Attempt folders without a manifest
  (crashed or losing publishers) are invisible to `list_runs` / `read_latest` and removed by
  `cleanup_orphans` (or by the next publish of the same run key).
* Exactly one result per run key: of concurrent publishers (threads, processes or hosts) only
  one creates the manifest; the others get ``PublishOutcome(published=False, reason="already
  published")`` and delete their attempt folder.  The same holds for reruns.
* A lost acknowledgement of the commit (the manifest was stored, the response was lost, the
  client's retry answered ``412`` or the call failed) is recognised by reading the manifest back:
  if it is ours byte for byte the publish completes normally.  Artifacts that a stored manifest
  names are never deleted (when the manifest cannot be read back nothing is deleted: uncommitted
  attempts are invisible and removed later by `cleanup_orphans`).  A manifest whose artifacts are
  missing (left by an older publisher) is a broken commit: the next publish of the run writes the
  artifacts again under a new attempt and replaces the manifest by compare-and-swap on its attempt
  id, keeping its ``published_at`` and adding ``repaired_at`` (reason ``"republished"``).
* ``latest.json`` is (re)written only after the manifest exists; a publisher that died between
  the two is repaired by the next publish call for that run.  What a reader of ``latest.json``
  sees: a complete pointer (one atomic object write) to a committed run, and over time only runs
  that are newer or equal by `publication_order`: the window's end and start dates, then the
  label-store version the run read, and only between runs of the same window and labels the
  ``published_at`` of the publisher's UTC clock (so a clock running ahead, or an older run finishing
  later, never moves it back).  The pointer moves by compare-and-swap on that order (`_compare_and_swap`: an exclusive lock on the
  folder for local storage, a conditional PUT with ``If-Match: <ETag>`` on S3), so of racing
  publishers the newest publication always ends in the pointer.  On S3 endpoints without
  conditional writes (``conditional_writes="emulated"``) the swap is read-compare-write and a
  racing older publisher can win until the next publish.  Of two publications with the same
  ``published_at`` (microseconds) either may end in the pointer (both are complete).
* Temporary files (``.cje-tmp-*``, local storage) of a writer killed mid-write are invisible to
  readers (listings skip them) and are removed by the next publish of the evaluation once older
  than 60 s (`clean_temp_files`).
* Storage renders nothing: after a commit the caller rebuilds ``results/index.html`` and
  ``results/<evaluation>/trend.html`` (the evaluate flow's `flows.pipelines.pages` step).

Reading back: `read_run` (and so `read_latest`, `cje diff`, `cje plan --evaluation`, the run history)
checks ``result.json`` against the sha256 its manifest records, and `read_result_file` does the same for
a local ``result.json`` given to `cje gate`; a mismatch is `ChecksumMismatch` (a `CJEInputError`, exit 2)
naming the file, and the result is never used.

Gate: before anything is written, ``result.json`` is checked (`check_result_gate`): every
policy whose ``level_claim`` is ``"refused"`` must carry non-empty ``refusal_reasons``, level
claims must be ``ok`` or ``refused``, ``best_policy`` must not be refused, and when
``policies.parquet`` has ``policy``/``level_claim`` columns they must agree with ``result.json``.
Artifacts are stored byte for byte; nothing is stripped.  One exception: given a `ReportRenderer`
(the evaluate flow gives `flows.pipelines.pages.contextual_report`), ``report.html`` is rendered again
from ``result.json`` with the run's context (generated-at time, links to result.json, the previous run,
the trend page and the index, what changed since the previous run, the drift of linked monitors), which
needs the attempt id only the publisher knows; if that fails the caller's report is stored unchanged.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from pathlib import Path, PurePath
from typing import Any, Iterable, Mapping, Protocol

from cje_engine.errors import CJEInputError
from cje_engine.result import validate_result

from flows.storage.arrow_threads import read_parquet_bytes
from flows.storage.local import LocalStorage
from flows.storage.s3 import S3Storage
from flows.storage.objects import (TMP_PREFIX, NotFoundError, ObjectInfo, Storage,
                                  StorageError)

log = logging.getLogger(__name__)

RESULTS = "results"
MANIFEST = "manifest.json"
LATEST = "latest.json"
MANIFEST_VERSION = 1
#: Keys the publisher adds to the caller's manifest dict.
RESERVED = ("manifest_version", "evaluation", "window", "run_key", "attempt", "published_at", "repaired_at",
            "artifacts")
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}$")
_ATTEMPT = re.compile(r"^(\d{8}T\d{6}Z)-[0-9a-f]{8}$")
_WINDOW_DATES = re.compile(r"^(\d{4}-\d{2}-\d{2})_(\d{4}-\d{2}-\d{2})$")


class PublishGateError(CJEInputError):
    """The result would publish a refused level claim without reasons (or is otherwise unsafe)."""


@dataclass(frozen=True)
class RunPlace:
    """Where a run is being published: its path segments and the attempt folder its artifacts go to."""

    evaluation: str
    window: str
    key: str
    attempt: str


class ReportRenderer(Protocol):
    """Renders a run's ``report.html`` again at publish time (given to `publish_run` by the caller, so
    storage renders nothing itself: `flows.pipelines.pages.contextual_report`)."""

    def __call__(self, st: Storage, run: RunPlace, result: Mapping[str, Any], report: bytes,
                 manifest: Mapping[str, Any]) -> bytes:
        """The new ``report.html`` bytes (raising keeps the caller's report)."""


@dataclass(frozen=True)
class PublishOutcome:
    """What `publish_run` did.

    Attributes
    ----------
    published : bool
        True if this call committed the run.
    path : str
        Location of the run folder (``.../results/<evaluation>/<window>/<run_key>``).
    reason : str
        ``"published"``, ``"already published"`` or ``"republished"`` (a manifest whose artifacts were
        missing was replaced; ``published`` is True).
    artifacts : dict
        Artifact name -> location of the committed artifact (also when already published).
    """

    published: bool
    path: str
    reason: str
    artifacts: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- helpers


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (datetime, date)):
        return obj.isoformat()
    if isinstance(obj, PurePath):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return obj.item()
    if hasattr(obj, "tolist") and callable(obj.tolist):  # numpy arrays
        return obj.tolist()
    if hasattr(obj, "_asdict"):
        return obj._asdict()
    raise TypeError(f"value of type {type(obj).__name__} is not JSON serialisable")


def canonical_json(value: Any) -> str:
    """Deterministic JSON (sorted keys, no spaces, no NaN) used for hashing."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False, default=_json_default)


def run_key(config_dict: Mapping[str, Any], input_fingerprint: Any) -> str:
    """Stable 20-hex-digit key: same configuration and inputs -> same key.

    Both arguments must be JSON data (dicts, lists, strings, numbers, booleans, None; dates,
    paths and numpy scalars are converted).  Key order of dicts does not matter.
    """
    try:
        text = canonical_json({"config": config_dict, "inputs": input_fingerprint})
    except (TypeError, ValueError) as exc:
        raise CJEInputError(f"run_key needs JSON data for the configuration and inputs: {exc}") from None
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def fingerprint_inputs(files: Iterable[ObjectInfo], label_version: int | None = None) -> dict[str, Any]:
    """Lineage of the inputs: every file with size and ETag/mtime, plus the label-store version."""
    return {
        "files": [{"key": f.key, "size": int(f.size), "etag_or_mtime": f.etag_or_mtime}
                  for f in sorted(files, key=lambda f: f.key)],
        "label_store_version": label_version,
    }


def check_segment(value: str, what: str) -> str:
    """``value`` if it is a valid result-path segment (an evaluation, window or run key), else a
    `CJEInputError` naming ``what``: 1-200 letters, digits and ``. _ = + -``, starting with a letter or digit."""
    if not isinstance(value, str) or not _SEGMENT.match(value) or value in (".", ".."):
        raise CJEInputError(f"{what} {value!r} must be 1-200 characters of letters, digits and . _ = + - "
                            "(starting with a letter or digit)")
    return value


def run_prefix(evaluation: str, window: str, key: str) -> str:
    """Storage prefix of one run: ``results/<evaluation>/<window>/<run key>`` (each segment checked)."""
    return (f"{RESULTS}/{check_segment(evaluation, 'evaluation name')}/{check_segment(window, 'window')}/"
            f"{check_segment(key, 'run key')}")


def _new_attempt() -> str:
    return f"{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(4)}"


def _attempt_age_seconds(attempt: str) -> float | None:
    m = _ATTEMPT.match(attempt)
    if not m:
        return None
    started = datetime.strptime(m.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - started).total_seconds()


# --------------------------------------------------------------------------- gate


def check_result_gate(result: Mapping[str, Any], policy_table: bytes | None = None) -> None:
    """Raise `PublishGateError` unless the result is safe to publish (see module docstring): the
    engine's `cje_engine.result.validate_result` (rules and schema), then the policy table."""
    try:
        validate_result(result)
    except PublishGateError:
        raise
    except CJEInputError as exc:
        raise PublishGateError(f"{exc.detail}; refusing to publish",
                               source="result.json", column=(exc.column or "").rsplit(".", 1)[-1] or None) from None
    if policy_table is not None:
        _check_policy_table(policy_table, {str(n): p["level_claim"] for n, p in result["policies"].items()})


def _check_policy_table(data: bytes, claims: dict[str, str]) -> None:
    try:
        table = read_parquet_bytes(data)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a gate failure
        raise PublishGateError(f"policies.parquet is not readable Parquet: {exc}", source="policies.parquet") from None
    if not {"policy", "level_claim"} <= set(table.column_names):
        return
    for row, (name, claim) in enumerate(zip(table.column("policy").to_pylist(),
                                            table.column("level_claim").to_pylist())):
        if name in claims and claims[name] != claim:
            raise PublishGateError(f"policy {name!r} is {claims[name]!r} in result.json but {claim!r} here",
                                   source="policies.parquet", column="level_claim", row=row)


# --------------------------------------------------------------------------- publish


def _read_json(st: Storage, key: str) -> dict | None:
    try:
        return json.loads(st.read_bytes(key))
    except NotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        log.warning("ignoring unreadable JSON object %s", st.url(key))
        return None


def _artifact_urls(st: Storage, run: str, manifest: Mapping[str, Any]) -> dict[str, str]:
    return {name: st.url(f"{run}/{a['key']}") for name, a in (manifest.get("artifacts") or {}).items()}


def _check_publish_input(evaluation: str, window: str, key: str, artifacts: dict[str, Any],
                         manifest: Mapping[str, Any]) -> dict:
    """Artifact names and types, the result gate and the caller's manifest keys; returns the parsed result."""
    for name, data in artifacts.items():
        if not isinstance(name, str) or "/" in name or name in (MANIFEST, LATEST) or not _SEGMENT.match(name):
            raise CJEInputError(f"artifact name {name!r} must be a plain file name other than {MANIFEST}/{LATEST}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CJEInputError(f"artifact {name!r} must be bytes, got {type(data).__name__}")
    if "result.json" not in artifacts:
        raise CJEInputError("artifacts must include result.json")
    try:
        result = json.loads(bytes(artifacts["result.json"]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise PublishGateError(f"result.json is not valid JSON: {exc}", source="result.json") from None
    check_result_gate(result, bytes(artifacts["policies.parquet"]) if "policies.parquet" in artifacts else None)
    for reserved in RESERVED:
        if reserved in manifest and reserved not in ("evaluation", "window", "run_key"):
            raise CJEInputError(f"manifest key {reserved!r} is reserved for the publisher")
    for name, value in (("evaluation", evaluation), ("window", window), ("run_key", key)):
        if name in manifest and manifest[name] != value:
            raise CJEInputError(f"manifest {name}={manifest[name]!r} disagrees with the published {name} {value!r}")
    return result


def publish_run(
    st: Storage,
    evaluation: str,
    window: str,
    key: str,
    artifacts: Mapping[str, bytes],
    manifest: Mapping[str, Any],
    render_report: ReportRenderer | None = None,
) -> PublishOutcome:
    """Publish one run (see module docstring); idempotent and safe under concurrent publishers.

    Parameters
    ----------
    st : Storage
    evaluation, window, key : str
        Path segments; ``key`` normally comes from `run_key`.
    artifacts : dict of str -> bytes
        Must contain ``result.json``; usually also ``policies.parquet`` and ``report.html``.
    manifest : dict
        Caller's lineage (input files, row counts, label-store version, configuration hash,
        code version, seed, ...).  The publisher adds `RESERVED` keys: timestamps, the attempt
        id and, per artifact, key, size and sha256.
    render_report : ReportRenderer, optional
        Renders ``report.html`` again once the attempt id is known (the run's context: links, the
        previous run); a failure keeps the caller's report.  None: artifacts are stored as given.

    Raises
    ------
    PublishGateError
        The result fails the gate; nothing is written.
    StorageError
        Storage failed; whatever this call wrote is removed again (best effort) and nothing
        is visible to readers.
    """
    run = run_prefix(evaluation, window, key)
    artifacts = dict(artifacts)
    result = _check_publish_input(evaluation, window, key, artifacts, manifest)
    _refuse_credentials(st, artifacts, manifest)

    manifest_key = f"{run}/{MANIFEST}"
    existing = _read_json(st, manifest_key)
    if existing is not None:
        missing = _missing_artifacts(st, run, existing)
        if not missing:
            _advance_latest(st, evaluation, existing, manifest_key)
            log.info("run %s already published; nothing written", st.url(run))
            return PublishOutcome(False, st.url(run), "already published", _artifact_urls(st, run, existing))
        log.warning("run %s has a manifest whose artifacts are missing (%s): publishing it again",
                    st.url(run), ", ".join(st.url(k) for k in missing))

    attempt = _new_attempt()
    if render_report is not None and "report.html" in artifacts:
        artifacts["report.html"] = _rendered_report(render_report, st, RunPlace(evaluation, window, key, attempt),
                                                    result, bytes(artifacts["report.html"]), manifest)
    written: list[str] = []
    committed = False
    try:
        entries = {}
        for name, data in artifacts.items():
            rel = f"{attempt}/{name}"
            blob = bytes(data)
            st.write_bytes(f"{run}/{rel}", blob)
            written.append(f"{run}/{rel}")
            entries[name] = {"key": rel, "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
        full = {**manifest, "manifest_version": MANIFEST_VERSION, "evaluation": evaluation, "window": window,
                "run_key": key, "attempt": attempt, "published_at": datetime.now(timezone.utc).isoformat(),
                "artifacts": entries}
        if existing is not None:  # a repair keeps the run's place in the history
            full.update(published_at=existing.get("published_at") or full["published_at"],
                        repaired_at=datetime.now(timezone.utc).isoformat())
        try:
            body = json.dumps(full, indent=1, sort_keys=True, allow_nan=False, default=_json_default).encode()
        except (TypeError, ValueError) as exc:
            raise CJEInputError(f"manifest must be JSON data: {exc}") from None
        committed = _commit(st, manifest_key, body, existing)
    finally:
        if not committed:
            _remove_unreferenced(st, run, manifest_key, written)

    # Read the commit back: with emulated conditional writes (servers without If-None-Match)
    # a racing writer could have replaced it; the stored manifest decides who owns the run.
    stored = _read_json(st, manifest_key) if committed else None
    if stored is None or stored.get("attempt") != attempt:
        stored = stored or _read_json(st, manifest_key) or {}
        if committed:
            log.warning("manifest of %s was replaced by attempt %s (storage without atomic create-only writes)",
                        st.url(run), stored.get("attempt"))
            _remove_unreferenced(st, run, manifest_key, written)
        else:
            log.info("run %s was published concurrently by attempt %s", st.url(run), stored.get("attempt"))
        _advance_latest(st, evaluation, stored, manifest_key)
        return PublishOutcome(False, st.url(run), "already published", _artifact_urls(st, run, stored))
    _advance_latest(st, evaluation, full, manifest_key)
    _remove_other_attempts(st, run, attempt)
    clean_temp_files(st, evaluation)
    log.info("%s %s (attempt %s)", "republished" if existing is not None else "published", st.url(run), attempt)
    return PublishOutcome(True, st.url(run), "republished" if existing is not None else "published",
                          _artifact_urls(st, run, full))


def _missing_artifacts(st: Storage, run: str, manifest: Mapping[str, Any]) -> list[str]:
    """Keys of the artifacts a stored manifest names that do not exist (a broken commit)."""
    arts = manifest.get("artifacts")
    if not isinstance(arts, dict) or not arts:
        return [f"{run}/{MANIFEST}"]
    missing = []
    for entry in arts.values():
        rel = entry.get("key") if isinstance(entry, dict) else None
        if not isinstance(rel, str) or not st.exists(f"{run}/{rel}"):
            missing.append(f"{run}/{rel}")
    return missing


def _stored_manifest_is(st: Storage, manifest_key: str, body: bytes) -> bool | None:
    """Whether the stored manifest is ``body`` byte for byte (or by sha256 of its parsed content);
    None when it cannot be read (then nobody can tell whose it is)."""
    try:
        raw = st.read_bytes(manifest_key)
    except NotFoundError:
        return False
    except StorageError as exc:
        log.warning("could not read back %s: %s", st.url(manifest_key), exc)
        return None
    if raw == body:
        return True
    parsed = _parse(raw)
    return parsed is not None and canonical_json(parsed) == canonical_json(json.loads(body))


def _commit(st: Storage, manifest_key: str, body: bytes, broken: Mapping[str, Any] | None) -> bool:
    """Create the manifest (create-only), or replace a broken one (compare-and-swap on its attempt).

    A lost acknowledgement (the object was stored, the response was lost, the retried conditional
    write answered 412, or the call raised) is recognised by reading the manifest back: if it is
    ours byte for byte the commit happened.
    """
    try:
        if broken is None:
            done = st.put_if_absent(manifest_key, body)
        else:
            same = broken.get("attempt")
            done = _compare_and_swap(st, manifest_key,
                                     lambda cur: cur is not None and cur.get("attempt") == same, body)
    except StorageError:
        if _stored_manifest_is(st, manifest_key, body):
            log.warning("the write of %s reported a failure but the stored manifest is ours: committed",
                        st.url(manifest_key))
            return True
        raise
    if done:
        return True
    if _stored_manifest_is(st, manifest_key, body):
        log.warning("the create-only write of %s was refused but the stored manifest is ours (a lost "
                    "acknowledgement and a retried request): committed", st.url(manifest_key))
        return True
    return False


def _remove_unreferenced(st: Storage, run: str, manifest_key: str, written: list[str]) -> None:
    """Delete what this attempt wrote, except objects the stored manifest names (best effort).

    When the stored manifest cannot be read nothing is deleted: it may be ours, and uncommitted
    attempts are invisible to readers and removed later by `cleanup_orphans`.
    """
    if not written:
        return
    try:
        raw = st.read_bytes(manifest_key)
    except NotFoundError:
        raw = None
    except StorageError as exc:
        log.warning("kept %d object(s) of an uncommitted attempt of %s: the manifest could not be read (%s)",
                    len(written), st.url(run), exc)
        return
    stored = _parse(raw) or {}
    referenced = {f"{run}/{a.get('key')}" for a in (stored.get("artifacts") or {}).values() if isinstance(a, dict)}
    for k in written:
        if k in referenced:
            continue
        try:
            st.delete(k)
        except StorageError as exc:
            log.warning("could not remove %s after a failed publish: %s", st.url(k), exc)


def _refuse_credentials(st: Storage, artifacts: Mapping[str, bytes], manifest: Mapping[str, Any]) -> None:
    """Never publish a storage credential (e.g. a configuration dict copied into the lineage)."""
    creds = [c for c in st.config.secrets() if len(c) >= 8]
    if not creds:
        return
    try:
        manifest_text = json.dumps(manifest, default=_json_default)
    except (TypeError, ValueError):
        manifest_text = repr(manifest)
    blobs = {name: bytes(data) for name, data in artifacts.items()}
    blobs[MANIFEST] = manifest_text.encode()
    for name, blob in blobs.items():
        if any(c.encode() in blob for c in creds):
            raise PublishGateError("contains a storage credential; refusing to publish it", source=name)


def publication_order(manifest: Mapping[str, Any]) -> list[Any]:
    """The key by which runs of an evaluation are ordered for ``latest.json`` (larger is newer).

    ``[window end, window start, label-store version, published_at]``: the run's identity first (its
    window's dates, from ``window_spec`` or a ``YYYY-MM-DD_YYYY-MM-DD`` window label; then the version of
    the label store it read), the publisher's clock only between runs of the same window and labels.
    So a publisher whose clock runs ahead, or a run that finishes later but evaluated an older window or
    older labels, never moves the pointer back.  Windows that are not dates compare equal.

    Parameters
    ----------
    manifest : mapping
        A run's manifest (or a ``latest.json`` pointer, which carries the key as ``order``).

    Returns
    -------
    list
        Comparable lists (strings and an int).
    """
    if isinstance(manifest.get("order"), list) and len(manifest["order"]) == 4:
        return list(manifest["order"])
    spec = manifest.get("window_spec") if isinstance(manifest.get("window_spec"), Mapping) else {}
    start, end = str(spec.get("start") or ""), str(spec.get("end") or "")
    if not (start and end):
        m = _WINDOW_DATES.match(str(manifest.get("window") or ""))
        start, end = (m.group(1), m.group(2)) if m else ("", "")
    labels = manifest.get("labels") if isinstance(manifest.get("labels"), Mapping) else {}
    version = labels.get("label_store_version", manifest.get("label_store_version"))
    try:
        version = int(version)
    except (TypeError, ValueError):
        version = -1
    return [end, start, version, str(manifest.get("published_at") or "")]


def _advance_latest(st: Storage, evaluation: str, manifest: Mapping[str, Any], manifest_key: str) -> None:
    """Point latest.json at this run unless it already points at a newer one (`publication_order`).

    A compare-and-swap on the order: the pointer is replaced only if, at the instant of the write, it
    still holds what was read (a directory lock locally, ``If-Match`` on the ETag on S3), so of two
    racing publishers the newer run always ends in the pointer.  A pointer written before the order
    existed is ordered by its run's manifest.
    """
    if not manifest.get("published_at"):
        return
    pointer_key = f"{RESULTS}/{evaluation}/{LATEST}"
    order = publication_order(manifest)
    pointer = {
        "evaluation": evaluation,
        "window": manifest.get("window"),
        "run_key": manifest.get("run_key"),
        "manifest": manifest_key,
        "published_at": manifest["published_at"],
        "order": order,
    }
    body = json.dumps(pointer, indent=1, sort_keys=True).encode()

    def wanted(current: dict | None) -> bool:
        if current is None:
            return True
        if current.get("manifest") == manifest_key and current.get("published_at") == manifest["published_at"]:
            return current.get("order") != order  # the same run: only to add the order to an old pointer
        return _pointer_order(st, current) <= order

    _compare_and_swap(st, pointer_key, wanted, body)


def _pointer_order(st: Storage, pointer: Mapping[str, Any]) -> list[Any]:
    """The order of the run a ``latest.json`` points at (read from its manifest for an old pointer)."""
    if isinstance(pointer.get("order"), list):
        return publication_order(pointer)
    stored = _read_json(st, str(pointer.get("manifest"))) if pointer.get("manifest") else None
    return publication_order(stored if stored is not None else pointer)


def _parse(raw: bytes | None) -> dict | None:
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _compare_and_swap(st: Storage, key: str, wanted: Any, body: bytes, attempts: int = 20) -> bool:
    """Write ``body`` to ``key`` if ``wanted(current document)``, atomically with respect to other
    callers of this function. Returns True if written."""
    if isinstance(st, LocalStorage):
        folder = st.url(key).rsplit("/", 1)[0]
        os.makedirs(folder, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if the process dies
            try:
                current = _parse(st.read_bytes(key))
            except NotFoundError:
                current = None
            if not wanted(current):
                return False
            st.write_bytes(key, body)
            return True
        finally:
            os.close(fd)
    if isinstance(st, S3Storage) and st.config.conditional_writes != "emulated":
        return _s3_compare_and_swap(st, key, wanted, body, attempts)
    # no conditional writes: read-compare-write (a racing writer may win; see the module docstring)
    if not wanted(_read_json(st, key)):
        return False
    st.write_bytes(key, body)
    return True


def _s3_compare_and_swap(st: "S3Storage", key: str, wanted: Any, body: bytes, attempts: int) -> bool:
    """`_compare_and_swap` on S3: read the object and its ETag, PUT with ``If-Match`` (``If-None-Match: *`` when
    absent), read again on 412.

    Ceph radosgw compares ``If-Match`` on PUT with the ETag *without* its quotes (a quoted ETag, as AWS and
    the ``ETag`` header give it, always answered 412: observed on the stack, where every replacement of a
    ``latest.json`` failed with "the pointer kept changing"). A 412 while the object's ETag is unchanged is
    that refusal, not a racing writer: the ETag is then sent the other way (unquoted, or quoted) and kept so.
    """
    from botocore.exceptions import ClientError

    full = st._full(key)  # the bucket key of a storage key (S3Storage's own mapping)
    unquoted = False
    for attempt in range(attempts):
        try:
            got = st.client.get_object(Bucket=st.bucket, Key=full)
            raw, etag = got["Body"].read(), got["ETag"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("NoSuchKey", "404"):
                raise StorageError(f"read {st.url(key)} failed: {exc}", key=key, operation="read") from None
            raw, etag = None, None
        if not wanted(_parse(raw)):
            return False
        sent = (etag.strip('"') if unquoted else etag) if etag else None
        cond = {"IfMatch": sent} if etag else {"IfNoneMatch": "*"}
        try:
            st.client.put_object(Bucket=st.bucket, Key=full, Body=body, **cond)
            return True
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code")
            if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                if etag and _s3_etag(st, full) == etag:  # unchanged: the endpoint refused this spelling
                    unquoted = not unquoted
                    continue
                time.sleep(0.02 * (attempt + 1))  # another publisher moved the pointer: read again
                continue
            raise StorageError(f"write {st.url(key)} failed: {exc}", key=key, operation="write") from None
    raise StorageError(f"write {st.url(key)} failed: the pointer kept changing over {attempts} attempts",
                       key=key, operation="write")


def _s3_etag(st: "S3Storage", full: str) -> str | None:
    """The current ETag of bucket key ``full`` (None when absent or unreadable)."""
    try:
        return st.client.head_object(Bucket=st.bucket, Key=full)["ETag"]
    except Exception:  # noqa: BLE001 - unknown: treated as changed (read again)
        return None


def clean_temp_files(st: Storage, evaluation: str, older_than_seconds: float = 60.0) -> int:
    """Remove temporary files (``.cje-tmp-*``) of writers that died (kill -9) under ``results/``.

    Local storage only (S3 writes have no temporary objects). A temporary file lives for the
    milliseconds of one write; one older than ``older_than_seconds`` has no live writer.
    """
    if not isinstance(st, LocalStorage):
        return 0
    now = time.time()
    top = Path(st.url(RESULTS))
    candidates = [p for p in top.glob(f"{TMP_PREFIX}*")]  # the index's
    candidates += (top / check_segment(evaluation, "evaluation name")).rglob(f"{TMP_PREFIX}*")
    removed = 0
    for path in candidates:
        try:
            if path.is_file() and now - path.stat().st_mtime >= older_than_seconds:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            continue  # its writer finished meanwhile
    if removed:
        log.info("removed %d temporary file(s) left by killed writers under %s", removed, top)
    return removed


def _rendered_report(render: ReportRenderer, st: Storage, run: RunPlace, result: Mapping[str, Any],
                     report: bytes, manifest: Mapping[str, Any]) -> bytes:
    """``report.html`` rendered again by the caller's `ReportRenderer`; the caller's report is kept (and a
    warning logged) when that fails."""
    try:
        return render(st, run, result, report, manifest)
    except Exception as exc:  # noqa: BLE001 - context is an addition; the caller's report stays valid
        log.warning("report of %s/%s/%s published without run context: %s", run.evaluation, run.window, run.key,
                    exc)
        return report


def _remove_other_attempts(st: Storage, run: str, committed_attempt: str) -> int:
    """After a commit every other attempt folder of the run is garbage (losers, crashed publishers).

    A loser still writing may recreate some of its objects; it deletes them itself when its
    commit fails.
    """
    removed = 0
    for info in st.list(f"{run}/"):
        rest = info.key[len(run) + 1:]
        if "/" in rest and rest.split("/", 1)[0] != committed_attempt:
            try:
                st.delete(info.key)
                removed += 1
            except StorageError as exc:
                log.warning("could not remove %s: %s", st.url(info.key), exc)
    return removed


# --------------------------------------------------------------------------- steps after the commit

#: Manifest key: the steps the publisher's flow owes after the commit (e.g. ``["notify"]``).  Each step's
#: completion is recorded beside the manifest as ``done-<step>.json`` (create-only), so a flow killed
#: between the commit and a step, then retried, finds the step still due ("already published" runs
#: included) and does it once; a run whose manifest lists no steps (older publishers) owes none.
FOLLOWUPS = "followups"
_STEP = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def _followup_key(evaluation: str, window: str, key: str, step: str) -> str:
    if not isinstance(step, str) or not _STEP.match(step):
        raise CJEInputError(f"follow-up step {step!r} must be 1-64 lower-case letters, digits and _")
    return f"{run_prefix(evaluation, window, key)}/done-{step}.json"


def followup_due(st: Storage, evaluation: str, window: str, key: str, step: str) -> bool:
    """Whether the published run still owes ``step``: its manifest lists it and no completion is recorded.

    Parameters
    ----------
    st : Storage
        The results root.
    evaluation, window, key : str
        The run.
    step : str
        A step name of the manifest's ``followups`` (``notify``, ``regression_alarms``).

    Returns
    -------
    bool
        False for a manifest without ``followups`` (an older publisher's run: nothing owed) and once the
        step is recorded; True when no manifest can be read (nothing says it was done).
    """
    done_key = _followup_key(evaluation, window, key, step)
    manifest = _read_json(st, f"{run_prefix(evaluation, window, key)}/{MANIFEST}")
    if manifest is not None and step not in (manifest.get(FOLLOWUPS) or ()):
        return False
    return not st.exists(done_key)


def record_followup(st: Storage, evaluation: str, window: str, key: str, step: str,
                    detail: Mapping[str, Any] | None = None) -> bool:
    """Record that ``step`` of the run was done (create-only: the first record stays).

    Parameters
    ----------
    st : Storage
        The results root.
    evaluation, window, key : str
        The run.
    step : str
        The step done.
    detail : mapping, optional
        What the step did (e.g. the number of notifications), stored in the record.

    Returns
    -------
    bool
        True if this call wrote the record, False if one existed.
    """
    body = {"step": step, "done_at": datetime.now(timezone.utc).isoformat(), **dict(detail or {})}
    return bool(st.put_if_absent(_followup_key(evaluation, window, key, step),
                                 json.dumps(body, indent=1, sort_keys=True, default=_json_default).encode()))


# --------------------------------------------------------------------------- reading


def list_runs(st: Storage, evaluation: str, window: str | None = None) -> list[dict[str, Any]]:
    """Published runs (those with a manifest), oldest publication first.

    Each item: evaluation, window, run_key, path, published_at, manifest (the dict).
    """
    base = f"{RESULTS}/{check_segment(evaluation, 'evaluation name')}/"
    if window is not None:
        base += f"{check_segment(window, 'window')}/"
    runs = []
    for info in st.list(base):
        parts = info.key.split("/")
        if len(parts) != 5 or parts[-1] != MANIFEST:
            continue
        manifest = _read_json(st, info.key)
        if manifest is None:
            continue
        run = "/".join(parts[:-1])
        runs.append({"evaluation": parts[1], "window": parts[2], "run_key": parts[3], "path": st.url(run),
                     "published_at": manifest.get("published_at"), "manifest": manifest})
    runs.sort(key=lambda r: (str(r["published_at"]), r["window"], r["run_key"]))
    return runs


def read_run(st: Storage, evaluation: str, window: str, key: str) -> dict[str, Any] | None:
    """A published run: manifest, parsed result.json and artifact locations; None if unpublished."""
    run = run_prefix(evaluation, window, key)
    manifest = _read_json(st, f"{run}/{MANIFEST}")
    if manifest is None:
        return None
    arts = manifest.get("artifacts") or {}
    result = None
    if "result.json" in arts:
        key_json = f"{run}/{arts['result.json']['key']}"
        raw = st.read_bytes(key_json)
        _check_artifact(raw, arts["result.json"], st.url(key_json), st.url(f"{run}/{MANIFEST}"))
        result = json.loads(raw)
    return {"evaluation": evaluation, "window": window, "run_key": key, "path": st.url(run),
            "published_at": manifest.get("published_at"), "manifest": manifest, "result": result,
            "artifacts": _artifact_urls(st, run, manifest)}


class ChecksumMismatch(CJEInputError):
    """A published artifact whose bytes do not match the sha256 its manifest records (exit 2)."""


def _check_artifact(raw: bytes, entry: Mapping[str, Any], source: str, manifest_url: str) -> None:
    """Raise `ChecksumMismatch` (naming ``source``) unless ``raw`` has the manifest entry's sha256."""
    got, want = hashlib.sha256(raw).hexdigest(), str(entry.get("sha256"))
    if got != want:
        raise ChecksumMismatch(
            f"checksum mismatch: sha256 of the {len(raw)} bytes is {got[:16]}..., the manifest {manifest_url} "
            f"records {want[:16]}... ({entry.get('size')} bytes); the published file was changed after "
            "publishing and is not used", source=source)


@dataclass(frozen=True)
class ResultFile:
    """A ``result.json`` read from a local path by `read_result_file`.

    Attributes
    ----------
    result : dict
        The parsed result.
    manifest : str or None
        The manifest it was verified against; None for a bare result (no manifest beside it).
    """

    result: dict
    manifest: str | None

    @property
    def verified(self) -> bool:
        """Whether the file was checked against its run's manifest."""
        return self.manifest is not None


def read_result_file(path: str | os.PathLike) -> ResultFile:
    """Read a local ``result.json``, verified against the manifest of its published run if it has one.

    A published result lies at ``<run>/<attempt>/result.json`` with the run's ``manifest.json`` in
    ``<run>/`` (a copied run folder may also hold both side by side).  When such a manifest exists,
    the file must be the artifact it commits (same attempt) with the recorded sha256; a bare
    result with no manifest beside it (``cje evaluate --out``) is returned unverified.

    Raises
    ------
    CJEInputError
        Missing or unreadable file, not a JSON object, a manifest that cannot be read, a result
        from an uncommitted attempt folder, or `ChecksumMismatch` (naming the file).
    """
    src = Path(path)
    try:
        raw = src.read_bytes()
    except FileNotFoundError:
        raise CJEInputError("result file not found", source=str(src)) from None
    except OSError as exc:
        raise CJEInputError(f"not a result.json: {exc}", source=str(src)) from None
    manifest_path = _manifest_beside(src)
    if manifest_path is not None:
        _verify_against_manifest(raw, src, manifest_path)
    try:
        result = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CJEInputError(f"not a result.json: {exc}", source=str(src)) from None
    if not isinstance(result, dict):
        raise CJEInputError("not a result.json: expected a JSON object", source=str(src))
    return ResultFile(result, None if manifest_path is None else str(manifest_path))


def _manifest_beside(src: Path) -> Path | None:
    for folder in (src.parent, src.parent.parent):
        candidate = folder / MANIFEST
        if candidate.is_file() or candidate.is_symlink():
            return candidate
    return None


def _verify_against_manifest(raw: bytes, src: Path, manifest_path: Path) -> None:
    try:
        manifest = json.loads(manifest_path.read_bytes())
        entry = manifest["artifacts"][src.name]
        key = str(entry["key"])
    except (OSError, ValueError, KeyError, TypeError):
        raise CJEInputError(f"the manifest beside it ({manifest_path}) cannot be read or lists no {src.name}; "
                            "the result cannot be verified", source=str(src)) from None
    if src.parent != manifest_path.parent and key != f"{src.parent.name}/{src.name}":
        raise CJEInputError(f"not the result its run published: the manifest {manifest_path} commits {key} "
                            "(this is another attempt's folder)", source=str(src))
    _check_artifact(raw, entry, str(src), str(manifest_path))


def read_latest(st: Storage, evaluation: str) -> dict[str, Any] | None:
    """The newest published run of ``evaluation`` (see `read_run`), or None if there is none.

    Follows ``latest.json``; if it is missing or points nowhere (a publisher died between
    manifest and pointer), falls back to the newest run found by listing.
    """
    check_segment(evaluation, "evaluation name")
    pointer = _read_json(st, f"{RESULTS}/{evaluation}/{LATEST}")
    if pointer is not None:
        try:
            found = read_run(st, evaluation, str(pointer.get("window")), str(pointer.get("run_key")))
        except ChecksumMismatch:
            raise  # a changed result is an error, never replaced silently by another run
        except CJEInputError:
            found = None
        if found is not None:
            return found
        log.warning("latest.json of %s points at no published run; falling back to listing", evaluation)
    runs = list_runs(st, evaluation)
    if not runs:
        return None
    newest = max(runs, key=lambda r: publication_order(r["manifest"]))
    return read_run(st, evaluation, newest["window"], newest["run_key"])


def storage_now(st: Storage, prefix: str) -> float | None:
    """The storage's own current time (seconds since the epoch): the modification time it gives a probe
    object written under ``prefix`` (deleted again); None if it gives none."""
    probe = f"{prefix}.clock-probe-{secrets.token_hex(6)}"
    st.write_bytes(probe, b"")
    try:
        return st.info(probe).modified
    finally:
        st.delete(probe)


def cleanup_orphans(st: Storage, evaluation: str, older_than_seconds: float = 3600.0) -> int:
    """Delete attempt folders that no manifest references and that are older than the limit.

    Returns the number of objects deleted.  Young orphans are kept because their publisher
    may still be writing.  An attempt's age is measured on the storage's own clock: from the
    modification time of its newest object (S3 ``LastModified``, a file's mtime) to the time the
    storage gives a probe object written now (`storage_now`), so neither the publisher's clock (the
    attempt id's timestamp) nor this caller's matters; a publisher whose clock runs hours slow does not
    have its attempt deleted while it is still writing.  The attempt id's timestamp is used only
    when the storage gives no modification times.
    """
    base = f"{RESULTS}/{check_segment(evaluation, 'evaluation name')}/"
    runs: dict[str, set[str]] = {}
    for info in st.list(base):
        parts = info.key.split("/")
        if len(parts) >= 5:
            runs.setdefault("/".join(parts[:4]), set()).add(parts[4])
    removed = 0
    now = storage_now(st, base) if runs else None
    for run, names in runs.items():
        manifest = _read_json(st, f"{run}/{MANIFEST}") if MANIFEST in names else None
        keep = manifest.get("attempt") if manifest else None
        attempts: dict[str, list] = {}
        for info in st.list(f"{run}/"):
            rest = info.key[len(run) + 1:]
            if "/" in rest:
                attempts.setdefault(rest.split("/", 1)[0], []).append(info)
        for attempt, infos in attempts.items():
            if attempt == keep or not _ATTEMPT.match(attempt):  # only attempt folders are ours to delete
                continue
            times = [i.modified for i in infos]
            if now is not None and None not in times:
                age: float | None = now - max(times)
            else:
                age = _attempt_age_seconds(attempt)
            if age is not None and age >= older_than_seconds:
                for info in infos:
                    st.delete(info.key)
                    removed += 1
    if removed:
        log.info("removed %d orphaned object(s) under %s", removed, st.url(base))
    return removed
