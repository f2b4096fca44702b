"""The sharded path's response-id check (issue 29): fingerprints sorted against the ids sorted as strings.

Each reader buckets its file's response ids and one task per bucket checks that none repeats
(`flows.runtime.sharded_ray.check_response_ids`). This compares, on the same ids in the same run, the check as
it is (64-bit fingerprints, `id_fingerprint`, their high halves packed with the row and sorted, only the ids
of a repeated half compared as strings) with the obvious one it replaced (every id sorted as a string,
`flows.storage.logs.first_duplicate`), on ids in sorted order (as `bench_sharded.py` writes them) and in
random order (ids written in time order, UUIDs). CPU time of this process (`time.process_time`), best of
``--repeat``. The bucketing of a file's ids is timed apart: by fingerprint (`response_id_buckets`) against the
range buckets it replaced (a comparison per splitter, `range_shard`, the splitters cut from a sample that the
readers had to read first: that read is not counted here).

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_response_ids.py --rows 2500000
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        c = time.process_time()
        out = fn()
        best = min(best, time.process_time() - c)
    return best, out


def _range_buckets(table, n_buckets: int, splitters):
    """The bucketing replaced: by the id's range among sampled splitters, then a stable sort and a take."""
    from cje_engine.pipeline.sharded import ROW, range_shard

    rid = table["response_id"]
    bucket = range_shard(rid, splitters)
    order = np.argsort(bucket, kind="stable")
    bounds = np.searchsorted(bucket[order], np.arange(n_buckets + 1))
    taken = pa.table({"response_id": rid, ROW: table[ROW]}).take(pa.array(order))
    return [taken.slice(bounds[b], bounds[b + 1] - bounds[b]) for b in range(n_buckets)]


def main() -> None:
    from cje_engine.pipeline.sharded import ROW, range_splitters, sample_prompt_ids
    from flows.runtime import sharded_ray
    from flows.storage.logs import first_duplicate

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_500_000, help="ids in one bucket (10M rows over 4 shards: 2.5M)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = args.rows
    rng = np.random.default_rng(0)
    policies = np.array(["base", "clone", "concise", "unhelpful", "verbose"])
    ids = pa.array([f"b{i // 1_000_000}-{policies[i % 5]}:p{i // 5:06d}:0" for i in range(n)], pa.string())
    print(f"{'ids':10s} {'rows':>10s} {'strings sorted':>15s} {'fingerprints':>13s} {'ratio':>6s} "
          f"{'4 buckets: ranges':>18s} {'fingerprints':>13s}")
    for order in ("sorted", "random"):
        col = ids if order == "sorted" else ids.take(pa.array(rng.permutation(n)))
        table = pa.table({"response_id": col, ROW: pa.array(np.arange(n, dtype=np.int64))})
        t_bucket, _ = _best(lambda: sharded_ray.response_id_buckets(table, 4), args.repeat)
        cuts = range_splitters([sample_prompt_ids(col, 64)], 4)
        t_range, _ = _best(lambda: _range_buckets(table, 4, cuts), args.repeat)
        bucket = pa.table({"response_id": col, sharded_ray.FINGERPRINT: pa.array(sharded_ray.id_fingerprint(col)),
                           ROW: table[ROW]})
        t_old, old = _best(lambda: first_duplicate(col), args.repeat)
        t_new, new = _best(lambda: sharded_ray.check_response_ids(bucket), args.repeat)
        assert old is None and new is None, (old, new)  # distinct ids: both find none
        print(f"{order:10s} {n:10d} {t_old:14.3f}s {t_new:12.3f}s {t_old / t_new:5.1f}x "
              f"{t_range:17.3f}s {t_bucket:12.3f}s")


if __name__ == "__main__":
    main()
