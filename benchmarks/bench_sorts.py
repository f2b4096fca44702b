"""The response-id check's two orders (issue 29, session 36): each beside the ``numpy.sort`` it replaced, same run.

* **A reader's fingerprints** (`flows.runtime.sharded_ray.bucket_runs`): a 1M-row file's 64-bit fingerprints put
  in order of their bucket and run (a stable radix order of a 16-bit key and one gather) against
  ``numpy.sort`` of them (what readers shipped before: sorted, so in runs by any top bits).
* **A check task's run** (`flows.storage.fingerprints.radix_sort_uint32`): the 32 bits a check sorts of one run
  of a bucket (~0.4M at 100M rows in 4 buckets of 64 runs) by two stable 16-bit passes, against ``numpy.sort``.

CPU time of this process (`time.process_time`), best of ``--repeat``; every result checked against its comparator
(the same fingerprints, in the same runs; the same sorted array). Whether ``numpy.sort`` is vectorised depends on
the machine (numpy's x86-simd-sort): the CPU model and numpy's SIMD targets are printed beside the figures.

Usage::

    .venv/bin/python benchmarks/bench_sorts.py [--rows 1000000] [--run 400000] [--buckets 4] [--repeat 7]
"""
from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_response_ids import _best  # noqa: E402 - the best CPU time of ``repeat`` calls


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main() -> None:
    from flows.runtime.sharded_ray import bucket_runs, bucket_starts, run_bits
    from flows.storage.fingerprints import radix_sort_uint32

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="fingerprints of one file")
    ap.add_argument("--run", type=int, default=400_000, help="values of one check task's run")
    ap.add_argument("--buckets", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    try:  # numpy's own detection (a private name: printed only)
        from numpy._core._multiarray_umath import __cpu_features__ as feats
    except ImportError:
        feats = {}
    simd = [k for k in ("AVX2", "AVX512_SKX", "AVX512_ICL") if feats.get(k)]
    print(f"cpu: {_cpu_model()}; numpy {np.__version__}, SIMD found: {', '.join(simd) or 'none'}")
    rng = np.random.default_rng(36)

    fp = rng.integers(0, 2**64 - 1, args.rows, dtype=np.uint64, endpoint=True)
    old_s, old = _best(lambda: np.sort(fp), args.repeat)
    new_s, new = _best(lambda: bucket_runs(fp, args.buckets), args.repeat)
    shift = np.uint64(64 - run_bits(args.buckets))
    assert np.array_equal(old >> shift, new >> shift) and np.array_equal(np.sort(new), old)
    assert np.array_equal(np.searchsorted(old, bucket_starts(args.buckets)),
                          np.searchsorted(new, bucket_starts(args.buckets)))
    print(f"a reader's {args.rows:,} fingerprints in {args.buckets} buckets: bucket_runs {new_s * 1e3:.1f} ms CPU, "
          f"numpy.sort {old_s * 1e3:.1f} ms ({old_s / new_s:.2f}x; {old_s / args.rows * 1e9:.0f} ns a value sorted)")

    high = rng.integers(0, 2**32, args.run, dtype=np.uint64).astype(np.uint32)
    old_s, old = _best(lambda: np.sort(high), args.repeat)
    new_s, new = _best(lambda: radix_sort_uint32(high), args.repeat)
    assert np.array_equal(old, new)
    print(f"a check's run of {args.run:,} 32-bit values: radix_sort_uint32 {new_s * 1e3:.2f} ms CPU, "
          f"numpy.sort {old_s * 1e3:.2f} ms ({old_s / new_s:.2f}x)")


if __name__ == "__main__":
    main()
