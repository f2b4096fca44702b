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
boto3 calls (``total_max_attempts`` requests in all, `flows.storage.s3.client_config`), pyarrow's
``AwsStandardS3RetryStrategy`` inside pyarrow, and `with_retries` (a bounded retry of our own)
around whole pyarrow reads.  What is transient is decided by `is_transient` from the exception's
type, S3 error code and HTTP status (pyarrow: the AWS SDK error type it carries), never from
free text; a non-transient service answer (access denied, no such bucket) fails at once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import random
import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, TypeVar
from urllib.parse import urlparse

import pyarrow.fs as pafs


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
#: Name prefix of a local temporary file (a write in progress: listings skip it).
TMP_PREFIX = ".cje-tmp-"
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
        """The configured region, else ``us-east-1``."""
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
        """A configuration from a plain mapping of its fields (unknown keys raise ValueError)."""
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


def register_secrets(config: StorageConfig) -> None:
    """Scrub the credentials of ``config`` from the messages of the storage loggers (boto, pyarrow).

    Parameters
    ----------
    config : StorageConfig
        Its `StorageConfig.secrets` of four characters or more are replaced in every log record.
    """
    secrets = [s for s in config.secrets() if len(s) >= 4]
    if not secrets:
        return
    _SCRUB.secrets.update(secrets)
    for name in _SCRUBBED_LOGGERS:
        logger = logging.getLogger(name)
        if _SCRUB not in logger.filters:
            logger.addFilter(_SCRUB)


# --------------------------------------------------------------------------- error classification

#: S3 / botocore error codes of a throttled or briefly failing service: retried.
TRANSIENT_CODES = frozenset({
    "InternalError", "InternalFailure", "ServiceUnavailable", "SlowDown", "Throttling", "ThrottlingException",
    "ThrottledException", "RequestThrottled", "RequestThrottledException", "TooManyRequests",
    "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded", "RequestTimeout",
    "RequestTimeoutException", "PriorRequestNotComplete", "OperationAborted",
})
#: HTTP statuses of a throttled or briefly failing service (408, 429, 5xx gateways): retried.
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
#: Error types the AWS C++ SDK under pyarrow reports (``AWS Error <TYPE> during ...``) that are retried:
#: the network (connection, timeout, partial transfer) and the service's throttling and 5xx answers.
TRANSIENT_AWS_TYPES = frozenset({"NETWORK_CONNECTION", "SLOW_DOWN", "SERVICE_UNAVAILABLE", "THROTTLING",
                                 "INTERNAL_FAILURE", "REQUEST_TIMEOUT"})
#: errno values of a network failure (a reset, refused or timed-out connection): retried.
TRANSIENT_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT,
                              errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN})
_AWS_ERROR_TYPE = re.compile(r"\bAWS Error ([A-Z][A-Z0-9_]*) (?:\(HTTP status (\d{3})\) )?during ")


def error_code(exc: BaseException) -> tuple[str, int]:
    """``(S3 error code, HTTP status)`` of a botocore ``ClientError`` (``("", 0)`` for anything else)."""
    resp = getattr(exc, "response", None)
    if not isinstance(resp, Mapping):
        return "", 0
    code = str((resp.get("Error") or {}).get("Code", "") or "")
    meta = resp.get("ResponseMetadata") or {}
    try:
        status = int(meta.get("HTTPStatusCode") or 0)
    except (TypeError, ValueError):
        status = 0
    if not status and code.isdigit():  # HEAD answers carry no body: botocore reports the status as the code
        status = int(code)
    return code, status


def aws_error_type(exc: BaseException) -> str | None:
    """The AWS C++ SDK error type of a pyarrow S3 ``OSError`` (``"SLOW_DOWN"``, ...), or None."""
    return aws_error(exc)[0]


def aws_error(exc: BaseException) -> tuple[str | None, int]:
    """``(AWS SDK error type, HTTP status or 0)`` of a pyarrow S3 ``OSError``; ``(None, 0)`` otherwise.

    pyarrow writes ``AWS Error SLOW_DOWN during GetObject operation: ...`` and, for answers
    without an S3 error body (HEAD), ``AWS Error UNKNOWN (HTTP status 503) during HeadObject ...``.
    """
    if not isinstance(exc, OSError):
        return None, 0
    m = _AWS_ERROR_TYPE.search(str(exc))
    if not m:
        return None, 0
    return m.group(1), int(m.group(2) or 0)


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` is a failure of the storage service or the network that a retry may cure.

    Classified by what the exception *is*, never by free text: a botocore ``ClientError`` by its
    S3 error code (`TRANSIENT_CODES`) or HTTP status (`TRANSIENT_STATUSES`); botocore's
    connection, timeout and streaming exceptions (a body cut off mid-transfer included);
    Python's ``ConnectionError`` and ``TimeoutError`` and an ``OSError`` whose errno is a network
    failure (`TRANSIENT_ERRNOS`); a pyarrow S3 ``OSError`` by the AWS SDK error type it carries
    (`TRANSIENT_AWS_TYPES`) or its HTTP status.  Anything else (access denied, a missing bucket or key, bad
    Parquet, a programming error) is not transient.
    """
    try:
        from botocore import exceptions as bce
    except ImportError:  # pragma: no cover - boto3 is a dependency
        bce = None
    if bce is not None:
        if isinstance(exc, bce.ClientError):
            code, status = error_code(exc)
            return code in TRANSIENT_CODES or status in TRANSIENT_STATUSES
        if isinstance(exc, (bce.ConnectionError, bce.HTTPClientError, bce.IncompleteReadError,
                            bce.ResponseStreamingError)):
            return True
        if isinstance(exc, bce.BotoCoreError):
            return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError):
        aws, status = aws_error(exc)
        if aws is not None:
            return aws in TRANSIENT_AWS_TYPES or status in TRANSIENT_STATUSES
        return exc.errno in TRANSIENT_ERRNOS
    return False


def is_storage_service_error(exc: BaseException) -> bool:
    """True when ``exc`` came from the storage service or the network rather than from the data
    (a pyarrow ``OSError`` carrying an AWS SDK error type, a botocore error, or `is_transient`)."""
    if is_transient(exc) or aws_error_type(exc) is not None:
        return True
    try:
        from botocore import exceptions as bce
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, (bce.ClientError, bce.BotoCoreError))


def short_error(exc: BaseException, config: StorageConfig | None, limit: int = 300) -> str:
    """A storage exception as one short line for an error message, its credentials scrubbed.

    Parameters
    ----------
    exc : BaseException
    config : StorageConfig or None
        Whose secrets are scrubbed.
    limit : int
        Characters kept of the message (what the service said, for S3 errors).

    Returns
    -------
    str
        ``"<ExceptionType>: <message>"``.
    """
    msg = " ".join(str(exc).split())
    m = _AWS_ERROR_TYPE.search(msg)
    if m:  # pyarrow's S3 errors repeat the path before what the service said: keep what it said
        msg = msg[m.start():]
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
                    f"{what} {describe(key)} failed after {attempt} attempt(s): {short_error(exc, config)}",
                    key=key,
                    operation=what,
                )
                raise err from None
            delay = min(max_delay, base_delay * 2 ** (attempt - 1)) * (0.5 + random.random())
            log.warning("%s %s failed (attempt %d/%d), retrying in %.2fs: %s",
                        what, describe(key), attempt, attempts, delay, short_error(exc, config))
            time.sleep(delay)


def check_key(key: str, *, allow_empty: bool = False) -> str:
    """A valid relative storage key (``a/b.parquet``: no leading ``/``, no empty, ``.`` or ``..`` segment).

    Parameters
    ----------
    key : str
    allow_empty : bool
        Also accept ``""`` and a trailing ``/`` (a listing prefix).

    Returns
    -------
    str
        ``key`` unchanged; a `ValueError` names a bad one.
    """
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


#: URI scheme (``""`` for a plain path) -> the function that opens a storage of that scheme.
_BACKENDS: dict[str, Callable[[str, "StorageConfig"], "Storage"]] = {}


def register_backend(*schemes: str) -> Callable[[Callable[[str, StorageConfig], "Storage"]], Callable]:
    """Register the decorated ``opener(uri, config) -> Storage`` for the URI ``schemes`` of `Storage.for_uri`.

    Parameters
    ----------
    *schemes : str
        URI schemes as written before ``://`` (``"s3"``, ``"file"``); ``""`` stands for a plain local path.

    Returns
    -------
    callable
        The decorator (it returns the opener unchanged).
    """
    def register(opener: Callable[[str, StorageConfig], "Storage"]) -> Callable:
        for scheme in schemes:
            _BACKENDS[scheme] = opener
        return opener

    return register


class Storage(ABC):
    """A root (local folder or S3 bucket/prefix) holding objects addressed by relative keys."""

    uri: str
    config: StorageConfig

    @staticmethod
    def for_uri(uri: str | os.PathLike, config: StorageConfig | None = None) -> "Storage":
        """`S3Storage` for ``s3://bucket[/prefix]``, `LocalStorage` for paths and ``file://``.

        The backends subclass `Storage` and register their URI schemes (`register_backend`) when
        ``flows.storage`` is imported, so this module imports none of them (no import cycle).
        """
        text = os.fspath(uri)
        if config is None:
            config = StorageConfig.from_env()
        scheme = text.split("://", 1)[0] if "://" in text else ""
        opener = _BACKENDS.get(scheme)
        if opener is None:
            raise ValueError(f"unsupported storage URI {text!r}; expected s3://bucket/prefix or a local path")
        return opener(text, config)

    # -- interface
    @abstractmethod
    def read_bytes(self, key: str) -> bytes:
        """The bytes of ``key``; a missing key raises `NotFoundError`."""

    @abstractmethod
    def write_bytes(self, key: str, data: bytes) -> None:
        """Create or replace ``key`` (readers see the old or the new bytes, never a mix)."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist; True if this call created it."""

    @abstractmethod
    def info(self, key: str) -> ObjectInfo:
        """Size, ETag (or mtime) and modification time of ``key``; a missing key raises `NotFoundError`."""

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
        """Whether ``key`` exists."""
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
        """Path of ``key`` in the filesystem of `arrow_fs`."""
        fs, base = self.arrow_fs
        return f"{base}/{check_key(key)}" if base else check_key(key)

    def read_with_retries(self, key: str, fn: Callable[[], T], what: str = "read") -> T:
        """Run a pyarrow read of ``key`` with our bounded retry (see `with_retries`)."""
        return with_retries(fn, what=what, key=key, attempts=self.config.max_attempts,
                            config=self.config, describe=self.url)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url()!r})"
