"""The `evaluate` flow's sharded row pass on a running Ray cluster (issue 29's 100M-row run), with its comparator.

Run against a stack of ``infra/stack/start.sh`` (its env file sourced: ``PREFECT_API_URL``, the S3 settings of
radosgw, ``RAY_AUTH_*``) with the logs and the label store written by ``bench_sharded.py --stage write
--label-store``. Two stages, each this process alone:

* ``flow``: `flows.pipelines.evaluate.evaluate` called in this process with the stack's settings (the flow run
  is recorded by the stack's Prefect API) and ``RAY_ADDRESS`` = the cluster's GCS address (``--ray``; this
  process is then the Ray driver itself: the rows' reduction runs on the cluster's workers, whatever the driver
  holds is in this process). Reports the flow's wall, this process's CPU (`time.process_time`) and peak RSS
  (``ru_maxrss`` and ``VmHWM``: the driver alone), the CPU of the stack's processes over the run (sampled
  from /proc every 0.5 s, every process whose command line names the stack's folder, ``--marker``, or descends
  from one: the ``ray::`` workers as ``worker``; as ``other`` the raylets, GCS and agents, and the stack's radosgw,
  ceph, Prefect server and PostgreSQL, per program in ``other_by_program``), the result's
  ``inference.row_pass``, the levels and the driver's garbage collections during the flow (``driver_gc``: per
  generation their count and the CPU of the thread that ran them, `GcCost`). With ``--runs N`` the flow runs N
  times in one Ray job: the first run's figures hold the job's start (its connection, made inside them, and the
  workers its tasks start), the others' (``warm_runs``) do not: the steady state, beside the comparator's warmed
  figures.
* ``groupby``: the comparator on the same cluster: one Ray task per file of the same window reads it
  (`flows.storage.logs.read_window`, radosgw) and sums the judge score per policy, partial sums merged
  (`bench_sharded._groupby_file`). First as a cold job (``cold``), measured as the flow is: this process's CPU
  from ``ray.init`` on and the cluster's, its workers started by its own tasks (a Ray job's workers are its own:
  the flow's start with it too), the columns the sharded readers keep. Then, warmed first (one import task a
  CPU, not counted), the two columns a mean needs and the columns the readers keep (``minimal``, ``needed``):
  the figures quoted before session 31, which leave out the workers' start that the flow's figure holds.
  With ``--by-prompt`` also a second comparator, Ray's own: Ray Data reads the same objects and groups the rows by
  prompt id (`ray_data_by_prompt`: the shuffle the per-prompt terms need, which the group-by of the policy skips).

Usage (after ``set -a; . $CJE_STACK_DIR/env; set +a``)::

    benchmarks/bench_flow_sharded.py --stage flow --logs s3://big29/logs100 --labels s3://big29/labels100 \\
        --results s3://big29/results --evaluation big29-100m --ray $CJE_STACK_RAY_GCS --out /tmp/flow100.json \\
        [--runs 3]
    benchmarks/bench_flow_sharded.py --stage groupby --logs s3://big29/logs100 --labels s3://big29/labels100 \
        --ray $CJE_STACK_RAY_GCS
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import threading
import time
from typing import Any
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if "--code" in sys.argv:  # another tree's flow code (e.g. main's, to alternate with this branch): before any import
    ROOT = Path(sys.argv[sys.argv.index("--code") + 1]).resolve()
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

log = logging.getLogger("bench_flow_sharded")
GiB = 1024**3
WINDOW = "2026-03-01..2026-03-07"  # bench_sharded's FIRST_DAY and DAYS


def _program(cmd: str) -> str:
    """A process's program from its command line: the base name of its first word, or of the script a Python runs
    (``ray::`` titles as they are)."""
    words = cmd.split()
    if not words or cmd.startswith("ray::"):
        return words[0] if words else "?"
    name = words[0].rsplit("/", 1)[-1]
    if name.startswith("python") and len(words) > 1:
        script = next((w for w in words[1:] if not w.startswith("-")), "")
        return script.rsplit("/", 1)[-1] or name
    return name


class RayCpu:
    """CPU seconds of the stack's processes while it runs: every 0.5 s the user + system time of each process whose
    command line names ``marker`` (raylet, GCS, agents; radosgw, ceph, PostgreSQL) and of their descendants (``ray::``
    workers; the Prefect server);
    a process's CPU counts from its first sample (from 0 when it started after this sampler), up to its last."""

    def __init__(self, marker: str, interval: float = 0.5) -> None:
        self.marker = marker.encode()
        self.interval = interval
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self.node: dict[int, int] = {}  # pid -> the raylet it runs under (its node), 0 for GCS and others
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ray-cpu-sampler")
        self._started = False
        self.samples = 0
        self.timeline: list[tuple[float, dict[str, float]]] = []  # (perf_counter, CPU so far per raylet)
        self.threads = DriverThreads()
        self.own_cpu = 0.0  # this sampler thread's CPU (in the driver process: not the flow's)
        self.cmd: dict[int, str] = {}  # the last command line seen of each process (200 characters)
        self.new_workers: set[int] = set()  # processes of the cluster started while it ran (a run's workers)

    def _scan(self) -> dict[int, tuple[str, float]]:
        """Every process of the cluster: whose command line names ``marker`` (raylet, GCS, agents) or that
        descends from one (its ``ray::`` workers); other sessions' Ray processes on the machine are left out."""
        tick = os.sysconf("SC_CLK_TCK")
        procs: dict[int, tuple[bytes, int, float]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmd = fh.read()
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    f = fh.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            procs[int(entry)] = (cmd, int(f[1]), (int(f[11]) + int(f[12])) / tick)
        out = {}
        for pid, (cmd, _, cpu) in procs.items():
            p, ours, raylet = pid, False, 0
            for _ in range(64):
                if p not in procs or p <= 1:
                    break
                if not raylet and b"raylet/raylet" in procs[p][0]:
                    raylet = p
                if self.marker in procs[p][0]:
                    ours = True
                    break
                p = procs[p][1]
            if not ours:
                continue
            self.node[pid] = raylet
            self.cmd[pid] = cmd[:200].replace(b"\0", b" ").decode(errors="replace")
            agent = any(w in cmd for w in (b"Dashboard", b"RuntimeEnv", b"Agent"))
            kind = "worker" if cmd.startswith(b"ray::") and not agent else "other"
            out[pid] = (kind, cpu)
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                seen = self._scan()
            except Exception as exc:  # noqa: BLE001 - a process that vanished mid-read: the next sample
                log.debug("sample failed: %s", exc)
                continue
            self.samples += 1
            for pid, v in seen.items():
                if pid not in self.first:
                    self.first[pid] = 0.0 if self._started else v[1]
                    if self._started:
                        self.new_workers.add(pid)
                self.last[pid] = v
            self.timeline.append((time.perf_counter(), self.per_node()))
            self.threads.sample()
            self.own_cpu = time.thread_time()

    def __enter__(self) -> "RayCpu":
        for pid, v in self._scan().items():
            self.first[pid] = v[1]
            self.last[pid] = v
        self._started = True
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for pid, v in self._scan().items():
            self.last[pid] = v

    def per_node(self) -> dict[str, float]:
        """CPU so far under each raylet ("0": GCS and agents of no raylet)."""
        out: dict[str, float] = {}
        for pid, (_, cpu) in self.last.items():
            key = str(self.node.get(pid, 0))
            out[key] = out.get(key, 0.0) + cpu - self.first.get(pid, 0.0)
        return out

    def at(self, t: float) -> dict[str, float]:
        """CPU so far per raylet at ``t`` (perf_counter), linear between the samples around it."""
        import bisect

        tl = self.timeline
        if not tl:
            return {}
        i = bisect.bisect_left([x[0] for x in tl], t)
        if i == 0:
            return dict(tl[0][1])
        if i >= len(tl):
            return dict(tl[-1][1])
        (ta, a), (tb, b) = tl[i - 1], tl[i]
        w = (t - ta) / (tb - ta) if tb > ta else 1.0
        return {k: a.get(k, 0.0) + w * (b.get(k, 0.0) - a.get(k, 0.0)) for k in set(a) | set(b)}

    def totals(self) -> dict[str, float]:
        out = {"worker": 0.0, "other": 0.0}
        per_node: dict[str, float] = {}  # CPU under each raylet (its workers and itself); "0": GCS, agents of no raylet
        for pid, (kind, cpu) in self.last.items():
            out[kind] += cpu - self.first.get(pid, 0.0)
            key = str(self.node.get(pid, 0))
            per_node[key] = per_node.get(key, 0.0) + cpu - self.first.get(pid, 0.0)
        other: dict[str, float] = {}  # the "other" CPU by program (raylet, GCS, agents, radosgw, ceph, postgres)
        for pid, (kind, cpu) in self.last.items():
            if kind == "other":
                name = _program(self.cmd.get(pid, "?"))
                other[name] = other.get(name, 0.0) + cpu - self.first.get(pid, 0.0)
        return {**{k: round(v, 2) for k, v in out.items()}, "samples": self.samples,
                "other_by_program": {k: round(v, 2) for k, v in sorted(other.items(), key=lambda kv: -kv[1])
                                     if v >= 0.01},
                "workers_started": len(self.new_workers),
                "started": sorted(([self.cmd.get(p, "?")[:60], round(self.last[p][1] - self.first.get(p, 0.0), 2)]
                                   for p in self.new_workers if p in self.last), key=lambda x: -x[1]),
                "per_raylet": {k: round(v, 2) for k, v in sorted(per_node.items())}}


class DriverThreads:
    """CPU of each thread of this process (user + system from /proc/self/task), its largest value seen by name:
    a Python thread by its ``threading`` name, another (Ray's C++ threads, gRPC) by its ``comm``."""

    def __init__(self) -> None:
        self.cpu: dict[int, tuple[str, float]] = {}

    def sample(self) -> dict[int, tuple[str, float]]:
        tick = os.sysconf("SC_CLK_TCK")
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat", "rb") as fh:
                    raw = fh.read()
            except OSError:
                continue
            comm = raw[raw.index(b"(") + 1:raw.rindex(b")")].decode(errors="replace")
            f = raw.rsplit(b")", 1)[1].split()
            t = int(tid)
            name = names.get(t) or (self.cpu[t][0] if t in self.cpu else comm)
            if name.startswith("Thread-") or name.startswith("ThreadPoolExecutor") or name.startswith("AnyIO"):
                name = name.split("-")[0] + " (pool)"
            self.cpu[t] = (name, (int(f[11]) + int(f[12])) / tick)
        return dict(self.cpu)

    def by_name(self, since: dict[int, tuple[str, float]] | None = None) -> dict[str, float]:
        out: dict[str, float] = {}
        for t, (name, cpu) in self.cpu.items():
            out[name] = out.get(name, 0.0) + cpu - (since.get(t, (name, 0.0))[1] if since else 0.0)
        return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if abs(v) >= 0.01}


#: The flow's phase borders: (a regular expression of a log line, the phase it ends; the first that matches).
PHASE_MARKS = [
    (r"^row pass: sharded \(.*read and reduced", "jackknife"),
    (r"^row pass: sharded \(", "discover"),
    (r"indexed on a Ray worker \([\d.]+ MiB in the object store\)$", "label index (serial, main)"),
    (r"prompt ids of \d+ (of \d+ )?file\(s\) sampled", "sampling"),
    (r"file\(s\) read, joined and split into", "readers"),
    (r"after pass 1$", "pass 1"),
    (r"after merge$", "merge"),
    (r"after calibration fit$", "calibration fit"),
    (r"after pass 2$", "pass 2"),
    (r"after influence terms$", "influence terms"),
    (r"replicates from the shards' histograms", "bootstrap"),
    (r"^finalized in", "finalize"),
    (r"^timings \(s\)", "render, publish"),
]


class Phases(logging.Handler):
    """The flow's phase borders from its log lines (`PHASE_MARKS`): at each, the wall clock and this process's CPU
    and threads (the log line is emitted by the thread that reaches the border)."""

    def __init__(self, threads: DriverThreads) -> None:
        super().__init__(logging.DEBUG)
        import re

        self.marks = [(re.compile(p), name) for p, name in PHASE_MARKS]
        self.threads = threads
        self.borders: list[tuple[str, float, float, dict]] = []

    def start(self) -> None:
        self.borders.append(("start", time.perf_counter(), time.process_time(), self.threads.sample()))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            return
        for rx, name in self.marks:
            if rx.search(msg):
                self.borders.append((name, time.perf_counter(), time.process_time(), self.threads.sample()))
                return

    def table(self, ray_cpu: "RayCpu", end: float, end_cpu: float) -> list[dict]:
        """Per phase: wall, this process's CPU (all threads; the sampler's own thread apart), the main thread's
        and the others' by name, the Ray CPU per raylet."""
        rows = []
        borders = self.borders + [("flow end", end, end_cpu, self.threads.sample())]
        sampler = {t for t, (n, _) in self.threads.cpu.items() if n == "ray-cpu-sampler"}
        for (_, t0, c0, th0), (name, t1, c1, th1) in zip(borders, borders[1:]):
            own = sum(th1.get(t, ("", 0.0))[1] - th0.get(t, ("", 0.0))[1] for t in sampler)
            r0, r1 = ray_cpu.at(t0), ray_cpu.at(t1)
            per = {k: round(r1.get(k, 0.0) - r0.get(k, 0.0), 2) for k in sorted(set(r0) | set(r1))}
            threads: dict[str, float] = {}
            for t, (n, cpu) in th1.items():
                if t in sampler:
                    continue
                threads[n] = threads.get(n, 0.0) + cpu - th0.get(t, (n, 0.0))[1]
            rows.append({"phase": name, "wall_s": round(t1 - t0, 2), "driver_cpu_s": round(c1 - c0 - own, 2),
                         "driver_threads": {k: round(v, 2) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])
                                            if v >= 0.05},
                         "ray_cpu_s": round(sum(per.values()), 2), "ray_cpu_per_raylet": per})
        return rows


def _hwm() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GiB
    return float("nan")


class GcCost:
    """Python's garbage collections in this process while the flow runs: per generation their count and the CPU of
    the thread that ran them (`time.thread_time` at each collection's start and stop, `gc.callbacks`)."""

    def __init__(self) -> None:
        self.by_gen: dict[int, list] = {}
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.thread_time()
            return
        acc = self.by_gen.setdefault(int(info["generation"]), [0, 0.0])
        acc[0] += 1
        acc[1] += time.thread_time() - self._t0

    def totals(self) -> dict:
        """``{generation: {"count": n, "cpu_s": s}}``."""
        return {str(g): {"count": n, "cpu_s": round(c, 3)} for g, (n, c) in sorted(self.by_gen.items())}


def stage_flow(args: argparse.Namespace) -> dict:
    """The evaluate flow in this process (the Ray driver), on the cluster at ``--ray``: one run (``--runs 1``, its
    own Ray job: connected and disconnected by the flow), or ``--runs N`` runs of the flow in one Ray job (this
    process connects first, inside the first run's figures; the flow finds Ray connected): the first run as the
    single one (its job's start: the connection and the workers its tasks start, with their imports), then
    ``warm_runs``, each on the workers the job has already started (the steady state, as the comparator's warmed
    figures)."""
    import contextlib

    os.environ["RAY_ADDRESS"] = args.ray
    t0 = time.perf_counter()
    from flows.pipelines.evaluate import evaluate
    from flows.runtime.prefect_server import use_api
    from flows.runtime.ray_fanout import ray_session

    t_import = time.perf_counter() - t0
    with use_api(os.environ["PREFECT_API_URL"]), contextlib.ExitStack() as job:
        def connect() -> None:
            job.enter_context(ray_session(args.ray))

        runs = [_flow_run(evaluate, args, args.evaluation if args.runs == 1 else f"{args.evaluation}-{i}",
                          connect if args.runs > 1 and i == 0 else None) for i in range(args.runs)]
    out = {"stage": "flow", "ray": args.ray, "import_s": round(t_import, 2), "code": str(ROOT),
           "worker_code": _worker_code(args.ray), **runs[0]}
    if out["worker_code"] != str(ROOT):
        log.warning("the Ray workers ran the code of %s, not of %s", out["worker_code"], ROOT)
    if args.runs > 1:
        out["warm_runs"] = runs[1:]
    return out


def _worker_code(address: str) -> str:
    """The tree whose ``flows`` a worker of a Ray job of this process imports (a job of its own, after the runs)."""
    import ray

    from flows.runtime.ray_fanout import ray_session

    def where() -> str:
        import flows

        return str(Path(flows.__file__).resolve().parents[1])

    with ray_session(address):
        return ray.get(ray.remote(where).remote())


def _flow_run(evaluate: Any, args: argparse.Namespace, evaluation: str, connect: Any = None) -> dict:
    """One run of the flow, measured: its wall, this process's CPU, the cluster's Ray CPU, per phase too.
    ``connect``: called first, inside the figures (the job's connection to Ray)."""
    import gc

    options = {"inference": args.inference, "seed": 0}
    if args.inference == "bootstrap":
        options["n_bootstrap"] = args.bootstrap
    with RayCpu(args.marker) as ray_cpu:
        phases = Phases(ray_cpu.threads)
        logging.getLogger().addHandler(phases)
        t1, c1 = time.perf_counter(), time.process_time()
        phases.start()
        collections = GcCost()
        gc.callbacks.append(collections)
        if connect is not None:
            connect()
        state = evaluate(logs_uri=args.logs, labels_uri=args.labels, results_uri=args.results, window=WINDOW,
                         evaluation=evaluation, options=options, row_pass=args.row_pass, return_state=True)
        t2, c2 = time.perf_counter(), time.process_time()
        gc.callbacks.remove(collections)
        wall, cpu = t2 - t1, c2 - c1
        out = state.result()
        time.sleep(1.0)  # a last sample of the Ray processes after the flow
    logging.getLogger().removeHandler(phases)
    table = phases.table(ray_cpu, t2, c2)
    sampler_cpu = round(sum(c for n, c in ray_cpu.threads.by_name().items() if n == "ray-cpu-sampler"), 2)
    log.info("phases:\n%s", "\n".join(f"  {r['phase']:<16} wall {r['wall_s']:7.2f} s  driver {r['driver_cpu_s']:6.2f} s"
                                       f"  Ray {r['ray_cpu_s']:7.2f} s {r['ray_cpu_per_raylet']}  {r['driver_threads']}"
                                       for r in table))
    res = out["result"]
    pols = res.get("policies") or {}
    return {"evaluation": evaluation, "flow_wall_s": round(wall, 2),
            "driver_cpu_s": round(cpu - sampler_cpu, 2), "sampler_cpu_s": sampler_cpu, "phases": table,
            "driver_threads_cpu_s": ray_cpu.threads.by_name(), "driver_gc": collections.totals(),
            "driver_maxrss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB, 3),
            "driver_vmhwm_gib": round(_hwm(), 3), "ray_cpu_s": ray_cpu.totals(),
            "flow_run_id": str(state.state_details.flow_run_id), "published": out["published"], "path": out["path"],
            "timings": out["timings"], "labels": out["labels"], "row_pass": (res.get("inference") or {}).get("row_pass"),
            "n_rows": (res.get("data") or {}).get("n_rows"),
            "levels": {k: {f: v.get(f) for f in ("estimate", "se", "ci", "level_claim")} for k, v in pols.items()}}


def stage_groupby(args: argparse.Namespace) -> dict:
    """Comparator: a Ray-parallel read + group-by of the same objects on the same cluster."""
    import ray

    from bench_sharded import GROUPBY_COLUMNS, _groupby_file, _keys, _warm, merge_groupby
    from flows.storage.objects import StorageConfig

    keys = _keys(args.logs)
    cfg = StorageConfig.from_env().to_dict(include_secrets=True)
    env = {"PYTHONPATH": str(ROOT)}
    if args.worker_allocator:  # the flow's workers' allocator settings (flows.runtime.ray_fanout) for it too
        from flows.runtime.ray_fanout import WORKER_ALLOCATOR_ENV

        env.update(WORKER_ALLOCATOR_ENV)
    sets = dict(GROUPBY_COLUMNS)
    if args.labels:  # the labels are in the label store, not in the logs: the columns of the logs the shards keep
        sets["needed"] = [c for c in sets["needed"] if c not in ("oracle_label", "label_probability")]
    # the cold job first: measured as the flow is, from the connection on (this process's CPU and the cluster's),
    # its workers started by its own tasks, as the flow's are (a Ray job's workers are its own)
    try:
        with RayCpu(args.marker) as ray_cpu:
            t0, c0 = time.perf_counter(), time.process_time()
            ray.init(address=args.ray, logging_level="ERROR", log_to_driver=False, runtime_env={"env_vars": env})
            remote = ray.remote(_groupby_file)
            total = merge_groupby(ray.get([remote.remote(args.logs, cfg, k, sets["needed"]) for k in keys]))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            time.sleep(1.0)  # a last sample of the Ray processes, as after the flow
        sampler = sum(c for n, c in ray_cpu.threads.by_name().items() if n == "ray-cpu-sampler")
        cold = {"columns": sets["needed"], "wall_s": round(wall, 2), "driver_cpu_s": round(cpu - sampler, 2),
                "rows": sum(n for _, n in total.values()), "ray_cpu_s": ray_cpu.totals()}
        cpus = int(ray.cluster_resources().get("CPU", 1))
        w0 = time.perf_counter()
        _warm(cpus)
        warmup = time.perf_counter() - w0
        out = {"stage": "groupby", "files": len(keys), "cpus": cpus, "warmup_s": round(warmup, 2), "cold": cold}
        for name, columns in sets.items():
            with RayCpu(args.marker) as ray_cpu:
                t0 = time.perf_counter()
                total = merge_groupby(ray.get([remote.remote(args.logs, cfg, k, columns) for k in keys]))
                wall = time.perf_counter() - t0
            out[name] = {"columns": columns, "wall_s": round(wall, 2), "ray_cpu_s": ray_cpu.totals(),
                         "rows": sum(n for _, n in total.values())}
        if args.by_prompt:
            with RayCpu(args.marker) as ray_cpu:
                t0 = time.perf_counter()
                groups = ray_data_by_prompt(args.logs, keys, cfg)
                wall = time.perf_counter() - t0
            out["by_prompt"] = {"columns": BY_PROMPT_COLUMNS, "wall_s": round(wall, 2), "ray_cpu_s": ray_cpu.totals(),
                                "groups": groups, "engine": f"ray.data {ray.__version__}"}
    finally:
        ray.shutdown()
    return out


#: The columns of the second comparator (`ray_data_by_prompt`): a prompt's rows over policies and days.
BY_PROMPT_COLUMNS = ["prompt_id", "policy", "judge_score"]


def ray_data_by_prompt(logs: str, keys: list[str], cfg: dict) -> int:
    """A second comparator, Ray's own: Ray Data reads the same objects (pyarrow's S3 filesystem on the same
    endpoint) and groups the rows by prompt id (a hash shuffle across the files: a prompt's rows are spread
    over its policies' days), each group's judge-score count and sum; returns the number of groups. It is the
    generic engine's version of what the analytic route cannot skip (the per-prompt terms over policies), beside
    the group-by of the policy (no shuffle), which issue 29's ratio is quoted against."""
    import pyarrow.fs as pafs
    import ray.data
    from ray.data.aggregate import Count, Sum

    from flows.storage.objects import Storage, StorageConfig

    c = StorageConfig.from_dict(cfg)
    st = Storage.for_uri(logs, c)
    endpoint = c.endpoint_url or ""
    fs = pafs.S3FileSystem(access_key=c.access_key, secret_key=c.secret_key, session_token=c.session_token,
                           region=c.region or "us-east-1", endpoint_override=endpoint.split("://", 1)[-1] or None,
                           scheme=endpoint.split("://", 1)[0] if "://" in endpoint else "https")
    paths = [st.url(k).split("://", 1)[1] for k in keys]  # bucket/prefix/key
    ds = ray.data.read_parquet(paths, filesystem=fs, columns=BY_PROMPT_COLUMNS)
    return ds.groupby("prompt_id").aggregate(Count(), Sum("judge_score")).count()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=["flow", "groupby"], required=True)
    p.add_argument("--worker-allocator", action="store_true",
                   help="groupby: its Ray workers get the flow's allocator settings too (WORKER_ALLOCATOR_ENV)")
    p.add_argument("--logs", required=True)
    p.add_argument("--labels")
    p.add_argument("--results")
    p.add_argument("--evaluation", default="bench-flow-sharded")
    p.add_argument("--ray", default=os.environ.get("CJE_STACK_RAY_GCS"), help="the cluster's GCS address")
    p.add_argument("--marker", default=os.environ.get("CJE_STACK_DIR", "/tmp/cje-stack"),
                   help="a string in the command line of the cluster's raylet/GCS (the stack's folder)")
    p.add_argument("--inference", default="analytic", choices=["analytic", "bootstrap"])
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--row-pass", default="sharded", choices=["auto", "single", "sharded"])
    p.add_argument("--runs", type=int, default=1,
                   help="flow stage: runs of the flow in one Ray job (the first connects; the others: warm_runs)")
    p.add_argument("--out", type=Path)
    p.add_argument("--by-prompt", action="store_true",
                   help="groupby stage: also Ray Data's group-by of the prompt id (a shuffle) over the same objects")
    p.add_argument("--code", type=Path, default=ROOT, help="the tree whose flow code runs (default: this one)")
    args = p.parse_args(argv)
    if not args.ray:
        p.error("--ray (or CJE_STACK_RAY_GCS) is needed")
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if args.out is not None:
        args.out = args.out.resolve()
    # the tree's workers too: a Ray job's workers put the driver's working folder first on their path (measured: a
    # driver in /work/main running another tree's flow had its workers import /work/main's `flows`)
    os.chdir(ROOT)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("cje_engine.pipeline.sharded").setLevel(logging.DEBUG)  # the driver's RSS per step
    out = (stage_flow if args.stage == "flow" else stage_groupby)(args)
    line = json.dumps(out)
    if args.out:
        args.out.write_text(line)
    print("STAGE_JSON " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
