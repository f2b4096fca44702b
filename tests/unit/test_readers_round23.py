"""The run's Ray workers' allocator settings of round 23 (issue 29): `flows.runtime.ray_fanout.WORKER_ALLOCATOR_ENV`.

Arrow's allocator (mimalloc) in every worker hands the memory it frees back to the kernel lazily (``MADV_FREE``)
instead of decommitting it, and glibc's keeps fixed thresholds, so that each next reader task does not fault the
memory back in page by page. They change where pages come from, never a value: a reader's outputs
(`flows.runtime.sharded_ray.split_file`: its packed pieces, every array bit for bit with the tables' chunks and
schemas, its response-id buckets and info) are the same in a process with the settings as in one without (the
allocators' defaults), over several files read in turn by one process (freed memory reused).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flows.runtime import ray_fanout

REPO = Path(__file__).resolve().parents[2]

#: A child process: every file's reader outputs, in turn, three times, as one digest a file (printed).
_CHILD = r"""
import hashlib, json, sys
import numpy as np, pyarrow as pa
from cje_engine.pipeline.sharded import PackedPiece
from flows.pipelines.sharded_pass import FileRows, shard_columns
from flows.runtime import sharded_ray
from flows.runtime.label_index import LabelIndex

root, keys = sys.argv[1], sys.argv[2:]
store = pa.ipc.open_file(root + "/store.arrow").read_all()
index = LabelIndex.build(store)


def ipc(t):
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return sink.getvalue().to_pybytes() + repr([[len(c) for c in col.chunks] for col in t.columns]).encode()


def digest(out):
    h = hashlib.sha256()
    for o in out[:-1]:
        if isinstance(o, PackedPiece):
            h.update(ipc(o.table) + o.schema.serialize().to_pybytes() + str(o.row_first).encode())
            for f in ("row_step", "row", "score_values", "lab_pos", "label", "label_prob"):
                a = getattr(o, f)
                h.update(b"-" if a is None else a.dtype.str.encode() + a.tobytes())
        else:
            h.update(ipc(o))
    h.update(json.dumps({k: v for k, v in out[-1].items() if k != "node"}, sort_keys=True).encode())
    return h.hexdigest()


for _ in range(3):
    for i, key in enumerate(keys):
        out = sharded_ray.split_file(root + "/logs", {}, key, i, 4, None, None, None, FileRows(()), ["p0300", "p0600",
                                     "p0900"], shard_columns(()), index, n_buckets=2)
        print(key, digest(out))
"""


def _files(tmp_path: Path) -> list[str]:
    """Three log files of 30k-60k rows (ids past 16 bytes and non-ASCII, chunks of 7,000 rows, a few policies) and a
    label store of every fifth id."""
    rng = np.random.default_rng(23)
    keys, ids_all = [], []
    for f, n in enumerate((30_000, 60_000, 45_000)):
        ids = [f"resp-{f}-{i:07d}-\u00e9\u00e8-long-id" for i in range(n)]
        ids_all += ids[::5]
        table = pa.table({"prompt_id": [f"p{(i * 7 + f) % 1200:04d}" for i in range(n)],
                          "policy": rng.choice(["base", "clone", "premium"], n).tolist(),
                          "judge_score": rng.integers(0, 21, n) / 20, "response_id": ids,
                          "response_length": rng.random(n),
                          "ts": pa.array(np.full(n, 1_767_225_600_000_000, dtype="datetime64[us]"))})
        key = f"dt=2026-01-0{f + 1}/part-{f}.parquet"
        (tmp_path / "logs" / key).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, tmp_path / "logs" / key, row_group_size=7_000)
        keys.append(key)
    m = len(ids_all)
    store = pa.table({"response_id": ids_all, "oracle_label": pa.array(np.where(rng.random(m) < 0.1, np.nan,
                                                                                rng.random(m)), from_pandas=True),
                      "label_probability": pa.array(np.full(m, 0.2))})
    with pa.ipc.new_file(str(tmp_path / "store.arrow"), store.schema) as w:
        w.write_table(store)
    return keys


def _digests(tmp_path: Path, keys: list[str], **env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ray_fanout.WORKER_ALLOCATOR_ENV}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), *keys], capture_output=True, text=True,
                         env={**base, "PYTHONPATH": str(REPO), **env}, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return [ln for ln in out.stdout.splitlines() if ln.startswith("dt=")]


def test_a_reader_ships_the_same_objects_with_the_workers_allocator_setting(tmp_path):
    keys = _files(tmp_path)
    want = _digests(tmp_path, keys)
    got = _digests(tmp_path, keys, **ray_fanout.WORKER_ALLOCATOR_ENV)
    assert len(want) == 3 * len(keys) and got == want
    assert want[:len(keys)] == want[len(keys):2 * len(keys)] == want[2 * len(keys):]  # memory reused: the same


def test_worker_env_sets_the_allocators_and_the_drivers_value_wins(monkeypatch):
    for k in ray_fanout.WORKER_ALLOCATOR_ENV:
        monkeypatch.delenv(k, raising=False)
    env = ray_fanout.worker_env()
    assert env["MIMALLOC_PURGE_DECOMMITS"] == "0" and env["MALLOC_MMAP_THRESHOLD_"] == str(2**25)
    assert {k: env[k] for k in ray_fanout.WORKER_ALLOCATOR_ENV} == ray_fanout.WORKER_ALLOCATOR_ENV
    monkeypatch.setenv("MIMALLOC_PURGE_DECOMMITS", "1")  # mimalloc's default, asked for by the driver's environment
    assert ray_fanout.worker_env()["MIMALLOC_PURGE_DECOMMITS"] == "1"
