"""The readers' split of one log file (issue 29, round 17): `range_shard` (a binary search a row among the
splitters' prefix words) beside `range_shard_reference` (a comparison a splitter, the code it replaced), the whole
`split_by_shard` with each, and `pack_piece` (what the pieces carry through the object store) beside the plain
pieces: CPU seconds (`time.process_time`, the median of ``--repeat`` alternated runs) and bytes a row.

    PYTHONPATH=$PWD python benchmarks/bench_split.py --logs DIR_OR_S3_ROOT [--shards 26] [--files 2] [--repeat 5]

The logs: `bench_sharded.py --stage write` (its files of 1M rows, 21 distinct judge scores, 5% labels)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    import pyarrow as pa

    from cje_engine.data.frame import POLICY
    from cje_engine.pipeline import sharded
    from flows.runtime import sharded_ray
    from flows.storage.logs import read_window
    from flows.storage.objects import Storage, StorageConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", required=True)
    p.add_argument("--shards", type=int, default=26, help="26: the shards of 100M rows on 2 CPUs")
    p.add_argument("--files", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    st = Storage.for_uri(args.logs, StorageConfig.from_env())
    keys = sorted(o.key for o in st.list() if o.key.endswith(".parquet"))[:args.files]
    tables = []
    for i, k in enumerate(keys):
        t = read_window(st, [k], check_unique=False, dictionary=(POLICY,)).drop_columns(["response_id", "dt", "ts"])
        start = i << sharded_ray.ROW_BITS
        tables.append(sharded_ray.compact_policy(t.append_column(sharded.ROW, pa.array(range(start, start + t.num_rows),
                                                                                        pa.int64()))))
    rows = sum(t.num_rows for t in tables)
    splitters = sharded.range_splitters(
        [sharded.sample_prompt_ids(t["prompt_id"], sharded_ray.SAMPLES_PER_SHARD * args.shards) for t in tables],
        args.shards)
    fast, slow = sharded.range_shard, sharded.range_shard_reference
    cpu: dict[str, list[float]] = {}

    def timed(name, fn, *a, **kw):
        c = time.process_time()
        out = fn(*a, **kw)
        cpu.setdefault(name, []).append(time.process_time() - c)
        return out

    for r in range(args.repeat):
        if r == 1:
            cpu.clear()  # the first round warms up
        for t in tables:
            want = timed("range_shard_reference", slow, t["prompt_id"], splitters)
            got = timed("range_shard", fast, t["prompt_id"], splitters)
            assert (want == got).all()
        for name, fn in (("split_by_shard (reference)", slow), ("split_by_shard", fast)):
            sharded.range_shard = fn
            try:
                pieces = [timed(name, sharded.split_by_shard, t, args.shards, splitters=splitters) for t in tables]
            finally:
                sharded.range_shard = fast
        c = time.process_time()
        packed = [[sharded.pack_piece(x) for x in ps] for ps in pieces]
        cpu.setdefault("pack_piece", []).append(time.process_time() - c)
    med = {k: round(statistics.median(v), 4) for k, v in cpu.items()}
    plain = sum(x.nbytes for ps in pieces for x in ps)
    shipped = sum(x.nbytes for ps in packed for x in ps)
    out = {"rows": rows, "files": len(tables), "shards": args.shards, "cpu_s_median": med,
           "cpu_s_per_100M_rows": {k: round(v * 1e8 / rows, 2) for k, v in med.items()},
           "range_shard_speedup": round(med["range_shard_reference"] / med["range_shard"], 2),
           "plain_piece_bytes_per_row": round(plain / rows, 2), "packed_piece_bytes_per_row": round(shipped / rows, 2),
           "plain_bytes_per_row_by_column": {c: round(sum(x[c].nbytes for ps in pieces for x in ps) / rows, 2)
                                             for c in pieces[0][0].column_names},
           "packed_bytes_per_row_by_column": {c: round(sum(x.table[c].nbytes for ps in packed for x in ps) / rows, 2)
                                              for c in packed[0][0].table.column_names}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
