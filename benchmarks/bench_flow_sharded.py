"""The `evaluate` flow's sharded row pass on a running Ray cluster (issue 29's 100M-row run), with its comparator.

Run against a stack of ``infra/stack/start.sh`` (its env file sourced: ``PREFECT_API_URL``, the S3 settings of
radosgw, ``RAY_AUTH_*``) with the logs and the label store written by ``bench_sharded.py --stage write
--label-store``. Two stages, each this process alone:

* ``flow``: `flows.pipelines.evaluate.evaluate` called in this process with the stack's settings (the flow run
  is recorded by the stack's Prefect API) and ``RAY_ADDRESS`` = the cluster's GCS address (``--ray``; this
  process is then the Ray driver itself: the rows' reduction runs on the cluster's workers, whatever the driver
  holds is in this process). Reports the flow's wall, this process's CPU (`time.process_time`) and peak RSS
  (``ru_maxrss`` and ``VmHWM``: the driver alone), the CPU of the cluster's Ray processes over the run (sampled
  from /proc every 0.5 s: ``ray::`` workers, and raylet/GCS/agents of the stack's Ray temp folder), the result's
  ``inference.row_pass`` and the levels.
* ``groupby``: the comparator on the same cluster: one Ray task per file of the same window reads it
  (`flows.storage.logs.read_window`, radosgw) and sums the judge score per policy, partial sums merged
  (`bench_sharded._groupby_file`): the two columns a mean needs, then the six the sharded readers keep. The
  workers are warmed first (one import task a CPU, not counted), as the flow's are by ``ray_session``.

Usage (after ``set -a; . $CJE_STACK_DIR/env; set +a``)::

    benchmarks/bench_flow_sharded.py --stage flow --logs s3://big29/logs100 --labels s3://big29/labels100 \\
        --results s3://big29/results --evaluation big29-100m --ray $CJE_STACK_RAY_GCS --out /tmp/flow100.json
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

log = logging.getLogger("bench_flow_sharded")
GiB = 1024**3
WINDOW = "2026-03-01..2026-03-07"  # bench_sharded's FIRST_DAY and DAYS


class RayCpu:
    """CPU seconds of the cluster's Ray processes while it runs: every 0.5 s the user + system time of each
    process whose command line names ``marker`` (raylet, GCS, agents) and of their descendants (``ray::`` workers);
    a process's CPU counts from its first sample (from 0 when it started after this sampler), up to its last."""

    def __init__(self, marker: str, interval: float = 0.5) -> None:
        self.marker = marker.encode()
        self.interval = interval
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self.node: dict[int, int] = {}  # pid -> the raylet it runs under (its node), 0 for GCS and others
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = False
        self.samples = 0

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
                self.last[pid] = v

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

    def totals(self) -> dict[str, float]:
        out = {"worker": 0.0, "other": 0.0}
        per_node: dict[str, float] = {}  # CPU under each raylet (its workers and itself); "0": GCS, agents of no raylet
        for pid, (kind, cpu) in self.last.items():
            out[kind] += cpu - self.first.get(pid, 0.0)
            key = str(self.node.get(pid, 0))
            per_node[key] = per_node.get(key, 0.0) + cpu - self.first.get(pid, 0.0)
        return {**{k: round(v, 2) for k, v in out.items()}, "samples": self.samples,
                "per_raylet": {k: round(v, 2) for k, v in sorted(per_node.items())}}


def _hwm() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GiB
    return float("nan")


def stage_flow(args: argparse.Namespace) -> dict:
    """The evaluate flow in this process (the Ray driver), on the cluster at ``--ray``."""
    os.environ["RAY_ADDRESS"] = args.ray
    t0, c0 = time.perf_counter(), time.process_time()
    from flows.pipelines.evaluate import evaluate
    from flows.runtime.prefect_server import use_api

    t_import = time.perf_counter() - t0
    options = {"inference": args.inference, "seed": 0}
    if args.inference == "bootstrap":
        options["n_bootstrap"] = args.bootstrap
    with RayCpu(args.marker) as ray_cpu, use_api(os.environ["PREFECT_API_URL"]):
        t1, c1 = time.perf_counter(), time.process_time()
        state = evaluate(logs_uri=args.logs, labels_uri=args.labels, results_uri=args.results, window=WINDOW,
                         evaluation=args.evaluation, options=options, row_pass=args.row_pass, return_state=True)
        wall, cpu = time.perf_counter() - t1, time.process_time() - c1
        out = state.result()
    res = out["result"]
    pols = res.get("policies") or {}
    return {"stage": "flow", "evaluation": args.evaluation, "ray": args.ray, "flow_wall_s": round(wall, 2),
            "driver_cpu_s": round(cpu, 2), "import_s": round(t_import, 2),
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
    ray.init(address=args.ray, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        w0 = time.perf_counter()
        _warm(cpus)
        warmup = time.perf_counter() - w0
        remote = ray.remote(_groupby_file)
        out = {"stage": "groupby", "files": len(keys), "cpus": cpus, "warmup_s": round(warmup, 2)}
        sets = dict(GROUPBY_COLUMNS)
        if args.labels:  # the labels are in the label store, not in the logs: the columns of the logs the shards keep
            sets["needed"] = [c for c in sets["needed"] if c not in ("oracle_label", "label_probability")]
        for name, columns in sets.items():
            with RayCpu(args.marker) as ray_cpu:
                t0 = time.perf_counter()
                total = merge_groupby(ray.get([remote.remote(args.logs, cfg, k, columns) for k in keys]))
                wall = time.perf_counter() - t0
            out[name] = {"columns": columns, "wall_s": round(wall, 2), "ray_cpu_s": ray_cpu.totals(),
                         "rows": sum(n for _, n in total.values())}
    finally:
        ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=["flow", "groupby"], required=True)
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
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not args.ray:
        p.error("--ray (or CJE_STACK_RAY_GCS) is needed")
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
