"""The sharded driver's steps run with glibc's heap keeping the large arrays they free
(`cje_engine.pipeline.sharded.heap_kept`): freed arrays reused without fresh pages, numpy's huge-page requests off
meanwhile, both undone after (an error too), nested calls left as they are; and every number of the sharded path
(estimates, SEs, intervals, p-values, bootstrap replicates, errors) the same bits as without it, the reference run
with every array of 64 KiB or more a fresh zeroed mapping and the kept run on a heap first filled with NaN (what an
array read before it is written would show)."""
from __future__ import annotations

import ctypes
import json
import resource

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.errors import CJEInputError
from cje_engine.options import EvaluationOptions
from cje_engine.pipeline import sharded
from cje_engine.simulate import simulate

GLIBC = sharded._mallopt(sharded._M_MMAP_THRESHOLD, sharded.MMAP_THRESHOLD_MAX)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _hugepage() -> bool | None:
    was = sharded._madvise_hugepage(True)
    if was is not None:
        sharded._madvise_hugepage(was)
    return was


def _faults_of_a_large_array() -> int:
    """Minor page faults of filling a 48 MiB array after one of the same size was filled and freed (4 KiB pages:
    numpy's huge-page requests off for the measure, then as they were)."""
    was = sharded._madvise_hugepage(False)
    try:
        a = np.ones(6 << 20)
        del a
        before = _minor_faults()
        b = np.ones(6 << 20)
        faults = _minor_faults() - before
        del b
    finally:
        if was is not None:
            sharded._madvise_hugepage(was)
    return faults


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_a_freed_large_array_is_reused_while_kept_and_everything_is_undone_after():
    assert sharded.prepare_sharded.__wrapped__.__wrapped__.__name__ == "prepare_sharded"  # name and doc kept
    assert sharded.ShardedPrepared.finalize.__wrapped__.__name__ == "finalize"
    huge = _hugepage()
    seen = {}

    @sharded.heap_kept
    def body(fail: bool) -> int:
        seen["faults"] = _faults_of_a_large_array()
        seen["huge"] = _hugepage()
        seen["depth"] = sharded._heap_kept_depth[0]
        seen["inner_huge"] = inner()
        return 1 if not fail else 1 // 0

    @sharded.heap_kept
    def inner() -> bool | None:  # nested: runs as it is, the outer scope not undone by it
        return _hugepage()

    # Its own mapping, fresh pages at every allocation, in a fresh process; a process whose earlier code (another test
    # of the same pytest-xdist worker) left glibc's thresholds higher reuses the heap already: then only the scope's
    # own effects below are checked (seen failing in a full default run: 0 faults before the scope).
    fresh = _faults_of_a_large_array() > 1000
    body(False)
    assert seen["faults"] < 100 and seen["depth"] == 1
    assert seen["huge"] in (False, None) and seen["inner_huge"] in (False, None)
    assert sharded._heap_kept_depth[0] == 0 and _hugepage() == huge
    if fresh:
        assert _faults_of_a_large_array() > 1000  # the mmap threshold back at glibc's ceiling (32 MiB < 48 MiB)
    with pytest.raises(ZeroDivisionError):
        body(True)
    assert sharded._heap_kept_depth[0] == 0 and _hugepage() == huge  # undone after an error too


def test_calls_in_two_threads_at_once_share_one_scope_restored_by_the_last_to_leave(monkeypatch):
    """Two threads entering `heap_kept` at once (both before either counted itself) each took the settings as they
    found them, so the first to leave restored the thresholds while the other still ran, and the last restored
    numpy's huge pages as the first had set them (off for good). The interleaving is forced: glibc's and numpy's
    switches are stand-ins, and the first one's raising of the mmap threshold waits (1 s at most) for a second
    thread to get there too, which only an unlocked entry lets it do. With the lock: one scope, set by the first
    in, held while either runs, restored once by the last out (and one trim)."""
    import threading

    state = {"mmap": sharded.MMAP_THRESHOLD_MAX, "trim": 2 * sharded.MMAP_THRESHOLD_MAX, "huge": True}
    both_entering = threading.Barrier(2)
    released = []

    def mallopt(param: int, value: int) -> bool:
        if param == sharded._M_MMAP_THRESHOLD and value == sharded.HEAP_KEPT_BYTES:
            try:
                both_entering.wait(timeout=1.0)  # the other thread entering meanwhile (unlocked only)
            except threading.BrokenBarrierError:
                pass
        state["mmap" if param == sharded._M_MMAP_THRESHOLD else "trim"] = value
        return True

    def madvise_hugepage(enabled: bool) -> bool:
        was, state["huge"] = state["huge"], enabled
        return was

    monkeypatch.setattr(sharded, "_mallopt", mallopt)
    monkeypatch.setattr(sharded, "_madvise_hugepage", madvise_hugepage)
    monkeypatch.setattr(sharded, "_release", lambda collect=True: released.append(collect))
    both_inside = threading.Barrier(2)
    first_left = threading.Event()
    seen, errors = {}, []

    @sharded.heap_kept
    def body(i: int) -> None:
        both_inside.wait(timeout=30)
        if i == 1:  # still running after the other one left
            assert first_left.wait(timeout=30)
            seen.update(state)

    def thread(i: int) -> None:
        try:
            body(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            if i == 0:
                first_left.set()

    threads = [threading.Thread(target=thread, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    # the scope held while the second thread still ran
    assert seen == {"mmap": sharded.HEAP_KEPT_BYTES, "trim": sharded.HEAP_KEPT_BYTES, "huge": False}
    # and restored by the last to leave as the first found it, trimmed once
    assert state == {"mmap": sharded.MMAP_THRESHOLD_MAX, "trim": 2 * sharded.MMAP_THRESHOLD_MAX, "huge": True}
    assert released == [False] and sharded._heap_kept_depth[0] == 0


def _tables() -> dict[str, pa.Table]:
    """Varied inputs: plain, tied scores (rounded to 0.1), many policies (nine), NaN labels of unlabelled rows,
    non-ASCII prompt ids longer than 16 bytes."""
    base = pa.Table.from_pandas(simulate(600, seed=1, oracle_fraction=0.1).frame, preserve_index=False)
    ties = base.set_column(base.column_names.index("judge_score"), "judge_score",
                           pa.array(np.round(base["judge_score"].to_numpy(), 1)))
    many = pa.Table.from_pandas(simulate(300, seed=2, oracle_fraction=0.2).frame, preserve_index=False)
    parts = []
    for k in range(2):  # the policies again under other names: 2 x the simulator's
        pol = pa.array([f"{p}-{k}" for p in many["policy"].to_pylist()])
        parts.append(many.set_column(many.column_names.index("policy"), "policy", pol))
    many = pa.concat_tables(parts)
    ids = pa.array(["préfixe-très-long-" + p for p in base["prompt_id"].cast(pa.string()).to_pylist()])
    long_ids = base.set_column(base.column_names.index("prompt_id"), "prompt_id", ids)
    return {"plain": base, "ties": ties, "many_policies": many, "non_ascii_long_ids": long_ids}


def _run(table: pa.Table, opts: EvaluationOptions, n_shards: int, keep: bool, reference: bool) -> str:
    """The sharded path's result (and replicates) as JSON: decorated (``reference`` False) or the undecorated
    functions with every allocation of 64 KiB or more its own zeroed mapping."""
    parts = sharded.split_by_shard(table, n_shards)
    if reference:
        prepare, finalize = sharded.prepare_sharded.__wrapped__.__wrapped__, sharded.ShardedPrepared.finalize.__wrapped__
        sharded._mallopt(sharded._M_MMAP_THRESHOLD, 64 << 10)
    else:
        prepare, finalize = sharded.prepare_sharded, sharded.ShardedPrepared.finalize
        junk = [np.full(n, np.nan) for n in (1 << 14, 1 << 17, 1 << 20, 1 << 22)]  # garbage left in the heap
        sharded._mallopt(sharded._M_MMAP_THRESHOLD, sharded.HEAP_KEPT_BYTES)
        del junk
    try:
        sp = prepare(parts, opts, keep_terms=keep)
        reps = [sp.replicates(0, 60)] if opts.inference == "bootstrap" else []
        out = finalize(sp, reps).to_dict()
    finally:
        sharded._mallopt(sharded._M_MMAP_THRESHOLD, sharded.MMAP_THRESHOLD_MAX)
    return json.dumps({"result": out, "replicates": [r.tolist() for r in reps]}, sort_keys=True, default=str)


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
@pytest.mark.parametrize("name", ["plain", "ties", "many_policies", "non_ascii_long_ids"])
@pytest.mark.parametrize("kw", [dict(inference="analytic"), dict(inference="bootstrap", n_bootstrap=60),
                                dict(inference="analytic", covariates=("response_length",), calibration_mode="auto")],
                         ids=["analytic", "bootstrap", "auto_covariates"])
def test_every_number_is_the_same_bits_with_the_heap_kept(name, kw):
    table = _tables()[name]
    opts = EvaluationOptions.of(None, seed=3, **kw)
    for n_shards, keep in ((1, True), (3, False)):
        assert _run(table, opts, n_shards, keep, reference=False) == _run(table, opts, n_shards, keep,
                                                                           reference=True), (name, n_shards, keep)


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_too_few_labels_raise_the_same_error_with_the_heap_kept():
    table = pa.Table.from_pandas(simulate(300, seed=4, oracle_fraction=0.05).frame, preserve_index=False)
    label = table["oracle_label"].to_numpy(zero_copy_only=False).copy()
    label[:] = np.nan
    label[0] = 0.5  # one label: too few to cross-fit
    table = table.set_column(table.column_names.index("oracle_label"), "oracle_label", pa.array(label))
    opts = EvaluationOptions.of(None, seed=3, inference="analytic")
    msgs = []
    for reference in (False, True):
        with pytest.raises(CJEInputError) as err:
            _run(table, opts, 2, True, reference)
        msgs.append(str(err.value))
    assert msgs[0] == msgs[1]
    assert sharded._heap_kept_depth[0] == 0
