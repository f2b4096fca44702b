"""`id_bounds` (a sharded reader's least and greatest prompt id, issue 29, round 21) beside `id_bounds_reference`
(Arrow's ``min_max`` of every id) in the same process, on 1M-row prompt-id columns of several layouts: CPU
milliseconds a call (`time.process_time`, the median of ``--repeat`` rounds of 5 calls, the two alternated).

    PYTHONPATH=$PWD python benchmarks/bench_id_bounds.py [--rows 1000000] [--repeat 5]

Layouts: ``ordered`` (the benchmarks' files: ``b<block>-p<6 digits>``, in order, 8 chunks as a Parquet read
gives), ``shuffled`` (the same ids in random order), ``uuid`` (random UUID strings), ``shared_prefix`` (33-byte
ids sharing their first 26 bytes, in random order), ``mixed`` (hex ids of 1-5 characters). Prints a JSON table."""
from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import numpy as np
import pyarrow as pa

from cje_engine.pipeline.sharded import id_bounds, id_bounds_reference


def layouts(n: int) -> dict[str, pa.ChunkedArray]:
    """The prompt-id columns measured, each of ``n`` ids in 8 chunks."""
    rng = np.random.default_rng(0)
    perm = rng.permutation(n)
    ordered = [f"b3-p{i:06d}" for i in range(n)]
    cols = {
        "ordered": ordered,
        "shuffled": [ordered[i] for i in perm],
        "uuid": [str(uuid.UUID(bytes=rng.bytes(16))) for _ in range(n)],
        "shared_prefix": [f"prompt-long-common-prefix-{i:07d}" for i in perm],
        "mixed": [f"{i:x}" for i in perm],
    }
    step = -(-n // 8)
    return {k: pa.chunked_array([pa.array(v[a:a + step], pa.string()) for a in range(0, n, step)])
            for k, v in cols.items()}


def cpu_ms(fn, ids, calls: int = 5) -> float:
    """CPU milliseconds a call of ``fn(ids)``."""
    t = time.process_time()
    for _ in range(calls):
        fn(ids)
    return (time.process_time() - t) / calls * 1e3


def main() -> None:
    """Measure every layout and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    out = []
    for name, ids in layouts(args.rows).items():
        assert id_bounds(ids) == id_bounds_reference(ids), name
        fast, ref = [], []
        for _ in range(args.repeat):
            fast.append(cpu_ms(id_bounds, ids))
            ref.append(cpu_ms(id_bounds_reference, ids))
        f, r = statistics.median(fast), statistics.median(ref)
        out.append({"layout": name, "id_bounds_ms": round(f, 2), "reference_ms": round(r, 2),
                     "ratio": round(r / f, 2)})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
