"""The storage layer against a local folder and a real S3-protocol server (moto in server mode)."""
from __future__ import annotations

import errno
import logging
import os
import pickle
import threading
import time

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from cje_engine.errors import CJEInputError
from flows.storage.local import LocalStorage
from flows.storage.objects import (
    ENV_VARS,
    NotFoundError,
    Storage,
    StorageConfig,
    StorageError,
    with_retries,
)
from flows.storage.s3 import S3Storage
from tests.storage.conftest import ACCESS_KEY, SECRET_KEY, closed_port_endpoint, make_s3_config, new_bucket


# --------------------------------------------------------------------------- configuration


def test_config_from_env_reads_standard_variables_and_repr_hides_secrets():
    env = {"AWS_ENDPOINT_URL": "http://aws-endpoint:1", "AWS_DEFAULT_REGION": "eu-west-3",
           "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_SESSION_TOKEN": "tok-SECRET-1234",
           "CJE_S3_MAX_ATTEMPTS": "7"}
    cfg = StorageConfig.from_env(env)
    assert (cfg.endpoint_url, cfg.region, cfg.access_key, cfg.secret_key, cfg.max_attempts) == (
        "http://aws-endpoint:1", "eu-west-3", ACCESS_KEY, SECRET_KEY, 7)
    # CJE_S3_ENDPOINT wins over AWS_ENDPOINT_URL; AWS_REGION over AWS_DEFAULT_REGION.
    cfg2 = StorageConfig.from_env({**env, "CJE_S3_ENDPOINT": "http://cje:2", "AWS_REGION": "us-west-2"})
    assert (cfg2.endpoint_url, cfg2.region) == ("http://cje:2", "us-west-2")
    for text in (repr(cfg), str(cfg), str(cfg.to_dict()), f"{cfg}"):
        assert SECRET_KEY not in text and ACCESS_KEY not in text and "tok-SECRET-1234" not in text
    assert "eu-west-3" in repr(cfg)
    # to_dict(include_secrets=True) / from_dict round-trip (for shipping to Ray workers).
    assert StorageConfig.from_dict(cfg.to_dict(include_secrets=True)) == cfg
    assert StorageConfig.from_dict(cfg.to_dict()).secret_key is None
    assert set(ENV_VARS) <= {f for f in StorageConfig.__dataclass_fields__}


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="CJE_S3_MAX_ATTEMPTS"):
        StorageConfig.from_env({"CJE_S3_MAX_ATTEMPTS": "many"})
    with pytest.raises(ValueError, match="unknown storage configuration keys"):
        StorageConfig.from_dict({"endpoint": "x"})
    with pytest.raises(ValueError, match="conditional_writes"):
        StorageConfig(conditional_writes="sometimes")


def test_endpoint_userinfo_is_redacted():
    cfg = StorageConfig(endpoint_url="http://user:pa55-word-xyz@host:9000")
    assert "pa55-word-xyz" not in repr(cfg)
    assert "host:9000" in repr(cfg)


def test_for_uri_dispatch(tmp_path):
    cfg = StorageConfig(region="us-east-1")
    s3 = Storage.for_uri("s3://my-bucket/some/prefix/", cfg)
    assert isinstance(s3, S3Storage) and (s3.bucket, s3.prefix) == ("my-bucket", "some/prefix")
    assert s3.url("a/b") == "s3://my-bucket/some/prefix/a/b"
    loc = Storage.for_uri(f"file://{tmp_path}/x", cfg)
    assert isinstance(loc, LocalStorage) and loc.root == (tmp_path / "x").resolve()
    assert isinstance(Storage.for_uri(tmp_path), LocalStorage)
    with pytest.raises(CJEInputError, match="never in a URI") as err:
        Storage.for_uri(f"s3://AK:{SECRET_KEY}@bucket/p", cfg)
    assert SECRET_KEY not in str(err.value) and "AWS_ACCESS_KEY_ID" in str(err.value)
    with pytest.raises(ValueError, match="unsupported storage URI"):
        Storage.for_uri("gs://bucket/p", cfg)


# --------------------------------------------------------------------------- basic operations


def test_roundtrip_list_info_delete(storage: Storage):
    storage.write_bytes("a/one.txt", b"1")
    storage.write_bytes("a/two.txt", b"22")
    storage.write_bytes("b/three.txt", b"333")
    storage.write_bytes("a/one.txt", b"111")  # replace
    assert storage.read_bytes("a/one.txt") == b"111"
    assert [o.key for o in storage.list()] == ["a/one.txt", "a/two.txt", "b/three.txt"]
    assert [o.key for o in storage.list("a/")] == ["a/one.txt", "a/two.txt"]
    assert [o.key for o in storage.list("a/t")] == ["a/two.txt"]
    assert storage.list("nothing/") == []
    info = storage.info("b/three.txt")
    assert info.size == 3 and info.etag_or_mtime and info.modified and info.modified > 1.6e9
    assert info == [o for o in storage.list("b/")][0]
    assert storage.exists("a/two.txt") and not storage.exists("a/zzz")
    storage.delete("a/two.txt")
    storage.delete("a/two.txt")  # deleting a missing key is fine
    assert not storage.exists("a/two.txt")
    assert storage.delete_prefix("a/") == 1
    assert [o.key for o in storage.list()] == ["b/three.txt"]


def test_missing_key_raises_not_found_naming_the_key(storage: Storage):
    with pytest.raises(NotFoundError) as err:
        storage.read_bytes("no/such/key.json")
    assert "no/such/key.json" in str(err.value) and err.value.key == "no/such/key.json"
    with pytest.raises(NotFoundError):
        storage.info("no/such/key.json")


def test_invalid_keys_rejected(storage: Storage):
    for bad in ["", "/abs", "a/../b", "a//b", "./a", "a\\b"]:
        with pytest.raises(ValueError, match="invalid storage key"):
            storage.write_bytes(bad, b"x")


def test_put_if_absent_creates_once(storage: Storage):
    assert storage.put_if_absent("m/manifest.json", b"first") is True
    assert storage.put_if_absent("m/manifest.json", b"second") is False
    assert storage.read_bytes("m/manifest.json") == b"first"
    # No temporary files are left or listed.
    assert [o.key for o in storage.list()] == ["m/manifest.json"]


def test_put_if_absent_under_concurrency_has_one_winner(storage: Storage):
    """16 threads race to create each of 10 keys; each key must have exactly one creator."""
    n_threads, n_keys = 16, 10
    winners: dict[str, list[int]] = {f"race/{k}": [] for k in range(n_keys)}
    barrier = threading.Barrier(n_threads)
    errors = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            for key in winners:
                if storage.put_if_absent(key, f"writer-{i}".encode() * 1000):
                    winners[key].append(i)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    for key, who in winners.items():
        assert len(who) == 1, (key, who)
        assert storage.read_bytes(key) == f"writer-{who[0]}".encode() * 1000


def test_open_output_is_atomic_and_parquet_readable(storage: Storage):
    table = pa.table({"x": list(range(1000)), "s": [str(i) for i in range(1000)]})
    with storage.open_output("p/data.parquet") as out:
        pq.write_table(table, out)
    fs, base = storage.arrow_fs
    assert pq.read_table(storage.arrow_path("p/data.parquet"), filesystem=fs).equals(table)
    assert storage.arrow_path("p/data.parquet") == f"{base}/p/data.parquet"
    with pytest.raises(RuntimeError, match="boom"):
        with storage.open_output("p/failed.parquet") as out:
            out.write(b"PAR1 partial")
            raise RuntimeError("boom")
    assert not storage.exists("p/failed.parquet")
    assert [o.key for o in storage.list()] == ["p/data.parquet"]


def test_storage_pickles_for_workers(storage: Storage):
    storage.write_bytes("k", b"v")
    clone = pickle.loads(pickle.dumps(storage))
    assert type(clone) is type(storage) and clone.url() == storage.url()
    assert clone.read_bytes("k") == b"v"


def test_pyarrow_dataset_reads_through_s3(s3_storage: S3Storage):
    """pyarrow.dataset with the explicit S3 filesystem: hive partitions, projection, filter."""
    fs, base = s3_storage.arrow_fs
    assert isinstance(fs, pa.fs.S3FileSystem)
    for day, vals in (("2025-01-01", [1, 2, 3]), ("2025-01-02", [4, 5])):
        with s3_storage.open_output(f"ds/dt={day}/part.parquet") as out:
            pq.write_table(pa.table({"v": vals, "w": [x * 10 for x in vals]}), out)
    dataset = ds.dataset(f"{base}/ds", filesystem=fs, format="parquet", partitioning="hive")
    got = dataset.to_table(columns=["v"], filter=(ds.field("dt") == "2025-01-02"))
    assert got.column_names == ["v"] and got.column("v").to_pylist() == [4, 5]


# --------------------------------------------------------------------------- conditional-write fallback


def test_emulated_conditional_writes(s3_endpoint: str):
    """The documented fallback for servers without If-None-Match (forced here) still creates once."""
    cfg = make_s3_config(s3_endpoint, conditional_writes="emulated")
    bucket = new_bucket(s3_endpoint, cfg)
    st = Storage.for_uri(f"s3://{bucket}", cfg)
    assert st._conditional_mode() == "emulated"
    assert st.put_if_absent("k", b"1") is True
    assert st.put_if_absent("k", b"2") is False
    assert st.read_bytes("k") == b"1"


def test_auto_mode_detects_native_conditional_writes(s3_storage: S3Storage):
    assert s3_storage._conditional_mode() == "native"  # moto 5.2.5 answers 412 to If-None-Match: *
    assert s3_storage.list(".cje-probe/") == []  # the probe cleans up


# --------------------------------------------------------------------------- failures, retries, secrets


SESSION_TOKEN = "FwoGZXIvYXdzEXAMPLE-session-token-LEAKCHECK"


def _assert_no_secret(text: str) -> None:
    assert SECRET_KEY not in text
    assert ACCESS_KEY not in text
    assert SESSION_TOKEN not in text


def test_unreachable_endpoint_fails_cleanly_without_secrets(caplog):
    with closed_port_endpoint() as endpoint:
        cfg = make_s3_config(endpoint, max_attempts=2, connect_timeout=0.5, session_token=SESSION_TOKEN)
        st = Storage.for_uri("s3://bucket-x/pre", cfg)
        caplog.set_level(logging.DEBUG)
        for op in (lambda: st.read_bytes("data/x.json"), lambda: st.write_bytes("data/x.json", b"1"),
                   lambda: st.put_if_absent("data/x.json", b"1"), lambda: st.list("data/")):
            t0 = time.monotonic()
            with pytest.raises(StorageError) as err:
                op()
            assert time.monotonic() - t0 < 20
            msg = str(err.value)
            assert "s3://bucket-x/pre/data" in msg or "s3://bucket-x/pre/." in msg
            _assert_no_secret(msg)
            _assert_no_secret(repr(err.value))
            assert err.value.__cause__ is None and err.value.__suppress_context__
    _assert_no_secret(caplog.text)


def test_hanging_endpoint_times_out_with_retries(black_hole, caplog):
    cfg = make_s3_config(black_hole.endpoint, max_attempts=2, connect_timeout=0.5, read_timeout=0.5)
    st = Storage.for_uri("s3://bucket-y", cfg)
    t0 = time.monotonic()
    with pytest.raises(StorageError) as err:
        st.read_bytes("slow/key.json")
    elapsed = time.monotonic() - t0
    # Two attempts of a 0.5 s read timeout (plus backoff) - not an indefinite hang.
    assert 0.9 <= elapsed < 15, elapsed
    assert "s3://bucket-y/slow/key.json" in str(err.value)
    assert len(black_hole.conns) >= 2  # it really retried
    _assert_no_secret(str(err.value) + caplog.text)


def test_missing_bucket_error_names_bucket_without_secrets(s3_endpoint: str, caplog):
    cfg = make_s3_config(s3_endpoint)
    st = Storage.for_uri("s3://bucket-that-does-not-exist/p", cfg)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(StorageError, match="bucket 'bucket-that-does-not-exist' does not exist") as err:
        st.write_bytes("k.json", b"1")
    assert "s3://bucket-that-does-not-exist/p/k.json" in str(err.value)
    _assert_no_secret(str(err.value) + caplog.text)


def test_transient_outage_is_retried_by_boto3_and_pyarrow(s3_endpoint: str, fault_proxy):
    """Connections reset by a proxy in front of the real server: retried, then succeed."""
    direct = make_s3_config(s3_endpoint)
    bucket = new_bucket(s3_endpoint, direct)
    via_proxy = make_s3_config(fault_proxy.endpoint, max_attempts=4)
    st = Storage.for_uri(f"s3://{bucket}/p", via_proxy)
    st.write_bytes("obj.json", b"payload")
    with st.open_output("t.parquet") as out:
        pq.write_table(pa.table({"x": [1, 2, 3]}), out)

    fault_proxy.drop_next(2)
    assert st.read_bytes("obj.json") == b"payload"
    assert fault_proxy.dropped == 2

    fault_proxy.drop_next(2)
    fs, _ = st.arrow_fs
    got = st.read_with_retries("t.parquet", lambda: pq.read_table(st.arrow_path("t.parquet"), filesystem=fs))
    assert got.column("x").to_pylist() == [1, 2, 3]
    assert fault_proxy.dropped == 4


def test_persistent_outage_gives_storage_error_after_bounded_retries(s3_endpoint: str, fault_proxy, caplog):
    direct = make_s3_config(s3_endpoint)
    bucket = new_bucket(s3_endpoint, direct)
    st = Storage.for_uri(f"s3://{bucket}/p", make_s3_config(fault_proxy.endpoint, max_attempts=3))
    st.write_bytes("obj.json", b"payload")
    fault_proxy.down = True
    before = fault_proxy.dropped
    with pytest.raises(StorageError) as err:
        st.read_bytes("obj.json")
    assert f"s3://{bucket}/p/obj.json" in str(err.value)
    assert fault_proxy.dropped - before >= 3  # max_attempts requests were made
    _assert_no_secret(str(err.value) + caplog.text)


def test_with_retries_bounded_and_scrubbed():
    calls = []
    cfg = StorageConfig(secret_key=SECRET_KEY)

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError("transient")
        return "ok"

    assert with_retries(flaky, what="read", key="k", attempts=3, base_delay=0.001) == "ok"
    assert len(calls) == 3

    def always():
        raise OSError(f"denied for secret {SECRET_KEY}")

    with pytest.raises(StorageError) as err:
        with_retries(always, what="read", key="some/key", attempts=2, base_delay=0.001, config=cfg)
    assert "some/key" in str(err.value) and "2 attempt" in str(err.value)
    _assert_no_secret(str(err.value))
    with pytest.raises(KeyError):  # non-storage errors are not swallowed
        with_retries(lambda: {}["x"], what="read", key="k", attempts=3)


def test_local_os_error_is_storage_error_naming_the_path(tmp_path):
    st = LocalStorage(tmp_path / "root")
    st.write_bytes("x/a", b"1")
    with pytest.raises(StorageError) as err:  # "x/a" is a file, so it cannot be a folder
        st.write_bytes("x/a/b", b"2")
    assert str(tmp_path / "root" / "x" / "a" / "b") in str(err.value)
    assert err.value.key == "x/a/b" and err.value.operation == "write"
    with pytest.raises(StorageError):
        st.put_if_absent("x/a/c", b"3")


def test_a_killed_writers_temporary_files_are_swept_by_the_next_write(tmp_path):
    """kill -9 during a local write leaves a ``.cje-tmp-*`` file; the next write into that folder
    removes it once it is stale (untouched for an hour), never a live writer's fresh one."""
    import os

    from flows.storage.local import LocalStorage
    from flows.storage.objects import TMP_PREFIX, STALE_TMP_SECONDS

    st = LocalStorage(tmp_path)
    (tmp_path / "results").mkdir()
    stale = tmp_path / "results" / f"{TMP_PREFIX}dead-result.json"
    fresh = tmp_path / "results" / f"{TMP_PREFIX}live-result.json"
    for p in (stale, fresh):
        p.write_bytes(b"partial")
    old = time.time() - STALE_TMP_SECONDS - 60
    os.utime(stale, (old, old))
    st.write_bytes("results/other.json", b"{}")
    assert not stale.exists() and fresh.exists()
    os.utime(fresh, (old, old))
    with st.open_output("results/table.parquet") as out:
        out.write(b"x")
    assert not fresh.exists()
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["other.json", "table.parquet"]


class _FullDisk:
    """A file object whose writes store half the bytes, then fail with ENOSPC (a disk filling up)."""

    def __init__(self, fh):
        self.fh = fh

    def write(self, data):
        self.fh.write(bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()
        return False

    def __getattr__(self, name):
        return getattr(self.fh, name)


def test_a_full_disk_leaves_no_temporary_file_per_retry(tmp_path, monkeypatch):
    """Issue 25: ENOSPC inside an atomic local write left one partial ``.cje-tmp-*`` file per retry.  Now
    every failed write removes its temporary file (and a partial object of the no-hard-link path), and
    the error names the object."""
    import builtins

    import flows.storage.local as local_module
    from flows.storage.local import LocalStorage
    from flows.storage.publish import publish_run
    from tests.storage.test_publish import LINEAGE, artifacts_for

    st = LocalStorage(tmp_path / "store")
    real_open, real_fdopen = builtins.open, os.fdopen
    monkeypatch.setattr(local_module, "open", lambda *a, **k: _FullDisk(real_open(*a, **k)), raising=False)
    for attempt in range(3):
        for call in (st.write_bytes, st.put_if_absent):
            with pytest.raises(StorageError, match=r"results/x\.json failed: OSError: .*No space left on device"):
                call("results/x.json", b"0123456789" * 100)
        with pytest.raises(StorageError, match="No space left on device"):
            publish_run(st, "ev", "w", "k", artifacts_for(), LINEAGE)
    # no hard links on this filesystem: the exclusive-create path removes its partial object too
    monkeypatch.setattr(local_module, "open", real_open)
    monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EPERM, "no links")))
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: _FullDisk(real_fdopen(*a, **k)))
    with pytest.raises(StorageError, match="No space left on device"):
        st.put_if_absent("results/y.json", b"0123456789" * 100)
    monkeypatch.undo()
    left = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "store").rglob("*") if p.is_file())
    assert left == []
    assert st.put_if_absent("results/y.json", b"ok") and st.read_bytes("results/y.json") == b"ok"
