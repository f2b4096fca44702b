"""The label index build and a reader's label join and response-id buckets (issue 29, round 17): this tree against
main's code, in one process, on the same data.

main's code is loaded from its files (``--main``, default ``/work/main``: ``flows/storage/labels.py`` and
``flows/runtime/label_index.py`` as modules of their own, bound to each other), so both sides run in the same
process on the same tables: CPU seconds (`time.process_time`), the median of ``--repeat`` runs, and the results
checked equal.

* ``store_read``: `LabelStore.read` of a store of ``--labels`` labels of distinct ids, one version (what
  `bench_sharded.py --stage write --label-store` writes): main groups every label twice (exact duplicates,
  conflicts); this tree tells by fingerprint that no id repeats and skips both.
* ``index_build``: `LabelIndex.build` of that table: main groups again (`first_labels`); this tree skips it.
* ``reader``: one 1M-row file's fingerprints, label join (`LabelIndex.join`) and response-id buckets
  (`flows.runtime.sharded_ray.response_id_buckets`, ``--buckets``: 4, as at 100M rows on 2 CPUs), main's
  `flows/runtime/sharded_ray.py` and `flows/storage/fingerprints.py` loaded from its files too.
* ``check``: one response-id check task (`flows.runtime.sharded_ray.check_response_ids`) of the bucket 0 of
  ``--check-files`` files of 1M random fingerprints each (100: a quarter of 100M rows), each side on its own
  readers' buckets; and the same with one fingerprint repeated across two files (the same candidates).
* ``store_read_fresh``: `LabelStore.read` in a fresh process (``--fresh`` runs of each side, alternated): the
  first large allocations of a process are what the build task pays once a run (on this VM the first touch of
  fresh memory costs system CPU: main's content hash held its ~200 MiB IPC stream in a buffer).

Usage::

    PYTHONPATH=$PWD /work/main/.venv/bin/python benchmarks/bench_label_ids.py --labels 5000000 --prompts 200000
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _cpu(fn, repeat: int):
    """(median CPU seconds, last result) of ``repeat`` calls of ``fn``."""
    cpu, out = [], None
    for _ in range(repeat):
        out = None
        c0 = time.process_time()
        out = fn()
        cpu.append(time.process_time() - c0)
    return round(statistics.median(cpu), 3), out


def _load(name: str, path: Path, **bind):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for k, v in bind.items():
        setattr(mod, k, v)
    return mod


def _tables(n_labels: int, prompts: int, seed: int):
    """A 1M-row file (``bench_label_join.py``'s) and a label table of distinct ids: its 5% labels plus other
    blocks' ids."""
    import numpy as np
    import pyarrow as pa

    from bench_label_join import block_file

    logs, own = block_file(prompts, seed)
    rng = np.random.default_rng(seed)
    n_other = max(0, n_labels - own.num_rows)
    pols = ["base", "clone", "parallel_universe_prompt", "premium", "unhelpful"]
    ids = [f"b{1 + j // 5_000_000}-{pols[j % 5]}:p{(j // 5) % 1_000_000}:0" for j in range(n_other)]
    other = pa.table({"response_id": pa.array(ids, pa.string()),
                      "oracle_label": rng.integers(0, 21, n_other) / 20.0,
                      "label_probability": pa.array(np.full(n_other, 0.5))})
    return logs, pa.concat_tables([own, other])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--labels", type=int, default=5_000_000)
    ap.add_argument("--prompts", type=int, default=200_000, help="prompts of the file (x5 policies = its rows)")
    ap.add_argument("--buckets", type=int, default=4)
    ap.add_argument("--check-files", type=int, default=100)
    ap.add_argument("--fresh", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--main", type=Path, default=Path("/work/main"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import numpy as np
    import pyarrow as pa

    from cje_engine.pipeline.sharded import ROW
    from flows.runtime import label_index as new_li
    from flows.runtime import sharded_ray
    from flows.storage import labels as new_labels
    from flows.storage.objects import Storage

    main_labels = _load("main_labels", args.main / "flows/storage/labels.py")
    main_li = _load("main_label_index", args.main / "flows/runtime/label_index.py")
    for k in ("fill_store_labels", "first_labels", "log_response_ids", "log_response_ids_nfc", "fingerprint_order"):
        if hasattr(main_labels, k):  # main's label_index on main's labels
            setattr(main_li, k, getattr(main_labels, k))
    main_fp = _load("main_fingerprints", args.main / "flows/storage/fingerprints.py")
    main_sr = _load("main_sharded_ray", args.main / "flows/runtime/sharded_ray.py")
    for k in ("id_fingerprint", "repeated_fingerprints"):  # main's sharded_ray on main's fingerprints
        setattr(main_sr, k, getattr(main_fp, k))

    logs, table = _tables(args.labels, args.prompts, args.seed)
    res: dict = {"file_rows": logs.num_rows, "label_rows": table.num_rows, "pyarrow": pa.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        st = Storage.for_uri(tmp)
        new_labels.LabelStore(st).append(table, "bench")
        c_main, read_main = _cpu(lambda: main_labels.LabelStore(st).read(), args.repeat)
        c_new, read_new = _cpu(lambda: new_labels.LabelStore(st).read(), args.repeat)
    assert read_new.equals(read_main), "the reads differ"
    res["store_read"] = {"main_cpu_s": c_main, "new_cpu_s": c_new}
    c_main, index_main = _cpu(lambda: main_li.LabelIndex.build(read_main), args.repeat)
    c_new, index_new = _cpu(lambda: new_li.LabelIndex.build(read_new), args.repeat)
    assert index_new.table.equals(index_main.table) and np.array_equal(index_new.fp, index_main.fp), "indexes differ"
    res["index_build"] = {"main_cpu_s": c_main, "new_cpu_s": c_new}
    res["build_total"] = {"main_cpu_s": round(res["store_read"]["main_cpu_s"] + c_main, 3),
                          "new_cpu_s": round(res["store_read"]["new_cpu_s"] + c_new, 3)}
    del read_main, read_new

    rows = pa.array(np.arange(logs.num_rows, dtype=np.int64))

    def reader(sr, index):
        t = logs.append_column(sr.FINGERPRINT, pa.array(sr.id_fingerprint(logs["response_id"])))
        joined = index.join(t)
        buckets = sr.response_id_buckets(joined.append_column(ROW, rows), args.buckets, ids=False, places=False)
        return joined.drop_columns([sr.FINGERPRINT]), buckets

    c_main, (j_main, b_main) = _cpu(lambda: reader(main_sr, index_main), args.repeat)
    c_new, (j_new, b_new) = _cpu(lambda: reader(sharded_ray, index_new), args.repeat)
    assert j_new.equals(j_main) and j_new.schema.metadata == j_main.schema.metadata, "the joins differ"
    assert all(np.array_equal(np.sort(a[sharded_ray.FINGERPRINT].to_numpy()), np.sort(b[sharded_ray.FINGERPRINT].to_numpy()))
               for a, b in zip(b_new, b_main)), "the buckets differ"
    res["reader"] = {"main_cpu_s": c_main, "new_cpu_s": c_new}
    t_main = logs.append_column(main_sr.FINGERPRINT, pa.array(main_sr.id_fingerprint(logs["response_id"])))
    t_new = logs.append_column(sharded_ray.FINGERPRINT, pa.array(sharded_ray.id_fingerprint(logs["response_id"])))
    c_main, _ = _cpu(lambda: index_main.join(t_main), args.repeat)
    c_new, _ = _cpu(lambda: index_new.join(t_new), args.repeat)
    res["join_only"] = {"main_cpu_s": c_main, "new_cpu_s": c_new}
    c_fp, _ = _cpu(lambda: sharded_ray.id_fingerprint(logs["response_id"]), args.repeat)
    res["one_fingerprint_cpu_s"] = c_fp
    del j_main, j_new, b_main, b_new, t_main, t_new

    # one check task: bucket 0 of ``--check-files`` readers' buckets, each side's readers
    rng = np.random.default_rng(args.seed)
    fake = pa.nulls(1_000_000, pa.string())
    files = [rng.integers(0, 2**64 - 1, 1_000_000, dtype=np.uint64, endpoint=True) for _ in range(args.check_files)]
    dup = None
    for label, inject in (("check", False), ("check_repeated", True)):
        if inject:  # one fingerprint of bucket 0 repeated in another file
            b0 = np.flatnonzero(((files[0] & np.uint64(0xFFFFFFFF)) * np.uint64(args.buckets)) >> np.uint64(32) == 0)
            dup = int(files[0][b0[0]])
            files[-1][123] = np.uint64(dup)
        got = {}
        for side, sr in (("main", main_sr), ("new", sharded_ray)):
            pieces = [sr.response_id_buckets(pa.table({"response_id": fake, sr.FINGERPRINT: pa.array(f)}),
                                             args.buckets, ids=False, places=False)[0] for f in files]
            c, out = _cpu(lambda: sr.check_response_ids(*pieces), args.repeat)
            got[side] = (c, out)
            del pieces
        assert got["main"][1] == got["new"][1], (got["main"][1], got["new"][1])
        if inject:
            assert got["new"][1] == {"candidates": {0: [dup], args.check_files - 1: [dup]}}, got["new"][1]
        else:
            assert got["new"][1] is None
        res[label] = {"main_cpu_s": got["main"][0], "new_cpu_s": got["new"][0], "ids": 0}
    res["check"]["ids"] = res["check_repeated"]["ids"] = int(sum(
        np.count_nonzero(((f & np.uint64(0xFFFFFFFF)) * np.uint64(args.buckets)) >> np.uint64(32) == 0) for f in files))
    del files

    # the store's read in fresh processes, alternated
    if args.fresh:
        import subprocess

        code = ("import importlib.util, sys, time; from flows.storage.objects import Storage; "
                "spec = importlib.util.spec_from_file_location('lab', sys.argv[1]); m = importlib.util.module_from_spec(spec); "
                "spec.loader.exec_module(m); st = Storage.for_uri(sys.argv[2]); c = time.process_time(); m.LabelStore(st).read(); "
                "print(time.process_time() - c)")
        runs: dict = {"main": [], "new": []}
        with tempfile.TemporaryDirectory() as tmp:
            new_labels.LabelStore(Storage.for_uri(tmp)).append(table, "bench")
            for _ in range(args.fresh):
                for side, path in (("main", args.main / "flows/storage/labels.py"),
                                   ("new", HERE.parent / "flows/storage/labels.py")):
                    out = subprocess.run([sys.executable, "-c", code, str(path), tmp], capture_output=True, text=True,
                                         check=True, cwd=str(HERE.parent))
                    runs[side].append(round(float(out.stdout.strip().splitlines()[-1]), 3))
        res["store_read_fresh"] = {"main_cpu_s": statistics.median(runs["main"]),
                                   "new_cpu_s": statistics.median(runs["new"]), "runs": runs}
    for k in ("store_read", "index_build", "build_total", "reader", "join_only", "check", "check_repeated",
              "store_read_fresh"):
        if k not in res:
            continue
        res[k]["ratio"] = round(res[k]["main_cpu_s"] / max(res[k]["new_cpu_s"], 1e-9), 2)
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
