"""The `evaluate` flow end to end on one window of 10,000,000 log rows in S3 on loopback.

What runs (all real, all on this machine, every process started here stopped here by PID):

* an S3 server on 127.0.0.1: moto's server mode (`tests.s3server`, default) or the one-node
  Ceph radosgw tier (``--s3 radosgw``: ``infra/radosgw/start.sh`` / ``stop.sh`` with a state
  directory of its own);
* a Prefect API server (`flows.runtime.prefect_server.launch_server`, its own SQLite database);
* a Ray cluster: ``ray start --head --num-cpus=1`` first, a second ``ray start --address=...
  --num-cpus=1`` node joining it later (both nodes share this machine's 2 cores);
* one child process that simulates the logs (`cje_engine.simulate.direct.simulate`: 5 policies x
  ``rows/5`` prompts, MCAR labels on ``--label-fraction`` of the rows), writes them as
  hive-partitioned Parquet (``dt=YYYY-MM-DD/``, one file per day over ``--days`` days) with
  `flows.storage.logs.write_logs` and the labels into the label store (`flows.storage.labels.LabelStore`);
* per configuration, one child process that is the flow's driver: it connects to the Prefect
  API (``PREFECT_API_URL``) and to the Ray cluster (``RAY_ADDRESS``), runs
  `flows.pipelines.evaluate.evaluate` and reports the flow's ``timings``, each Prefect task run's
  duration (read back from the API), its own CPU time and ``ru_maxrss``.

Memory: a sampling thread reads ``/proc`` every 0.2 s and sums RSS and PSS over the process
tree of each part (driver, Ray head node, Ray second node, S3 server, Prefect server); it
also keeps the largest single Ray worker (``ray::...`` process).  RSS of Ray processes
counts the shared-memory object store pages they touched (a page mapped by the driver and a
worker is counted twice in an RSS sum); PSS splits shared pages between the processes
mapping them, so the PSS sum over everything is the machine-level figure.

Configurations (each with a fresh driver process and its own evaluation name, so that each
one really publishes):

* ``analytic``: ``covariates=["response_length"], calibration_mode="auto",
  inference="analytic"`` - what a production run at this size uses (see RESULTS.md);
* ``bootstrap``: ``calibration_mode="monotone", inference="bootstrap", n_bootstrap=B``
  (``--bootstrap-B``, default 100: the flow's minimum of 50 replicates per Ray chunk gives
  two chunks), to measure the Ray fan-out of the bootstrap and the per-replicate cost.

each on one Ray node and then on two.

Usage::

    .venv/bin/python benchmarks/bench_flow.py                       # 10,000,000 rows
    .venv/bin/python benchmarks/bench_flow.py --rows 200000         # smoke run (~2 min)
    .venv/bin/python benchmarks/bench_flow.py --s3 radosgw --configs analytic
    .venv/bin/python benchmarks/bench_flow.py --repeat 2 --json benchmarks/_work/flow_10m_final.json
    .venv/bin/python benchmarks/bench_flow.py --nodes 2 --ray-client --profile benchmarks/_work/prof

``--ray-client`` makes the drivers connect with ``ray://`` (Ray Client, as ``infra/`` deploys);
``--profile`` runs each driver under ``py-spy record`` (raw stacks, 20 Hz) and prints the top
functions.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench_flow")
MiB = 1024**2
GiB = 1024**3
PAGE = os.sysconf("SC_PAGE_SIZE")
BIN = Path(sys.executable).parent
WORK = HERE / "_work"

FIRST_DAY = "2025-03-01"
BUCKET = "cje-bench"
LOGS_URI = f"s3://{BUCKET}/logs"
LABELS_URI = f"s3://{BUCKET}/labelstore"
RESULTS_URI = f"s3://{BUCKET}/results"
RESULT_TAG = "BENCH_RESULT "

#: Credentials moto accepts (any); radosgw's come from its env file.
MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "cjebenchaccesskey",
    "AWS_SECRET_ACCESS_KEY": "cje-bench-secret-never-printed",
    "AWS_REGION": "us-east-1",
}


def window_of(days: int) -> str:
    from datetime import date, timedelta

    first = date.fromisoformat(FIRST_DAY)
    return f"{FIRST_DAY}..{(first + timedelta(days=days - 1)).isoformat()}"


def engine_options(config: str, n_bootstrap: int) -> dict:
    """Engine options of a benchmark configuration."""
    if config == "analytic":
        return {"covariates": ["response_length"], "calibration_mode": "auto", "inference": "analytic",
                "seed": 0}
    if config == "bootstrap":
        return {"calibration_mode": "monotone", "inference": "bootstrap", "n_bootstrap": int(n_bootstrap),
                "seed": 0}
    raise ValueError(f"unknown configuration {config!r}")


# --------------------------------------------------------------------------------------------
# memory sampling over process trees


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU ticks used so far: utime + stime)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(d)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _machine_busy() -> int:
    """CPU ticks the whole machine spent busy (all cores; /proc/stat minus idle and iowait)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    return sum(vals[:8]) - vals[3] - vals[4]


def _mem(pid: int) -> tuple[int, int] | None:
    """(RSS, PSS) in bytes from smaps_rollup (None if the process is gone)."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except OSError:
        return None
    return rss, pss


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")[:60]
    except OSError:
        return ""


class TreeSampler:
    """Peak RSS / PSS sums of named process trees, sampled from /proc in a thread."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.roots: dict[str, set[int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.overall: dict[str, int] = {}
        self.reset()

    def reset(self) -> None:
        """Start a new phase (peaks since the last reset); `overall` is never reset."""
        with self._lock:
            self.peak: dict[str, dict[str, int]] = {}
            self.peak_total = {"rss": 0, "pss": 0}
            self.worker_peak = {"rss": 0, "pss": 0, "title": ""}
            self.samples = 0
            # CPU accounting: ticks of our process trees since the reset, and of the machine,
            # so that the CPU other users took during a run ("foreign" load) can be reported.
            self._cpu_base = {pid: ticks for pid, (_, ticks) in _proc_table().items()}
            self._cpu_last: dict[int, tuple[str, int]] = {}
            self._busy0 = _machine_busy()
            self._t0 = time.monotonic()

    def set_root(self, name: str, pids: set[int] | int | None) -> None:
        with self._lock:
            if pids is None:
                self.roots.pop(name, None)
            else:
                self.roots[name] = {pids} if isinstance(pids, int) else set(pids)

    def start(self) -> "TreeSampler":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - sampling must never kill the benchmark
                log.debug("sampling failed: %s", exc)
            self._stop.wait(self.interval)

    def sample(self) -> None:
        table = _proc_table()
        parent = {pid: pp for pid, (pp, _) in table.items()}
        children: dict[int, list[int]] = {}
        for pid, pp in parent.items():
            children.setdefault(pp, []).append(pid)
        cpu_now: dict[int, tuple[str, int]] = {}
        with self._lock:
            roots = {k: set(v) for k, v in self.roots.items()}
        totals = {"rss": 0, "pss": 0}
        now: dict[str, dict[str, int]] = {}
        for name, rset in roots.items():
            todo = [p for p in rset if p in parent]
            seen: set[int] = set()
            rss = pss = 0
            while todo:
                pid = todo.pop()
                if pid in seen:
                    continue
                seen.add(pid)
                todo.extend(children.get(pid, []))
                cpu_now[pid] = (name, table[pid][1])
                m = _mem(pid)
                if m is None:
                    continue
                rss += m[0]
                pss += m[1]
                if name.startswith("ray") and m[0] > self.worker_peak["rss"]:
                    title = _title(pid)
                    if title.startswith("ray::"):
                        with self._lock:
                            self.worker_peak = {"rss": m[0], "pss": m[1], "title": title}
            now[name] = {"rss": rss, "pss": pss, "procs": len(seen)}
            totals["rss"] += rss
            totals["pss"] += pss
        with self._lock:
            self._cpu_last.update(cpu_now)
            self.samples += 1
            for name, v in now.items():
                p = self.peak.setdefault(name, {"rss": 0, "pss": 0, "procs": 0})
                p["rss"] = max(p["rss"], v["rss"])
                p["pss"] = max(p["pss"], v["pss"])
                p["procs"] = max(p["procs"], v["procs"])
            for name, v in now.items():
                self.overall[name] = max(self.overall.get(name, 0), v["rss"])
            self.peak_total["rss"] = max(self.peak_total["rss"], totals["rss"])
            self.peak_total["pss"] = max(self.peak_total["pss"], totals["pss"])

    def cpu(self) -> dict:
        """CPU seconds since the reset: ours per tree, the machine's, and others' mean cores."""
        with self._lock:
            by_tree: dict[str, float] = {}
            for pid, (name, ticks) in self._cpu_last.items():
                by_tree[name] = by_tree.get(name, 0.0) + (ticks - self._cpu_base.get(pid, 0)) / CLK_TCK
            machine = (_machine_busy() - self._busy0) / CLK_TCK
            wall = time.monotonic() - self._t0
        ours = sum(by_tree.values())
        return {"wall_s": wall, "machine_busy_s": machine, "ours_s": ours,
                "by_tree_s": {k: round(v, 2) for k, v in by_tree.items()},
                "foreign_cores": max(0.0, machine - ours) / wall if wall > 0 else 0.0}

    def snapshot(self) -> dict:
        cpu = self.cpu()
        with self._lock:
            return {"trees": {k: dict(v) for k, v in self.peak.items()}, "total": dict(self.peak_total),
                    "largest_ray_worker": dict(self.worker_peak), "samples": self.samples, "cpu": cpu}


# --------------------------------------------------------------------------------------------
# servers


def _stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group we started (start_new_session), then SIGKILL it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


@dataclass
class S3:
    kind: str
    endpoint: str
    env: dict
    pids: set[int]
    stop: object = None


def start_moto(log_dir: Path) -> S3:
    from tests.s3server import start_s3_server

    server = start_s3_server(log_file=log_dir / "moto.log")
    env = dict(MOTO_ENV, CJE_S3_ENDPOINT=server.endpoint)
    return S3("moto", server.endpoint, env, {server.pid}, server.stop)


def start_radosgw(log_dir: Path) -> S3:
    state = Path(tempfile.gettempdir()) / f"cje-rgw-bench-{os.getpid()}"
    env = dict(os.environ, CJE_RGW_DIR=str(state), CJE_RGW_MEM=str(6 * GiB))
    out = subprocess.run(["bash", str(ROOT / "infra/radosgw/start.sh")], env=env, capture_output=True,
                         text=True, timeout=300)
    (log_dir / "radosgw.start.log").write_text(out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"radosgw did not start:\n{out.stderr[-2000:]}")
    env_file = Path(out.stdout.strip().splitlines()[-1])
    s3_env = {}
    for line in env_file.read_text().splitlines():
        m = re.match(r"^(?:export\s+)?([A-Z0-9_]+)=['\"]?(.*?)['\"]?$", line.strip())
        if m:
            s3_env[m.group(1)] = m.group(2)
    pids = set()
    for line in (state / "pids").read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            pids.add(int(parts[1]))

    def stop() -> None:
        subprocess.run(["bash", str(ROOT / "infra/radosgw/stop.sh")], env=env, capture_output=True, timeout=120)

    keep = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "CJE_S3_ENDPOINT",
            "AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION")
    s3_env = {k: v for k, v in s3_env.items() if k in keep}
    return S3("radosgw", s3_env["CJE_S3_ENDPOINT"], s3_env, pids, stop)


def create_bucket(s3: S3) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name=s3.env.get("AWS_REGION", "us-east-1"),
                          aws_access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"],
                          config=Config(request_checksum_calculation="when_required"))
    client.create_bucket(Bucket=BUCKET)


@dataclass
class RayCluster:
    address: str
    temp_dir: str
    env: dict
    head: subprocess.Popen
    nodes: list[subprocess.Popen] = field(default_factory=list)
    client_port: int = 0

    @property
    def client_address(self) -> str:
        """Ray Client address of the head (what infra/ deploys: ``ray://<head>:<port>``)."""
        return f"ray://127.0.0.1:{self.client_port}"

    def stop(self, keep_logs: Path | None = None) -> None:
        for proc in [*reversed(self.nodes), self.head]:
            _stop_group(proc)
        if keep_logs is not None:  # Ray's own logs of the client server and the raylets
            for f in Path(self.temp_dir).glob("session_*/logs/*"):
                if f.is_file() and f.name.startswith(("ray_client_server", "raylet", "python-core-worker")):
                    with contextlib.suppress(OSError):
                        (keep_logs / "ray").mkdir(exist_ok=True)
                        shutil.copy(f, keep_logs / "ray" / f"{f.parent.parent.name[-6:]}-{f.name}")
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _ray_common(object_store: int) -> list[str]:
    return ["--num-cpus=1", "--disable-usage-stats", "--node-ip-address=127.0.0.1", "--block",
            f"--object-store-memory={object_store}"]


def _alive_nodes(address: str, env: dict) -> int:
    code = ("import ray,json; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
            "print(sum(1 for n in ray.nodes() if n['Alive'])); ray.shutdown()" % address)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    try:
        return int(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def start_ray_head(env: dict, object_store: int, log_dir: Path) -> RayCluster:
    from flows.runtime.prefect_server import free_port

    temp_dir = tempfile.mkdtemp(prefix="cjebr")  # short: Ray's socket paths have a length limit
    port, client_port = free_port(), free_port()
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", f"--port={port}", "--include-dashboard=false",
         f"--ray-client-server-port={client_port}", f"--temp-dir={temp_dir}", *_ray_common(object_store)],
        env=env, cwd=str(ROOT), stdout=open(log_dir / "ray-head.out", "wb"), stderr=subprocess.STDOUT,
        start_new_session=True)
    address = f"127.0.0.1:{port}"
    cluster = RayCluster(address, temp_dir, env, head, client_port=client_port)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if head.poll() is not None:
            cluster.stop()
            raise RuntimeError("ray head exited:\n" + (log_dir / "ray-head.out").read_text()[-2000:])
        r = subprocess.run([str(BIN / "ray"), "status", f"--address={address}"], env=env, capture_output=True)
        if r.returncode == 0:
            return cluster
        time.sleep(0.5)
    cluster.stop()
    raise RuntimeError("ray head did not come up in 120 s")


def add_ray_node(cluster: RayCluster, object_store: int, log_dir: Path) -> subprocess.Popen:
    i = len(cluster.nodes) + 1
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", f"--address={cluster.address}", *_ray_common(object_store)],
        env=cluster.env, cwd=str(ROOT), stdout=open(log_dir / f"ray-node{i}.out", "wb"),
        stderr=subprocess.STDOUT, start_new_session=True)
    cluster.nodes.append(proc)
    want = 1 + len(cluster.nodes)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if _alive_nodes(cluster.address, cluster.env) >= want:
            return proc
        time.sleep(1.0)
    raise RuntimeError(f"Ray node {i} did not join in 120 s")


# --------------------------------------------------------------------------------------------
# child: data generation


def child_generate(args: argparse.Namespace) -> dict:
    """Simulate, write the logs and the label store; report sizes and times."""
    from datetime import date, datetime, timezone

    import numpy as np
    import pyarrow as pa

    from cje_engine.simulate.direct import simulate
    from flows.storage.labels import LabelStore
    from flows.storage.logs import write_logs
    from flows.storage.objects import Storage, StorageConfig

    t0, c0 = time.perf_counter(), time.process_time()
    n_prompts = args.rows // args.policies
    from cje_engine.simulate.direct import default_policies

    pols = default_policies()
    if args.policies != len(pols):
        raise SystemExit(f"--policies must be {len(pols)} (the simulator's default policies)")
    sim = simulate(n_prompts, oracle_fraction=args.label_fraction, seed=args.seed)
    truth = dict(sim.true_values)
    frame = sim.frame
    del sim
    t_sim = time.perf_counter() - t0
    n = len(frame)
    # Policy-major layout: row i is prompt i % n_prompts; a prompt's responses share a day.
    day = (np.arange(n, dtype=np.int64) % n_prompts) % args.days
    start_us = int(datetime.combine(date.fromisoformat(FIRST_DAY), datetime.min.time(),
                                    tzinfo=timezone.utc).timestamp() * 1_000_000)
    rng = np.random.default_rng(args.seed + 1)
    ts_us = start_us + day * 86_400_000_000 + rng.integers(0, 86_400_000_000, n)
    del day
    table = pa.Table.from_pandas(frame, preserve_index=False)
    del frame
    labelled = table.filter(table["oracle_label"].is_valid())
    labels = labelled.select(["response_id", "oracle_label", "label_probability"])
    del labelled
    logs = table.drop_columns(["oracle_label", "label_probability"]).append_column(
        "ts", pa.array(ts_us, pa.int64()).cast(pa.timestamp("us", tz="UTC")))
    del table, ts_us
    cfg = StorageConfig.from_env()
    t1 = time.perf_counter()
    keys = write_logs(Storage.for_uri(LOGS_URI, cfg), logs, basename="bench")
    t_logs = time.perf_counter() - t1
    t2 = time.perf_counter()
    version = LabelStore(Storage.for_uri(LABELS_URI, cfg)).append(labels, "oracle")
    t_labels = time.perf_counter() - t2
    st = Storage.for_uri(LOGS_URI, cfg)
    sizes = {k: st.info(k).size for k in keys}
    return {"rows": logs.num_rows, "prompts": n_prompts, "labels": labels.num_rows, "label_version": version,
            "files": len(keys), "bytes": sum(sizes.values()), "truth": truth,
            "simulate_s": t_sim, "write_logs_s": t_logs, "write_labels_s": t_labels,
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# --------------------------------------------------------------------------------------------
# child: the flow driver


def _task_durations(flow_run_id) -> list[dict]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    out = []
    for tr in runs:
        dur = tr.total_run_time.total_seconds() if tr.total_run_time else None
        if (not dur) and tr.start_time and tr.end_time:
            dur = (tr.end_time - tr.start_time).total_seconds()
        out.append({"name": tr.name, "task": tr.task_key, "state": tr.state_type.value if tr.state_type else None,
                    "start": tr.start_time.isoformat() if tr.start_time else None, "seconds": dur,
                    "attempts": tr.run_count})
    out.sort(key=lambda r: r["start"] or "")
    return out


def child_flow(args: argparse.Namespace) -> dict:
    """Run the evaluate flow once (this process is the Prefect and Ray driver)."""
    t0, c0 = time.perf_counter(), time.process_time()
    from flows.pipelines.evaluate import evaluate
    from flows.runtime.prefect_server import use_api

    opts = engine_options(args.config, args.bootstrap_B)
    t_import = time.perf_counter() - t0
    with use_api(os.environ["PREFECT_API_URL"]):
        t1 = time.perf_counter()
        state = evaluate(logs_uri=LOGS_URI, labels_uri=LABELS_URI, results_uri=RESULTS_URI,
                         window=window_of(args.days), evaluation=args.evaluation, options=opts,
                         return_state=True)
        wall = time.perf_counter() - t1
        out = state.result()
        flow_run_id = state.state_details.flow_run_id
        tasks = _task_durations(flow_run_id)
    res = out["result"]
    policies = res.get("policies") or {}
    return {"config": args.config, "evaluation": args.evaluation, "options": opts, "flow_wall_s": wall,
            "import_s": t_import, "timings": out["timings"], "tasks": tasks, "published": out["published"],
            "path": out["path"], "report": out.get("report"), "flow_run_id": str(flow_run_id),
            "cpu_s": time.process_time() - c0,
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "estimates": {k: _brief_policy(v) for k, v in policies.items()},
            "calibration_mode": (res.get("calibration") or {}).get("mode"),
            "warnings": res.get("warnings")}


def _brief_policy(p: dict) -> dict:
    return {k: p.get(k) for k in ("estimate", "se", "ci", "level_claim", "basis", "se_analytic", "se_bootstrap")}


# --------------------------------------------------------------------------------------------
# orchestration


def run_child(mode: str, extra: list[str], env: dict, sampler: TreeSampler, log_path: Path,
              timeout: float, profile: Path | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, *extra]
    if profile is not None:  # py-spy starts the child itself (no ptrace permission needed)
        cmd = [str(BIN / "py-spy"), "record", "--rate", "20", "--nonblocking", "--format", "raw",
               "--output", str(profile), "--", *cmd]
    sampler.reset()
    with open(log_path, "wb") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=err,
                                start_new_session=True)
        sampler.set_root("driver", proc.pid)
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            raise RuntimeError(f"{mode} child timed out after {timeout:.0f} s (log: {log_path})") from None
        finally:
            sampler.sample()
            sampler.set_root("driver", None)
    mem = sampler.snapshot()
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} child failed with code {proc.returncode}; log tail:\n"
                           + log_path.read_text(errors="replace")[-3000:])
    for line in stdout.decode().splitlines():
        if line.startswith(RESULT_TAG):
            out = json.loads(line[len(RESULT_TAG):])
            out["memory"] = mem
            return out
    raise RuntimeError(f"{mode} child printed no result (log: {log_path})")


def summarize_profile(path: Path, top: int = 25) -> list[tuple[str, float, float]]:
    """Inclusive and self shares of functions in a py-spy ``raw`` (collapsed stacks) file."""
    incl: dict[str, int] = {}
    self_: dict[str, int] = {}
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
        self_[frames[-1]] = self_.get(frames[-1], 0) + n
    rows = sorted(incl.items(), key=lambda kv: -kv[1])
    return [(f, n / total, self_.get(f, 0) / total) for f, n in rows[:top]] if total else []


def _fmt_b(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def _task_seconds(run: dict, name: str) -> float:
    return sum(t["seconds"] or 0.0 for t in run["tasks"] if t["name"].split("-")[0] == name
               or t["task"].split("-")[0].endswith(name))


def _ray_cpu(run: dict) -> str:
    cpu = run["memory"].get("cpu")
    if not cpu:
        return "-"
    return f"{sum(v for k, v in cpu['by_tree_s'].items() if k.startswith('ray')):.1f} s"


def _foreign(run: dict) -> str:
    cpu = run["memory"].get("cpu")
    return "-" if not cpu else f"{cpu['foreign_cores']:.2f} cores"


def print_tables(report: dict) -> None:
    gen = report["data"]
    print(f"\nData: {gen['rows']:,} rows ({gen['prompts']:,} prompts x 5 policies), {gen['labels']:,} labels "
          f"in the label store, {gen['files']} files, {gen['bytes'] / MiB:.1f} MiB on {report['s3']} S3; "
          f"simulate {gen['simulate_s']:.1f} s, write logs {gen['write_logs_s']:.1f} s, "
          f"write labels {gen['write_labels_s']:.1f} s, peak RSS {_fmt_b(gen['maxrss'])}")
    print(f"Drivers connect to Ray by {report.get('ray_address_kind', '?')}; object store "
          f"{_fmt_b(report.get('object_store'))} per node; load average before {report['load_before'][0]:.1f}")
    hdr = ("| config | Ray nodes | flow wall | read | statistics | (prepare / bootstrap / finalize) | render "
           "| publish | driver CPU | Ray nodes CPU | others' load | driver peak RSS | Ray nodes peak RSS (sum) "
           "| largest Ray worker | all parts peak PSS |")
    print("\n" + hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for run in report["runs"]:
        t = run["timings"]
        mem = run["memory"]
        trees = mem["trees"]
        ray_rss = sum(v["rss"] for k, v in trees.items() if k.startswith("ray"))
        split = " / ".join(f"{_task_seconds(run, n):.1f}" for n in ("prepare", "bootstrap", "finalize"))
        print(f"| {run['config']} | {run['nodes']} | {run['flow_wall_s']:.1f} s | {t.get('read', 0):.1f} s | "
              f"{t.get('statistics', 0):.1f} s | {split} s | {t.get('render', 0):.1f} s | "
              f"{t.get('publish', 0):.1f} s | {run['cpu_s']:.1f} s | {_ray_cpu(run)} | {_foreign(run)} | "
              f"{_fmt_b(run['maxrss'])} | "
              f"{_fmt_b(ray_rss)} | {_fmt_b(mem['largest_ray_worker']['rss'])} | {_fmt_b(mem['total']['pss'])} |")
    print("\nPrefect task runs (seconds, from the API):")
    for run in report["runs"]:
        print(f"  {run['config']:9s} {run['nodes']} node(s): " + ", ".join(
            f"{t['name'].rsplit('-', 1)[0]} {t['seconds']:.1f}" for t in run["tasks"] if t["seconds"] is not None))
    import statistics as stats_

    by: dict[tuple[str, int], list[dict]] = {}
    for r in report["runs"]:
        by.setdefault((r["config"], r["nodes"]), []).append(r)
    for cfg in ("analytic", "bootstrap"):
        if (cfg, 1) in by and (cfg, 2) in by:
            a, b = by[(cfg, 1)], by[(cfg, 2)]
            fa = stats_.median(r["flow_wall_s"] for r in a)
            fb = stats_.median(r["flow_wall_s"] for r in b)
            line = f"speed-up 1 -> 2 nodes, {cfg} (medians of {len(a)} / {len(b)} runs): flow {fa / fb:.2f}x"
            for stage in ("read", "bootstrap"):
                sa = stats_.median(_task_seconds(r, stage) for r in a)
                sb = stats_.median(_task_seconds(r, stage) for r in b)
                if sa > 0.05 and sb > 0.05:
                    line += f", {stage} task {sa / sb:.2f}x ({sa:.1f} s -> {sb:.1f} s)"
            print(line)
    for run in report["runs"]:
        if run["config"] == "bootstrap":
            B = run["options"]["n_bootstrap"]
            bt = _task_seconds(run, "bootstrap")
            print(f"bootstrap, {run['nodes']} node(s): {bt:.1f} s for B={B} -> {bt / B:.3f} s per replicate "
                  f"(wall, {run['nodes']} worker(s)); {bt * run['nodes'] / B:.3f} worker-s per replicate")
    first = report["runs"][0] if report["runs"] else None
    if first:
        print("\nEstimates (first run) vs the simulator's truth:")
        for pol, v in first["estimates"].items():
            print(f"  {pol:12s} estimate {v.get('estimate')!s:22s} ci {v.get('ci')!s:44s} truth "
                  f"{gen['truth'].get(pol, float('nan')):.4f}  level {v.get('level_claim')}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000, help="log rows (5 policies x rows/5 prompts)")
    p.add_argument("--policies", type=int, default=5)
    p.add_argument("--days", type=int, default=7, help="daily partitions in the window")
    p.add_argument("--label-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--s3", choices=("moto", "radosgw"), default="moto")
    p.add_argument("--configs", default="analytic,bootstrap", help="comma list of analytic, bootstrap")
    p.add_argument("--nodes", default="1,2", help="Ray node counts to run, ascending (1, 2)")
    p.add_argument("--bootstrap-B", type=int, default=100)
    p.add_argument("--repeat", type=int, default=1, help="runs of each configuration per node count")
    p.add_argument("--object-store", type=int, default=3 * GiB, help="object store bytes per Ray node")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per child process")
    p.add_argument("--ray-client", action="store_true",
                   help="drivers connect with RAY_ADDRESS=ray://127.0.0.1:PORT (Ray Client, as infra/ deploys) "
                        "instead of the GCS address")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--profile", type=Path, default=None,
                   help="folder for py-spy profiles of the flow driver (raw collapsed stacks, 20 Hz)")
    p.add_argument("--child", choices=("generate", "flow"), help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--evaluation", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    if args.child:
        out = child_generate(args) if args.child == "generate" else child_flow(args)
        sys.stdout.write(RESULT_TAG + json.dumps(out, default=str) + "\n")
        sys.stdout.flush()
        return 0
    return orchestrate(args)


def orchestrate(args: argparse.Namespace) -> int:
    from flows.runtime.prefect_server import launch_server, stop_server, wait_healthy

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    node_counts = sorted({int(x) for x in args.nodes.split(",")})
    if any(n not in (1, 2) for n in node_counts):
        raise SystemExit("--nodes takes 1 and/or 2")
    log_dir = Path(tempfile.mkdtemp(prefix="cje-bench-flow-"))
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    log.info("logs of every process: %s", log_dir)
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    sampler = TreeSampler().start()
    ray_env_extra = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                     "RAY_USAGE_STATS_ENABLED": "0", "DO_NOT_TRACK": "1"}
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("PREFECT_", "RAY_", "AWS_", "CJE_S3"))}
    base_env.update(ray_env_extra)
    base_env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [x for x in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if x])
    base_env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    s3 = prefect = cluster = None
    report: dict = {"rows_requested": args.rows, "s3": args.s3, "load_before": load0, "runs": [],
                    "object_store": args.object_store,
                    "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    try:
        prefect = launch_server()
        sampler.set_root("prefect", prefect.pid)
        t = time.perf_counter()
        s3 = start_moto(log_dir) if args.s3 == "moto" else start_radosgw(log_dir)
        report["s3_start_s"] = time.perf_counter() - t
        sampler.set_root("s3", s3.pids)
        create_bucket(s3)
        env = dict(base_env, **s3.env)
        log.info("generating %d rows into %s", args.rows, s3.kind)
        gen_extra = ["--rows", str(args.rows), "--policies", str(args.policies), "--days", str(args.days),
                     "--label-fraction", str(args.label_fraction), "--seed", str(args.seed)]
        report["data"] = run_child("generate", gen_extra, env, sampler, log_dir / "generate.log", args.timeout)
        report["s3_after_generate"] = sampler.snapshot()["trees"].get("s3")
        wait_healthy(prefect)
        env["PREFECT_API_URL"] = prefect.url
        for k in ("DO_NOT_TRACK", "PREFECT_SERVER_ANALYTICS_ENABLED"):
            env.setdefault(k, "1" if k == "DO_NOT_TRACK" else "false")
        cluster = start_ray_head(env, args.object_store, log_dir)
        sampler.set_root("ray_head", cluster.head.pid)
        env["RAY_ADDRESS"] = cluster.client_address if args.ray_client else cluster.address
        report["ray_address_kind"] = "ray client (ray://)" if args.ray_client else "GCS address (driver on the head node)"
        for nodes in node_counts:
            while 1 + len(cluster.nodes) < nodes:
                proc = add_ray_node(cluster, args.object_store, log_dir)
                sampler.set_root(f"ray_node{len(cluster.nodes) + 1}", proc.pid)
            for rep, cfg in [(r, c) for r in range(args.repeat) for c in configs]:
                evaluation = f"bench-{cfg}-{nodes}node" + (f"-r{rep}" if rep else "")
                log.info("flow run: %s on %d Ray node(s)", cfg, nodes)
                prof = args.profile / f"{evaluation}.txt" if args.profile else None
                run = run_child("flow", ["--config", cfg, "--evaluation", evaluation, "--days", str(args.days),
                                         "--bootstrap-B", str(args.bootstrap_B)],
                                env, sampler, log_dir / f"{evaluation}.log", args.timeout, prof)
                run["repeat"] = rep
                if prof is not None and prof.exists():
                    run["profile"] = {"file": str(prof), "top": summarize_profile(prof)}
                run["nodes"] = nodes
                run["load_after"] = os.getloadavg()
                report["runs"].append(run)
                log.info("%s on %d node(s): %.1f s, timings %s", cfg, nodes, run["flow_wall_s"],
                         {k: round(v, 1) for k, v in run["timings"].items()})
    finally:
        sampler.stop()
        if cluster is not None:
            cluster.stop(keep_logs=log_dir)
        if s3 is not None:
            s3.stop()
        if prefect is not None:
            stop_server(prefect)
    report["total_s"] = time.perf_counter() - t_start
    report["load_after"] = os.getloadavg()
    report["overall_peak_rss"] = dict(sampler.overall)
    print_tables(report)
    for run in report["runs"]:
        if run.get("profile"):
            print(f"\npy-spy, driver of {run['config']} on {run['nodes']} node(s) ({run['profile']['file']}): "
                  "inclusive / self share of samples")
            for f, inc, slf in run["profile"]["top"]:
                print(f"  {inc:6.1%} {slf:6.1%}  {f[:150]}")
    print(f"\ntotal benchmark time {report['total_s']:.0f} s; load average before {load0[0]:.1f}, "
          f"after {report['load_after'][0]:.1f}; process logs in {log_dir}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
