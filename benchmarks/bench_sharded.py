"""The sharded row pass (issue 29) against the single-process path: same numbers, time, CPU, driver memory.

Stages, each in its own child process so that every peak RSS is that process's alone
(``getrusage(RUSAGE_SELF).ru_maxrss`` plus a 20 ms sampler, `bench_scale.MemorySampler`):

1. ``write``: 5 policies x ``--prompts`` prompts (5% labels, `cje_engine.simulate`) as daily Parquet
   files under ``--logs`` (a local folder or ``s3://bucket/prefix``, e.g. radosgw of ``infra/stack``),
   written in blocks of at most 1M prompts (prompt ids prefixed by the block) so that memory stays
   bounded at any size; each policy's rows of a block go to another day, so every prompt is spread over
   several daily files.
2. ``single``: the single-process path (`cje_engine.pipeline.direct`): the files read in window order,
   ``prepare`` + ``finalize`` (``--inference``); wall, CPU and peak RSS of the process.
3. ``sharded``: the driver of the sharded path (`cje_engine.pipeline.sharded` on Ray,
   `flows.runtime.sharded_ray`): shards read and reduced on Ray workers, the driver merges and finalizes.
   Wall and CPU of the driver process, its peak RSS (the driver alone: the workers are other processes). ``RAY_ADDRESS`` set: that cluster
   (e.g. two nodes of ``infra/stack``); else a local Ray with ``--ray-cpus`` CPUs.
4. ``inprocess``: every Ray task's function of the analytic route run in this one process (no Ray): CPU per
   function (the readers' sample, split and check, passes 1 and 2, the driver's merge/fit/Gram form, finalize).
5. ``groupby`` (comparator): a Ray-parallel read of the same objects plus a group-by mean of the judge
   score per policy (one task per file, partial sums merged), twice: reading the two columns the mean needs
   (``wall_s``) and reading the columns the sharded readers keep plus the response id (``wall_needed_s``).
   Both stages first run one task a CPU that imports what the tasks import (``warmup_s``, not in the
   figures): warm workers, as on a long-lived cluster. The sharded stage reports the Ray workers' CPU too (``ray_workers_cpu_s``, from /proc: every ``ray::``
   process under the driver; ``ray_other_cpu_s``: raylet, GCS and agents), and with ``--inference bootstrap`` the
   bootstrap's own wall and CPU (``bootstrap``: driver, Ray workers, raylet/GCS over pass 3 and the refits alone,
   and per replicate); ``--reference-pass3`` runs pass 3 as before (every shard draws every replicate's weights).

``--sizes 1000000,2000000`` runs write/single/sharded per size (prompts; rows = 5x) and prints one line per
size; ``--skip-single`` leaves out the single-process run (sizes where it does not fit). The numbers of the
two paths are compared field by field (largest relative difference printed); replicates with
``--bootstrap B`` are compared bit for bit.

Usage::

    .venv/bin/python benchmarks/bench_sharded.py --sizes 200000,2000000          # 1M and 10M rows
    .venv/bin/python benchmarks/bench_sharded.py --sizes 20000000 --skip-single \\
        --logs s3://cje-bench/logs --bootstrap 2000                               # 100M rows, radosgw + Ray
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from bench_scale import GiB, MemorySampler, _release_memory  # noqa: E402

log = logging.getLogger("bench_sharded")
BLOCK = 1_000_000  # prompts simulated and written at a time
DAYS = 7
FIRST_DAY = "2026-03-01"


def _storage(uri: str):
    from flows.storage.objects import Storage, StorageConfig

    return Storage.for_uri(uri, StorageConfig.from_env())


def _keys(uri: str) -> list[str]:
    from flows.storage.logs import discover_partitions
    from datetime import date, timedelta

    end = (date.fromisoformat(FIRST_DAY) + timedelta(days=DAYS - 1)).isoformat()
    return [f.key for f in discover_partitions(_storage(uri), FIRST_DAY, end)]


def stage_write(args: argparse.Namespace) -> dict:
    """Simulated logs in blocks of `BLOCK` prompts, one file per (block, day)."""
    from datetime import date, datetime, timedelta, timezone

    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from cje_engine.simulate.direct import simulate

    st = _storage(args.logs)
    rows = 0
    labels = []  # with --label-store: the labels leave the logs for the label store (as the evaluate flow reads)
    with MemorySampler() as mem:
        for block in range(math.ceil(args.prompts / BLOCK)):
            n = min(BLOCK, args.prompts - block * BLOCK)
            t = pa.Table.from_pandas(simulate(n, oracle_fraction=args.fraction, seed=args.seed + block).frame,
                                     preserve_index=False)
            t = t.set_column(0, "prompt_id", pc.binary_join_element_wise(f"b{block}-", t["prompt_id"].cast(pa.string()), ""))
            t = t.set_column(t.column_names.index("response_id"), "response_id",
                             pc.binary_join_element_wise(f"b{block}-", t["response_id"].cast(pa.string()), ""))
            if args.label_store:
                lab = t.filter(t["oracle_label"].is_valid())
                labels.append(lab.select(["response_id", "oracle_label", "label_probability"]))
                t = t.drop_columns(["oracle_label", "label_probability"])
            pol = np.asarray(pc.index_in(t["policy"], value_set=pc.unique(t["policy"])))
            day = (pol + block) % DAYS
            for d in range(DAYS):
                part = t.filter(pa.array(day == d))
                if not part.num_rows:
                    continue
                dt = (date.fromisoformat(FIRST_DAY) + timedelta(days=d)).isoformat()
                stamp = datetime.fromisoformat(dt).replace(tzinfo=timezone.utc)
                part = part.append_column("ts", pa.array([stamp] * part.num_rows, pa.timestamp("us", tz="UTC")))
                key = f"dt={dt}/part-b{block:04d}.parquet"
                sink = pa.BufferOutputStream()
                pq.write_table(part, sink, row_group_size=1 << 20, compression="zstd")
                st.write_bytes(key, sink.getvalue().to_pybytes())
            rows += t.num_rows
            del t
            _release_memory()
        mem.mark("write")
        version = n_labels = None
        if args.label_store:
            from flows.storage.labels import LabelStore

            table = pa.concat_tables(labels)
            del labels
            n_labels = table.num_rows
            version = LabelStore(_storage(args.label_store)).append(table, "bench_sharded")
            del table
            mem.mark("labels")
    return {"rows": rows, "files": len(_keys(args.logs)), "labels": n_labels, "label_version": version,
            "max_rss_gib": _max_rss()}


def _max_rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB


def _ray(args: argparse.Namespace):
    """`ray_session` (RAY_ADDRESS or a local Ray of ``--ray-cpus``), retried: a local raylet that does not
    register within Ray's fixed 30 s (a loaded machine) is started again, up to 4 times."""
    import contextlib

    from flows.runtime import ray_fanout

    for attempt in range(4):
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(ray_fanout.ray_session(
                num_cpus=None if os.environ.get("RAY_ADDRESS") else args.ray_cpus))
            return stack
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception on a slow start
            stack.close()
            import ray

            ray.shutdown()  # stop what the failed start left running
            log.warning("Ray did not start (attempt %d): %s", attempt + 1, exc)
            time.sleep(10)
    raise RuntimeError("Ray did not start in 4 attempts")


def _opts(args: argparse.Namespace):
    from cje_engine.options import EvaluationOptions

    kw = {"inference": args.inference, "seed": args.seed}
    if args.inference == "bootstrap":
        kw["n_bootstrap"] = args.bootstrap
    return EvaluationOptions.of(None, **kw)


def stage_single(args: argparse.Namespace) -> dict:
    """The single-process path on the whole window."""
    import numpy as np

    from cje_engine.pipeline import direct
    from flows.storage.logs import read_window

    keys = _keys(args.logs)
    opts = _opts(args)
    with MemorySampler() as mem:
        t0, c0 = time.perf_counter(), time.process_time()
        table = read_window(_storage(args.logs), keys, check_unique=False).drop(["dt", "ts"])
        mem.mark("read")
        prep = direct.prepare(table, opts)
        del table
        mem.mark("prepare")
        reps = [direct.bootstrap_chunk(prep, 0, args.check_replicates)] if args.check_replicates else []
        result = direct.finalize(prep, [direct.bootstrap_chunk(prep, 0, args.bootstrap)]
                                 if args.inference == "bootstrap" else [])
        mem.mark("finalize")
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = _write_result(args, "single", result)
    if reps:
        np.save(args.out / "single_reps.npy", reps[0])
    return {"wall_s": wall, "cpu_s": cpu, "max_rss_gib": _max_rss(), "stages": mem.stages, **out}


def _write_result(args: argparse.Namespace, name: str, result) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result.to_dict()))
    return {"n_rows": result.to_dict()["data"]["n_rows"]}


def stage_sharded(args: argparse.Namespace) -> dict:
    """The sharded path's driver: Ray reads, reduces and bootstraps; the driver merges and finalizes."""
    import numpy as np
    import ray

    from cje_engine.pipeline import sharded
    from flows.pipelines.sharded_pass import shard_columns
    from flows.runtime import ray_fanout, sharded_ray
    from flows.storage.objects import StorageConfig

    keys = _keys(args.logs)
    opts = _opts(args)
    cfg = StorageConfig.from_env().to_dict(include_secrets=True)
    rows = args.prompts * 5
    with _ray(args):
        cpus = ray_fanout.cluster_cpus()
        n_shards = args.shards or sharded_ray.n_shards_for(rows, cpus)
        w0 = time.perf_counter()
        _warm(cpus)
        warmup = time.perf_counter() - w0
        ray0 = _ray_cpu()
        with MemorySampler() as mem:
            t0, c0 = time.perf_counter(), time.process_time()
            refs = sharded_ray.read_shards(args.logs, cfg, keys, n_shards, rows_hint=rows, keep=shard_columns(()))
            per_task, memory = sharded_ray.task_memory(rows // n_shards), {}
            mapper = sharded_ray.ray_mapper(memory=lambda name: memory.get(name, per_task))
            keep = {"auto": None, "per_prompt": True, "gram": False}[args.terms]
            sp = sharded.prepare_sharded(refs, opts, mapper=mapper, reason="benchmark", keep_terms=keep)
            memory.update(sharded_ray.bootstrap_task_memory(sp))
            mem.mark("read + passes 1-2 + merge")
            t_prep = time.perf_counter() - t0
            chunks = []
            boot = {}
            if args.inference == "bootstrap":
                K, G = sp.prep.design.n_policies, sp.prep.design.cells.cells.size
                step = sharded_ray.replicate_chunk(args.bootstrap, K, G)
                rb0, b0, cb0 = _ray_cpu(), time.perf_counter(), time.process_time()
                sp.fast_histograms = not args.reference_pass3
                chunks = [sp.replicates(a, min(a + step, args.bootstrap)) for a in range(0, args.bootstrap, step)]
                rb1 = _ray_cpu()
                boot = {"wall_s": time.perf_counter() - b0, "driver_cpu_s": time.process_time() - cb0,
                        "ray_workers_cpu_s": rb1["worker"] - rb0.get("worker", 0.0),
                        "ray_other_cpu_s": rb1["other"] - rb0.get("other", 0.0), "replicates": args.bootstrap,
                        "weights": "every shard draws them" if args.reference_pass3 else "drawn once per chunk"}
                boot["cpu_per_replicate_ms"] = 1e3 * (boot["driver_cpu_s"] + boot["ray_workers_cpu_s"]
                                                      + boot["ray_other_cpu_s"]) / args.bootstrap
                log.info("bootstrap (pass 3): %s", boot)
                mem.mark("bootstrap (pass 3)")
            reps = sp.replicates(0, args.check_replicates) if args.check_replicates else None
            result = sp.finalize(chunks)
            mem.mark("finalize")
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        ray1 = _ray_cpu()
        time.sleep(2)  # the workers' task events reach the GCS every second
        tasks = _task_times()
        del refs
    workers = {k: ray1[k] - ray0.get(k, 0.0) for k in ray1}
    out = _write_result(args, "sharded", result)
    if reps is not None:
        np.save(args.out / "sharded_reps.npy", reps)
    return {"wall_s": wall, "cpu_s": cpu, "prepare_wall_s": t_prep, "max_rss_gib": _max_rss(), "shards": n_shards,
            "terms": sp.influence, "warmup_s": warmup, "bootstrap": boot, "ray_workers_cpu_s": sum(v for k, v in workers.items() if k == "worker"),
            "ray_other_cpu_s": sum(v for k, v in workers.items() if k != "worker"), "tasks": tasks,
            "cpus": cpus, "stages": mem.stages, **out}


def stage_inprocess(args: argparse.Namespace) -> dict:
    """Every Ray task's function of the analytic route run in this process, in the order Ray runs them (the readers'
    sample, split and response-id check, passes 1 and 2, the driver's merge, fit and Gram form, finalize), with
    ``--shards`` (default 4) range shards: CPU seconds (`time.process_time`) per function, without Ray's own costs
    (and apart, its user and system CPU: the driver's merge and calibration fit are timed as functions too).
    What to cut first, and a before/after of the same files without the noise of the Ray processes."""
    from cje_engine.pipeline import sharded
    from flows.pipelines.sharded_pass import shard_columns
    from flows.runtime import sharded_ray
    from flows.storage.objects import StorageConfig

    keys = _keys(args.logs)
    opts = _opts(args)
    cfg = StorageConfig.from_env().to_dict(include_secrets=True)
    n_shards = args.shards or 4
    cpu: dict[str, float] = {}

    split: dict[str, list[float]] = {}  # user and system CPU of each function (getrusage: page faults are system)

    def usage() -> tuple[float, float]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime, r.ru_stime

    def timed(fn):
        def run(*a, **kw):
            c, (u, s) = time.process_time(), usage()
            try:
                return fn(*a, **kw)
            finally:
                cpu[fn.__name__] = cpu.get(fn.__name__, 0.0) + time.process_time() - c
                u1, s1 = usage()
                us = split.setdefault(fn.__name__, [0.0, 0.0])
                us[0] += u1 - u
                us[1] += s1 - s
        run.__dict__.update(fn.__dict__)  # its ``from_pieces`` (pass 1 reads the pieces as a Ray task does)
        return run

    # the readers' split and packing timed apart (`split_file` looks them up in the engine's module when called)
    plain_split, plain_pack = sharded.split_by_shard, getattr(sharded, "pack_piece", None)
    sharded.split_by_shard = timed(plain_split)
    if plain_pack is not None:
        sharded.pack_piece = timed(plain_pack)
    c0 = time.process_time()
    samples = [timed(sharded_ray.sample_file)(args.logs, cfg, k, sharded_ray.SAMPLES_PER_SHARD * n_shards, None, None)
               for k in keys]
    splitters = sharded.range_splitters(samples, n_shards)
    pieces = [timed(sharded_ray.split_file)(args.logs, cfg, k, i, n_shards, None, None, None, None, splitters,
                                            shard_columns(())) for i, k in enumerate(keys)]
    found = [timed(sharded_ray.check_response_ids)(*[p[n_shards + b] for p in pieces]) for b in range(n_shards)]
    if any(f is not None for f in found):
        raise RuntimeError(f"repeated response-id fingerprints in the benchmark's files: {found}")
    shards = [sharded_ray.ShardPieces([p[s] for p in pieces]) for s in range(n_shards)]
    readers = time.process_time() - c0
    sharded.split_by_shard = plain_split
    # bytes the pieces put in the object store a row (their buffers; slices count their part only), and beside
    # them the same pieces as plain tables (what the readers shipped before pieces were packed: `unpack_piece`)
    n_rows = sum(p[2 * n_shards]["rows"] for p in pieces)
    shipped = sum(getattr(x, "nbytes", 0) for p in pieces for x in p[:n_shards])
    plain = sum((sharded.unpack_piece(x) if plain_pack is not None else x).nbytes for p in pieces for x in p[:n_shards])
    if plain_pack is not None:
        sharded.pack_piece = plain_pack
    del pieces

    def mapper(fn, items):
        run = timed(fn)
        for i, item in enumerate(items):
            layout, flat = sharded_ray._flatten(item)
            yield i, sharded_ray._with_pieces(run, layout, *flat)

    keep = {"auto": None, "per_prompt": True, "gram": False}[args.terms]
    # the driver's steps timed apart too (looked up in their modules when called)
    from cje_engine.pipeline import calibration

    plain_fit, plain_merge = calibration.fit_calibration, sharded.merge_summaries
    calibration.fit_calibration, sharded.merge_summaries = timed(plain_fit), timed(plain_merge)
    c1 = time.process_time()
    try:
        sp = sharded.prepare_sharded(shards, opts, mapper=mapper, reason="benchmark", keep_terms=keep)
    finally:
        calibration.fit_calibration, sharded.merge_summaries = plain_fit, plain_merge
    prepare = time.process_time() - c1
    result = timed(sp.finalize)([])
    total = time.process_time() - c0
    cpu["driver: merge, fit, Gram form"] = prepare - cpu.get("reduce_shard", 0.0) - cpu.get("shard_evaluation_terms",
                                                                                           0.0)
    out = _write_result(args, "inprocess", result)
    return {"cpu_s": total, "readers_cpu_s": readers, "cpu_by_function_s": {k: round(v, 3) for k, v in cpu.items()},
            "user_system_by_function_s": {k: [round(u, 3), round(s, 3)] for k, (u, s) in split.items()},
            "shards": n_shards, "terms": sp.influence, "max_rss_gib": _max_rss(),
            "piece_bytes_per_row": round(shipped / max(n_rows, 1), 2),
            "plain_piece_bytes_per_row": round(plain / max(n_rows, 1), 2), **out}


def _ray_cpu() -> dict:
    """CPU seconds (user + system) of this process's descendants by kind: ``worker`` (Ray's worker processes,
    ``ray::...`` but its agents) and ``other`` (raylet, GCS, agents). Processes that ended are not counted
    (Ray's local workers live as long as the session, so this is read before it ends)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    stats: dict[int, tuple[float, bytes]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        stats[int(entry)] = ((int(fields[11]) + int(fields[12])) / tick, cmd)
    me, out = os.getpid(), {"worker": 0.0, "other": 0.0}
    for pid, (cpu, cmd) in stats.items():
        p = parent.get(pid)
        while p and p != me:
            p = parent.get(p)
        if p != me:
            continue
        agent = any(w in cmd for w in (b"Dashboard", b"RuntimeEnv", b"Agent"))
        out["worker" if cmd.startswith(b"ray::") and not agent else "other"] += cpu
    return out


def _warm(cpus: int) -> None:
    """One task a CPU importing what the passes and the comparator import (Arrow, the log reader, the engine),
    so that neither measure pays the Ray workers' first imports (reported apart as ``warmup_s``)."""
    import ray

    def imports() -> int:
        import flows.storage.logs  # noqa: F401
        import cje_engine.pipeline.sharded  # noqa: F401
        time.sleep(0.5)  # hold the worker: the next task goes to another one
        return os.getpid()

    ray.get([ray.remote(imports).remote() for _ in range(max(1, cpus))])


def _task_times() -> dict:
    """Per Ray task name: [tasks, their summed wall seconds, first start and last end in seconds from the first
    task's start] (Ray's timeline of this session)."""
    import ray

    spans: dict = {}
    for ev in ray.timeline():
        cat = str(ev.get("cat", ""))
        if ev.get("ph") != "X" or not cat.startswith("task::cje_"):
            continue
        name = cat[len("task::"):]
        spans.setdefault(name, []).append((ev["ts"] / 1e6, (ev["ts"] + ev["dur"]) / 1e6))
    if not spans:
        return {}
    t0 = min(a for v in spans.values() for a, _ in v)
    return {n: [len(v), round(sum(b - a for a, b in v), 2), round(min(a for a, _ in v) - t0, 2),
                round(max(b for _, b in v) - t0, 2)] for n, v in spans.items()}


#: Columns of the comparator's read: ``minimal`` (what a mean of the score per policy needs) and ``needed``
#: (what the sharded readers keep of the same files, plus the response id they check).
GROUPBY_COLUMNS = {"minimal": ["policy", "judge_score"],
                   "needed": ["prompt_id", "policy", "judge_score", "oracle_label", "label_probability",
                              "response_id"]}


def merge_groupby(parts: list[dict]) -> dict:
    """The comparator's merge: per policy the sum and count over the files' partial results."""
    total: dict = {}
    for p in parts:
        for pol, (s, n) in p.items():
            a = total.setdefault(pol, [0.0, 0])
            a[0] += s
            a[1] += n
    return total


def _groupby_file(uri: str, cfg: dict, key: str, columns: list[str] = GROUPBY_COLUMNS["minimal"]):
    from flows.storage.logs import read_window
    from flows.storage.objects import Storage, StorageConfig

    t = read_window(Storage.for_uri(uri, StorageConfig.from_dict(cfg)), [key], columns=columns,
                    check_unique=False)
    g = t.group_by("policy").aggregate([("judge_score", "sum"), ("judge_score", "count")])
    return dict(zip(g["policy"].to_pylist(), zip(g["judge_score_sum"].to_pylist(), g["judge_score_count"].to_pylist())))


def stage_groupby(args: argparse.Namespace) -> dict:
    """Comparator: a Ray-parallel read + group-by mean of the same objects."""
    import ray

    from flows.runtime import ray_fanout
    from flows.storage.objects import StorageConfig

    keys = _keys(args.logs)
    cfg = StorageConfig.from_env().to_dict(include_secrets=True)
    walls, cpus = {}, {}
    with _ray(args):
        w0 = time.perf_counter()
        _warm(ray_fanout.cluster_cpus())
        warmup = time.perf_counter() - w0
        remote = ray.remote(_groupby_file)
        for name, columns in GROUPBY_COLUMNS.items():
            ray0 = _ray_cpu()
            t0 = time.perf_counter()
            total = merge_groupby(ray.get([remote.remote(args.logs, cfg, k, columns) for k in keys]))
            walls[name] = time.perf_counter() - t0
            cpus[name] = _ray_cpu()["worker"] - ray0["worker"]
    return {"wall_s": walls["minimal"], "wall_needed_s": walls["needed"], "workers_cpu_s": cpus, "warmup_s": warmup,
            "means": {p: s / n for p, (s, n) in total.items()}}


def compare(a: dict, b: dict) -> tuple[float, str]:
    """Largest relative difference over every number of two results (``inference.row_pass`` left out)."""
    worst = (0.0, "")

    def walk(x, y, path):
        nonlocal worst
        if isinstance(x, dict):
            for k in x:
                if k in ("row_pass", "engine_version", "generated_at"):
                    continue
                walk(x[k], y.get(k) if isinstance(y, dict) else None, f"{path}.{k}")
        elif isinstance(x, list) and isinstance(y, list):
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{path}[{i}]")
        elif isinstance(x, float) and isinstance(y, (int, float)):
            d = abs(x - y)
            rel = d / max(abs(x), abs(y)) if d > 0 else 0.0
            if rel > worst[0]:
                worst = (rel, path)
        elif x != y:
            worst = (math.inf, f"{path}: {x!r} vs {y!r}")

    walk(a, b, "")
    return worst


def _child(stage: str, args: argparse.Namespace, prompts: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", stage, "--sizes", str(prompts),
           "--logs", _logs_for(args, prompts), "--inference", args.inference, "--bootstrap", str(args.bootstrap),
           "--seed", str(args.seed), "--fraction", str(args.fraction), "--ray-cpus", str(args.ray_cpus),
           "--shards", str(args.shards), "--check-replicates", str(args.check_replicates), "--terms", args.terms,
           *(["--reference-pass3"] if args.reference_pass3 else []),
           "--out", str(args.out / str(prompts))]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("STAGE_JSON ")), None)
    if proc.returncode != 0 or line is None:
        sys.stderr.write(proc.stderr[-6000:])
        raise RuntimeError(f"stage {stage} at {prompts} prompts failed with exit code {proc.returncode}")
    out = json.loads(line[len("STAGE_JSON "):])
    out["process_wall_s"] = time.perf_counter() - t0
    log.info("%s %d prompts: %s", stage, prompts, {k: v for k, v in out.items() if k != "stages"})
    return out


def _logs_for(args: argparse.Namespace, prompts: int) -> str:
    return args.logs if args.logs.startswith("s3://") or args.stage else str(Path(args.logs) / str(prompts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="200000,2000000", help="prompts per run, comma-separated (rows = 5x)")
    p.add_argument("--logs", default=str(HERE / "_work" / "sharded"), help="folder or s3:// root of the logs")
    p.add_argument("--inference", default="analytic", choices=["analytic", "bootstrap"])
    p.add_argument("--bootstrap", type=int, default=0, help="B of the bootstrap route")
    p.add_argument("--check-replicates", type=int, default=0, help="replicates compared bit for bit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--ray-cpus", type=int, default=2)
    p.add_argument("--shards", type=int, default=0, help="0: from the rows and the cluster's CPUs")
    p.add_argument("--skip-single", action="store_true")
    p.add_argument("--terms", default="auto", choices=["auto", "per_prompt", "gram"],
                   help="influence terms on the sharded driver: per prompt, the Gram form, or by the driver budget")
    p.add_argument("--keep", action="store_true", help="keep the written logs")
    p.add_argument("--reference-pass3", action="store_true",
                   help="the bootstrap's pass 3 as before: every shard draws every replicate's weights itself")
    p.add_argument("--out", type=Path, default=HERE / "_work" / "sharded_out")
    p.add_argument("--stage", choices=["write", "single", "sharded", "groupby", "inprocess"])
    p.add_argument("--label-store", default=None,
                   help="write stage: the labels go to this label store (folder or s3:// root), not into the logs")
    args = p.parse_args(argv)
    if args.inference == "bootstrap" and args.bootstrap < 50:
        p.error("--inference bootstrap needs --bootstrap >= 50")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("cje_engine.pipeline.sharded").setLevel(logging.DEBUG)  # the driver's RSS per step
    if args.stage:
        args.prompts = int(args.sizes)
        fn = {"write": stage_write, "single": stage_single, "sharded": stage_sharded, "groupby": stage_groupby,
              "inprocess": stage_inprocess}
        print("STAGE_JSON " + json.dumps(fn[args.stage](args)))
        return 0
    rows_out = []
    for prompts in [int(s) for s in args.sizes.split(",")]:
        logs = _logs_for(args, prompts)
        reuse = not logs.startswith("s3://") and any(Path(logs).glob("dt=*/*.parquet"))
        w = {"rows": 5 * prompts, "files": len(list(Path(logs).glob("dt=*/*.parquet")))} if reuse else \
            _child("write", args, prompts)
        single = None if args.skip_single else _child("single", args, prompts)
        sh = _child("sharded", args, prompts)
        gb = _child("groupby", args, prompts)
        row = {"prompts": prompts, "rows": w["rows"], "files": w["files"], "sharded": sh, "single": single,
               "groupby_wall_s": gb["wall_s"], "groupby_needed_wall_s": gb["wall_needed_s"],
               "groupby_workers_cpu_s": gb["workers_cpu_s"]}
        if single is not None:
            a = json.loads((args.out / str(prompts) / "single.json").read_text())
            b = json.loads((args.out / str(prompts) / "sharded.json").read_text())
            row["max_rel_diff"], row["max_rel_diff_at"] = compare(a, b)
            if args.check_replicates:
                import numpy as np

                row["replicates_identical"] = bool(np.array_equal(
                    np.load(args.out / str(prompts) / "single_reps.npy"),
                    np.load(args.out / str(prompts) / "sharded_reps.npy"), equal_nan=True))
        rows_out.append(row)
        if not args.keep and not logs.startswith("s3://"):
            shutil.rmtree(logs, ignore_errors=True)
    print("\n rows        | path    | wall s | driver CPU s | driver peak RSS GiB | shards | ratio | same numbers")
    for r in rows_out:
        s, sh = r["single"], r["sharded"]
        ratio = f"{sh['wall_s'] / s['wall_s']:.2f}" if s else "-"
        same = (f"max rel {r['max_rel_diff']:.1e}" + (f", reps identical {r.get('replicates_identical')}"
                                                       if "replicates_identical" in r else "")) if s else "-"
        if s:
            print(f" {r['rows']:>11,} | single  | {s['wall_s']:6.1f} | {s['cpu_s']:12.1f} | {s['max_rss_gib']:19.2f} | "
                  f"{'-':>6} |       |")
        print(f" {r['rows']:>11,} | sharded | {sh['wall_s']:6.1f} | {sh['cpu_s']:12.1f} | {sh['max_rss_gib']:19.2f} | "
              f"{sh['shards']:>6} | {ratio:>5} | {same} | terms {sh.get('terms')}")
        print(f" {r['rows']:>11,} | Ray workers' CPU {sh['ray_workers_cpu_s']:.1f} s (+ raylet/GCS "
              f"{sh['ray_other_cpu_s']:.1f} s)")
        if sh.get("bootstrap"):
            b = sh["bootstrap"]
            print(f" {r['rows']:>11,} | bootstrap B={b['replicates']} ({b['weights']}): wall {b['wall_s']:.1f} s, CPU "
                  f"driver {b['driver_cpu_s']:.1f} s + Ray workers {b['ray_workers_cpu_s']:.1f} s + raylet/GCS "
                  f"{b['ray_other_cpu_s']:.1f} s = {b['cpu_per_replicate_ms']:.1f} ms a replicate")
        print(f" {r['rows']:>11,} | read+group-by on Ray: {r['groupby_wall_s']:.1f} s (2 columns), "
              f"{r['groupby_needed_wall_s']:.1f} s (the sharded readers' columns); sharded / read+group-by "
              f"{sh['wall_s'] / r['groupby_wall_s']:.1f}x, {sh['wall_s'] / r['groupby_needed_wall_s']:.1f}x")
    (args.out / "summary.json").write_text(json.dumps(rows_out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
