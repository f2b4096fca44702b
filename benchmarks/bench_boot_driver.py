"""What the sharded bootstrap costs the driver, per labelled row: the refits' view built on the driver and put from
it (before round 16) against the labelled rows' `RefitRows` sent to a worker that builds it (issue 29, boot30).

Two stages, each in this process:

* ``rows`` (default): a simulated window (``--prompts`` x 5 policies, ``--fraction`` labelled, the design of
  ``bench_sharded.py --stage write``) prepared in process (`prepare_sharded`, 4 shards, Gram form), then per
  calibration mode, measured with tracemalloc (numpy registers its allocations) and pickle protocol 5 (what a
  ``ray.put`` or a task argument writes into the object store):

  - **old** (the comparator): `compact_view(bootstrap_view(design, seed))` on the driver: the heap the full view and
    the rebuilt calibration plan hold (cached on the design until the end of `finalize`), after the compact view,
    its peak; the bytes its ``ray.put`` wrote;
  - **new**: `refit_rows(design, seed)` on the driver (its heap) and the bytes it sends; `refit_view` of them (what
    the worker builds, its tracemalloc peak); the view compared array for array with the old one.

* ``plasma``: a local Ray (1 CPU, 1.5 GiB object store): the driver's RSS (``RssAnon`` / ``RssShmem`` from
  /proc/self/status) after a ``ray.put`` of 200 MB, after the object is freed, and after zero-copy ``ray.get`` of
  objects a worker made: the object-store pages a driver touches stay in its RSS.

Usage::

    .venv/bin/python benchmarks/bench_boot_driver.py --prompts 200000 --fraction 0.05
    .venv/bin/python benchmarks/bench_boot_driver.py --stage plasma
"""
from __future__ import annotations

import argparse
import pickle
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def stage_rows(args: argparse.Namespace) -> None:
    import numpy as np
    import pyarrow as pa

    from cje_engine.direct.estimators import bootstrap_view, compact_view
    from cje_engine.options import EvaluationOptions
    from cje_engine.pipeline import sharded
    from cje_engine.simulate import simulate

    print(f"{'mode':10s} {'labelled':>9s} {'calib.':>8s} | {'old: view+plan held':>20s} {'+compact':>9s} {'peak':>6s} "
          f"{'put':>6s} | {'new: rows heap':>15s} {'sent':>6s} {'worker peak':>12s}   (bytes a labelled row)")
    for mode in ("monotone", "two_stage"):
        table = pa.Table.from_pandas(simulate(args.prompts, seed=3, oracle_fraction=args.fraction).frame,
                                     preserve_index=False)
        cov = ("response_length",) if mode == "two_stage" else ()
        opts = EvaluationOptions.of(None, seed=1, inference="bootstrap", n_bootstrap=50, calibration_mode=mode,
                                    covariates=cov)
        sp = sharded.prepare_sharded(sharded.split_by_shard(table, 4), opts, keep_terms=False)
        del table
        d = sp.prep.design
        L = d.data.n_rows
        tracemalloc.start()
        view = bootstrap_view(d, 1)
        held = tracemalloc.get_traced_memory()[0]
        small, prompts = compact_view(view)
        after, peak = tracemalloc.get_traced_memory()
        put = len(pickle.dumps(small, protocol=5))
        tracemalloc.stop()
        d.__dict__.pop("_bootstrap_view", None)
        d.__dict__.pop("_calibration_plan", None)
        del view
        tracemalloc.start()
        rows = sharded.refit_rows(d, 1)
        rows_heap = tracemalloc.get_traced_memory()[0]
        blob = pickle.dumps(rows, protocol=5)
        tracemalloc.stop()
        del rows
        shipped = pickle.loads(blob)
        tracemalloc.start()
        c0 = time.process_time()
        built = sharded.refit_view(shipped)
        cpu = time.process_time() - c0
        worker_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        same = all(np.array_equal(getattr(built.view, k), getattr(small, k))
                   for k, v in vars(small).items() if isinstance(v, np.ndarray)) and np.array_equal(built.prompts,
                                                                                                     prompts)
        print(f"{mode:10s} {L:9d} {d.cal_rows.size:8d} | {held / L:20.1f} {after / L:9.1f} {peak / L:6.1f} "
              f"{put / L:6.1f} | {rows_heap / L:15.1f} {len(blob) / L:6.1f} {worker_peak / L:12.1f}   "
              f"(refit_view {cpu:.2f} s CPU; the same view: {same})", flush=True)


def stage_plasma(args: argparse.Namespace) -> None:
    import numpy as np
    import ray

    def rss() -> str:
        got = {}
        with open("/proc/self/status") as fh:
            for line in fh:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssShmem"):
                    got[k] = int(v.split()[0]) / 2**20
        return "  ".join(f"{k} {v:.3f} GiB" for k, v in got.items())

    ray.init(num_cpus=1, object_store_memory=1500 * 2**20, include_dashboard=False)

    @ray.remote
    def make(n: int, i: int):
        return np.full(n, i, dtype=np.int64)

    n = 25_000_000  # 200 MB
    print(f"{'started':40s} {rss()}")
    ref = ray.put(np.ones(n))
    print(f"{'ray.put of 200 MB':40s} {rss()}")
    del ref
    time.sleep(1)
    print(f"{'its reference dropped':40s} {rss()}")
    for i in range(5):
        x = ray.get(make.remote(n, i))
        int(x.sum())
        del x
        time.sleep(0.5)
        print(f"{f'ray.get of a worker-made 200 MB #{i}, freed':40s} {rss()}")
    ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", choices=["rows", "plasma"], default="rows")
    p.add_argument("--prompts", type=int, default=200_000)
    p.add_argument("--fraction", type=float, default=0.05)
    args = p.parse_args()
    (stage_rows if args.stage == "rows" else stage_plasma)(args)


if __name__ == "__main__":
    main()
