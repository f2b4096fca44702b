"""Real-S3 tier: boto3, pyarrow and flows.storage.objects against Ceph radosgw on loopback.

Start the gateway first: ``bash infra/radosgw/start.sh`` (``.ci/run`` does, with
``CJE_REQUIRE_RGW=1`` so that a missing gateway fails these tests instead of skipping them).
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from botocore.exceptions import ClientError

from tests.integration.conftest import make_s3_client

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


def _status(exc: ClientError) -> int:
    return int(exc.response["ResponseMetadata"]["HTTPStatusCode"])


# --------------------------------------------------------------------------- boto3 basics


def test_put_get_head_delete(rgw_s3, rgw_bucket):
    body = b"hello radosgw \x00\xff"
    put = rgw_s3.put_object(Bucket=rgw_bucket, Key="a/b.txt", Body=body)
    got = rgw_s3.get_object(Bucket=rgw_bucket, Key="a/b.txt")
    assert got["Body"].read() == body
    head = rgw_s3.head_object(Bucket=rgw_bucket, Key="a/b.txt")
    assert head["ContentLength"] == len(body)
    assert head["ETag"] == put["ETag"]
    rgw_s3.delete_object(Bucket=rgw_bucket, Key="a/b.txt")
    with pytest.raises(ClientError) as info:
        rgw_s3.head_object(Bucket=rgw_bucket, Key="a/b.txt")
    assert _status(info.value) == 404


def test_listing_prefix_delimiter_and_pagination(rgw_s3, rgw_bucket):
    keys = [f"logs/dt=2024-01-0{d}/part-{i}.parquet" for d in (1, 2, 3) for i in range(3)]
    keys += ["labels/v1.parquet", "results/x/manifest.json"]
    for k in keys:
        rgw_s3.put_object(Bucket=rgw_bucket, Key=k, Body=k.encode())

    # Prefix listing, paginated two at a time: all 9 log keys, in lexicographic order, no others.
    pages = rgw_s3.get_paginator("list_objects_v2").paginate(
        Bucket=rgw_bucket, Prefix="logs/", PaginationConfig={"PageSize": 2})
    listed, n_pages = [], 0
    for page in pages:
        n_pages += 1
        assert page["KeyCount"] <= 2
        listed += [o["Key"] for o in page.get("Contents", [])]
    assert listed == sorted(k for k in keys if k.startswith("logs/"))
    assert n_pages == 5  # ceil(9 / 2)

    # Delimiter listing gives the partition "folders".
    resp = rgw_s3.list_objects_v2(Bucket=rgw_bucket, Prefix="logs/", Delimiter="/")
    assert [p["Prefix"] for p in resp["CommonPrefixes"]] == [
        "logs/dt=2024-01-01/", "logs/dt=2024-01-02/", "logs/dt=2024-01-03/"]
    assert "Contents" not in resp or resp["Contents"] == []

    top = rgw_s3.list_objects_v2(Bucket=rgw_bucket, Delimiter="/")
    assert sorted(p["Prefix"] for p in top["CommonPrefixes"]) == ["labels/", "logs/", "results/"]


def test_missing_bucket_and_key_errors(rgw_s3, rgw_bucket):
    with pytest.raises(ClientError) as info:
        rgw_s3.get_object(Bucket=rgw_bucket, Key="nope")
    assert info.value.response["Error"]["Code"] == "NoSuchKey"
    with pytest.raises(ClientError) as info:
        rgw_s3.list_objects_v2(Bucket=f"cje-missing-{uuid.uuid4().hex[:12]}")
    assert info.value.response["Error"]["Code"] == "NoSuchBucket"


def test_wrong_secret_is_refused(rgw_env, rgw_bucket):
    bad = dict(rgw_env, AWS_SECRET_ACCESS_KEY="not-the-secret-" + "x" * 25)
    s3 = make_s3_client(bad, retries={"max_attempts": 1, "mode": "standard"})
    with pytest.raises(ClientError) as info:
        s3.put_object(Bucket=rgw_bucket, Key="k", Body=b"x")
    assert _status(info.value) == 403
    assert info.value.response["Error"]["Code"] == "SignatureDoesNotMatch"


# --------------------------------------------------------------------------- conditional PUT


def test_conditional_put_creates_once(rgw_s3, rgw_bucket):
    rgw_s3.put_object(Bucket=rgw_bucket, Key="once", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as info:
        rgw_s3.put_object(Bucket=rgw_bucket, Key="once", Body=b"second", IfNoneMatch="*")
    assert _status(info.value) == 412
    assert info.value.response["Error"]["Code"] == "PreconditionFailed"
    assert rgw_s3.get_object(Bucket=rgw_bucket, Key="once")["Body"].read() == b"first"
    # An unconditional PUT still replaces (so the 412 above really came from the header).
    rgw_s3.put_object(Bucket=rgw_bucket, Key="once", Body=b"third")
    assert rgw_s3.get_object(Bucket=rgw_bucket, Key="once")["Body"].read() == b"third"


def test_conditional_put_race_has_one_winner(rgw_env, rgw_bucket):
    """8 clients race create-only PUTs on the same key, 5 rounds: exactly one wins each round and
    the stored bytes are the winner's."""
    n_writers, rounds = 8, 5
    clients = [make_s3_client(rgw_env) for _ in range(n_writers)]
    for r in range(rounds):
        key = f"race/{r}"
        barrier = threading.Barrier(n_writers)

        def attempt(i: int) -> bool:
            body = f"writer-{i}".encode()
            barrier.wait()
            try:
                clients[i].put_object(Bucket=rgw_bucket, Key=key, Body=body, IfNoneMatch="*")
                return True
            except ClientError as exc:
                # 412 = lost the race; 409 = concurrent conditional write in flight (also a loss).
                assert _status(exc) in (409, 412), exc.response
                return False

        with ThreadPoolExecutor(n_writers) as pool:
            won = list(pool.map(attempt, range(n_writers)))
        assert sum(won) == 1, f"round {r}: winners {won}"
        stored = clients[0].get_object(Bucket=rgw_bucket, Key=key)["Body"].read()
        assert stored == f"writer-{won.index(True)}".encode()


# --------------------------------------------------------------------------- multipart


def test_multipart_upload_explicit_parts(rgw_s3, rgw_bucket):
    rng = np.random.default_rng(7)
    parts = [rng.bytes(5 * MiB), rng.bytes(5 * MiB), rng.bytes(MiB // 3)]
    up = rgw_s3.create_multipart_upload(Bucket=rgw_bucket, Key="mp/obj.bin")
    done = []
    for n, chunk in enumerate(parts, start=1):
        r = rgw_s3.upload_part(Bucket=rgw_bucket, Key="mp/obj.bin", UploadId=up["UploadId"],
                               PartNumber=n, Body=chunk)
        done.append({"PartNumber": n, "ETag": r["ETag"]})
    rgw_s3.complete_multipart_upload(Bucket=rgw_bucket, Key="mp/obj.bin", UploadId=up["UploadId"],
                                     MultipartUpload={"Parts": done})
    head = rgw_s3.head_object(Bucket=rgw_bucket, Key="mp/obj.bin")
    assert head["ETag"].strip('"').endswith("-3")  # multipart ETag: md5-of-md5s "-" part count
    assert head["ContentLength"] == sum(map(len, parts))
    assert rgw_s3.get_object(Bucket=rgw_bucket, Key="mp/obj.bin")["Body"].read() == b"".join(parts)
    # Ranged read inside the second part.
    rng_body = rgw_s3.get_object(Bucket=rgw_bucket, Key="mp/obj.bin",
                                 Range=f"bytes={5 * MiB + 10}-{5 * MiB + 19}")["Body"].read()
    assert rng_body == parts[1][10:20]


def test_multipart_upload_abort_leaves_nothing(rgw_s3, rgw_bucket):
    up = rgw_s3.create_multipart_upload(Bucket=rgw_bucket, Key="mp/aborted")
    rgw_s3.upload_part(Bucket=rgw_bucket, Key="mp/aborted", UploadId=up["UploadId"], PartNumber=1,
                       Body=b"x" * (5 * MiB))
    assert [u["Key"] for u in rgw_s3.list_multipart_uploads(Bucket=rgw_bucket).get("Uploads", [])] == ["mp/aborted"]
    rgw_s3.abort_multipart_upload(Bucket=rgw_bucket, Key="mp/aborted", UploadId=up["UploadId"])
    assert rgw_s3.list_multipart_uploads(Bucket=rgw_bucket).get("Uploads", []) == []
    assert rgw_s3.list_objects_v2(Bucket=rgw_bucket).get("KeyCount", 0) == 0


def test_managed_transfer_multipart(rgw_s3, rgw_bucket):
    from boto3.s3.transfer import TransferConfig

    data = np.random.default_rng(11).bytes(12 * MiB)
    cfg = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=3)
    rgw_s3.upload_fileobj(io.BytesIO(data), rgw_bucket, "mp/managed.bin", Config=cfg)
    assert rgw_s3.head_object(Bucket=rgw_bucket, Key="mp/managed.bin")["ETag"].strip('"').endswith("-3")
    out = io.BytesIO()
    rgw_s3.download_fileobj(rgw_bucket, "mp/managed.bin", out, Config=cfg)
    assert out.getvalue() == data


# --------------------------------------------------------------------------- pyarrow


def _log_table(n: int = 3000, seed: int = 3) -> pa.Table:
    rng = np.random.default_rng(seed)
    days = np.array(["2024-05-01", "2024-05-02", "2024-05-03"])
    return pa.table({
        "dt": days[rng.integers(0, 3, n)],
        "prompt_id": [f"p{i % 500}" for i in range(n)],
        "policy": np.array(["base", "clone", "premium"])[rng.integers(0, 3, n)],
        "judge_score": rng.random(n),
        "response_id": [f"r{i}" for i in range(n)],
    })


def test_pyarrow_dataset_roundtrip_with_pushdown(rgw_arrow_fs, rgw_s3, rgw_bucket):
    table = _log_table()
    ds.write_dataset(table, f"{rgw_bucket}/logs", format="parquet", filesystem=rgw_arrow_fs,
                     partitioning=ds.partitioning(pa.schema([("dt", pa.string())]), flavor="hive"),
                     existing_data_behavior="overwrite_or_ignore")

    objs = rgw_s3.list_objects_v2(Bucket=rgw_bucket, Prefix="logs/")["Contents"]
    # pyarrow also leaves zero-byte "directory marker" objects ending in "/".
    assert all(o["Size"] == 0 for o in objs if o["Key"].endswith("/"))
    keys = sorted(o["Key"] for o in objs if not o["Key"].endswith("/"))
    assert {k.split("/")[1] for k in keys} == {"dt=2024-05-01", "dt=2024-05-02", "dt=2024-05-03"}
    assert all(k.endswith(".parquet") for k in keys)

    dataset = ds.dataset(f"{rgw_bucket}/logs", format="parquet", filesystem=rgw_arrow_fs, partitioning="hive")
    got = dataset.to_table(columns=["response_id", "judge_score"],
                           filter=(pc.field("dt") == "2024-05-02") & (pc.field("policy") == "clone"))
    assert got.column_names == ["response_id", "judge_score"]
    mask = pc.and_(pc.equal(table["dt"], "2024-05-02"), pc.equal(table["policy"], "clone"))
    want = table.filter(mask).select(["response_id", "judge_score"])
    assert got.num_rows == want.num_rows > 0
    assert got.sort_by("response_id").equals(want.sort_by("response_id"))
    assert dataset.count_rows() == table.num_rows


def test_pyarrow_parquet_file_and_multipart_stream(rgw_arrow_fs, rgw_s3, rgw_bucket):
    table = _log_table(n=500)
    pq.write_table(table, f"{rgw_bucket}/one.parquet", filesystem=rgw_arrow_fs)
    assert pq.read_table(f"{rgw_bucket}/one.parquet", filesystem=rgw_arrow_fs).equals(table)
    info = rgw_arrow_fs.get_file_info(f"{rgw_bucket}/one.parquet")
    assert info.size == rgw_s3.head_object(Bucket=rgw_bucket, Key="one.parquet")["ContentLength"]

    # > 10 MiB through an output stream: pyarrow uploads it as a multipart upload.
    data = np.random.default_rng(5).bytes(23 * MiB)
    with rgw_arrow_fs.open_output_stream(f"{rgw_bucket}/big.bin") as f:
        f.write(data)
    etag = rgw_s3.head_object(Bucket=rgw_bucket, Key="big.bin")["ETag"].strip('"')
    assert "-" in etag and int(etag.rsplit("-", 1)[1]) >= 2, etag
    with rgw_arrow_fs.open_input_file(f"{rgw_bucket}/big.bin") as f:
        assert f.size() == len(data)
        assert f.read_at(16, 12 * MiB) == data[12 * MiB:12 * MiB + 16]
        f.seek(0)
        assert f.read() == data


_PYARROW_MULTIPART = r"""
import os, sys
import pyarrow.fs as pafs
endpoint, key, secret, bucket = sys.argv[1:5]
scheme, _, hostport = endpoint.partition("://")
fs = pafs.S3FileSystem(endpoint_override=hostport, scheme=scheme, access_key=key, secret_key=secret,
                       region="us-east-1")
try:
    with fs.open_output_stream(bucket + "/mp-probe.bin") as f:
        f.write(b"z" * (12 * 1024 * 1024))
except OSError as exc:
    print("FAILED", exc)
    sys.exit(3)
print("OK")
"""


@pytest.mark.parametrize("checksum_env", [None, "when_required"])
def test_pyarrow_multipart_needs_checksum_when_required(rgw_env, rgw_bucket, checksum_env):
    """The measured fact flows.storage.objects relies on: pyarrow's AWS SDK sends CRC checksums with
    multipart parts by default, which this radosgw refuses (411 MissingContentLength), and
    AWS_REQUEST_CHECKSUM_CALCULATION=when_required fixes it.  Fresh processes, because the SDK
    reads the variable from the process environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION")}
    if checksum_env:
        env["AWS_REQUEST_CHECKSUM_CALCULATION"] = checksum_env
        env["AWS_RESPONSE_CHECKSUM_VALIDATION"] = checksum_env
    proc = subprocess.run(
        [sys.executable, "-c", _PYARROW_MULTIPART, rgw_env["CJE_RGW_ENDPOINT"],
         rgw_env["AWS_ACCESS_KEY_ID"], rgw_env["AWS_SECRET_ACCESS_KEY"], rgw_bucket],
        env=env, capture_output=True, text=True, timeout=120)
    if checksum_env:
        assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    else:
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "411" in proc.stdout or "MissingContentLength" in proc.stdout, proc.stdout


# --------------------------------------------------------------------------- flows.storage.objects


def _storage(rgw_env, bucket, prefix="root", **overrides):
    from flows.storage.objects import Storage, StorageConfig

    cfg = StorageConfig.from_env(rgw_env, **overrides)
    return Storage.for_uri(f"s3://{bucket}/{prefix}", cfg)


def test_storage_config_from_env_file(rgw_env):
    from flows.storage.objects import StorageConfig

    cfg = StorageConfig.from_env(rgw_env)
    assert cfg.endpoint_url == rgw_env["CJE_S3_ENDPOINT"] == rgw_env["CJE_RGW_ENDPOINT"]
    assert cfg.access_key == rgw_env["AWS_ACCESS_KEY_ID"]
    assert rgw_env["AWS_SECRET_ACCESS_KEY"] not in repr(cfg)
    assert rgw_env["AWS_SECRET_ACCESS_KEY"] not in str(cfg.to_dict())


def test_storage_roundtrip(rgw_env, rgw_s3, rgw_bucket):
    st = _storage(rgw_env, rgw_bucket)
    st.write_bytes("a/one.json", b'{"x": 1}')
    assert st.read_bytes("a/one.json") == b'{"x": 1}'
    assert st.exists("a/one.json") and not st.exists("a/two.json")

    assert st.put_if_absent("a/two.json", b"first") is True
    assert st.put_if_absent("a/two.json", b"second") is False
    assert st.read_bytes("a/two.json") == b"first"

    listed = st.list("a/")
    assert [o.key for o in listed] == ["a/one.json", "a/two.json"]
    assert [o.size for o in listed] == [8, 5]
    # Keys are relative to the root: the bucket really holds them under the prefix.
    raw = sorted(o["Key"] for o in rgw_s3.list_objects_v2(Bucket=rgw_bucket, Prefix="root/a/")["Contents"])
    assert raw == ["root/a/one.json", "root/a/two.json"]
    info = st.info("a/two.json")
    assert info.size == 5
    assert info.etag_or_mtime == rgw_s3.head_object(Bucket=rgw_bucket, Key="root/a/two.json")["ETag"].strip('"')

    st.delete("a/one.json")
    assert [o.key for o in st.list("a/")] == ["a/two.json"]
    st.delete("a/one.json")  # deleting a missing key is not an error


def test_storage_put_if_absent_race(rgw_env, rgw_bucket):
    """Separate Storage objects (as separate workers would have) race create-only writes."""
    n = 6
    stores = [_storage(rgw_env, rgw_bucket) for _ in range(n)]
    stores[0].write_bytes("warmup", b"")  # not part of the race
    for r in range(3):
        key = f"manifest-{r}.json"
        barrier = threading.Barrier(n)

        def attempt(i: int) -> bool:
            barrier.wait()
            return stores[i].put_if_absent(key, f"writer-{i}".encode())

        with ThreadPoolExecutor(n) as pool:
            won = list(pool.map(attempt, range(n)))
        assert sum(won) == 1, won
        assert stores[0].read_bytes(key) == f"writer-{won.index(True)}".encode()


def test_storage_arrow_fs_dataset(rgw_env, rgw_bucket):
    st = _storage(rgw_env, rgw_bucket, prefix="lake")
    fs, base = st.arrow_fs
    table = _log_table(n=900, seed=9)
    ds.write_dataset(table, f"{base}/logs", format="parquet", filesystem=fs,
                     partitioning=ds.partitioning(pa.schema([("dt", pa.string())]), flavor="hive"))
    # Storage.list returns what is stored, pyarrow's zero-byte "dir/" markers included.
    listed = st.list("logs/")
    keys = [o.key for o in listed if o.key.endswith(".parquet")]
    assert len(keys) == 3 and all(k.startswith("logs/dt=2024-05-0") for k in keys)
    assert all(o.size == 0 for o in listed if o.key.endswith("/"))
    got = ds.dataset(f"{base}/logs", filesystem=fs, format="parquet", partitioning="hive").to_table(
        filter=pc.field("dt") == "2024-05-03", columns=["response_id"])
    assert got.num_rows == pc.sum(pc.equal(table["dt"], "2024-05-03")).as_py()


def test_storage_errors_name_object_and_hide_secrets(rgw_env, rgw_bucket):
    from flows.storage.objects import NotFoundError, StorageError

    st = _storage(rgw_env, rgw_bucket)
    with pytest.raises(NotFoundError) as info:
        st.read_bytes("no/such.json")
    assert f"s3://{rgw_bucket}/root/no/such.json" in str(info.value)
    assert info.value.key == "no/such.json"

    secret = "wrong-secret-" + uuid.uuid4().hex
    bad = _storage(dict(rgw_env, AWS_SECRET_ACCESS_KEY=secret), rgw_bucket, max_attempts=1)
    with pytest.raises(StorageError) as info:
        bad.write_bytes("x.json", b"{}")
    text = str(info.value) + repr(info.value)
    assert f"s3://{rgw_bucket}/root/x.json" in text
    assert secret not in text and rgw_env["AWS_ACCESS_KEY_ID"] not in text
    assert info.value.__cause__ is None


# --------------------------------------------------------------------------- bucket policy


def test_bucket_policy_lets_the_flow_read_and_publish_but_not_delete(rgw_env, rgw_s3, rgw_bucket):
    """infra/bucket-policy.json, applied on radosgw to an unprivileged user, is enough for what
    the evaluate flow does (discover + read logs, read labels, publish and re-publish a run,
    read it back) and refuses deletes, writes outside results/ and reads outside the prefixes.

    Not checked here: the create-only condition on labels/ (``s3:if-none-match``), which AWS S3
    evaluates and this radosgw (Ceph 16) does not know, so it refuses every label PUT of the
    service user; the owner writes the labels below.
    """
    import json
    from datetime import datetime, timezone
    from pathlib import Path

    from flows.storage.labels import LabelStore
    from flows.storage.logs import discover_partitions, read_window, write_logs
    from flows.storage.publish import publish_run, read_latest
    from flows.storage.objects import StorageError

    repo = Path(__file__).resolve().parents[2]
    policy = (repo / "infra" / "bucket-policy.json").read_text()
    policy = policy.replace("arn:aws:s3:::cje-data", f"arn:aws:s3:::{rgw_bucket}").replace(
        "arn:aws:iam::123456789012:role/cje-service", f"arn:aws:iam:::user/{rgw_env['CJE_RGW_SERVICE_USER']}")
    rgw_s3.put_bucket_policy(Bucket=rgw_bucket, Policy=policy)

    # The owner writes logs and labels (the serving system and the labelling job).
    n = 400
    rng = np.random.default_rng(1)
    ts = [datetime(2024, 6, 1 + (i % 2), 12, tzinfo=timezone.utc) for i in range(n)]
    logs = pa.table({
        "prompt_id": [f"p{i // 2}" for i in range(n)],
        "policy": ["base", "clone"] * (n // 2),
        "judge_score": rng.random(n),
        "response_id": [f"r{i}" for i in range(n)],
        "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
        "response_length": rng.integers(10, 500, n),
    })
    owner_logs = _storage(rgw_env, rgw_bucket, prefix="logs")
    write_logs(owner_logs, logs)
    owner_root = _storage(rgw_env, rgw_bucket, prefix="", conditional_writes="native")
    labels = pa.table({"response_id": [f"r{i}" for i in range(0, n, 10)],
                       "oracle_label": rng.random(n // 10)})
    assert LabelStore(owner_root).append(labels, "batch-1") == 1

    svc_env = dict(rgw_env, AWS_ACCESS_KEY_ID=rgw_env["CJE_RGW_SERVICE_ACCESS_KEY"],
                   AWS_SECRET_ACCESS_KEY=rgw_env["CJE_RGW_SERVICE_SECRET_KEY"])
    svc_logs = _storage(svc_env, rgw_bucket, prefix="logs", max_attempts=1)
    svc_root = _storage(svc_env, rgw_bucket, prefix="", max_attempts=1, conditional_writes="native")

    files = discover_partitions(svc_logs, "2024-06-01", "2024-06-02")
    assert len(files) == 2
    table = read_window(svc_logs, files, columns=["response_id", "policy", "judge_score"])
    assert table.num_rows == n
    assert LabelStore(svc_root).read().num_rows == n // 10

    result = (repo / "tests" / "fixtures" / "result_example.json").read_bytes()
    out1 = publish_run(svc_root, "policy-test", "2024-06-01..2024-06-02", "k1",
                       artifacts={"result.json": result}, manifest={"seed": 0})
    assert out1.published
    out2 = publish_run(svc_root, "policy-test", "2024-06-01..2024-06-02", "k1",
                       artifacts={"result.json": result}, manifest={"seed": 0})
    assert not out2.published and out2.reason == "already published"
    latest = read_latest(svc_root, "policy-test")
    assert latest is not None and latest["run_key"] == "k1"
    assert latest["result"] == json.loads(result)

    # Refused: deletes anywhere, writing logs, overwriting labels, reading outside the prefixes.
    svc_s3 = make_s3_client(svc_env, retries={"max_attempts": 1, "mode": "standard"})
    run_keys = [o.key for o in svc_root.list("results/policy-test/")]
    for key in (run_keys[0], f"logs/{files[0].key}", "labels/_commits/v000001.json"):
        with pytest.raises(ClientError) as info:
            svc_s3.delete_object(Bucket=rgw_bucket, Key=key)
        assert info.value.response["Error"]["Code"] == "AccessDenied", key
    with pytest.raises(StorageError):
        svc_logs.write_bytes("dt=2024-06-03/evil.parquet", b"x")
    with pytest.raises(ClientError) as info:
        svc_s3.put_object(Bucket=rgw_bucket, Key="labels/_commits/v000001.json", Body=b"{}")
    assert info.value.response["Error"]["Code"] == "AccessDenied"
    rgw_s3.put_object(Bucket=rgw_bucket, Key="private/notes.txt", Body=b"owner only")
    with pytest.raises(ClientError) as info:
        svc_s3.get_object(Bucket=rgw_bucket, Key="private/notes.txt")
    assert info.value.response["Error"]["Code"] == "AccessDenied"
    # A missing key is "not found", not "denied" (S3 answers 403 for a missing key unless the
    # caller may list the bucket): the publisher relies on it to see an unpublished run.
    with pytest.raises(ClientError) as info:
        svc_s3.get_object(Bucket=rgw_bucket, Key="results/policy-test/none.json")
    assert _status(info.value) == 404
    # Everything the owner and the service wrote is still there.
    assert {o.key for o in svc_root.list("results/policy-test/")} == set(run_keys)
