"""S3-protocol object storage (boto3; conditional writes; endpoint probing)."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

import pyarrow.fs as pafs

from cje_engine.errors import CJEInputError


from flows.storage.objects import (NotFoundError, ObjectInfo, Storage, StorageConfig, StorageError, T, check_key,
                                   error_code, register_backend, register_secrets, short_error, with_retries)

log = logging.getLogger(__name__)


_PROBED: dict[tuple[str | None, str], str] = {}
_CLIENTS: dict[tuple[int, StorageConfig], Any] = {}
_CLIENTS_LOCK = threading.Lock()
_PROBE_LOCK = threading.Lock()


def _client_error_code(exc: BaseException) -> tuple[str, int]:
    return error_code(exc)


def client_config(cfg: StorageConfig) -> Any:
    """The botocore ``Config`` of every S3 client, every remote-call setting explicit.

    * ``retries``: botocore's ``standard`` mode (exponential backoff with jitter, at most 20 s a
      pause; retries connection errors, timeouts, HTTP 500/502/503/504, throttling codes such as
      ``SlowDown`` and 429) with ``total_max_attempts = cfg.max_attempts``: that many requests in
      all, the first included (botocore's ``max_attempts`` key would count retries only and make
      one request more).
    * ``connect_timeout`` / ``read_timeout``: seconds to open a connection and to wait for each
      read of the socket (``CJE_S3_CONNECT_TIMEOUT``, default 5; ``CJE_S3_READ_TIMEOUT``, default 60).

    One call therefore ends within about ``max_attempts * (connect_timeout + read_timeout) +``
    the backoff pauses.
    """
    from botocore.config import Config

    return Config(
        region_name=cfg.region_or_default,
        retries={"total_max_attempts": int(cfg.max_attempts), "mode": "standard"},
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"} if cfg.endpoint_url else {},
        max_pool_connections=32,
    )


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
        """``s3://bucket/prefix/key``; see `Storage.url`."""
        return f"{self.uri}/{key}" if key else self.uri

    @property
    def client(self):
        """The boto3 S3 client (created on first use; thread-safe)."""
        with self._lock:
            if self._client is None:
                import boto3

                cfg = self.config
                conf = client_config(cfg)
                register_secrets(cfg)
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
        """pyarrow's S3 filesystem (created once, with this configuration) and ``bucket/prefix``; see `Storage.arrow_fs`."""
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
        return StorageError(f"{op} {self.url(key)} failed: {short_error(exc, self.config)}", key=key, operation=op)

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except (ClientError, BotoCoreError) as exc:
            err = self._fail(op, key, exc)
        raise err from None

    # -- interface
    def read_bytes(self, key: str) -> bytes:
        """The bytes of ``key`` (a body cut off mid-stream is retried); see `Storage.read_bytes`."""
        from botocore.exceptions import IncompleteReadError, ResponseStreamingError

        full = self._full(check_key(key))

        def go() -> bytes:
            resp = self.client.get_object(Bucket=self.bucket, Key=full)
            return resp["Body"].read()

        # botocore retries the request itself; a body cut off mid-stream is retried here.
        return self._call("read", key, lambda: with_retries(
            go, what="read", key=key, attempts=self.config.max_attempts, config=self.config,
            describe=self.url, retry_on=(IncompleteReadError, ResponseStreamingError)))

    def write_bytes(self, key: str, data: bytes) -> None:
        """Create or replace ``key`` with one PUT; see `Storage.write_bytes`."""
        full = self._full(check_key(key))
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
        """Create ``key`` only if absent (a conditional PUT, or emulated where the server lacks it); see `Storage.put_if_absent`."""
        from botocore.exceptions import BotoCoreError, ClientError

        full = self._full(check_key(key))
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
        """Size, ETag and modification time of ``key``; see `Storage.info`."""
        full = self._full(check_key(key))
        resp = self._call("stat", key, lambda: self.client.head_object(Bucket=self.bucket, Key=full))
        modified = resp.get("LastModified")
        return ObjectInfo(key, int(resp["ContentLength"]), str(resp.get("ETag", "")).strip('"'),
                          modified.timestamp() if modified else None)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects under ``prefix``, all pages, sorted by key; see `Storage.list`."""
        if prefix:
            check_key(prefix, allow_empty=True)
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
        """Delete ``key``; see `Storage.delete`."""
        full = self._full(check_key(key))
        self._call("delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=full))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix`` in batches of 1000; returns how many were deleted."""
        items = self.list(prefix)
        for start in range(0, len(items), 1000):
            chunk = items[start:start + 1000]
            objs = [{"Key": self._full(o.key)} for o in chunk]
            self._call("delete", chunk[0].key,
                       lambda: self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objs, "Quiet": True}))
        return len(items)

    @contextlib.contextmanager
    def open_output(self, key: str) -> Iterator[Any]:
        """Write ``key`` through pyarrow's S3 output stream (a failed write is deleted); see `Storage.open_output`."""
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
            raise StorageError(f"write {self.url(key)} failed: {short_error(exc, self.config)}", key=key,
                               operation="write") from None
        finally:
            if not ok:
                with contextlib.suppress(Exception):
                    self.delete(key)


@register_backend("s3", "s3a")
def open_s3(uri: str, config: StorageConfig) -> S3Storage:
    """`S3Storage` of ``s3://bucket[/prefix]`` (the `Storage.for_uri` backend of ``s3://`` and ``s3a://``).

    Parameters
    ----------
    uri : str
    config : StorageConfig

    Returns
    -------
    S3Storage
        A URI with credentials in it is a `CJEInputError` (they belong in the environment); one without a
        bucket a `ValueError`.
    """
    p = urlparse(uri)
    if p.username or p.password or "@" in p.netloc:
        raise CJEInputError(f"S3 URI s3://***@{p.netloc.rsplit('@', 1)[-1]}{p.path} has credentials in it; "
                            "put them in the AWS environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                            "a profile or a role) or StorageConfig, never in a URI")
    if not p.netloc:
        raise ValueError(f"S3 URI {uri!r} has no bucket; expected s3://bucket/prefix")
    return S3Storage(p.netloc, p.path.strip("/"), config)
