"""One storage layer for local folders and S3 URIs.

``Storage.for_uri(uri, config)`` returns a `LocalStorage` for ``/path``, ``relative/path`` or
``file:///path`` and an `S3Storage` for ``s3://bucket/prefix``.  Keys are always relative to
that root and use ``/`` as separator.  Small objects go through boto3; Parquet goes through
``arrow_fs`` (a ``pyarrow.fs`` filesystem plus base path) so that ``pyarrow.dataset`` can push
projection and filters down.

Facts this module is built on (measured, see the orchestration issue):

* pyarrow's S3 filesystem ignores ``AWS_ENDPOINT_URL``; the endpoint is passed explicitly as
  ``endpoint_override``.  ``FileSystem.from_uri`` wants credentials in the user-info part, so
  ``pyarrow.fs.S3FileSystem`` is constructed explicitly from `StorageConfig`.
* Some S3 implementations (radosgw) reject the default CRC checksums of new SDKs on multipart
  uploads: boto3 gets ``request_checksum_calculation="when_required"`` in its client config and
  pyarrow's C++ SDK gets ``AWS_REQUEST_CHECKSUM_CALCULATION=when_required`` (set with
  ``setdefault`` before the first S3 filesystem is created, so a user's own value wins).

Atomic create-only writes (`Storage.put_if_absent`):

* local: the bytes go to a temporary file in the target folder, which is then hard-linked to
  the key (``os.link`` fails if the key exists; atomic on POSIX).  Where hard links are not
  supported, ``O_CREAT | O_EXCL`` is used instead.
* S3: a conditional ``PUT`` with ``If-None-Match: *`` (AWS S3, Ceph radosgw, MinIO and moto
  >= 5 honour it; a second writer gets ``412 Precondition Failed``).  With
  ``conditional_writes="auto"`` (the default) the first create-only write of a `S3Storage`
  probes once whether the server really refuses the second write; if it does not (an old
  S3 implementation ignoring the header) the storage falls back to "emulated" mode:
  ``HEAD`` then ``PUT`` then read back.  That fallback is safe against a crashed writer and
  against sequential reruns but NOT against two writers racing within milliseconds; a
  warning is logged once.

Errors: every storage failure is raised as `StorageError` (or `NotFoundError` for a missing
key) whose message names the operation and the object (``s3://bucket/key`` or the local
path) and never contains credentials: messages are built here, secrets are scrubbed from any
text taken from the underlying exception, and the original exception is not chained.
Transient failures are retried with exponential backoff: botocore's "standard" retry mode for
boto3 calls, pyarrow's ``AwsStandardS3RetryStrategy`` inside pyarrow, and `with_retries` (a
bounded retry of our own) around whole pyarrow reads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import random
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, TypeVar
from urllib.parse import urlparse

import pyarrow.fs as pafs

from cje_engine.errors import CJEInputError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Environment variables read by `StorageConfig.from_env` (first match wins within a line).
ENV_VARS: dict[str, tuple[str, ...]] = {
    "endpoint_url": ("CJE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "access_key": ("AWS_ACCESS_KEY_ID",),
    "secret_key": ("AWS_SECRET_ACCESS_KEY",),
    "session_token": ("AWS_SESSION_TOKEN",),
    "max_attempts": ("CJE_S3_MAX_ATTEMPTS",),
    "connect_timeout": ("CJE_S3_CONNECT_TIMEOUT",),
    "read_timeout": ("CJE_S3_READ_TIMEOUT",),
    "conditional_writes": ("CJE_S3_CONDITIONAL_WRITES",),
}

_SECRET_FIELDS = ("access_key", "secret_key", "session_token")
_TMP_PREFIX = ".cje-tmp-"
#: A local temporary file untouched this long belongs to a killed writer and is removed by the
#: next write into its folder (a live writer touches its file continuously).
STALE_TMP_SECONDS = 3600.0
_CONDITIONAL_MODES = ("auto", "native", "emulated")


class StorageError(RuntimeError):
    """A storage operation failed (after retries where the failure looked transient).

    Attributes
    ----------
    key : str or None
        Object key (relative to the storage root) the operation was about.
    operation : str
        What was attempted ("read", "write", "list", ...).
    """

    def __init__(self, message: str, *, key: str | None = None, operation: str = "") -> None:
        super().__init__(message)
        self.key = key
        self.operation = operation


class NotFoundError(StorageError):
    """The object does not exist."""


class ObjectInfo(NamedTuple):
    """One stored object.

    ``etag_or_mtime`` is the S3 ETag (without quotes) or, for local files,
    ``"mtime:<ISO-8601 UTC>"``.  ``modified`` is the modification time in seconds since
    the epoch (S3 ``LastModified`` or the file's mtime).
    """

    key: str
    size: int
    etag_or_mtime: str
    modified: float | None = None


# --------------------------------------------------------------------------- configuration


def _redact_endpoint(url: str | None) -> str | None:
    """Drop any ``user:password@`` part from an endpoint URL."""
    if not url:
        return url
    p = urlparse(url)
    if p.username is None and p.password is None:
        return url
    host = p.hostname or ""
    if p.port:
        host = f"{host}:{p.port}"
    return p._replace(netloc=host).geturl()


@dataclass(frozen=True)
class StorageConfig:
    """Where and how to reach object storage.

    Parameters
    ----------
    endpoint_url : str, optional
        S3 endpoint such as ``http://127.0.0.1:9000``; None means AWS itself.
    region : str, optional
        Region; None means ``us-east-1``.
    access_key, secret_key, session_token : str, optional
        Credentials; None means the standard AWS chain (environment, profile, instance role).
        Never shown by ``repr`` / ``str`` / ``to_dict()``.
    max_attempts : int
        Attempts per request (botocore standard retries, pyarrow's retry strategy and
        `with_retries`).
    connect_timeout, read_timeout : float
        Socket timeouts in seconds.
    conditional_writes : {"auto", "native", "emulated"}
        How `Storage.put_if_absent` works on S3 (see the module docstring).
    """

    endpoint_url: str | None = None
    region: str | None = None
    access_key: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    max_attempts: int = 5
    connect_timeout: float = 5.0
    read_timeout: float = 60.0
    conditional_writes: str = "auto"

    def __post_init__(self) -> None:
        if self.conditional_writes not in _CONDITIONAL_MODES:
            raise ValueError(
                f"conditional_writes must be one of {_CONDITIONAL_MODES}, got {self.conditional_writes!r}"
            )
        if int(self.max_attempts) < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")

    def __repr__(self) -> str:
        shown = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _SECRET_FIELDS:
                value = None if value is None else "***"
                shown.append(f"{f.name}={value}" if value is None else f"{f.name}='***'")
                continue
            if f.name == "endpoint_url":
                value = _redact_endpoint(value)
            shown.append(f"{f.name}={value!r}")
        return f"StorageConfig({', '.join(shown)})"

    __str__ = __repr__

    @property
    def region_or_default(self) -> str:
        return self.region or "us-east-1"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "StorageConfig":
        """Read the configuration from the environment (see `ENV_VARS`); ``overrides`` win."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, names in ENV_VARS.items():
            for var in names:
                raw = env.get(var)
                if raw not in (None, ""):
                    values[name] = raw
                    break
        for name, conv in (("max_attempts", int), ("connect_timeout", float), ("read_timeout", float)):
            if name in values:
                try:
                    values[name] = conv(values[name])
                except ValueError:
                    raise ValueError(
                        f"environment variable {ENV_VARS[name][0]}={values[name]!r} is not a number"
                    ) from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_dict(self, include_secrets: bool = False) -> dict[str, Any]:
        """Plain dict (for shipping to Ray workers explicitly).

        Without ``include_secrets`` the credential fields are None, so the dict is safe to
        log; the receiving side then falls back to its own AWS credential chain.
        """
        out = dataclasses.asdict(self)
        if not include_secrets:
            for name in _SECRET_FIELDS:
                out[name] = None
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StorageConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown storage configuration keys {unknown}; expected some of {sorted(known)}")
        return cls(**dict(data))

    def secrets(self) -> list[str]:
        """The credential strings (for scrubbing text)."""
        out = [s for s in (getattr(self, n) for n in _SECRET_FIELDS) if s]
        if self.endpoint_url:
            p = urlparse(self.endpoint_url)
            out += [s for s in (p.username, p.password) if s]
        return out


def _scrub(text: str, config: StorageConfig | None) -> str:
    """Remove credentials (ours and the environment's) from a message."""
    candidates = list(config.secrets()) if config is not None else []
    for var in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        v = os.environ.get(var)
        if v:
            candidates.append(v)
    for secret in sorted(set(candidates), key=len, reverse=True):
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


class _ScrubFilter(logging.Filter):
    """Removes known credentials from records of third-party loggers that print request headers.

    botocore's DEBUG log of every request includes the ``Authorization`` header (access key
    id) and ``X-Amz-Security-Token`` (session token).  S3 storages register their
    credentials here, and the filter rewrites such records before any handler sees them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = [s for s in self.secrets if s]
        if not secrets:
            return True
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken record is not ours to fix
            return True
        if any(s in text for s in secrets):
            for s in sorted(secrets, key=len, reverse=True):
                text = text.replace(s, "***")
            record.msg, record.args = text, ()
        return True


_SCRUB = _ScrubFilter()
_SCRUBBED_LOGGERS = ("botocore.endpoint", "botocore.auth", "botocore.httpsession", "botocore.parsers",
                     "botocore.hooks", "urllib3.connectionpool")


def _register_secrets(config: StorageConfig) -> None:
    secrets = [s for s in config.secrets() if len(s) >= 4]
    if not secrets:
        return
    _SCRUB.secrets.update(secrets)
    for name in _SCRUBBED_LOGGERS:
        logger = logging.getLogger(name)
        if _SCRUB not in logger.filters:
            logger.addFilter(_SCRUB)


def _short(exc: BaseException, config: StorageConfig | None, limit: int = 300) -> str:
    msg = " ".join(str(exc).split())
    if len(msg) > limit:
        msg = msg[:limit] + "..."
    return _scrub(f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__, config)


def with_retries(
    fn: Callable[[], T],
    *,
    what: str,
    key: str | None,
    attempts: int = 5,
    base_delay: float = 0.2,
    max_delay: float = 5.0,
    retry_on: tuple[type[BaseException], ...] = (OSError,),
    no_retry: tuple[type[BaseException], ...] = (FileNotFoundError, NotFoundError),
    config: StorageConfig | None = None,
    describe: Callable[[str | None], str] = lambda k: str(k),
) -> T:
    """Call ``fn`` up to ``attempts`` times with exponential backoff and jitter.

    Exceptions in ``retry_on`` (and not in ``no_retry``) are retried; after the last attempt
    a `StorageError` naming ``what`` and ``key`` is raised (credentials scrubbed, original
    exception not chained).  Other exceptions propagate unchanged.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except no_retry:
            raise
        except StorageError:
            raise
        except retry_on as exc:
            if attempt >= attempts:
                err = StorageError(
                    f"{what} {describe(key)} failed after {attempt} attempt(s): {_short(exc, config)}",
                    key=key,
                    operation=what,
                )
                raise err from None
            delay = min(max_delay, base_delay * 2 ** (attempt - 1)) * (0.5 + random.random())
            log.warning("%s %s failed (attempt %d/%d), retrying in %.2fs: %s",
                        what, describe(key), attempt, attempts, delay, _short(exc, config))
            time.sleep(delay)


def _check_key(key: str, *, allow_empty: bool = False) -> str:
    if not isinstance(key, str):
        raise ValueError(f"storage key must be a string, got {type(key).__name__}")
    if key == "" and allow_empty:
        return key
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"invalid storage key {key!r}: expected a relative path like 'a/b.parquet'")
    parts = key.split("/")
    body = parts[:-1] if (allow_empty and key.endswith("/")) else parts
    if any(p in ("", ".", "..") for p in body):
        raise ValueError(f"invalid storage key {key!r}: empty, '.' or '..' path segment")
    return key


# --------------------------------------------------------------------------- base class


class Storage(ABC):
    """A root (local folder or S3 bucket/prefix) holding objects addressed by relative keys."""

    uri: str
    config: StorageConfig

    @staticmethod
    def for_uri(uri: str | os.PathLike, config: StorageConfig | None = None) -> "Storage":
        """`S3Storage` for ``s3://bucket[/prefix]``, `LocalStorage` for paths and ``file://``."""
        text = os.fspath(uri)
        if config is None:
            config = StorageConfig.from_env()
        if text.startswith("s3://") or text.startswith("s3a://"):
            p = urlparse(text)
            if p.username or p.password or "@" in p.netloc:
                raise CJEInputError(f"S3 URI s3://***@{p.netloc.rsplit('@', 1)[-1]}{p.path} has credentials in it; "
                                    "put them in the AWS environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                                    "a profile or a role) or StorageConfig, never in a URI")
            if not p.netloc:
                raise ValueError(f"S3 URI {text!r} has no bucket; expected s3://bucket/prefix")
            return S3Storage(p.netloc, p.path.strip("/"), config)
        if text.startswith("file://"):
            p = urlparse(text)
            return LocalStorage(Path(p.path), config)
        if "://" in text:
            raise ValueError(f"unsupported storage URI {text!r}; expected s3://bucket/prefix or a local path")
        return LocalStorage(Path(text), config)

    # -- interface
    @abstractmethod
    def read_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def write_bytes(self, key: str, data: bytes) -> None:
        """Create or replace ``key`` (readers see the old or the new bytes, never a mix)."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist; True if this call created it."""

    @abstractmethod
    def info(self, key: str) -> ObjectInfo: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """All objects whose key starts with ``prefix`` (recursive), sorted by key."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""

    @property
    @abstractmethod
    def arrow_fs(self) -> tuple[pafs.FileSystem, str]:
        """``(pyarrow filesystem, base path)``; ``base + "/" + key`` is the object's path."""

    @abstractmethod
    def url(self, key: str = "") -> str:
        """Human-readable location of ``key`` (for messages and lineage; no credentials)."""

    @abstractmethod
    def open_output(self, key: str) -> contextlib.AbstractContextManager[Any]:
        """Write a (large) object through a pyarrow output stream; visible only on success."""

    # -- shared helpers
    def exists(self, key: str) -> bool:
        try:
            self.info(key)
            return True
        except NotFoundError:
            return False

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``; returns how many were deleted."""
        items = self.list(prefix)
        for item in items:
            self.delete(item.key)
        return len(items)

    def arrow_path(self, key: str) -> str:
        fs, base = self.arrow_fs
        return f"{base}/{_check_key(key)}" if base else _check_key(key)

    def read_with_retries(self, key: str, fn: Callable[[], T], what: str = "read") -> T:
        """Run a pyarrow read of ``key`` with our bounded retry (see `with_retries`)."""
        return with_retries(fn, what=what, key=key, attempts=self.config.max_attempts,
                            config=self.config, describe=self.url)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url()!r})"


# --------------------------------------------------------------------------- local


def _iso_mtime(ns: int) -> str:
    return "mtime:" + datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat().replace("+00:00", "Z")


class LocalStorage(Storage):
    """A local folder; writes are atomic (temporary file + rename / hard link)."""

    def __init__(self, root: Path, config: StorageConfig | None = None) -> None:
        self.root = Path(root).expanduser().resolve()
        self.config = config or StorageConfig()
        self.uri = str(self.root)

    def __reduce__(self):
        return (LocalStorage, (self.root, self.config))

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*_check_key(key).split("/"))

    def url(self, key: str = "") -> str:
        if not key:
            return str(self.root)
        return str(self.root.joinpath(*_check_key(key, allow_empty=True).rstrip("/").split("/")))

    def _fail(self, op: str, key: str, exc: BaseException) -> StorageError:
        cls = NotFoundError if isinstance(exc, FileNotFoundError) else StorageError
        what = "does not exist" if cls is NotFoundError else _short(exc, self.config)
        return cls(f"{op} {self.url(key)} failed: {what}", key=key, operation=op)

    def read_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except OSError as exc:
            raise self._fail("read", key, exc) from None

    @staticmethod
    def sweep_stale_tmp(folder: Path, older_than: float = STALE_TMP_SECONDS) -> int:
        """Remove ``.cje-tmp-*`` files of killed writers (untouched for ``older_than`` seconds)
        from ``folder``; returns how many were removed."""
        removed = 0
        cutoff = time.time() - older_than
        with contextlib.suppress(OSError):
            for entry in os.scandir(folder):
                if entry.name.startswith(_TMP_PREFIX) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                            os.unlink(entry.path)
                            removed += 1
        if removed:
            log.info("removed %d stale temporary file(s) of killed writers in %s", removed, folder)
        return removed

    def _tmp_file(self, path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.sweep_stale_tmp(path.parent)
        tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}-{path.name}"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        return tmp

    def write_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = None
        try:
            tmp = self._tmp_file(path, bytes(data))
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            raise self._fail("write", key, exc) from None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        tmp = None
        try:
            tmp = self._tmp_file(path, bytes(data))
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                # No hard links on this filesystem: exclusive create (content appears progressively).
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as fh:
                    fh.write(bytes(data))
                return True
        except OSError as exc:
            raise self._fail("create", key, exc) from None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def info(self, key: str) -> ObjectInfo:
        try:
            st = self._path(key).stat()
        except OSError as exc:
            raise self._fail("stat", key, exc) from None
        if not os.path.isfile(self._path(key)):
            raise NotFoundError(f"stat {self.url(key)} failed: not a file", key=key, operation="stat")
        return ObjectInfo(key, st.st_size, _iso_mtime(st.st_mtime_ns), st.st_mtime_ns / 1e9)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        _check_key(prefix, allow_empty=True) if prefix else None
        # Walk the deepest existing folder that covers the prefix.
        folder_part = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root.joinpath(*folder_part.split("/")) if folder_part else self.root
        out: list[ObjectInfo] = []
        if not start.is_dir():
            return out
        try:
            for dirpath, dirnames, filenames in os.walk(start):
                dirnames.sort()
                rel_dir = os.path.relpath(dirpath, self.root)
                for name in filenames:
                    if name.startswith(_TMP_PREFIX):
                        continue
                    key = name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}"
                    if not key.startswith(prefix):
                        continue
                    try:
                        st = os.stat(os.path.join(dirpath, name))
                    except FileNotFoundError:
                        continue  # deleted while listing
                    out.append(ObjectInfo(key, st.st_size, _iso_mtime(st.st_mtime_ns), st.st_mtime_ns / 1e9))
        except OSError as exc:
            raise self._fail("list", prefix or ".", exc) from None
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._fail("delete", key, exc) from None
        # Remove folders left empty (never the root).
        parent = path.parent
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    @property
    def arrow_fs(self) -> tuple[pafs.FileSystem, str]:
        return pafs.LocalFileSystem(), str(self.root)

    @contextlib.contextmanager
    def open_output(self, key: str) -> Iterator[Any]:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.sweep_stale_tmp(path.parent)
        tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}-{path.name}"
        fs = pafs.LocalFileSystem()
        try:
            stream = fs.open_output_stream(str(tmp))
            try:
                yield stream
            finally:
                stream.close()
            os.replace(tmp, path)
        except OSError as exc:
            raise self._fail("write", key, exc) from None
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()


# --------------------------------------------------------------------------- S3

_PROBED: dict[tuple[str | None, str], str] = {}
_CLIENTS: dict[tuple[int, StorageConfig], Any] = {}
_CLIENTS_LOCK = threading.Lock()
_PROBE_LOCK = threading.Lock()


def _client_error_code(exc: BaseException) -> tuple[str, int]:
    resp = getattr(exc, "response", None) or {}
    code = str((resp.get("Error") or {}).get("Code", ""))
    status = int((resp.get("ResponseMetadata") or {}).get("HTTPStatusCode", 0) or 0)
    return code, status


class S3Storage(Storage):
    """``s3://bucket/prefix`` through boto3 (small objects) and pyarrow (Parquet)."""

    def __init__(self, bucket: str, prefix: str, config: StorageConfig | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.config = config or StorageConfig()
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._lock = threading.Lock()
        self._client = None
        self._fs = None

    def __reduce__(self):
        return (S3Storage, (self.bucket, self.prefix, self.config))

    # -- plumbing
    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def url(self, key: str = "") -> str:
        return f"{self.uri}/{key}" if key else self.uri

    @property
    def client(self):
        """The boto3 S3 client (created on first use; thread-safe)."""
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                cfg = self.config
                conf = Config(
                    region_name=cfg.region_or_default,
                    retries={"max_attempts": int(cfg.max_attempts), "mode": "standard"},
                    connect_timeout=cfg.connect_timeout,
                    read_timeout=cfg.read_timeout,
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                    s3={"addressing_style": "path"} if cfg.endpoint_url else {},
                    max_pool_connections=32,
                )
                _register_secrets(cfg)
                cache_key = (os.getpid(), cfg)
                with _CLIENTS_LOCK:
                    client = _CLIENTS.get(cache_key)
                    if client is None:  # boto3 clients are thread-safe and slow to create: share
                        session = boto3.session.Session()
                        client = session.client(
                            "s3",
                            endpoint_url=cfg.endpoint_url,
                            aws_access_key_id=cfg.access_key,
                            aws_secret_access_key=cfg.secret_key,
                            aws_session_token=cfg.session_token,
                            config=conf,
                        )
                        _CLIENTS[cache_key] = client
                self._client = client
            return self._client

    @property
    def arrow_fs(self) -> tuple[pafs.FileSystem, str]:
        with self._lock:
            if self._fs is None:
                # pyarrow's AWS SDK reads these at client creation; a user's own value wins.
                os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
                os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
                cfg = self.config
                kwargs: dict[str, Any] = dict(
                    region=cfg.region_or_default,
                    connect_timeout=cfg.connect_timeout,
                    request_timeout=cfg.read_timeout,
                    retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=int(cfg.max_attempts)),
                )
                if cfg.access_key or cfg.secret_key:
                    kwargs.update(access_key=cfg.access_key, secret_key=cfg.secret_key,
                                  session_token=cfg.session_token)
                if cfg.endpoint_url:
                    p = urlparse(cfg.endpoint_url)
                    host = p.hostname or ""
                    kwargs["endpoint_override"] = f"{host}:{p.port}" if p.port else host
                    kwargs["scheme"] = p.scheme or "https"
                self._fs = pafs.S3FileSystem(**kwargs)
            base = f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket
            return self._fs, base

    def _fail(self, op: str, key: str, exc: BaseException) -> StorageError:
        code, status = _client_error_code(exc)
        if code in ("NoSuchKey", "404", "NotFound") or status == 404 and code != "NoSuchBucket":
            return NotFoundError(f"{op} {self.url(key)} failed: does not exist", key=key, operation=op)
        if code == "NoSuchBucket":
            return StorageError(f"{op} {self.url(key)} failed: bucket {self.bucket!r} does not exist",
                                key=key, operation=op)
        return StorageError(f"{op} {self.url(key)} failed: {_short(exc, self.config)}", key=key, operation=op)

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except (ClientError, BotoCoreError) as exc:
            err = self._fail(op, key, exc)
        raise err from None

    # -- interface
    def read_bytes(self, key: str) -> bytes:
        from botocore.exceptions import IncompleteReadError, ResponseStreamingError

        full = self._full(_check_key(key))

        def go() -> bytes:
            resp = self.client.get_object(Bucket=self.bucket, Key=full)
            return resp["Body"].read()

        # botocore retries the request itself; a body cut off mid-stream is retried here.
        return self._call("read", key, lambda: with_retries(
            go, what="read", key=key, attempts=self.config.max_attempts, config=self.config,
            describe=self.url, retry_on=(IncompleteReadError, ResponseStreamingError)))

    def write_bytes(self, key: str, data: bytes) -> None:
        full = self._full(_check_key(key))
        self._call("write", key, lambda: self.client.put_object(Bucket=self.bucket, Key=full, Body=bytes(data)))

    def _conditional_mode(self) -> str:
        mode = self.config.conditional_writes
        if mode != "auto":
            return mode
        cache_key = (self.config.endpoint_url, self.bucket)
        with _PROBE_LOCK:
            if cache_key not in _PROBED:
                _PROBED[cache_key] = self._probe_conditional()
            return _PROBED[cache_key]

    def _probe_conditional(self) -> str:
        from botocore.exceptions import ClientError

        key = f".cje-probe/{uuid.uuid4().hex}"
        full = self._full(key)
        self._call("write", key, lambda: self.client.put_object(Bucket=self.bucket, Key=full, Body=b"1"))
        try:
            try:
                self.client.put_object(Bucket=self.bucket, Key=full, Body=b"2", IfNoneMatch="*")
                mode = "emulated"
            except ClientError as exc:
                code, status = _client_error_code(exc)
                mode = "native" if (status == 412 or code == "PreconditionFailed") else "emulated"
        finally:
            with contextlib.suppress(Exception):
                self.client.delete_object(Bucket=self.bucket, Key=full)
        if mode == "emulated":
            log.warning("S3 endpoint for %s does not honour 'If-None-Match: *'; create-only writes are "
                        "emulated (HEAD, PUT, read back) and not safe against racing writers", self.uri)
        return mode

    def put_if_absent(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        full = self._full(_check_key(key))
        body = bytes(data)
        if self._conditional_mode() == "emulated":
            if self.exists(key):
                return False
            self.write_bytes(key, body)
            return self.read_bytes(key) == body
        attempts = int(self.config.max_attempts)
        for attempt in range(1, attempts + 1):
            try:
                self.client.put_object(Bucket=self.bucket, Key=full, Body=body, IfNoneMatch="*")
                return True
            except ClientError as exc:
                code, status = _client_error_code(exc)
                if status == 412 or code == "PreconditionFailed":
                    return False
                if (status == 409 or code == "ConditionalRequestConflict") and attempt < attempts:
                    # AWS: a concurrent conditional write is in flight; retry to learn who won.
                    time.sleep(0.1 * attempt)
                    continue
                err = self._fail("create", key, exc)
            except BotoCoreError as exc:
                err = self._fail("create", key, exc)
            raise err from None
        raise StorageError(f"create {self.url(key)} failed: conflicting concurrent writes", key=key,
                           operation="create")

    def info(self, key: str) -> ObjectInfo:
        full = self._full(_check_key(key))
        resp = self._call("stat", key, lambda: self.client.head_object(Bucket=self.bucket, Key=full))
        modified = resp.get("LastModified")
        return ObjectInfo(key, int(resp["ContentLength"]), str(resp.get("ETag", "")).strip('"'),
                          modified.timestamp() if modified else None)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        if prefix:
            _check_key(prefix, allow_empty=True)
        full_prefix = self._full(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        cut = len(self.prefix) + 1 if self.prefix else 0

        def go() -> list[ObjectInfo]:
            out = []
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
                for obj in page.get("Contents", []) or []:
                    modified = obj.get("LastModified")
                    out.append(ObjectInfo(obj["Key"][cut:], int(obj["Size"]), str(obj.get("ETag", "")).strip('"'),
                                          modified.timestamp() if modified else None))
            return out

        out = self._call("list", prefix or ".", go)
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        full = self._full(_check_key(key))
        self._call("delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=full))

    def delete_prefix(self, prefix: str) -> int:
        items = self.list(prefix)
        for start in range(0, len(items), 1000):
            chunk = items[start:start + 1000]
            objs = [{"Key": self._full(o.key)} for o in chunk]
            self._call("delete", chunk[0].key,
                       lambda: self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objs, "Quiet": True}))
        return len(items)

    @contextlib.contextmanager
    def open_output(self, key: str) -> Iterator[Any]:
        fs, _ = self.arrow_fs
        path = self.arrow_path(key)
        ok = False
        try:
            stream = fs.open_output_stream(path)
            try:
                yield stream
                ok = True
            finally:
                # Closing completes the (multipart) upload; on failure the object is removed again.
                stream.close()
        except OSError as exc:
            raise StorageError(f"write {self.url(key)} failed: {_short(exc, self.config)}", key=key,
                               operation="write") from None
        finally:
            if not ok:
                with contextlib.suppress(Exception):
                    self.delete(key)
