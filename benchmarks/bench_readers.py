"""The sharded readers phase of the 100M-row flow (issue 29, round 18), function by function on one 1M-row file,
this tree beside another (``--main``, default ``/work/main``), each in its own process, alternated, same data.

The file: one of `bench_sharded.py --stage write --label-store`'s files (one policy of a block of 1M prompts, in
prompt-id order, its labels in the label store), probed against a label index of ``--labels`` labels (the file's
own labels plus ids of other blocks), split into ``--shards`` prompt-id ranges cut from ids of 20 blocks (as the
100M window's 26 shards: each file falls in 2-3 of them). Per tree, CPU seconds (`time.process_time`, the median of
``--repeat`` runs) of:

* ``split_file``: the whole reader (`flows.runtime.sharded_ray.split_file` with the flow's `FileRows`: read, label
  join, buckets, split, pack), returning the pieces of its file's shards only (`file_shards`, as the flow's readers);
* ``read`` (`read_window` as the reader calls it: here the columns its rows need, `FileRows.read_columns`; main
  every column); ``file_rows`` (`FileRows`: the join and the per-policy counts); ``split_by_shard`` and
  ``pack_piece`` of its rows (the columns the shards keep, its shards);
* ``id_fingerprint`` of the file's response ids; ``range_shard`` of its prompt ids; ``join`` (`LabelIndex.join`);
  ``buckets`` (`response_id_buckets` into the tree's number of buckets at 100M rows on 2 CPUs: main one a shard,
  26; this tree `response_id_bucket_count`, 4);
* ``check_100M``: the window's response-id check at 100M rows: one `check_response_ids` task of 100 pieces (one a
  file) of random fingerprints, times the tree's number of buckets (main 26 tasks of 3.85M ids, this tree 4 of 25M);
* ``steps`` (round 22): `split_file`'s steps as it runs them on each file in turn, one `time.process_time` a step
  (Arrow's threads included), the mean a file (`steps`); ``--steps-only``: ``split_file`` and the steps alone.
* ``--task`` (round 23): the reader's task as the flow runs it, the mean a file: in process (`split_file`'s user and
  system CPU and page faults, `getrusage`) and as Ray tasks one after another on a local Ray of 1 CPU whose worker
  gets the tree's `flows.runtime.ray_fanout.worker_env` (the flow's), the returned objects kept in the object store
  as the flow keeps the pieces: the worker's CPU inside `split_file` and between two tasks (the results put in the
  object store, the next task's arguments), user and system, and its page faults (`/proc/self/stat`). The child
  process runs with the tree's allocator settings of `worker_env` (as a worker would).

Usage (after ``bench_sharded.py --stage write --sizes 1000000 --logs DIR --label-store LABELS``)::

    PYTHONPATH=$PWD /work/main/.venv/bin/python benchmarks/bench_readers.py --logs DIR --label-store LABELS
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _cpu(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        c = time.process_time()
        fn()
        out.append(time.process_time() - c)
    return round(statistics.median(out), 4)


def _label_table(label_store: str, n_labels: int):
    """The store's labels plus ids of other blocks (``b<k>-<policy>:p<i>:0``) up to ``n_labels`` rows."""
    import numpy as np
    import pyarrow as pa

    from flows.storage.labels import LabelStore
    from flows.storage.objects import Storage

    own = LabelStore(Storage.for_uri(label_store)).read()
    n_other = max(0, n_labels - own.num_rows)
    pols = ["base", "clone", "parallel_universe_prompt", "premium", "unhelpful"]
    ids = [f"b{1 + j // 250_000}-{pols[j % 5]}:p{(j // 5) % 1_000_000:06d}:0" for j in range(n_other)]
    rng = np.random.default_rng(1)
    cols = {}
    for c in own.column_names:
        col = own[c].combine_chunks()
        extra = pa.array(ids, col.type) if c == "response_id" else col.take(pa.array(rng.integers(0, len(col), n_other)))
        cols[c] = pa.concat_arrays([col, extra])
    return pa.table(cols)


def splitters(n_shards: int) -> list[str]:
    """Prompt-id ranges of a window of 20 blocks of 1M prompts (``b<k>-p<i>``), as `range_splitters` cuts them."""
    ids = sorted(f"b{k}-p{i:06d}" for k in range(20) for i in range(0, 1_000_000, 997))
    return [ids[(j * len(ids)) // n_shards] for j in range(1, n_shards)]


#: `split_file`'s steps, in its order (`steps`).
STEPS = ("read", "fingerprint", "join", "counts", "row", "buckets", "select", "compact_policy", "split_by_shard",
         "pack_piece")


def steps(st, keys, index, cuts, keep, touched, n_buckets, n_shards: int, repeat: int) -> dict:
    """CPU seconds (`time.process_time`, Arrow's own threads included) of each step of `split_file` as it runs them
    on each file in turn (the same calls in the same order, one timer a step), the mean a file of the median of
    ``repeat`` passes over the files: ``read`` (`read_window` with the reader's choice of columns),
    ``fingerprint`` (`id_fingerprint`), ``join`` (`LabelIndex.join`), ``counts`` (`join_counts` and
    `policy_counts`: the rest of `FileRows`), ``row`` (the window places), ``buckets`` (`response_id_buckets`),
    ``select`` (the drops and the shards' columns), ``compact_policy``, ``split_by_shard`` and ``pack_piece``;
    ``total`` their sum."""
    import numpy as np
    import pyarrow as pa

    from cje_engine.data.frame import POLICY
    from cje_engine.pipeline import sharded
    from flows.pipelines.sharded_pass import FileRows, policy_counts
    from flows.runtime import sharded_ray
    from flows.storage.labels import join_counts
    from flows.storage.logs import read_window

    rows = FileRows((), ())
    row_bits = getattr(sharded_ray, "ROW_BITS", 40)

    def select(names):
        need = rows.read_columns(names)
        return None if need is None else [*need, *keep, "response_id"]

    def one_file(i: int, acc: dict) -> None:
        def timed(name, fn):
            c = time.process_time()
            out = fn()
            acc[name] = acc.get(name, 0.0) + time.process_time() - c
            return out

        key = keys[i]
        table = timed("read", lambda: read_window(st, [key], check_unique=False, dictionary=(POLICY,),
                                                  select=select))
        table = timed("fingerprint", lambda: table.append_column(
            sharded_ray.FINGERPRINT, pa.array(sharded_ray.id_fingerprint(table["response_id"]))))
        joined = timed("join", lambda: index.join(table))
        info = timed("counts", lambda: {**join_counts(joined), "policies": policy_counts(
            joined.drop_columns(["label_conflict"]))})
        joined = joined.drop_columns(["label_conflict"])
        start = i << row_bits
        joined = timed("row", lambda: joined.append_column(
            sharded.ROW, pa.array(np.arange(start, start + joined.num_rows, dtype=np.int64))))
        kw = {"n_buckets": n_buckets} if n_buckets else {}
        timed("buckets", lambda: sharded_ray.response_id_buckets(joined, kw.get("n_buckets", n_shards), ids=False,
                                                                 places=False))
        out = timed("select", lambda: joined.drop_columns(["response_id", sharded_ray.FINGERPRINT]).select(
            [c for c in dict.fromkeys([*keep, sharded.ROW]) if c in joined.column_names]))
        out = timed("compact_policy", lambda: sharded_ray.compact_policy(out))
        parts = timed("split_by_shard", lambda: sharded.split_by_shard(out, n_shards, splitters=cuts,
                                                                        shards=touched[i]))
        timed("pack_piece", lambda: [sharded.pack_piece(t) for t in parts])
        assert info["policies"]

    one_file(0, {})  # warm
    runs = []
    for _ in range(repeat):
        acc: dict = {}
        for i in range(len(keys)):
            one_file(i, acc)
        runs.append(acc)
    out = {k: round(statistics.median(r[k] for r in runs) / len(keys), 4) for k in STEPS}
    out["total"] = round(sum(out[k] for k in STEPS), 4)
    return out


def _proc_stat() -> tuple[float, float, int]:
    """(user CPU s, system CPU s, minor page faults) of this process so far (`/proc/self/stat`)."""
    with open("/proc/self/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(f[11]) / tick, int(f[12]) / tick, int(f[7])


def task_costs(args: argparse.Namespace, reader_with, index, n_files: int) -> dict:
    """`--task`: the reader in process (getrusage a file) and as Ray tasks on a local Ray of 1 CPU (the worker's
    CPU and faults inside `split_file` and between two tasks), the mean a file of ``repeat`` passes over the files.
    ``reader_with(i, index)``: the ``i``-th file's reader with the label index ``index`` (put once in the object
    store for the tasks, as the flow does)."""
    import resource

    import ray

    from flows.runtime.ray_fanout import worker_env

    out: dict = {}

    def reader(i: int):
        return reader_with(i, index)

    for i in range(n_files):  # warm
        reader(i)
    acc = [0.0, 0.0, 0]
    for _ in range(args.repeat):
        for i in range(n_files):
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            reader(i)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            acc[0] += r1.ru_utime - r0.ru_utime
            acc[1] += r1.ru_stime - r0.ru_stime
            acc[2] += r1.ru_minflt - r0.ru_minflt
    n = args.repeat * n_files
    out["inprocess"] = {"user": round(acc[0] / n, 4), "sys": round(acc[1] / n, 4), "faults": round(acc[2] / n)}
    env = {**worker_env(), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    for attempt in range(3):  # a local raylet slow to start on a loaded machine times out: again
        try:
            ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
            break
        except Exception:  # noqa: BLE001 - Ray's own "timed out during startup"
            ray.shutdown()
            if attempt == 2:
                raise
            time.sleep(5)
    try:
        stat = _proc_stat

        def task(i: int, idx):
            s0 = stat()
            res = reader_with(i, idx)
            s1 = stat()
            res[-1]["stat"] = (*s0, *s1)
            return res

        remote = ray.remote(task)
        n_returns = [len(reader(i)) for i in range(n_files)]
        idx = ray.put(index)
        kept, rows = [], []
        ray.get(remote.options(num_returns=n_returns[0]).remote(0, idx)[-1])  # the worker started, imports done
        for _ in range(args.repeat):
            for i in range(n_files):
                refs = remote.options(num_returns=n_returns[i]).remote(i, idx)
                rows.append(ray.get(refs[-1])["stat"])
                kept.append(refs)  # the pieces stay in the object store, as the flow's do
        inside = [sum(r[k + 3] - r[k] for r in rows) / len(rows) for k in range(3)]
        gaps = [sum(b[k] - a[k + 3] for a, b in zip(rows, rows[1:])) / max(len(rows) - 1, 1) for k in range(3)]
        out["ray_task"] = {"user": round(inside[0], 4), "sys": round(inside[1], 4), "faults": round(inside[2])}
        out["ray_between"] = {"user": round(gaps[0], 4), "sys": round(gaps[1], 4), "faults": round(gaps[2])}
        out["worker_env"] = {k: v for k, v in env.items() if k.startswith(("MIMALLOC", "MALLOC", "ARROW"))}
    finally:
        ray.shutdown()
    return out


def child(args: argparse.Namespace) -> dict:
    """The measures of the tree this process imports (its ``PYTHONPATH``)."""
    import numpy as np
    import pyarrow as pa

    from cje_engine.data.frame import POLICY
    from cje_engine.pipeline import sharded
    from flows.pipelines.sharded_pass import FileRows, shard_columns
    from flows.runtime import sharded_ray
    from flows.runtime.label_index import LabelIndex
    from flows.storage.logs import read_window
    from flows.storage.objects import Storage

    index = LabelIndex.build(_label_table(args.label_store, args.labels))
    st = Storage.for_uri(args.logs)
    keys = sorted(o.key for o in st.list() if o.key.endswith(".parquet"))
    cuts = splitters(args.shards)
    keep = shard_columns(())
    rows_100m, cpus = 100_000_000, 2
    count = getattr(sharded_ray, "response_id_bucket_count", None)
    n_buckets = count(rows_100m, cpus) if count else args.shards  # main: one a shard

    # the shards each file's reader returns pieces of (the flow's `file_shards`: 2-3 of 26 a file of a block of
    # prompts), the first file of the window not being the one measured (it also returns every shard no file touches)
    bounds = [sharded.id_bounds(read_window(st, [k], columns=["prompt_id"], check_unique=False)["prompt_id"])
              for k in keys]
    touched = sharded.file_shards([None] + bounds, cuts, args.shards)[1:]

    def reader_with(i: int, idx):
        return sharded_ray.split_file(args.logs, {}, keys[i % len(keys)], i, args.shards, None, None, None,
                                      FileRows((), ()), cuts, keep, idx,
                                      **({"n_buckets": n_buckets} if count else {}), shards=touched[i % len(keys)])

    def reader(i: int = 0):
        return reader_with(i, index)

    if args.task:
        return {"code": os.environ.get("PYTHONPATH", ""), "split_file": _cpu(reader, args.repeat),
                "steps": steps(st, keys, index, cuts, keep, touched, n_buckets if count else None, args.shards,
                               args.repeat), "task": task_costs(args, reader_with, index, len(keys))}
    if args.steps_only:
        return {"code": os.environ.get("PYTHONPATH", ""), "buckets_at_100M": n_buckets,
                "split_file": _cpu(reader, args.repeat),
                "steps": steps(st, keys, index, cuts, keep, touched, n_buckets if count else None, args.shards,
                               args.repeat)}
    reader()  # warm
    table = read_window(st, [keys[0]], check_unique=False, dictionary=(POLICY,))
    fp = sharded_ray.id_fingerprint(table["response_id"])
    with_fp = table.append_column(sharded_ray.FINGERPRINT, pa.array(fp))
    res = {"code": os.environ.get("PYTHONPATH", ""), "rows": table.num_rows, "buckets_at_100M": n_buckets,
           "split_file": _cpu(reader, args.repeat),
           "id_fingerprint": _cpu(lambda: sharded_ray.id_fingerprint(table["response_id"]), args.repeat),
           "range_shard": _cpu(lambda: sharded.range_shard(table["prompt_id"], cuts), args.repeat),
           "join": _cpu(lambda: index.join(with_fp), args.repeat),
           "buckets": _cpu(lambda: sharded_ray.response_id_buckets(with_fp, n_buckets, ids=False, places=False),
                           args.repeat)}
    # the reader's other steps on the file as it reads it: its read (this tree: the columns its rows need,
    # `FileRows.read_columns`; main: every column), `FileRows` (join and counts), the split and the packing
    rows = FileRows((), ())
    sel = {}
    if hasattr(rows, "read_columns"):
        sel = {"select": lambda names: None if rows.read_columns(names) is None else [*rows.read_columns(names), *keep]}
    res["read"] = _cpu(lambda: read_window(st, [keys[0]], check_unique=False, dictionary=(POLICY,), **sel),
                       args.repeat)
    res["file_rows"] = _cpu(lambda: rows(with_fp, st.url(keys[0]), index), args.repeat)
    prepared = rows(with_fp, st.url(keys[0]), index)[0]
    prepared = prepared.append_column(sharded.ROW, pa.array(np.arange(prepared.num_rows, dtype=np.int64)))
    prepared = sharded_ray.compact_policy(prepared.select([c for c in [*keep, sharded.ROW]
                                                            if c in prepared.column_names]))
    res["split_by_shard"] = _cpu(lambda: sharded.split_by_shard(prepared, args.shards, splitters=cuts,
                                                                shards=touched[0]), args.repeat)
    parts = sharded.split_by_shard(prepared, args.shards, splitters=cuts, shards=touched[0])
    res["pack_piece"] = _cpu(lambda: [sharded.pack_piece(t) for t in parts], args.repeat)
    res["steps"] = steps(st, keys, index, cuts, keep, touched, n_buckets if count else None, args.shards,
                         args.repeat)
    rng = np.random.default_rng(0)
    per = rows_100m // n_buckets // 100
    bucket = [pa.table({sharded_ray.FINGERPRINT: pa.array(rng.integers(0, 2**64 - 1, per, dtype=np.uint64))})
              for _ in range(100)]
    assert sharded_ray.check_response_ids(*bucket) is None
    res["check_one_task"] = _cpu(lambda: sharded_ray.check_response_ids(*bucket), max(1, args.repeat // 2))
    res["check_100M"] = round(res["check_one_task"] * n_buckets, 2)
    return res


def _print_task(runs: dict, trees: dict) -> int:
    """`--task`'s table: CPU s (and page faults) a 1M-row file, this tree and main, the median of the rounds."""
    def med(name: str, get) -> float:
        return statistics.median(get(r) for r in runs[name])

    print(f"{'CPU s a 1M-row file (median of rounds)':<52} {'this tree':>10} {'main':>10} {'ratio':>7}")
    rows = [(f"step {k}", lambda r, k=k: r["steps"][k]) for k in [*STEPS, "total"]]
    rows.append(("split_file (process_time)", lambda r: r["split_file"]))
    for where in ("inprocess", "ray_task", "ray_between"):
        for m in ("user", "sys", "faults"):
            rows.append((f"{where} {m}", lambda r, w=where, m=m: r["task"][w][m]))
    rows.append(("ray worker a file (task + between, user + sys)", lambda r: sum(
        r["task"][w][m] for w in ("ray_task", "ray_between") for m in ("user", "sys"))))
    for label, get in rows:
        a, b = med("this", get), med("main", get)
        ratio = f"{b / a:6.2f}x" if a else "      -"
        print(f"{label:<52} {a:10.4f} {b:10.4f} {ratio}")
    for name in trees:
        print(name, json.dumps(runs[name]))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", required=True)
    p.add_argument("--label-store", required=True)
    p.add_argument("--labels", type=int, default=5_000_000)
    p.add_argument("--shards", type=int, default=26)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two trees")
    p.add_argument("--main", type=Path, default=Path("/work/main"))
    p.add_argument("--steps-only", action="store_true", help="split_file and its steps only")
    p.add_argument("--task", action="store_true", help="the reader's task in process and on Ray (round 23)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        if args.task and not os.environ.get("_BENCH_WORKER_ENV"):  # as a Ray worker of the tree would start
            from flows.runtime.ray_fanout import worker_env

            alloc = {k: v for k, v in worker_env().items() if k.startswith(("MIMALLOC", "MALLOC", "ARROW"))}
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **alloc, "_BENCH_WORKER_ENV": "1"})
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    trees = {"this": HERE.parent, "main": args.main}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for _ in range(args.rounds):
        for name, root in trees.items():
            env = {**os.environ, "PYTHONPATH": str(root)}
            cmd = [sys.executable, str(HERE / "bench_readers.py"), "--child", "--logs", args.logs, "--label-store",
                   args.label_store, "--labels", str(args.labels), "--shards", str(args.shards), "--repeat",
                   str(args.repeat)] + (["--steps-only"] if args.steps_only else []) + (
                       ["--task"] if args.task else [])
            proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
            if proc.returncode:
                sys.stderr.write(proc.stderr[-4000:])
                proc.check_returncode()
            out = proc.stdout
            runs[name].append(json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]))
    if args.task:
        return _print_task(runs, trees)
    keys = ["split_file"] if args.steps_only else ["split_file", "read", "id_fingerprint", "file_rows", "join", "buckets", "split_by_shard", "range_shard",
            "pack_piece", "check_one_task", "check_100M"]
    print(f"{'CPU s (median of rounds)':<26} {'this tree':>10} {'main':>10} {'ratio':>7}")
    for k in keys:
        a = statistics.median(r[k] for r in runs["this"])
        b = statistics.median(r[k] for r in runs["main"])
        print(f"{k:<26} {a:10.4f} {b:10.4f} {b / max(a, 1e-9):6.2f}x")
    print(f"{'buckets at 100M':<26} {runs['this'][0]['buckets_at_100M']:>10} {runs['main'][0]['buckets_at_100M']:>10}")
    print(f"\n{'split_file by step, CPU s a file':<34} {'this tree':>10} {'main':>10} {'ratio':>7}")
    for k in [*STEPS, "total"]:
        a = statistics.median(r["steps"][k] for r in runs["this"])
        b = statistics.median(r["steps"][k] for r in runs["main"])
        print(f"{k:<34} {a:10.4f} {b:10.4f} {b / max(a, 1e-9):6.2f}x")
    for name in trees:
        print(name, json.dumps(runs[name]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
