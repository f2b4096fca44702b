"""Fixtures for the integration tier: a real S3 implementation (Ceph radosgw on loopback).

The gateway is started outside pytest by ``bash infra/radosgw/start.sh`` (``.ci/run`` does it),
which writes an env file with the endpoint and the fixed test keys.  The fixtures here only read
that file; they never start or stop daemons.

* env file missing or gateway not answering and ``CJE_REQUIRE_RGW=1`` (CI): the test FAILS;
* otherwise: the test is skipped with the reason and the command that starts the gateway.

Fixtures are opt-in (a test asks for ``rgw_env``, ``rgw_s3``, ``rgw_bucket`` or
``rgw_storage_config``), so other integration tests in this folder are not affected.
"""
from __future__ import annotations

import os
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator

import pytest

RGW_ENV_DEFAULT = "/tmp/cje-rgw/env"
START_HINT = "start it with `bash infra/radosgw/start.sh` (stop: `bash infra/radosgw/stop.sh`)"
REQUIRED_KEYS = ("CJE_RGW_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")


def rgw_env_path() -> Path:
    """Where ``infra/radosgw/start.sh`` wrote (or will write) its env file."""
    return Path(os.environ.get("CJE_RGW_ENV") or RGW_ENV_DEFAULT)


def parse_env_file(path: Path) -> dict[str, str]:
    """Parse ``NAME=value`` lines (comments and blank lines ignored).

    Raises
    ------
    ValueError
        Naming the file and line when a line is not ``NAME=value`` or a required key is missing.
    """
    values: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep or not name.strip().isidentifier():
            raise ValueError(f"{path}:{lineno}: expected NAME=value, got {raw!r}")
        values[name.strip()] = value.strip()
    missing = [k for k in REQUIRED_KEYS if not values.get(k)]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    return values


def _unavailable(reason: str) -> None:
    """Fail under CJE_REQUIRE_RGW=1 (CI), skip otherwise; never returns."""
    if os.environ.get("CJE_REQUIRE_RGW") == "1":
        pytest.fail(f"radosgw required (CJE_REQUIRE_RGW=1) but {reason}; {START_HINT}", pytrace=False)
    pytest.skip(f"radosgw not available: {reason}; {START_HINT}")


def _answers(endpoint: str, timeout: float = 5.0) -> str | None:
    """None if the S3 endpoint answers HTTP at all, else the error text."""
    try:
        with urllib.request.urlopen(endpoint.rstrip("/") + "/", timeout=timeout) as resp:
            resp.read(1)
        return None
    except urllib.error.HTTPError:
        return None  # an S3 error document is an answer
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="session")
def rgw_env() -> dict[str, str]:
    """Endpoint and test keys of the running gateway (from the env file)."""
    path = rgw_env_path()
    if not path.is_file():
        _unavailable(f"env file {path} does not exist")
    env = parse_env_file(path)
    err = _answers(env["CJE_RGW_ENDPOINT"])
    if err is not None:
        _unavailable(f"env file {path} names {env['CJE_RGW_ENDPOINT']} but it does not answer ({err})")
    return env


@pytest.fixture(scope="session")
def rgw_checksum_env(rgw_env: dict[str, str]) -> Iterator[None]:
    """AWS_REQUEST/RESPONSE_CHECKSUM_* = when_required for pyarrow's AWS SDK (read from the
    process environment when an S3 client is created); restored afterwards."""
    names = ("AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION")
    old = {n: os.environ.get(n) for n in names}
    for n in names:
        os.environ[n] = rgw_env.get(n, "when_required")
    yield
    for n, v in old.items():
        if v is None:
            os.environ.pop(n, None)
        else:
            os.environ[n] = v


def make_s3_client(rgw_env: dict[str, str], **config_overrides):
    """boto3 S3 client for the gateway (path-style, checksums only when required)."""
    import boto3
    from botocore.config import Config

    conf = dict(
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"},
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=5,
        read_timeout=30,
    )
    conf.update(config_overrides)
    return boto3.session.Session().client(
        "s3",
        endpoint_url=rgw_env["CJE_RGW_ENDPOINT"],
        region_name=rgw_env["AWS_REGION"],
        aws_access_key_id=rgw_env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=rgw_env["AWS_SECRET_ACCESS_KEY"],
        config=Config(**conf),
    )


@pytest.fixture(scope="session")
def rgw_s3(rgw_env: dict[str, str]):
    """A boto3 S3 client for the gateway."""
    return make_s3_client(rgw_env)


def empty_bucket(s3, bucket: str) -> None:
    """Delete every object and unfinished multipart upload, then the bucket."""
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", []) or []]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    for up in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) or []:
        s3.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
    s3.delete_bucket(Bucket=bucket)


@pytest.fixture
def rgw_bucket(rgw_s3) -> Iterator[str]:
    """A fresh, empty bucket for one test; removed with its contents afterwards."""
    name = f"cje-it-{uuid.uuid4().hex[:16]}"
    rgw_s3.create_bucket(Bucket=name)
    yield name
    empty_bucket(rgw_s3, name)


@pytest.fixture
def rgw_arrow_fs(rgw_env: dict[str, str], rgw_checksum_env: None):
    """pyarrow S3FileSystem for the gateway, endpoint passed explicitly (pyarrow ignores
    AWS_ENDPOINT_URL)."""
    import pyarrow.fs as pafs

    scheme, _, hostport = rgw_env["CJE_RGW_ENDPOINT"].partition("://")
    return pafs.S3FileSystem(
        endpoint_override=hostport.rstrip("/"),
        scheme=scheme,
        access_key=rgw_env["AWS_ACCESS_KEY_ID"],
        secret_key=rgw_env["AWS_SECRET_ACCESS_KEY"],
        region=rgw_env["AWS_REGION"],
    )
