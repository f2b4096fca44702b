"""The per-period label budget is taken atomically: concurrent runs never exceed it.

Every worker raises the requests of a different evaluation (so deduplication by evaluation and
scope does not hide the race) over the same logs, at the same instant, with a period budget that
covers fewer requests than there are workers.  Without the ledger each worker reads "0 used" and
requests its full size (8 x 20 = 160 > 50).
"""
from __future__ import annotations

import multiprocessing as mp
import threading
from datetime import datetime, timezone

import pytest

from flows.label_requests.budget import LabelBudget
from flows.label_requests.manifests import list_requests
from flows.label_requests.raising import raise_requests_for_run
from flows.storage.objects import Storage, StorageConfig

NOW = datetime(2025, 3, 5, 12, tzinfo=timezone.utc)
BUDGET = 50
PER_REQUEST = 20
CFG = {"max_labels_per_request": PER_REQUEST, "max_labels_per_period": BUDGET, "notify": False,
       "triggers": ["audit_failed"], "target_se": 0.001}  # tiny target: every failed audit wants the cap


def _raise(root: str, storage: dict | None, i: int, result: dict, table, barrier) -> int:
    barrier.wait()
    made = raise_requests_for_run(storage, root, f"ev{i}", "2025-03-01_2025-03-02", result, table, CFG, now=NOW)
    return sum(m["n_labels"] for m in made)


def _check(st, made: list[int]) -> None:
    stored = list_requests(st, now=NOW)
    total = sum(m["n_labels"] for m in stored)
    assert total <= BUDGET
    assert total == BUDGET  # the budget is used up (8 x 20 wanted), not left idle by lost races
    assert sum(made) == total  # what the workers report is what is stored
    ledger = LabelBudget(st, stored[0]["period"]).entries()
    assert sum(e["labels"] for e in ledger) == total  # every reservation has its manifest
    ids = [r["response_id"] for m in stored for r in m["rows"]]
    assert len(ids) == len(set(ids))  # no row requested twice, though every worker drew from the same pool
    assert sorted(m["n_labels"] for m in stored) == [10, 20, 20]  # the last one truncated to what was left


@pytest.mark.parametrize("where", ["local", "s3"])
def test_threads_never_exceed_the_budget(audit_case, tmp_path, where, request):
    _, table, result = audit_case
    if where == "s3":
        bucket = request.getfixturevalue("moto_bucket")
        root, storage = f"s3://{bucket}/results", None
    else:
        root, storage = str(tmp_path / "results"), None
    barrier = threading.Barrier(8)
    made = [0] * 8

    def work(i):
        made[i] = _raise(root, storage, i, result, table, barrier)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    _check(Storage.for_uri(root, StorageConfig.from_env()), made)


def _proc(root, storage, i, result, table_bytes, barrier, out):
    import pyarrow as pa

    table = pa.ipc.open_stream(table_bytes).read_all()
    out.put((i, _raise(root, storage, i, result, table, barrier)))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_processes_never_exceed_the_budget(audit_case, tmp_path, where, request):
    import pyarrow as pa

    _, table, result = audit_case
    if where == "s3":
        bucket = request.getfixturevalue("moto_bucket")
        root, storage = f"s3://{bucket}/results", StorageConfig.from_env().to_dict(include_secrets=True)
    else:
        root, storage = str(tmp_path / "results"), None
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    ctx = mp.get_context("fork")  # each child builds its own storage clients; spawn re-imports numpy/scipy (30 s here)
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_proc, args=(root, storage, i, result, sink.getvalue().to_pybytes(), barrier, out))
             for i in range(4)]
    for p in procs:
        p.start()
    made = [out.get(timeout=180)[1] for _ in procs]
    for p in procs:
        p.join(timeout=120)  # bounds a hang only
        assert p.exitcode == 0
    _check(Storage.for_uri(root, StorageConfig.from_env()), made)


def test_a_lost_race_replans_against_what_is_left(audit_case, tmp_path):
    """Deterministic version of the race: another writer reserves between our read and our write."""
    _, table, result = audit_case
    st = Storage.for_uri(str(tmp_path))
    ledger = LabelBudget(st, "2025-W10")
    snap = ledger.snapshot()
    assert ledger.take(snap, [{"request_id": "lr-20250305-aaaaaaaaaaaa", "n_labels": 45}], BUDGET)
    assert not ledger.take(snap, [{"request_id": "lr-20250305-bbbbbbbbbbbb", "n_labels": 20}], BUDGET)  # stale
    made = raise_requests_for_run(None, str(tmp_path), "ev", "2025-03-01_2025-03-02", result, table, CFG, now=NOW)
    assert [m["n_labels"] for m in made] == [5]  # 50 - 45 left
    assert "period budget (5 label(s) left of 50)" in made[0]["note"]
