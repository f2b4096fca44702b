"""Gated, atomic, idempotent publishing on local folders and S3 (moto server)."""
from __future__ import annotations

import hashlib
import io
import json
import multiprocessing as mp
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cje_engine.errors import CJEInputError
from flows.storage.publish import (
    PublishGateError,
    cleanup_orphans,
    fingerprint_inputs,
    list_runs,
    publish_run,
    read_latest,
    read_run,
    run_key,
)
from flows.pipelines.pages import contextual_report
from flows.storage.objects import TMP_PREFIX, ObjectInfo, Storage, StorageConfig, StorageError
from tests.storage.conftest import SECRET_KEY

RESULT_EXAMPLE = Path(__file__).resolve().parents[1] / "fixtures" / "result_example.json"


def example_result() -> dict:
    return json.loads(RESULT_EXAMPLE.read_text())


def policy_parquet(result: dict) -> bytes:
    names = sorted(result["policies"])
    table = pa.table({"policy": names, "level_claim": [result["policies"][n]["level_claim"] for n in names],
                      "estimate": [result["policies"][n]["estimate"] for n in names]})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def artifacts_for(result: dict | None = None, report: str = "<html>report</html>") -> dict[str, bytes]:
    result = example_result() if result is None else result
    return {"result.json": json.dumps(result, indent=1).encode(), "policies.parquet": policy_parquet(result),
            "report.html": report.encode()}


LINEAGE = {"inputs": {"files": [{"key": "dt=2025-03-01/part-0.parquet", "size": 123, "etag_or_mtime": "abc"}]},
           "rows": 4150, "label_store_version": 3, "config_hash": "c0ffee", "code_version": "0.1.0", "seed": 0}


def _is_page(key: str) -> bool:
    """The service index and trend pages (rebuilt by the evaluate flow after a publish, not by `publish_run`)."""
    return key == "results/index.html" or (key.count("/") == 2 and key.endswith("/trend.html"))


def _run_objects(st: Storage) -> list[str]:
    return [o.key for o in st.list("results/") if not _is_page(o.key)]


# --------------------------------------------------------------------------- basics


def test_publish_layout_manifest_and_latest(storage: Storage):
    arts = artifacts_for()
    out = publish_run(storage, "arena", "2025-03-01_2025-03-07", "k1", arts, LINEAGE, render_report=contextual_report)
    assert out.published and out.reason == "published"
    run = "results/arena/2025-03-01_2025-03-07/k1"
    assert out.path == storage.url(run)
    manifest = json.loads(storage.read_bytes(f"{run}/manifest.json"))
    for k, v in LINEAGE.items():
        assert manifest[k] == v
    assert manifest["run_key"] == "k1" and manifest["window"] == "2025-03-01_2025-03-07"
    assert manifest["published_at"] and manifest["attempt"]
    for name, blob in arts.items():
        entry = manifest["artifacts"][name]
        stored = storage.read_bytes(f"{run}/{entry['key']}")
        if name == "report.html":  # rendered again with the run's context (generated-at, links)
            assert b"generated " in stored and b"href='result.json'" in stored and b"<html>report" not in stored
            blob = stored
        assert stored == blob  # byte for byte: nothing stripped
        assert entry["sha256"] == hashlib.sha256(blob).hexdigest() and entry["size"] == len(blob)
        assert out.artifacts[name] == storage.url(f"{run}/{entry['key']}")
    latest = json.loads(storage.read_bytes("results/arena/latest.json"))
    assert latest["manifest"] == f"{run}/manifest.json" and latest["run_key"] == "k1"
    got = read_latest(storage, "arena")
    assert got["result"] == example_result()
    refused = got["result"]["policies"]["unhelpful"]
    assert refused["level_claim"] == "refused" and refused["refusal_reasons"]
    assert [r["run_key"] for r in list_runs(storage, "arena")] == ["k1"]


def test_storage_renders_nothing_without_a_renderer_and_keeps_the_report_when_it_fails(local_storage: Storage):
    out = publish_run(local_storage, "ev", "w1", "k1", artifacts_for(report="<html>mine</html>"), LINEAGE)
    assert read_run(local_storage, "ev", "w1", "k1")["manifest"]["artifacts"]["report.html"]["size"] == 17
    assert not [o.key for o in local_storage.list("results/") if _is_page(o.key)]  # pages: the flow's step

    def broken(*args: Any) -> bytes:
        raise RuntimeError("no context")

    out = publish_run(local_storage, "ev", "w2", "k1", artifacts_for(report="<html>mine</html>"), LINEAGE,
                      render_report=broken)
    assert out.published and Path(out.artifacts["report.html"]).read_bytes() == b"<html>mine</html>"


def test_rerun_is_idempotent(storage: Storage):
    first = publish_run(storage, "ev", "w1", "k", artifacts_for(report="<html>one</html>"), LINEAGE)
    before = {o.key: o.etag_or_mtime for o in storage.list()}
    again = publish_run(storage, "ev", "w1", "k", artifacts_for(report="<html>two</html>"), LINEAGE)
    assert (again.published, again.reason) == (False, "already published")
    assert again.path == first.path and again.artifacts == first.artifacts
    assert {o.key: o.etag_or_mtime for o in storage.list()} == before  # nothing added or overwritten
    assert read_run(storage, "ev", "w1", "k")["result"] == example_result()
    assert len(list_runs(storage, "ev")) == 1


def test_run_key_is_stable():
    cfg = {"n_bootstrap": 2000, "alpha": 0.05, "policies": ["a", "b"]}
    files = [ObjectInfo("dt=2025-01-01/p.parquet", 10, "e1"), ObjectInfo("dt=2025-01-02/p.parquet", 20, "e2")]
    fp = fingerprint_inputs(files, label_version=2)
    k = run_key(cfg, fp)
    assert len(k) == 20 and k == run_key(dict(reversed(list(cfg.items()))), fingerprint_inputs(files[::-1], 2))
    assert run_key({**cfg, "alpha": 0.1}, fp) != k
    assert run_key(cfg, fingerprint_inputs(files, 3)) != k  # a new label version is a new run
    assert run_key(cfg, fingerprint_inputs([files[0]._replace(etag_or_mtime="e9"), files[1]], 2)) != k
    with pytest.raises(CJEInputError, match="JSON"):
        run_key({"x": object()}, fp)
    with pytest.raises(CJEInputError, match="JSON"):
        run_key({"x": float("nan")}, fp)


@pytest.mark.parametrize("segment", ["../up", "a/b", "", ".hidden"])
def test_unsafe_path_segments_are_rejected(local_storage: Storage, segment: str):
    with pytest.raises(CJEInputError):
        publish_run(local_storage, segment, "w", "k", artifacts_for(), LINEAGE)
    with pytest.raises(CJEInputError):
        publish_run(local_storage, "ev", "w", segment, artifacts_for(), LINEAGE)
    assert local_storage.list() == []


# --------------------------------------------------------------------------- gate


def _mutated(fn) -> dict:
    r = example_result()
    fn(r)
    return r


@pytest.mark.parametrize("mutate, column", [
    (lambda r: r["policies"]["unhelpful"].update(refusal_reasons=[]), "refusal_reasons"),
    (lambda r: r["policies"]["unhelpful"].pop("refusal_reasons"), "refusal_reasons"),
    (lambda r: r["policies"]["unhelpful"].update(refusal_reasons=["  "]), "refusal_reasons"),
    (lambda r: r["policies"]["base"].update(level_claim="maybe"), "level_claim"),
    (lambda r: r.update(best_policy="unhelpful"), "best_policy"),
    (lambda r: r.update(policies={}), "policies"),
])
def test_gate_refuses_unsafe_results_and_writes_nothing(storage: Storage, mutate, column):
    with pytest.raises(PublishGateError) as err:
        publish_run(storage, "ev", "w", "k", artifacts_for(_mutated(mutate)), LINEAGE)
    assert err.value.column == column
    assert _run_objects(storage) == []


def test_gate_checks_policy_table_agrees(local_storage: Storage):
    arts = artifacts_for()
    stripped = _mutated(lambda r: r["policies"]["unhelpful"].update(level_claim="ok", refusal_reasons=[]))
    arts["policies.parquet"] = policy_parquet(stripped)  # the Parquet summary dropped the refusal
    with pytest.raises(PublishGateError, match="unhelpful") as err:
        publish_run(local_storage, "ev", "w", "k", arts, LINEAGE)
    assert err.value.source == "policies.parquet"
    bad = artifacts_for()
    bad["result.json"] = b"{not json"
    with pytest.raises(PublishGateError, match="not valid JSON"):
        publish_run(local_storage, "ev", "w", "k", bad, LINEAGE)
    with pytest.raises(CJEInputError, match="result.json"):
        publish_run(local_storage, "ev", "w", "k", {"report.html": b"x"}, LINEAGE)
    with pytest.raises(CJEInputError, match="reserved"):
        publish_run(local_storage, "ev", "w", "k", artifacts_for(), {"artifacts": {}})
    with pytest.raises(CJEInputError, match="disagrees"):
        publish_run(local_storage, "ev", "w", "k", artifacts_for(), {"window": "other"})
    with pytest.raises(CJEInputError, match="must be bytes"):
        publish_run(local_storage, "ev", "w", "k", {**artifacts_for(), "report.html": "<html>str</html>"}, LINEAGE)
    with pytest.raises(CJEInputError, match="plain file name"):
        publish_run(local_storage, "ev", "w", "k", {**artifacts_for(), "manifest.json": b"{}"}, LINEAGE)
    with pytest.raises(CJEInputError, match="JSON data"):
        publish_run(local_storage, "ev", "w", "k", artifacts_for(), {"not_json": object()})
    assert local_storage.list() == []


def test_credentials_are_never_published(s3_storage: Storage, caplog):
    leaky = dict(LINEAGE, storage=s3_storage.config.to_dict(include_secrets=True))
    with pytest.raises(PublishGateError, match="credential") as err:
        publish_run(s3_storage, "ev", "w", "k", artifacts_for(), leaky)
    assert SECRET_KEY not in str(err.value) + caplog.text
    arts = artifacts_for(report=f"<html>{SECRET_KEY}</html>")
    with pytest.raises(PublishGateError, match="credential"):
        publish_run(s3_storage, "ev", "w", "k", arts, LINEAGE)
    assert _run_objects(s3_storage) == []
    # The safe form of the configuration is fine to record.
    ok = publish_run(s3_storage, "ev", "w", "k", artifacts_for(), dict(LINEAGE, storage=s3_storage.config.to_dict()))
    assert ok.published
    for o in s3_storage.list():
        assert SECRET_KEY.encode() not in s3_storage.read_bytes(o.key)


# --------------------------------------------------------------------------- failures


class FaultyStorage(Storage):
    """Delegates to a real storage; raises (or dies) on the n-th write of a chosen kind."""

    def __init__(self, inner: Storage, fail_on_write: int | None = None, fail_key_suffix: str | None = None,
                 kill: bool = False) -> None:
        self.inner, self.uri, self.config = inner, inner.uri, inner.config
        self.fail_on_write, self.fail_key_suffix, self.kill = fail_on_write, fail_key_suffix, kill
        self.writes: list[str] = []

    def _maybe_fail(self, key: str) -> None:
        self.writes.append(key)
        hit = (self.fail_on_write is not None and len(self.writes) == self.fail_on_write) or (
            self.fail_key_suffix is not None and key.endswith(self.fail_key_suffix))
        if hit:
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise StorageError(f"write {self.url(key)} failed: injected fault", key=key, operation="write")

    def write_bytes(self, key, data):
        self._maybe_fail(key)
        self.inner.write_bytes(key, data)

    def put_if_absent(self, key, data):
        self._maybe_fail(key)
        return self.inner.put_if_absent(key, data)

    def read_bytes(self, key):
        return self.inner.read_bytes(key)

    def info(self, key):
        return self.inner.info(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, key):
        self.inner.delete(key)

    @property
    def arrow_fs(self):
        return self.inner.arrow_fs

    def url(self, key=""):
        return self.inner.url(key)

    def open_output(self, key):
        return self.inner.open_output(key)


def test_failure_midway_leaves_nothing_visible_and_retry_succeeds(storage: Storage):
    faulty = FaultyStorage(storage, fail_on_write=2)  # result.json written, policies.parquet fails
    with pytest.raises(StorageError, match="injected fault"):
        publish_run(faulty, "ev", "w", "k", artifacts_for(), LINEAGE)
    assert list_runs(storage, "ev") == [] and read_latest(storage, "ev") is None
    assert _run_objects(storage) == []  # the failed attempt removed what it wrote
    out = publish_run(storage, "ev", "w", "k", artifacts_for(), LINEAGE)
    assert out.published and read_latest(storage, "ev")["result"] == example_result()


def test_commit_failure_leaves_nothing_visible(storage: Storage):
    faulty = FaultyStorage(storage, fail_key_suffix="manifest.json")
    with pytest.raises(StorageError):
        publish_run(faulty, "ev", "w", "k", artifacts_for(), LINEAGE)
    assert _run_objects(storage) == [] and read_latest(storage, "ev") is None


def test_latest_moves_only_after_manifest_and_is_repaired(storage: Storage):
    faulty = FaultyStorage(storage, fail_key_suffix="latest.json")
    with pytest.raises(StorageError):
        publish_run(faulty, "ev", "w", "k", artifacts_for(), LINEAGE)
    order = [k.rsplit("/", 1)[-1] for k in faulty.writes]
    assert order.index("manifest.json") < order.index("latest.json") == len(order) - 1
    assert order.index("manifest.json") > max(order.index(n) for n in ("result.json", "report.html",
                                                                        "policies.parquet"))
    # Died between manifest and pointer: the run is complete and found by listing ...
    assert not storage.exists("results/ev/latest.json")
    assert read_latest(storage, "ev")["run_key"] == "k"
    # ... and the next publish of the same run repairs the pointer without writing a new run.
    again = publish_run(storage, "ev", "w", "k", artifacts_for(), LINEAGE)
    assert again.reason == "already published"
    assert json.loads(storage.read_bytes("results/ev/latest.json"))["run_key"] == "k"


def test_latest_never_moves_back(storage: Storage):
    publish_run(storage, "ev", "w1", "old", artifacts_for(), LINEAGE)
    publish_run(storage, "ev", "w2", "new", artifacts_for(), LINEAGE)
    assert read_latest(storage, "ev")["run_key"] == "new"
    assert publish_run(storage, "ev", "w1", "old", artifacts_for(), LINEAGE).reason == "already published"
    assert read_latest(storage, "ev")["run_key"] == "new"
    assert [r["run_key"] for r in list_runs(storage, "ev")] == ["old", "new"]
    assert [r["run_key"] for r in list_runs(storage, "ev", window="w1")] == ["old"]


def _mp_context():
    """forkserver with the heavy imports preloaded once: children start in milliseconds instead of
    re-importing pyarrow/boto3/the engine (spawn), and without fork's inherited thread pools."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["flows.storage.publish", "flows.storage.objects", "tests.storage.test_publish"])
    return ctx


def _publish_then_die(uri: str, cfg: dict) -> None:
    st = FaultyStorage(Storage.for_uri(uri, StorageConfig.from_dict(cfg)), fail_on_write=3, kill=True)
    publish_run(st, "ev", "w", "k", artifacts_for(), LINEAGE)


def test_publisher_killed_midway(storage: Storage):
    """SIGKILL after two artifacts: no cleanup ran, yet readers see nothing and a rerun succeeds."""
    ctx = _mp_context()
    proc = ctx.Process(target=_publish_then_die, args=(storage.uri, storage.config.to_dict(include_secrets=True)))
    proc.start()
    proc.join(300)  # bounds a hang only: the first start of the forkserver imports pyarrow, boto3, the engine
    assert proc.exitcode == -signal.SIGKILL
    leftovers = _run_objects(storage)
    assert len(leftovers) == 2 and not any(k.endswith("manifest.json") for k in leftovers)
    assert list_runs(storage, "ev") == [] and read_latest(storage, "ev") is None
    assert cleanup_orphans(storage, "ev", older_than_seconds=3600) == 0  # too young: may still be writing
    out = publish_run(storage, "ev", "w", "k", artifacts_for(), LINEAGE)
    assert out.published
    manifest = read_latest(storage, "ev")["manifest"]
    # The committed run removed the dead attempt's objects.
    assert sorted(_run_objects(storage)) == sorted(
        ["results/ev/latest.json", "results/ev/w/k/manifest.json"]
        + [f"results/ev/w/k/{a['key']}" for a in manifest["artifacts"].values()])


def test_cleanup_orphans_removes_old_uncommitted_attempts(local_storage: Storage, tmp_path):
    """Old by the storage's clock (the objects' modification time, here backdated 2 h): removed, whatever the
    attempt id says (one id from a clock 2 h fast, which the publisher's clock used to keep for 3 h); young:
    kept; the committed run untouched."""
    import os
    import time as _time
    from datetime import datetime, timedelta, timezone

    storage = local_storage
    old = "results/ev/w/k2/20200101T000000Z-deadbeef/result.json"
    fast = f"results/ev/w/k4/{(datetime.now(timezone.utc) + timedelta(hours=2)).strftime('%Y%m%dT%H%M%SZ')}-0badc10c/result.json"
    young = f"results/ev/w/k3/{__import__('flows.storage.publish', fromlist=['x'])._new_attempt()}/result.json"
    for key in (old, fast, young):
        storage.write_bytes(key, b"{}")
    two_hours_ago = _time.time() - 7200
    for key in (old, fast):
        os.utime(tmp_path / "store" / key, (two_hours_ago, two_hours_ago))
    publish_run(storage, "ev", "w", "k1", artifacts_for(), LINEAGE)
    committed = _run_objects(storage)
    assert cleanup_orphans(storage, "ev", older_than_seconds=3600) == 2
    assert not storage.exists(old) and not storage.exists(fast)
    assert storage.exists(young)
    assert set(_run_objects(storage)) == set(committed) - {old, fast}
    assert read_latest(storage, "ev")["run_key"] == "k1"
    assert not [o.key for o in storage.list("results/ev/") if "clock-probe" in o.key]  # the probe is gone


def test_cleanup_orphans_keeps_an_attempt_of_a_slow_publisher_clock(storage: Storage):
    """Issue 25: attempts were dated by the publisher's clock (the attempt id): a publisher whose clock is
    hours slow (here its id says 2020) had its attempt deleted while it was still writing. Dated by the
    storage's own clock the attempt is seconds old and kept; with a limit of 0 s it goes, nothing committed
    with it."""
    slow = "results/ev/w/k2/20200101T000000Z-deadbeef/result.json"
    storage.write_bytes(slow, b"{}")
    publish_run(storage, "ev", "w", "k1", artifacts_for(), LINEAGE)
    committed = _run_objects(storage)
    assert cleanup_orphans(storage, "ev", older_than_seconds=3600) == 0  # was 1
    assert storage.exists(slow)
    assert cleanup_orphans(storage, "ev", older_than_seconds=0) == 1
    assert set(_run_objects(storage)) == set(committed) - {slow}
    assert read_latest(storage, "ev")["run_key"] == "k1"


# --------------------------------------------------------------------------- concurrency


def _check_single_committed(storage: Storage, outcomes: list[Any]) -> None:
    assert sum(o.published for o in outcomes) == 1, outcomes
    assert all(o.reason == "already published" for o in outcomes if not o.published)
    run = read_run(storage, "ev", "w", "k")
    manifest = run["manifest"]
    for name, entry in manifest["artifacts"].items():  # the committed artifacts match their checksums
        assert hashlib.sha256(storage.read_bytes(f"results/ev/w/k/{entry['key']}")).hexdigest() == entry["sha256"]
    attempts = {k.split("/")[4] for k in _run_objects(storage) if k.count("/") == 5}
    assert attempts == {manifest["attempt"]}  # losers left nothing behind
    assert len(list_runs(storage, "ev")) == 1


def test_concurrent_thread_publishers_end_with_one_result(storage: Storage):
    n = 6
    barrier = threading.Barrier(n)
    outcomes, errors = [], []

    def worker(i: int) -> None:
        try:
            arts = artifacts_for(report=f"<html>{'x' * 200_000} writer {i}</html>")
            barrier.wait()
            outcomes.append(publish_run(storage, "ev", "w", "k", arts, dict(LINEAGE, writer=i)))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    _check_single_committed(storage, outcomes)
    entry = read_latest(storage, "ev")["manifest"]["artifacts"]["report.html"]
    # the report is rendered again by each publisher (run context); the committed one is the winner's
    assert hashlib.sha256(storage.read_bytes(f"results/ev/w/k/{entry['key']}")).hexdigest() == entry["sha256"]


def _process_publisher(uri: str, cfg: dict, barrier, queue, i: int) -> None:
    st = Storage.for_uri(uri, StorageConfig.from_dict(cfg))
    arts = artifacts_for(report=f"<html>{'y' * 200_000} process {i}</html>")
    barrier.wait()
    out = publish_run(st, "ev", "w", "k", arts, dict(LINEAGE, writer=i))
    queue.put((out.published, out.reason, out.path))


def test_concurrent_process_publishers_end_with_one_result(storage: Storage):
    ctx = _mp_context()
    n = 3
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_process_publisher,
                         args=(storage.uri, storage.config.to_dict(include_secrets=True), barrier, queue, i))
             for i in range(n)]
    [p.start() for p in procs]
    results = [queue.get(timeout=300) for _ in range(n)]  # bounds a hang only (see test_publisher_killed_midway)
    [p.join(120) for p in procs]
    assert [p.exitcode for p in procs] == [0] * n

    class O:  # adapt tuples to the outcome shape used by the checker
        def __init__(self, t):
            self.published, self.reason, self.path = t

    _check_single_committed(storage, [O(r) for r in results])


def test_publish_with_emulated_conditional_writes(s3_endpoint: str):
    """The fallback for S3 servers without If-None-Match keeps sequential reruns idempotent."""
    from tests.storage.conftest import make_s3_config, new_bucket

    cfg = make_s3_config(s3_endpoint, conditional_writes="emulated")
    st = Storage.for_uri(f"s3://{new_bucket(s3_endpoint, cfg)}/r", cfg)
    assert publish_run(st, "ev", "w", "k", artifacts_for(), LINEAGE).published
    again = publish_run(st, "ev", "w", "k", artifacts_for(report="<html>other</html>"), LINEAGE)
    assert again.reason == "already published"
    assert read_latest(st, "ev")["result"] == example_result()
    assert len(list_runs(st, "ev")) == 1


# --------------------------------------------------------------------------- latest.json compare-and-swap


def test_latest_pointer_race_always_ends_on_the_newest_publication(storage: Storage):
    """Issue 11: in a race between run keys the pointer ended on the older publication in 3 of 100 tries.

    Eight threads advance the pointer with distinct publication times in a shuffled order, released by a
    barrier; with a compare-and-swap the newest must win every round (30 rounds, 240 racing writes).
    """
    import random

    from flows.storage.publish import _advance_latest

    rng = random.Random(0)
    for rnd in range(30):
        stamps = [f"2026-01-01T00:00:{s:02d}+00:00" for s in range(8)]
        rng.shuffle(stamps)
        barrier = threading.Barrier(len(stamps))

        def go(ts: str) -> None:
            barrier.wait()
            _advance_latest(storage, "race", {"published_at": ts, "window": "w", "run_key": ts[-11:-6].replace(":", "")},
                            f"results/race/w/{ts}/manifest.json")

        threads = [threading.Thread(target=go, args=(ts,)) for ts in stamps]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        pointer = json.loads(storage.read_bytes("results/race/latest.json"))
        assert pointer["published_at"] == "2026-01-01T00:00:07+00:00", f"round {rnd}"
        storage.delete("results/race/latest.json")


def test_temp_files_of_killed_writers_are_removed_on_the_next_publish(local_storage: Storage):
    """A kill -9 between the temporary file and the rename leaves a .cje-tmp-* file: the next publish removes
    it once it is older than any live write (60 s); a young one (a writer at work) is kept."""
    publish_run(local_storage, "ev", "w", "k1", artifacts_for(), LINEAGE)
    root = Path(local_storage.url("results"))
    stale = [root / ".cje-tmp-dead-index.html", root / "ev" / "w" / "k1" / ".cje-tmp-dead-manifest.json"]
    young = root / "ev" / ".cje-tmp-live-latest.json"
    for p in stale + [young]:
        p.write_bytes(b"partial")
    for p in stale:
        os.utime(p, (p.stat().st_mtime - 120, p.stat().st_mtime - 120))
    publish_run(local_storage, "ev", "w", "k2", artifacts_for(), LINEAGE)
    assert not any(p.exists() for p in stale) and young.exists()


def test_temp_file_left_by_a_real_kill_is_removed(local_storage: Storage, tmp_path: Path):
    """A child killed with SIGKILL inside a write (after the temporary file, before the rename)."""
    ctx = _mp_context()
    proc = ctx.Process(target=_write_then_die, args=(local_storage.uri,))
    proc.start()
    proc.join(300)  # bounds a hang only (see test_publisher_killed_midway)
    assert proc.exitcode == -signal.SIGKILL
    root = Path(local_storage.url("results"))
    left = list(root.rglob(".cje-tmp-*"))
    assert left, "the killed writer should have left its temporary file"
    for p in left:
        os.utime(p, (p.stat().st_mtime - 120, p.stat().st_mtime - 120))
    publish_run(local_storage, "ev", "w", "k9", artifacts_for(), LINEAGE)
    assert list(root.rglob(".cje-tmp-*")) == []


def _write_then_die(uri: str) -> None:
    st = Storage.for_uri(uri)
    real = os.replace

    def die(*a: Any, **k: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    os.replace = die  # the kill lands between the temporary file and the rename
    try:
        st.write_bytes("results/ev/w/k9/result.json", b"{}")
    finally:
        os.replace = real


# --------------------------------------------------------------------------- lost acknowledgement of the commit


class LostAckStorage(FaultyStorage):
    """The first create-only write of a manifest is stored, then its acknowledgement is lost: the
    client's retried conditional PUT answers 412 (``put_if_absent`` returns False, mode "412") or the
    call fails (mode "raise").  ``unreadable_manifest_reads`` makes that many manifest reads after it
    fail (a storage outage right after the lost response)."""

    def __init__(self, inner: Storage, mode: str, unreadable_manifest_reads: int = 0) -> None:
        super().__init__(inner)
        self.mode, self.lost, self.unreadable = mode, 0, unreadable_manifest_reads

    def put_if_absent(self, key, data):
        if key.endswith("manifest.json") and not self.lost:
            self.lost += 1
            assert self.inner.put_if_absent(key, data)  # stored ...
            if self.mode == "412":
                return False  # ... and the retried request found it there
            raise StorageError(f"create {self.url(key)} failed: connection reset (response lost)", key=key,
                               operation="create")
        return self.inner.put_if_absent(key, data)

    def read_bytes(self, key):
        if key.endswith("manifest.json") and self.lost and self.unreadable > 0:
            self.unreadable -= 1
            raise StorageError(f"read {self.url(key)} failed: injected outage", key=key, operation="read")
        return self.inner.read_bytes(key)


def _assert_one_intact_run(st: Storage, evaluation: str = "ev") -> dict:
    got = read_latest(st, evaluation)
    assert got is not None and got["result"] == example_result()
    run = "results/ev/w/k"
    for entry in got["manifest"]["artifacts"].values():
        assert st.exists(f"{run}/{entry['key']}")
    assert json.loads(st.read_bytes("results/ev/latest.json"))["run_key"] == "k"
    return got


@pytest.mark.parametrize("mode", ["412", "raise"])
def test_a_lost_acknowledgement_of_the_manifest_write_still_publishes(storage: Storage, mode: str):
    """Issue 25: the manifest was stored but the publisher was told 412 (or an error): it deleted the
    run's artifacts, kept the manifest and moved latest.json to it; read_latest failed and every rerun
    said "already published".  Now the manifest read back is ours byte for byte: the publish completes."""
    lossy = LostAckStorage(storage, mode)
    out = publish_run(lossy, "ev", "w", "k", artifacts_for(), LINEAGE)
    assert lossy.lost == 1
    assert (out.published, out.reason) == (True, "published")
    got = _assert_one_intact_run(storage)
    assert out.artifacts == got["artifacts"]
    again = publish_run(storage, "ev", "w", "k", artifacts_for(), LINEAGE)
    assert again.reason == "already published" and _assert_one_intact_run(storage)["manifest"] == got["manifest"]


def test_s3_lost_response_then_412_on_the_retried_conditional_put(s3_storage):
    """The same on the moto S3 server, at the HTTP client: the first conditional PUT of the manifest
    reaches the server, then the client sees 412 PreconditionFailed (what its retry gets)."""
    from botocore.exceptions import ClientError

    real = s3_storage.client
    calls = {"lost": 0}

    class Client:
        def __getattr__(self, name):
            return getattr(real, name)

        def put_object(self, **kw):
            out = real.put_object(**kw)
            if kw.get("IfNoneMatch") == "*" and kw["Key"].endswith("manifest.json") and not calls["lost"]:
                calls["lost"] += 1
                raise ClientError({"Error": {"Code": "PreconditionFailed", "Message": "At least one of the "
                                             "pre-conditions you specified did not hold"},
                                   "ResponseMetadata": {"HTTPStatusCode": 412}}, "PutObject")
            return out

    s3_storage._client = Client()
    out = publish_run(s3_storage, "ev", "w", "k", artifacts_for(), LINEAGE)
    assert calls["lost"] == 1 and out.published
    _assert_one_intact_run(s3_storage)


def test_a_lost_acknowledgement_with_an_unreadable_manifest_keeps_the_artifacts(storage: Storage):
    """Whose manifest it is cannot be told (the read-back fails too): the error is raised, but nothing a
    stored manifest may name is deleted; the rerun finds the run complete."""
    lossy = LostAckStorage(storage, "raise", unreadable_manifest_reads=5)
    with pytest.raises(StorageError, match="response lost"):
        publish_run(lossy, "ev", "w", "k", artifacts_for(), LINEAGE)
    again = publish_run(storage, "ev", "w", "k", artifacts_for(), LINEAGE)
    assert again.reason == "already published"
    _assert_one_intact_run(storage)


def test_a_real_conflict_keeps_the_stored_runs_artifacts(storage: Storage):
    """412 because another attempt committed first: ours are removed, the winner's are kept and pointed at."""
    other: list = []

    class Racing(FaultyStorage):
        def put_if_absent(self, key, data):
            if key.endswith("manifest.json") and not other:  # the other publisher commits first
                other.append(publish_run(self.inner, "ev", "w", "k", artifacts_for(), LINEAGE))
            return self.inner.put_if_absent(key, data)

    out = publish_run(Racing(storage), "ev", "w", "k", artifacts_for(), LINEAGE)
    assert other[0].published and out.reason == "already published" and out.artifacts == other[0].artifacts
    manifest = json.loads(storage.read_bytes("results/ev/w/k/manifest.json"))
    assert sorted(o.key for o in storage.list("results/ev/w/k/")) == sorted(
        ["results/ev/w/k/manifest.json"] + [f"results/ev/w/k/{a['key']}" for a in manifest["artifacts"].values()])
    _assert_one_intact_run(storage)


def test_a_manifest_left_without_its_artifacts_is_repaired_by_the_rerun(storage: Storage):
    """The state the old publisher left behind (manifest and latest.json, artifacts deleted): the rerun
    publishes the run again under a new attempt (compare-and-swap on the broken manifest), keeping its
    publication time; it no longer says "already published" forever."""
    first = publish_run(storage, "ev", "w", "k", artifacts_for(), LINEAGE)
    broken = json.loads(storage.read_bytes("results/ev/w/k/manifest.json"))
    for entry in broken["artifacts"].values():
        storage.delete(f"results/ev/w/k/{entry['key']}")
    with pytest.raises(StorageError):
        read_latest(storage, "ev")
    again = publish_run(storage, "ev", "w", "k", artifacts_for(), LINEAGE)
    assert (again.published, again.reason) == (True, "republished") and again.artifacts != first.artifacts
    got = _assert_one_intact_run(storage)
    assert got["manifest"]["published_at"] == broken["published_at"] and got["manifest"]["repaired_at"]
    assert got["manifest"]["attempt"] != broken["attempt"]
    assert publish_run(storage, "ev", "w", "k", artifacts_for(), LINEAGE).reason == "already published"


def _dated(window: str, label_version: int) -> dict:
    start, end = window.split("_")
    return {**LINEAGE, "window_spec": {"start": start, "end": end}, "labels": {"label_store_version": label_version}}


def test_latest_follows_the_runs_identity_not_the_publishers_clock(storage: Storage, monkeypatch):
    """Issue 25: ``latest.json`` was ordered by the publisher's clock at commit.  A publisher whose clock ran
    2 h fast kept the pointer on its run while the next day's run was published (for 2 h), and a run that
    finished later but was older (a slow run of yesterday's window, a re-evaluation of an old window, a run
    that read an older label-store version) moved the pointer back.  Now the pointer follows the run's
    identity: the window's end and start dates, then the label-store version; the clock only between runs
    of the same window and labels."""
    import flows.storage.publish as publish
    from datetime import datetime as real_datetime, timedelta

    class FastClock(real_datetime):
        @classmethod
        def now(cls, tz=None):
            return real_datetime.now(tz) + timedelta(hours=2)

    monkeypatch.setattr(publish, "datetime", FastClock)
    publish_run(storage, "ev", "2025-03-01_2025-03-03", "fast", artifacts_for(), _dated("2025-03-01_2025-03-03", 1))
    monkeypatch.undo()
    assert read_latest(storage, "ev")["run_key"] == "fast"
    publish_run(storage, "ev", "2025-03-02_2025-03-04", "next", artifacts_for(), _dated("2025-03-02_2025-03-04", 1))
    assert read_latest(storage, "ev")["run_key"] == "next"  # was: "fast" for 2 hours
    # an older window finishing later (a slow run, or new labels for its days) does not move it back
    publish_run(storage, "ev", "2025-03-01_2025-03-03", "late", artifacts_for(), _dated("2025-03-01_2025-03-03", 2))
    assert read_latest(storage, "ev")["run_key"] == "next"
    # the same window: the newer label-store version wins, whenever each run finishes
    publish_run(storage, "ev", "2025-03-02_2025-03-04", "relabelled", artifacts_for(), _dated("2025-03-02_2025-03-04", 3))
    publish_run(storage, "ev", "2025-03-02_2025-03-04", "stale", artifacts_for(), _dated("2025-03-02_2025-03-04", 2))
    assert read_latest(storage, "ev")["run_key"] == "relabelled"
    # the listing fallback (a pointer lost) agrees
    storage.delete("results/ev/latest.json")
    assert read_latest(storage, "ev")["run_key"] == "relabelled"


def test_latest_moves_on_an_endpoint_that_compares_if_match_unquoted(s3_storage):
    """Issue 25, found by the stack's clock test: Ceph radosgw compares ``If-Match`` on PUT with the ETag
    without its quotes, so the quoted ETag (as ``GetObject`` returns it) always answered 412 and every
    replacement of ``latest.json`` failed with "the pointer kept changing over 20 attempts" after the run's
    manifest was committed (the flow run then failed).  A 412 on an unchanged object now retries with the
    other spelling; a racing writer is still told apart (the ETag changed)."""
    from botocore.exceptions import ClientError

    client = s3_storage.client
    real_put, refused = client.put_object, []

    def radosgw_put(**kw):
        if str(kw.get("IfMatch", "")).startswith('"'):
            refused.append(kw["Key"])
            raise ClientError({"Error": {"Code": "PreconditionFailed"}, "ResponseMetadata": {"HTTPStatusCode": 412}},
                              "PutObject")
        return real_put(**kw)

    client.put_object = radosgw_put
    publish_run(s3_storage, "ev", "2025-03-01_2025-03-03", "old", artifacts_for(), _dated("2025-03-01_2025-03-03", 1))
    publish_run(s3_storage, "ev", "2025-03-02_2025-03-04", "new", artifacts_for(), _dated("2025-03-02_2025-03-04", 1))
    assert read_latest(s3_storage, "ev")["run_key"] == "new"  # was: StorageError "the pointer kept changing"
    assert refused == [s3_storage._full("results/ev/latest.json")]  # one refusal, then the unquoted ETag


def test_a_folder_pruned_by_a_concurrent_delete_while_writing_is_created_again(tmp_path, monkeypatch):
    """The race behind a rare FileNotFoundError of six publishing threads (session 23's default run): one
    thread's `delete` of a loser's last object removes the folder it leaves empty between another thread's
    creating that folder and its temporary file there. The write creates the folder again; a folder that keeps
    vanishing is still an error after `FOLDER_RACE_TRIES` attempts."""
    import builtins
    import shutil

    from flows.storage import local

    st = local.LocalStorage(tmp_path / "root", StorageConfig())
    real_open = builtins.open
    pruned = []

    def racing_open(file, mode="r", *args, **kwargs):
        name = os.path.basename(str(file))
        if "wb" in mode and name.startswith(TMP_PREFIX) and len(pruned) < budget[0]:
            shutil.rmtree(os.path.dirname(str(file)))  # the concurrent delete, just before our file
            pruned.append(name)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(local, "open", racing_open, raising=False)
    budget = [2]
    st.write_bytes("results/ev/w/k/a1/report.html", b"<html>x</html>")
    assert len(pruned) == 2 and st.read_bytes("results/ev/w/k/a1/report.html") == b"<html>x</html>"
    assert st.put_if_absent("results/ev/w/k/a2/manifest.json", b"{}") and len(pruned) == 2
    budget[0] = 2 + local.FOLDER_RACE_TRIES
    with pytest.raises(Exception) as err:
        st.write_bytes("results/ev/w/k/a3/report.html", b"<html>y</html>")
    assert "a3" in str(err.value) or "report.html" in str(err.value)
    assert not [p for p in (tmp_path / "root").rglob(f"{TMP_PREFIX}*")]


def test_a_folder_pruned_by_a_concurrent_delete_while_opening_an_output_is_created_again(tmp_path, monkeypatch):
    """`LocalStorage.open_output` (a Parquet table written as a stream) has the same race as `write_bytes`: its
    folder created, then removed by another thread's `delete` before its temporary file is opened there. It
    creates the folder again (the helper `write_bytes` and `put_if_absent` share), and a folder that keeps
    vanishing is a `StorageError` naming the key after `FOLDER_RACE_TRIES` attempts, no temporary file left.
    The race is forced between the folder's creation and the file's, where the write sweeps stale temporary
    files, for the three writes."""
    import shutil

    from flows.storage import local

    st = local.LocalStorage(tmp_path / "root", StorageConfig())
    real_sweep = local.LocalStorage.sweep_stale_tmp
    pruned = []
    budget = [0]

    def racing_sweep(folder, *args, **kwargs):
        removed = real_sweep(folder, *args, **kwargs)
        if len(pruned) < budget[0]:
            shutil.rmtree(folder)  # the concurrent delete: the folder was just created, the file is not there yet
            pruned.append(str(folder))
        return removed

    monkeypatch.setattr(local.LocalStorage, "sweep_stale_tmp", staticmethod(racing_sweep))
    table = pa.table({"x": [1, 2, 3]})

    def write_parquet(key: str) -> None:
        with st.open_output(key) as out:
            pq.write_table(table, out)

    writes = {"open_output": write_parquet,
              "write_bytes": lambda key: st.write_bytes(key, b"<html>x</html>"),
              "put_if_absent": lambda key: st.put_if_absent(key, b"{}")}
    for i, (name, write) in enumerate(writes.items()):
        key = f"results/ev/w/k/{name}/out.bin"
        budget[0] = len(pruned) + local.FOLDER_RACE_TRIES - 1  # every attempt but the last loses its folder
        write(key)
        assert len(pruned) == (i + 1) * (local.FOLDER_RACE_TRIES - 1), name
        if name == "open_output":
            assert pq.read_table(io.BytesIO(st.read_bytes(key))).equals(table)
        assert st.list(f"results/ev/w/k/{name}/")[0].key == key
    budget[0] = len(pruned) + local.FOLDER_RACE_TRIES
    with pytest.raises(StorageError, match="a3") as err:
        write_parquet("results/ev/w/k/a3/table.parquet")
    assert "table.parquet" in str(err.value) and not st.list("results/ev/w/k/a3/")
    assert not [p for p in (tmp_path / "root").rglob(f"{TMP_PREFIX}*")]
