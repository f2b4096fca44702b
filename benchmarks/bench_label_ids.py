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
* ``reader``: one 1M-row file's label join (`LabelIndex.join`) and response-id buckets
  (`flows.runtime.sharded_ray.response_id_buckets`, 26 buckets): main fingerprints the ids twice, fills the
  labels by a take of every row and ships fingerprints and places (16 B a row); this tree fingerprints once (the
  reader's ``_fp`` column), fills the joined rows only and ships the fingerprints alone (8 B a row).

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
    ap.add_argument("--buckets", type=int, default=26)
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
    for k in ("fill_store_labels", "first_labels", "log_response_ids"):  # main's label_index on main's labels
        setattr(main_li, k, getattr(main_labels, k))

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

    def reader_main():
        joined = index_main.join(logs)  # main: fingerprints inside the lookup, then the takes of every row
        return joined, sharded_ray.response_id_buckets(joined.append_column(ROW, rows), args.buckets, ids=False)

    def reader_new():
        t = logs.append_column(sharded_ray.FINGERPRINT, pa.array(sharded_ray.id_fingerprint(logs["response_id"])))
        joined = index_new.join(t)
        buckets = sharded_ray.response_id_buckets(joined.append_column(ROW, rows), args.buckets, ids=False,
                                                  places=False)
        return joined.drop_columns([sharded_ray.FINGERPRINT]), buckets

    c_main, (j_main, b_main) = _cpu(reader_main, args.repeat)
    c_new, (j_new, b_new) = _cpu(reader_new, args.repeat)
    assert j_new.equals(j_main) and j_new.schema.metadata == j_main.schema.metadata, "the joins differ"
    assert all(a[sharded_ray.FINGERPRINT].equals(b[sharded_ray.FINGERPRINT]) for a, b in zip(b_new, b_main)), \
        "the buckets differ"
    res["reader"] = {"main_cpu_s": c_main, "new_cpu_s": c_new,
                     "main_bucket_bytes": sum(b.nbytes for b in b_main), "new_bucket_bytes": sum(b.nbytes for b in b_new)}
    c_main, _ = _cpu(lambda: index_main.join(logs), args.repeat)
    t = logs.append_column(sharded_ray.FINGERPRINT, pa.array(sharded_ray.id_fingerprint(logs["response_id"])))
    c_new, _ = _cpu(lambda: index_new.join(t), args.repeat)
    res["join_only"] = {"main_cpu_s": c_main, "new_cpu_s": c_new}
    c_fp, _ = _cpu(lambda: sharded_ray.id_fingerprint(logs["response_id"]), args.repeat)
    res["one_fingerprint_cpu_s"] = c_fp
    for k in ("store_read", "index_build", "build_total", "reader", "join_only"):
        res[k]["ratio"] = round(res[k]["main_cpu_s"] / max(res[k]["new_cpu_s"], 1e-9), 2)
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
