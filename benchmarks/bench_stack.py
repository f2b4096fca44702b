"""The 10M-row evaluation through the production topology: worker -> Ray cluster -> S3.

Needs the loopback stack of ``infra/stack/start.sh`` (PostgreSQL, Prefect server, a process work
pool and its worker, a two-node Ray cluster reached through the Ray Client, radosgw). Then:

1. a child process simulates the logs (``benchmarks/bench_flow.py``'s generator: 5 policies x
   rows/5 prompts, MCAR labels on 5%, 7 daily Parquet files) into a fresh bucket on the stack's
   radosgw, plus the label store;
2. ``cje deploy`` registers one evaluation per configuration (analytic, bootstrap) on the pool;
3. each is started through the Prefect API (``create_flow_run_from_deployment``) and the worker
   runs it: its flow-run subprocess is the driver, connected to the cluster with ``ray://``;
4. meanwhile a sampler reads ``/proc`` every 0.25 s: RSS and PSS per stack service (each runs in
   its own session: worker + flow run, Ray head, Ray worker node, Prefect server, PostgreSQL,
   radosgw) and the largest single processes (the flow-run driver, Ray workers).

Reported per configuration: the run's wall time (from Running to Completed in the API), the
flow's own read / statistics / render / publish split (its manifest's ``timings_s``), every
task's duration, and peak memory per service and per process.  ``--idle`` only prints the idle
stack's memory (and start.sh's start-up time).

Usage::

    bash infra/stack/start.sh
    .venv/bin/python benchmarks/bench_stack.py --idle
    .venv/bin/python benchmarks/bench_stack.py --rows 200000                 # smoke (~2 min)
    .venv/bin/python benchmarks/bench_stack.py --json benchmarks/_work/stack_10m.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BIN = Path(sys.executable).parent
GiB = 1024**3
MiB = 1024**2
PAGE = os.sysconf("SC_PAGE_SIZE")


def parse_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def command_env(stack: dict[str, str]) -> dict[str, str]:
    drop = ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "PREFECT_API_URL", "AWS_ENDPOINT_URL",
            "CJE_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({k: v for k, v in stack.items() if not k.startswith("CJE_STACK_")})
    env.update({"DO_NOT_TRACK": "1", "RAY_USAGE_STATS_ENABLED": "0", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    return env


# ------------------------------------------------------------------------------ memory


def _mem(pid: int) -> tuple[int, int] | None:
    """(RSS, PSS) bytes of one process (smaps_rollup), None when it is gone."""
    try:
        rss = pss = 0
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
        return rss, pss
    except OSError:
        return None


def _title(pid: int) -> str:
    """``ray::<task>`` for Ray workers, else the program and script names."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):
        return " ".join(argv)[:60]
    names = [os.path.basename(a) for a in argv[:3] if not a.startswith("-")]
    return " ".join(names)[:60]


def services(stack: dict[str, str]) -> dict[str, int]:
    """Service name -> session id (the PIDs start.sh recorded; radosgw's three daemons as one)."""
    out: dict[str, int] = {}
    for line in Path(stack["CJE_STACK_PIDS"]).read_text().splitlines():
        name, _, pid = line.partition(" ")
        if pid.strip():
            out[name] = int(pid)
    return out


def _group(name: str) -> str:
    return "radosgw" if name.startswith("rgw-") else name


class Sampler(threading.Thread):
    """Peak RSS/PSS per service (sum over its session) and the largest single processes."""

    def __init__(self, stack: dict[str, str], period: float = 0.25):
        super().__init__(daemon=True)
        self.sessions = services(stack)
        self.period = period
        self.stop_flag = threading.Event()
        self.peak: dict[str, dict[str, int]] = {}
        self.procs: dict[int, dict] = {}

    def sample(self) -> None:
        by_sid: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    by_sid.setdefault(os.getsid(int(d.name)), []).append(int(d.name))
                except OSError:
                    pass
        totals: dict[str, list[int]] = {}
        for name, sid in list(self.sessions.items()):
            g = _group(name)
            acc = totals.setdefault(g, [0, 0])
            for pid in by_sid.get(sid, []):
                m = _mem(pid)
                if m is None:
                    continue
                acc[0] += m[0]
                acc[1] += m[1]
                rec = self.procs.setdefault(pid, {"service": g, "title": _title(pid), "rss": 0, "pss": 0})
                rec["rss"], rec["pss"] = max(rec["rss"], m[0]), max(rec["pss"], m[1])
                if rec["title"].startswith("ray::IDLE"):
                    rec["title"] = _title(pid)
        for g, (rss, pss) in totals.items():
            p = self.peak.setdefault(g, {"rss": 0, "pss": 0})
            p["rss"], p["pss"] = max(p["rss"], rss), max(p["pss"], pss)
        all_pss = sum(v[1] for v in totals.values())
        self.peak.setdefault("(all)", {"rss": 0, "pss": 0})
        self.peak["(all)"]["pss"] = max(self.peak["(all)"]["pss"], all_pss)
        self.peak["(all)"]["rss"] = max(self.peak["(all)"]["rss"], sum(v[0] for v in totals.values()))

    def run(self) -> None:
        while not self.stop_flag.is_set():
            self.sample()
            self.stop_flag.wait(self.period)

    def top(self, n: int = 8) -> list[dict]:
        return sorted(({"pid": p, **r} for p, r in self.procs.items()), key=lambda r: -r["rss"])[:n]


# ------------------------------------------------------------------------------ steps


def child_generate(rows: int, bucket: str) -> None:
    """In a child process with the stack's S3 environment: bench_flow's generator into ``bucket``."""
    import bench_flow as bf

    bf.BUCKET = bucket
    bf.LOGS_URI, bf.LABELS_URI, bf.RESULTS_URI = (f"s3://{bucket}/logs", f"s3://{bucket}/labelstore",
                                                  f"s3://{bucket}/results")
    ns = argparse.Namespace(rows=rows, policies=5, days=7, label_fraction=0.05, seed=0)
    print(json.dumps(bf.child_generate(ns)))


def make_bucket(stack: dict[str, str], bucket: str) -> None:
    import boto3
    from botocore.config import Config

    boto3.session.Session().client(
        "s3", endpoint_url=stack["CJE_RGW_ENDPOINT"], region_name=stack["AWS_REGION"],
        aws_access_key_id=stack["AWS_ACCESS_KEY_ID"], aws_secret_access_key=stack["AWS_SECRET_ACCESS_KEY"],
        config=Config(request_checksum_calculation="when_required", s3={"addressing_style": "path"}),
    ).create_bucket(Bucket=bucket)


def write_config(path: Path, bucket: str, configs: list[str], tag: str, B: int) -> dict[str, str]:
    import yaml

    import bench_flow as bf

    names, entries = {}, []
    for c in configs:
        names[c] = f"bench-{c}-{tag}"
        entries.append({"name": names[c], "logs_uri": f"s3://{bucket}/logs", "labels_uri": f"s3://{bucket}/labelstore",
                        "results_uri": f"s3://{bucket}/results", "window": bf.window_of(7),
                        "options": bf.engine_options(c, B)})
    path.write_text(yaml.safe_dump({"evaluations": entries}))
    return names


def _client(stack):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    class _C:
        def __enter__(self):
            self.t = temporary_settings(updates={PREFECT_API_URL: stack["PREFECT_API_URL"]})
            self.t.__enter__()
            self.c = get_client(sync_client=True)
            return self.c.__enter__()

        def __exit__(self, *a):
            self.c.__exit__(*a)
            self.t.__exit__(*a)
    return _C()


def run_one(stack: dict[str, str], name: str, bucket: str, timeout: float) -> dict:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.storage.objects import Storage, StorageConfig

    with _client(stack) as c:
        dep = c.read_deployment_by_name(f"evaluate_and_audit/{name}")
        run = c.create_flow_run_from_deployment(dep.id)
    sampler = Sampler(stack)
    sampler.start()
    t0 = time.monotonic()
    while True:
        time.sleep(1.0)
        with _client(stack) as c:
            run = c.read_flow_run(run.id)
        if run.infrastructure_pid and "flow-run (driver)" not in sampler.sessions:
            # The process worker starts each flow run in a session of its own.
            try:
                sampler.sessions["flow-run (driver)"] = os.getsid(int(str(run.infrastructure_pid).rsplit(":", 1)[-1]))
            except OSError:
                pass
        if run.state and run.state.is_final():
            break
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"run {run.id} not finished after {timeout:.0f} s")
    sampler.stop_flag.set()
    sampler.join()
    if not run.state.is_completed():
        raise SystemExit(f"run {run.id} ended {run.state.type.value}: {run.state.message}")
    with _client(stack) as c:
        sub = c.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [run.id]}))
        ids = [run.id] + [r.id for r in sub]
        trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
    tasks = sorted(({"name": t.name.rsplit("-", 1)[0], "seconds": t.total_run_time.total_seconds(),
                     "start": t.start_time.isoformat() if t.start_time else ""} for t in trs), key=lambda r: r["start"])
    st = Storage.for_uri(f"s3://{bucket}/results", StorageConfig.from_env(environ=command_env(stack)))
    manifests = [json.loads(st.read_bytes(o.key)) for o in st.list(f"results/{name}/") if o.key.endswith("manifest.json")]
    if len(manifests) != 1:
        raise SystemExit(f"{name}: expected one published run, found {len(manifests)}")
    m = manifests[0]
    return {"evaluation": name, "flow_run_id": str(run.id),
            "wall_s": (run.end_time - run.start_time).total_seconds(),
            "queue_s": (run.start_time - run.expected_start_time).total_seconds(),
            "timings": m["timings_s"], "rows": m["rows"]["n_rows"], "ray": m["ray"], "tasks": tasks,
            "memory": sampler.peak, "top_processes": sampler.top()}


def idle_memory(stack: dict[str, str]) -> dict:
    s = Sampler(stack)
    s.sample()
    return {"startup_s": float(stack.get("CJE_STACK_STARTUP_S", "nan")), "memory": s.peak, "top_processes": s.top(12)}


def _fmt(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def print_memory(mem: dict) -> None:
    print(f"  {'service':<18} {'peak RSS':>10} {'peak PSS':>10}")
    for g, v in sorted(mem.items(), key=lambda kv: -kv[1]["pss"]):
        if not v["rss"]:
            continue  # a service that is not running (a stopped extra worker)
        print(f"  {g:<18} {_fmt(v['rss']):>10} {_fmt(v['pss']):>10}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--configs", default="analytic,bootstrap")
    p.add_argument("--bootstrap-B", type=int, default=100)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--idle", action="store_true", help="only the idle stack: start-up time and memory")
    p.add_argument("--json", type=Path)
    p.add_argument("--child-generate", nargs=2, metavar=("ROWS", "BUCKET"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_generate:
        sys.path.insert(0, str(HERE))
        child_generate(int(args.child_generate[0]), args.child_generate[1])
        return 0
    env_path = Path(os.environ.get("CJE_STACK_ENV") or "/tmp/cje-stack/env")
    if not env_path.is_file():
        raise SystemExit(f"no stack env file {env_path}: start the stack with `bash infra/stack/start.sh`")
    stack = parse_env(env_path)
    report: dict = {"idle": idle_memory(stack)}
    print(f"stack start-up (infra/stack/start.sh): {report['idle']['startup_s']:.1f} s; idle memory:")
    print_memory(report["idle"]["memory"])
    if not args.idle:
        sys.path.insert(0, str(HERE))
        tag = uuid.uuid4().hex[:6]
        bucket = f"cje-bench-stack-{tag}"
        make_bucket(stack, bucket)
        t0 = time.perf_counter()
        gen = subprocess.run([sys.executable, __file__, "--child-generate", str(args.rows), bucket],
                             env=command_env(stack), capture_output=True, text=True, timeout=args.timeout)
        if gen.returncode != 0:
            raise SystemExit(f"generation failed:\n{gen.stderr[-3000:]}")
        report["generate"] = json.loads(gen.stdout.strip().splitlines()[-1])
        report["generate"]["wall_s"] = time.perf_counter() - t0
        g = report["generate"]
        print(f"\n{g['rows']:,} rows, {g['labels']:,} labels, {g['files']} files ({g['bytes'] / MiB:.0f} MiB) "
              f"written to radosgw in {g['write_logs_s']:.1f} s (+ labels {g['write_labels_s']:.1f} s)")
        cfg_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-stack-{tag}.yaml"
        names = write_config(cfg_path, bucket, args.configs.split(","), tag, args.bootstrap_B)
        dep = subprocess.run([str(BIN / "cje"), "deploy", "--config", str(cfg_path), "--pool", stack["CJE_STACK_POOL"],
                              "--no-drift"], env=command_env(stack), capture_output=True, text=True, timeout=300)
        if dep.returncode != 0:
            raise SystemExit(f"cje deploy failed:\n{dep.stderr[-3000:]}")
        report["runs"] = {}
        for config, name in names.items():
            r = run_one(stack, name, bucket, args.timeout)
            report["runs"][config] = r
            t = r["timings"]
            print(f"\n{config}: {r['rows']:,} rows through worker -> Ray ({r['ray']}) -> S3: run {r['wall_s']:.1f} s "
                  f"(queued {r['queue_s']:.1f} s); read {t.get('read', 0):.1f} s, statistics "
                  f"{t.get('statistics', 0):.1f} s, render {t.get('render', 0):.2f} s, publish {t.get('publish', 0):.2f} s")
            print("  tasks: " + ", ".join(f"{x['name']} {x['seconds']:.1f}" for x in r["tasks"]))
            print_memory(r["memory"])
            print("  largest processes: " + "; ".join(f"{x['service']} {x['title'][:40]!r} {_fmt(x['rss'])}"
                                                      for x in r["top_processes"][:5]), flush=True)
            if args.json:  # after every configuration: a partial report survives a timeout
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(report, indent=2, default=str))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
