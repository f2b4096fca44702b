"""The sharded readers' label join (issue 29): one log file against a big label store, main's way and the index's.

One process, CPU seconds (`time.process_time`: every thread of the process) of each step, the median of
``--repeat`` runs:

* ``join_labels``: `flows.storage.labels.join_labels` of one file against the whole label table (a group-by of
  every label and a hash of every stored id at each call): what each reader of main's sharded path paid;
* ``index_build``: `flows.runtime.label_index.LabelIndex.build` of the same table, once a run (on a worker);
* ``index_join``: `LabelIndex.join` of the same file: what each reader pays now;
* ``file_rows_main`` / ``file_rows_index``: the reader's whole `FileRows` call (join, covariates, checks,
  counts) with main's join and with the index;
* ``unpickle_table`` / ``unpickle_index``: pickle protocol 5 with out-of-band buffers (what Ray does) of the
  label table and of the index: the bytes each reader gets from the object store and the CPU to rebuild it.

The file: 5 policies x ``--prompts`` prompts of `cje_engine.simulate` (1M rows at the default), ids as
``bench_sharded.py --stage write`` writes them (``b0-<policy>:p<i>:0``), its 5% labels moved to the label
table; the label table: those plus ``--labels`` minus them of other blocks' ids (``b<k>-...``), in
`flows.storage.labels.LabelStore.read`'s columns. The two joins' tables are checked equal (and their counts).

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_label_join.py --labels 5000000 --prompts 200000
"""
from __future__ import annotations

import argparse
import json
import logging
import pickle
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

log = logging.getLogger("bench_label_join")


def _cpu(fn, repeat: int):
    """(median CPU seconds, median wall seconds, last result) of ``repeat`` calls of ``fn``."""
    cpu, wall, out = [], [], None
    for _ in range(repeat):
        out = None
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall), out


def block_file(prompts: int, seed: int):
    """(logs, own labels): a file of `bench_sharded.py`'s block 0 (5 policies x ``prompts``, ids prefixed ``b0-``)
    without its label columns, and its 5% labels (response id, label, probability) as a label store holds them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from cje_engine.simulate.direct import simulate

    t = pa.Table.from_pandas(simulate(prompts, oracle_fraction=0.05, seed=seed).frame, preserve_index=False)
    t = t.set_column(0, "prompt_id", pc.binary_join_element_wise("b0-", t["prompt_id"].cast(pa.string()), ""))
    t = t.set_column(t.column_names.index("response_id"), "response_id",
                     pc.binary_join_element_wise("b0-", t["response_id"].cast(pa.string()), ""))
    own = t.filter(t["oracle_label"].is_valid()).select(["response_id", "oracle_label", "label_probability"])
    return t.drop_columns(["oracle_label", "label_probability"]), own


def _tables(n_labels: int, prompts: int, seed: int):
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from flows.storage.labels import READ_SCHEMA

    logs, own = block_file(prompts, seed)
    rng = np.random.default_rng(seed)
    n_other = max(0, n_labels - own.num_rows)
    pols = np.array(["base", "clone", "parallel_universe_prompt", "premium", "unhelpful"])
    block = rng.integers(1, 20, n_other)
    pol = pols[rng.integers(0, 5, n_other)]
    prompt = rng.integers(0, 1_000_000, n_other)
    ids = [f"b{b}-{p}:p{i}:0" for b, p, i in zip(block.tolist(), pol.tolist(), prompt.tolist())]
    other = pa.table({"response_id": pa.array(ids, pa.string()),
                      "oracle_label": rng.integers(0, 21, n_other) / 20.0,
                      "label_probability": pa.array(np.full(n_other, 0.5))})
    # in the store's order (`flows.storage.labels.normalize_labels`)
    labels = pa.concat_tables([own, other]).sort_by([("response_id", "ascending"), ("oracle_label", "ascending")])
    labels = labels.append_column("version", pa.array(np.ones(labels.num_rows, dtype=np.int64)))
    dup = pc.value_counts(labels["response_id"])
    conflicting = dup.filter(pc.greater(dup.field("counts"), 1)).field("values")
    labels = labels.append_column("flagged", pc.is_in(labels["response_id"], value_set=conflicting))
    return logs, labels.cast(READ_SCHEMA)


def _pickle5(obj) -> tuple[bytes, list]:
    bufs: list = []
    return pickle.dumps(obj, protocol=5, buffer_callback=bufs.append), bufs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--labels", type=int, default=5_000_000, help="rows of the label table")
    ap.add_argument("--prompts", type=int, default=200_000, help="prompts of the file (x5 policies = its rows)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import pyarrow as pa

    from flows.pipelines.sharded_pass import FileRows
    from flows.runtime.label_index import LabelIndex
    from flows.storage.labels import join_counts, join_labels

    class MainFileRows(FileRows):
        """main's reader: `join_labels` against the whole label table at each call."""

        def __init__(self, labels, covariates):
            super().__init__(covariates)
            self.table = labels

        def __call__(self, table, source, labels=None):
            joined = join_labels(table, self.table).drop_columns(["label_conflict"])
            out, info = FileRows(self.covariates)(joined, source)
            return out, {**join_counts(joined), **info}

    logs, labels = _tables(args.labels, args.prompts, args.seed)
    res: dict = {"file_rows": logs.num_rows, "label_rows": labels.num_rows,
                 "label_table_mib": round(labels.nbytes / 2**20, 1)}
    c, w, want = _cpu(lambda: join_labels(logs, labels), args.repeat)
    res["join_labels"] = {"cpu_s": round(c, 3), "wall_s": round(w, 3)}
    c, w, index = _cpu(lambda: LabelIndex.build(labels), args.repeat)
    res["index_build"] = {"cpu_s": round(c, 3), "wall_s": round(w, 3), "index_mib": round(index.nbytes / 2**20, 1)}
    c, w, got = _cpu(lambda: index.join(logs), args.repeat)
    res["index_join"] = {"cpu_s": round(c, 3), "wall_s": round(w, 3)}
    assert got.equals(want) and got.schema.metadata == want.schema.metadata, "the joins differ"
    res["same_join"] = True
    covs = ["response_length"]
    c, w, main_out = _cpu(lambda: MainFileRows(labels, covs)(logs, "file"), args.repeat)
    res["file_rows_main"] = {"cpu_s": round(c, 3), "wall_s": round(w, 3)}
    reader = FileRows(covs)
    c, w, new_out = _cpu(lambda: reader(logs, "file", index), args.repeat)
    res["file_rows_index"] = {"cpu_s": round(c, 3), "wall_s": round(w, 3)}
    assert new_out[0].equals(main_out[0]) and new_out[1] == main_out[1], "the readers differ"
    for name, obj in (("table", labels), ("index", index)):
        head, bufs = _pickle5(obj)
        size = len(head) + sum(memoryview(b).nbytes for b in bufs)
        c, w, _ = _cpu(lambda: pickle.loads(head, buffers=bufs), args.repeat)
        res[f"unpickle_{name}"] = {"cpu_s": round(c, 4), "wall_s": round(w, 4), "mib": round(size / 2**20, 1)}
    res["join_ratio"] = round(res["join_labels"]["cpu_s"] / max(res["index_join"]["cpu_s"], 1e-9), 1)
    res["file_rows_ratio"] = round(res["file_rows_main"]["cpu_s"] / max(res["file_rows_index"]["cpu_s"], 1e-9), 1)
    res["pyarrow"] = pa.__version__
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
