"""The sharded row pass on a real local Ray reading daily Parquet files from S3 (moto).

Shards are read and reduced on the workers (`flows.runtime.sharded_ray`); the numbers are the
single-process engine's on the same files (replicates bit-identical), also when a worker is killed
in the middle of a pass.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.errors import CJEInputError
from cje_engine.options import EvaluationOptions
from cje_engine.pipeline import direct, sharded
from cje_engine.simulate import simulate
from flows.runtime import sharded_ray
from flows.storage.logs import read_window, write_logs

from tests.unit.test_sharded import assert_same_result


@pytest.fixture(scope="module")
def local_ray():
    """A real local Ray (this process's own, two CPUs): the test kills one of its worker processes."""
    from flows.runtime import ray_fanout

    with ray_fanout.ray_session(num_cpus=2):
        yield os.getpid()


def _descends_from(pid: int, root: int) -> bool:
    for _ in range(64):
        if pid == root:
            return True
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


@pytest.fixture
def two_days(direct_storage, bucket, s3_server):
    """Simulated logs with inline labels in two daily files; every prompt has rows on both days."""
    frame = simulate(1200, seed=2, oracle_fraction=0.05).frame.copy()
    pol_code = frame["policy"].astype("category").cat.codes.to_numpy()
    start = datetime(2026, 3, 1, tzinfo=timezone.utc)
    frame["ts"] = [start + timedelta(days=int(c % 2), seconds=i % 80000) for i, c in enumerate(pol_code)]
    uri = f"s3://{bucket}/logs"
    st = direct_storage(uri)
    keys = sorted(write_logs(st, pa.Table.from_pandas(frame, preserve_index=False), basename="sim"))
    assert len(keys) == 2
    cfg = st.config.to_dict(include_secrets=True)
    window = read_window(st, keys)  # the single-process path's table: files in window order
    return uri, cfg, keys, window.drop([c for c in ("dt", "ts") if c in window.column_names])


def test_shards_read_on_workers_give_the_single_process_numbers(local_ray, two_days, monkeypatch):
    """The shards' numbers on Ray are the single path's; the bootstrap in 9 chunks of 7 replicates, so that
    weights, histograms and up to two refit tasks are in flight at once, and chunks finish in any order."""
    uri, cfg, keys, window = two_days
    opts = EvaluationOptions.of(None, seed=4, inference="bootstrap", n_bootstrap=60)
    prep = direct.prepare(window, opts)
    expected = direct.bootstrap_chunk(prep, 0, 60)
    refs = sharded_ray.read_shards(uri, cfg, keys, 3, rows_hint=window.num_rows)
    sp = sharded.prepare_sharded(refs, opts, mapper=sharded_ray.ray_mapper(
        memory=sharded_ray.task_memory(window.num_rows // 3)))
    monkeypatch.setattr(sharded, "WEIGHTS_BLOCK_BYTES", 7 * sp.n_prompts)
    got = sp.replicates(0, 60)
    assert np.array_equal(got, expected, equal_nan=True)
    assert_same_result(direct.finalize(prep, [expected]).to_dict(), sp.finalize([got]).to_dict())


def test_segments_reduced_on_ray_workers_give_the_single_process_block(local_ray, two_days):
    """``segment_by`` on the workers: each task recodes its shard's rows to segment x policy cells where the shard
    is (`sharded_segments.recoding_mapper`); the segments block is the single-process one, replicates included."""
    uri, cfg, keys, window = two_days
    cut = float(np.median(np.asarray(window["response_length"])))
    band = pa.array(np.where(np.asarray(window["response_length"]) > cut, "long", "short"))
    opts = EvaluationOptions.of(None, seed=4, inference="bootstrap", n_bootstrap=60, segment_by=("band",),
                                segment_min_labels=5, segment_min_rows=20)
    prep = direct.prepare(window.append_column("band", band), opts)
    expected = direct.bootstrap_chunk(prep, 0, 60)
    refs = sharded_ray.read_shards(uri, cfg, keys, 3, rows_hint=window.num_rows, prepare_rows=_WithBand(cut))
    sp = sharded.prepare_sharded(refs, opts, mapper=sharded_ray.ray_mapper())
    got = sp.replicates(0, 60)
    assert np.array_equal(got, expected, equal_nan=True)
    res = sp.finalize([got]).to_dict()
    assert len(res["segments"]["cells"]) == 10
    assert_same_result(direct.finalize(prep, [expected]).to_dict(), res)


class _WithBand:
    """A read task's row preparation: the per-row segment column ``band`` (picklable: shipped to the workers)."""

    def __init__(self, cut: float) -> None:
        self.cut = cut

    def __call__(self, table: pa.Table, source: str) -> tuple[pa.Table, dict]:
        band = np.where(np.asarray(table["response_length"]) > self.cut, "long", "short")
        return table.append_column("band", pa.array(band)), {}


#: Where a held pass's task finds its chunk's first replicate among its arguments.
_START = {"shard_histogram_block": 3, "replicate_refits": 2}
#: Seconds a held task waits for the test to kill it (then it goes on: the test fails on its retry count).
HOLD_S = 120.0


def _held(fn_name: str, hold: str, index: int, *args):
    """``sharded.<fn_name>(*args)`` on a Ray worker, recording each attempt: every task writes
    ``started-<index>-<start>-<attempt>`` holding its pid; the first attempt of item 0 of the pass's first chunk
    (``start`` 0) then waits for ``hold/release`` (at most `HOLD_S`), so the test's SIGKILL lands while it runs."""
    import glob

    fn = getattr(sharded, fn_name)
    start = args[_START[fn_name]]
    stem = os.path.join(hold, f"started-{index}-{start}-")
    attempt = len(glob.glob(stem + "*"))
    with open(f"{stem}{attempt}", "w") as f:
        f.write(str(os.getpid()))
    if index == 0 and start == 0 and attempt == 0:
        deadline = time.monotonic() + HOLD_S
        while not os.path.exists(os.path.join(hold, "release")) and time.monotonic() < deadline:
            time.sleep(0.01)
    return fn(*args)


def _holding_mapper(inner, fn_name: str, hold: str):
    """``inner`` (a `sharded_ray.ray_mapper`) with the pass ``fn_name``'s tasks run through `_held`."""
    def mapper(fn, items):
        if fn.__name__ != fn_name:
            yield from inner(fn, items)
            return
        wrapped = [(fn_name, hold, i, *item) for i, item in enumerate(items)]
        yield from inner(_held, wrapped)

    mapper.put = inner.put
    return mapper


def _kill_held(hold: str, root: int, killed: list, timeout: float = HOLD_S) -> None:
    """Wait for the held task's first attempt to start, SIGKILL its worker (a process of this test's Ray),
    wait until it is gone, then release the hold (the retry then runs at once)."""
    first = os.path.join(hold, "started-0-0-0")
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not killed:
            if os.path.exists(first):
                with open(first) as f:
                    text = f.read()
                if text:
                    pid = int(text)
                    assert _descends_from(pid, root), "the held task is not a worker of this test's Ray"
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    while time.monotonic() < deadline:  # gone, or a zombie until Ray reaps it
                        try:
                            with open(f"/proc/{pid}/stat") as f:
                                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                                    break
                        except OSError:
                            break
                        time.sleep(0.01)
                    break
            time.sleep(0.01)
    finally:
        open(os.path.join(hold, "release"), "w").close()


@pytest.mark.parametrize("task", ["shard_histogram_block", "replicate_refits"])
def test_a_worker_killed_mid_pass_is_retried_without_changing_a_number(local_ray, two_days, tmp_path, task):
    """A bootstrap task (shard 0's histograms of the first chunk, or the first chunk's refits) is held running
    until the test has SIGKILLed its worker: Ray runs it again on another worker (the task ran twice, the first
    attempt's process is gone) and every replicate equals the undisturbed single-process run's, bit for bit."""
    uri, cfg, keys, window = two_days
    B = 100
    opts = EvaluationOptions.of(None, seed=4, inference="bootstrap", n_bootstrap=B)
    expected = direct.bootstrap_chunk(direct.prepare(window, opts), 0, B)
    refs = sharded_ray.read_shards(uri, cfg, keys, 2, rows_hint=window.num_rows)
    hold = str(tmp_path)
    mapper = _holding_mapper(sharded_ray.ray_mapper(), task, hold)
    sp = sharded.prepare_sharded(refs, opts, mapper=mapper)
    killed: list = []
    th = threading.Thread(target=_kill_held, args=(hold, local_ray, killed))
    th.start()
    try:
        got = sp.replicates(0, B)
    finally:
        th.join()
    assert len(killed) == 1, f"the held {task} task was never seen running"
    attempts = sorted(p.name for p in tmp_path.glob("started-0-0-*"))
    assert attempts == ["started-0-0-0", "started-0-0-1"], attempts  # killed mid-task, then retried once
    assert int((tmp_path / "started-0-0-0").read_text()) == killed[0]
    assert int((tmp_path / "started-0-0-1").read_text()) != killed[0]
    if task == "shard_histogram_block":  # the other shard's task ran once
        assert sorted(p.name for p in tmp_path.glob("started-1-0-*")) == ["started-1-0-0"]
    assert np.array_equal(got, expected, equal_nan=True)


@pytest.mark.parametrize("nodes", ["cluster", "two_nodes_four_buckets"])
@pytest.mark.parametrize("where", ["one_file_one_shard", "two_days_two_shards"])
def test_a_repeated_response_id_is_refused_on_the_sharded_path(local_ray, direct_storage, bucket, s3_server, where,
                                                               nodes, monkeypatch):
    """The single path refuses a window whose ``response_id`` repeats (exit 2, naming it); so does the sharded
    path, whose rows never meet: the readers bucket the ids by hash and the workers check each bucket. A copy
    in the same file (same prompt: the same shard) and a copy on another day (another prompt, another shard).
    Each reader returns one object of the buckets of a node (`split_file`'s ``bucket_groups``): on the session's
    cluster, and on two nodes (one of them gone: its tasks run on the other) with four buckets, two an object."""
    import ray

    from flows.cli.exits import EXIT_BAD_INPUT
    from flows.cli.main import exit_code_of

    if nodes == "two_nodes_four_buckets":
        real = ray.get_runtime_context().get_node_id()
        monkeypatch.setattr(sharded_ray, "_cluster_nodes", lambda: sorted([(real, 1.0), ("ef" * 28, 1.0)]))
        monkeypatch.setattr(sharded_ray, "response_id_bucket_count", lambda n_rows, cpus: 4)
        # the readers' buckets: two objects of two buckets each
        assert sharded_ray.bucket_spans(sharded_ray.shard_nodes(4, sharded_ray._cluster_nodes())) == (
            [(0, 2), (2, 4)], [0, 0, 1, 1])

    frame = simulate(400, seed=3, oracle_fraction=0.05).frame.copy()
    pol_code = frame["policy"].astype("category").cat.codes.to_numpy()
    start = datetime(2026, 3, 1, tzinfo=timezone.utc)
    frame["ts"] = [start + timedelta(days=int(c % 2)) for c in pol_code]
    day = pol_code % 2
    a = int(np.flatnonzero(day == 0)[0])
    if where == "one_file_one_shard":  # another row of the same prompt, same day
        b = int(np.flatnonzero((day == 0) & (frame["prompt_id"] == frame["prompt_id"][a]).to_numpy())[1])
    else:  # a row of the other day whose prompt is in another shard
        ids = frame["prompt_id"].astype(str).to_numpy()
        cut = sharded.range_splitters([sorted(set(ids))], 3)
        shard = np.searchsorted(np.asarray(cut, dtype=object), ids.astype(object), side="right")
        b = int(np.flatnonzero((day == 1) & (shard != shard[a]))[0])
    dup = frame.at[a, "response_id"]
    frame.at[b, "response_id"] = dup
    uri = f"s3://{bucket}/logs"
    st = direct_storage(uri)
    keys = sorted(write_logs(st, pa.Table.from_pandas(frame, preserve_index=False), basename="sim"))
    with pytest.raises(CJEInputError, match=f"response_id {dup!r} appears more than once") as err:
        sharded_ray.read_shards(uri, st.config.to_dict(include_secrets=True), keys, 3, rows_hint=len(frame))
    files = {k for k in keys if k in str(err.value)}
    assert files == ({keys[0]} if where == "one_file_one_shard" else set(keys))
    assert exit_code_of(err.value) == EXIT_BAD_INPUT


class _CountedRows:
    """A ``prepare_rows`` that counts how often the driver pickles it (its rows unchanged)."""

    pickled = 0

    def __reduce__(self):
        type(self).pickled += 1
        return (_CountedRows, ())

    def __call__(self, table: pa.Table, source: str) -> tuple[pa.Table, dict]:
        return table, {}


def test_prepare_rows_is_put_in_the_object_store_once_for_every_file(local_ray, two_days):
    """The evaluate flow's `prepare_rows` carries the label store's labels (~5M rows at 100M log rows): passed to
    every file's reader by value, Ray would serialize it into the object store once per file (100 copies at 100
    files); `read_shards` puts it once and passes its reference. Two files here: pickled once, not twice (or 4:
    ``sample_file`` does not take it), and the shards' numbers unchanged."""
    uri, cfg, keys, window = two_days
    _CountedRows.pickled = 0
    refs = sharded_ray.read_shards(uri, cfg, keys, 3, rows_hint=window.num_rows, prepare_rows=_CountedRows())
    assert len(keys) == 2 and _CountedRows.pickled == 1
    opts = EvaluationOptions.of(None, seed=4, inference="analytic")
    sp = sharded.prepare_sharded(refs, opts, mapper=sharded_ray.ray_mapper())
    assert_same_result(direct.finalize(direct.prepare(window, opts), []).to_dict(), sp.finalize([]).to_dict())


@pytest.fixture
def prompt_blocks(direct_storage, bucket, s3_server):
    """Simulated logs in four daily files, each a block of prompts (the benchmark's layout: a file's prompt ids
    touch few shards), but one prompt whose rows are spread over two days (two files, far apart in the window)."""
    frame = simulate(1200, seed=5, oracle_fraction=0.05).frame.copy()
    rank = frame["prompt_id"].rank(method="dense").astype(int).to_numpy() - 1
    day = rank * 4 // (rank.max() + 1)
    spread = frame.index[frame["prompt_id"] == frame["prompt_id"].iloc[0]].to_numpy()
    day[spread[::2]] = 3  # prompt 0's rows on the first and the last day
    start = datetime(2026, 3, 1, tzinfo=timezone.utc)
    frame["ts"] = [start + timedelta(days=int(d), seconds=i % 80000) for i, d in enumerate(day)]
    uri = f"s3://{bucket}/logs"
    st = direct_storage(uri)
    keys = sorted(write_logs(st, pa.Table.from_pandas(frame, preserve_index=False), basename="blk"))
    assert len(keys) == 4
    window = read_window(st, keys)
    return uri, st.config.to_dict(include_secrets=True), keys, window.drop(
        [c for c in ("dt", "ts") if c in window.column_names])


class _HeldRows:
    """A ``prepare_rows`` whose first attempt on the file ``key`` records its pid (``started-0-0-0``, as `_held`)
    and waits for the test to kill it (`_kill_held`); every other call leaves the rows as they are."""

    def __init__(self, hold: str, key: str) -> None:
        self.hold, self.key = hold, key

    def __call__(self, table: pa.Table, source: str) -> tuple[pa.Table, dict]:
        import glob

        if source.endswith(self.key):
            stem = os.path.join(self.hold, "started-0-0-")
            attempt = len(glob.glob(stem + "*"))
            with open(f"{stem}{attempt}", "w") as f:
                f.write(str(os.getpid()))
            if attempt == 0:
                deadline = time.monotonic() + HOLD_S
                while not os.path.exists(os.path.join(self.hold, "release")) and time.monotonic() < deadline:
                    time.sleep(0.01)
        return table, {}


@pytest.mark.parametrize("n_shards", [1, 5])
def test_readers_of_prompt_blocks_return_only_the_pieces_they_touch(local_ray, prompt_blocks, n_shards):
    """Each reader returns the pieces of the shards its file's prompt range touches only (`file_shards`): fewer
    pieces than every reader's every piece (the reference, ``every_piece``), the same numbers bit for bit (the
    analytic result and the bootstrap's replicates), which are the single path's."""
    uri, cfg, keys, window = prompt_blocks
    opts = EvaluationOptions.of(None, seed=4, inference="bootstrap", n_bootstrap=50)
    prep = direct.prepare(window, opts)
    expected = direct.bootstrap_chunk(prep, 0, 50)
    results = {}
    for every in (True, False):
        refs = sharded_ray.read_shards(uri, cfg, keys, n_shards, rows_hint=window.num_rows, every_piece=every)
        results[every] = ([len(r.refs) for r in refs], refs)
    every_n, pruned_n = results[True][0], results[False][0]
    assert every_n == [4] * n_shards
    # the pruned readers return their pieces as one object a node their file's shards run on (one node: one bundle a
    # file; the session's cluster may have two), each shard its place in it; every reader's every piece (the
    # reference) one object a piece
    nodes = max(1, len(sharded_ray._cluster_nodes()))
    assert len(keys) <= len({ref for r in results[False][1] for ref in r.refs}) <= len(keys) * min(nodes, n_shards)
    assert all(j is not None for r in results[False][1] for j in r.at)
    assert all(j is None for r in results[True][1] for j in r.at)
    if n_shards == 5:  # 4 blocks over 5 ranges: each file 2-3 shards (the spread prompt widens the last file's)
        assert sum(pruned_n) < sum(every_n) and all(1 <= n <= 4 for n in pruned_n)
    got = {}
    for every in (True, False):
        sp = sharded.prepare_sharded(results[every][1], opts, mapper=sharded_ray.ray_mapper())
        reps = sp.replicates(0, 50)
        got[every] = (reps, sp.finalize([reps]).to_dict())
    assert np.array_equal(got[True][0], got[False][0], equal_nan=True)
    assert np.array_equal(got[False][0], expected, equal_nan=True)
    assert got[True][1] == got[False][1]
    assert_same_result(direct.finalize(prep, [expected]).to_dict(), got[False][1])
    if n_shards == 5:  # ``concat``: each shard's table from its places in the bundles, the pieces' rows
        import ray

        tables = sharded_ray.read_shards(uri, cfg, keys, n_shards, rows_hint=window.num_rows, concat=True)
        for ref, pieces in zip(tables, results[False][1]):
            layout, args = sharded_ray._flatten((pieces,))
            want = sharded_ray._with_pieces(sharded_ray._itself, layout, *ray.get(list(args)))
            got_t = ray.get(ref)  # (NaN labels: compared as pandas does, NaN equal to NaN)
            assert got_t.schema == want.schema and got_t.to_pandas().equals(want.to_pandas()) and want.num_rows > 0


@pytest.fixture
def policy_blocks(direct_storage, bucket, s3_server):
    """Simulated logs in two daily blocks of prompts, each block in one file per policy (the benchmark's layout: the
    files of a block have the same prompts, so their footers the same prompt-id range), plus one file of each
    block in several row groups."""
    frame = simulate(900, seed=6, oracle_fraction=0.05).frame.copy()
    rank = frame["prompt_id"].rank(method="dense").astype(int).to_numpy() - 1
    start = datetime(2026, 3, 1, tzinfo=timezone.utc)
    frame["ts"] = [start + timedelta(days=int(d), seconds=i % 80000) for i, d in enumerate(rank * 2 // (rank.max() + 1))]
    uri = f"s3://{bucket}/logs"
    st = direct_storage(uri)
    keys = []
    for j, p in enumerate(sorted(frame["policy"].unique())):
        part = pa.Table.from_pandas(frame[frame["policy"] == p], preserve_index=False)
        keys += write_logs(st, part, basename=f"p{j}", row_group_size=64 if j == 0 else 262_144)
    keys = sorted(keys)
    window = read_window(st, keys)
    return uri, st, keys, window.drop([c for c in ("dt", "ts") if c in window.column_names])


def test_footer_bounds_sample_one_file_of_each_prompt_range_and_give_the_same_numbers(local_ray, policy_blocks,
                                                                                        caplog):
    """With the files' footers (`flows.storage.logs.parquet_footers`), each reader's prompt-id range comes from its
    footer, and of the files of one range one only is sampled: 2 of the 10 files read for the sample, the same shard
    ranges (each policy's file of a block holds the block's prompts) and the same numbers bit for bit as without the
    footers, which are the single path's."""
    from flows.storage.logs import parquet_footers

    uri, st, keys, window = policy_blocks
    assert len(keys) == 10
    cfg = st.config.to_dict(include_secrets=True)
    footers = parquet_footers(st, keys, column="prompt_id")
    assert all(f.bounds_known for f in footers) and len({f.bounds for f in footers}) == 2
    opts = EvaluationOptions.of(None, seed=4, inference="bootstrap", n_bootstrap=50)
    prep = direct.prepare(window, opts)
    expected = direct.bootstrap_chunk(prep, 0, 50)
    got = {}
    for with_footers in (False, True):
        caplog.clear()
        with caplog.at_level("INFO", logger="flows.runtime.sharded_ray"):
            refs = sharded_ray.read_shards(uri, cfg, keys, 5, rows_hint=window.num_rows,
                                           footers=footers if with_footers else None)
        said = [r.getMessage() for r in caplog.records if "sampled" in r.getMessage()]
        assert said and said[0].startswith("prompt ids of 2 of 10 file(s) sampled (10 bounded by their footers)"
                                           if with_footers else "prompt ids of 10 of 10 file(s) sampled (0 bounded")
        sp = sharded.prepare_sharded(refs, opts, mapper=sharded_ray.ray_mapper())
        reps = sp.replicates(0, 50)
        got[with_footers] = ([len(r.refs) for r in refs], reps, sp.finalize([reps]).to_dict())
    assert np.array_equal(got[True][1], got[False][1], equal_nan=True)
    assert np.array_equal(got[True][1], expected, equal_nan=True)
    assert got[True][2] == got[False][2]
    assert_same_result(direct.finalize(prep, [expected]).to_dict(), got[True][2])
    assert sum(got[True][0]) <= sum(got[False][0]) + len(keys)  # at most one more (empty) piece a file


def test_a_reader_killed_mid_read_is_retried_with_the_same_pieces(local_ray, prompt_blocks, tmp_path):
    """The reader of the first file is SIGKILLed while it prepares its rows: Ray runs it again (its ``num_returns``
    the pieces of its shards, as on the first attempt) and the numbers are the undisturbed run's."""
    uri, cfg, keys, window = prompt_blocks
    opts = EvaluationOptions.of(None, seed=4, inference="analytic")
    hold = str(tmp_path)
    killed: list = []
    th = threading.Thread(target=_kill_held, args=(hold, local_ray, killed))
    th.start()
    try:
        refs = sharded_ray.read_shards(uri, cfg, keys, 5, rows_hint=window.num_rows,
                                       prepare_rows=_HeldRows(hold, keys[0]))
        sp = sharded.prepare_sharded(refs, opts, mapper=sharded_ray.ray_mapper())
    finally:
        th.join()
    assert len(killed) == 1, "the held reader was never seen running"
    attempts = sorted(p.name for p in tmp_path.glob("started-0-0-*"))
    assert attempts == ["started-0-0-0", "started-0-0-1"], attempts
    assert_same_result(direct.finalize(direct.prepare(window, opts), []).to_dict(), sp.finalize([]).to_dict())


def test_item_home_names_the_node_of_the_pieces_or_of_the_kept_fields(local_ray):
    """`item_home`: the node a task's `ShardPieces` name, or the node the task that made a kept field of its arguments
    ran on (by the reference's id); None when none is named or two differ; arrays, lists and other references
    among the arguments name none."""
    import ray

    a, b, other = ray.put(1), ray.put(2), ray.put(3)
    homes = {a.hex(): "node-a", b.hex(): "node-b"}
    home = sharded_ray.item_home
    assert home((sharded_ray.ShardPieces([], "node-a"), 3, None), {}) == "node-a"
    assert home((a, np.arange(3), [1, 2], {"k": 1}, None), homes) == "node-a"
    assert home((a, sharded_ray.ShardPieces([], "node-a")), homes) == "node-a"
    assert home((a, b), homes) is None
    assert home((a, sharded_ray.ShardPieces([], "node-b")), homes) is None
    assert home((sharded_ray.ShardPieces([], None),), {}) is None
    assert home((other, np.arange(3)), homes) is None
    assert home((), homes) is None


def test_the_checks_and_every_pass_ask_for_their_data_s_node(local_ray, prompt_blocks, monkeypatch):
    """With ``locality`` on two nodes (one of them gone, as in the test below): the response-id checks spread over
    the nodes as the shards (`shard_nodes` of the buckets), pass 1 asks for the node of each shard's pieces and pass
    2, which takes pass 1's kept codes and not the pieces, for the same node (`item_home`); tasks asked for the gone
    node run on the other (a soft affinity), and every number is the undisturbed run's."""
    import ray

    from flows.runtime.ray_fanout import cluster_cpus

    uri, cfg, keys, window = prompt_blocks
    real = ray.get_runtime_context().get_node_id()
    gone = "cd" * 28
    nodes = sorted([(real, 1.0), (gone, 1.0)])
    monkeypatch.setattr(sharded_ray, "_cluster_nodes", lambda: nodes)
    asked: list = []
    affinity = sharded_ray._affinity
    monkeypatch.setattr(sharded_ray, "_affinity", lambda node: (asked.append(node), affinity(node))[1])
    refs = sharded_ray.read_shards(uri, cfg, keys, 6, rows_hint=window.num_rows)
    n_buckets = sharded_ray.response_id_bucket_count(window.num_rows, cluster_cpus())
    assert asked[len(keys):] == sharded_ray.shard_nodes(n_buckets, nodes)  # the checks, after the readers
    refs[0].node = refs[3].node = gone  # as if their node was lost after the readers
    homes = [r.node for r in refs]
    asked.clear()
    opts = EvaluationOptions.of(None, seed=4, inference="analytic")
    sp = sharded.prepare_sharded(refs, opts, mapper=sharded_ray.ray_mapper())
    assert asked == homes + homes  # pass 1 (the pieces' node), then pass 2 (the node of pass 1's kept codes)
    assert_same_result(direct.finalize(direct.prepare(window, opts), []).to_dict(), sp.finalize([]).to_dict())


def test_locality_pins_readers_and_shards_and_a_lost_node_changes_no_number(local_ray, prompt_blocks, monkeypatch):
    """``locality`` on a cluster of two nodes, one of them gone (an id no node has: the soft affinity runs the
    readers pinned to it on the node that is left, as when a node is lost mid-run): the shards name the node that
    holds their pieces (`ShardPieces.node`: the one left); a shard named on the gone node runs elsewhere; every
    number is the undisturbed run's."""
    import ray

    uri, cfg, keys, window = prompt_blocks
    real = ray.get_runtime_context().get_node_id()
    gone = "ab" * 28  # (all-ff is the nil id)
    monkeypatch.setattr(sharded_ray, "_cluster_nodes", lambda: sorted([(real, 1.0), (gone, 1.0)]))
    opts = EvaluationOptions.of(None, seed=4, inference="bootstrap", n_bootstrap=50)
    prep = direct.prepare(window, opts)
    expected = direct.bootstrap_chunk(prep, 0, 50)
    refs = sharded_ray.read_shards(uri, cfg, keys, 6, rows_hint=window.num_rows)
    homes = [r.node for r in refs]
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    # every shard has rows, named on a node that holds them: one alive (the session's cluster may have two), never
    # the gone one
    assert None not in homes and set(homes) <= alive and gone not in homes
    refs[0].node = refs[5].node = gone  # as if their node was lost after the readers
    plain = sharded_ray.read_shards(uri, cfg, keys, 6, rows_hint=window.num_rows, locality=False)
    assert all(r.node is None for r in plain)
    sp = sharded.prepare_sharded(refs, opts, mapper=sharded_ray.ray_mapper())
    got = sp.replicates(0, 50)
    assert np.array_equal(got, expected, equal_nan=True)
    assert_same_result(direct.finalize(prep, [expected]).to_dict(), sp.finalize([got]).to_dict())
