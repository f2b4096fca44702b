"""The flow's sharded analytic route (issue 29, round 25) on a fresh local Ray, this tree beside another, alternated.

Two stages, each run of each tree in its own process, the trees alternated ``--pairs`` times:

* ``imports``: the CPU (`time.process_time`) of a fresh Ray worker's imports of the sharded pass's modules (after
  ``import ray``, which the worker has already): what every flow run pays once a worker, two workers a run on the
  loopback stack (every run is a new Ray job, so new workers). The comparator warms its workers and does not.
* ``route``: `flows.pipelines.sharded_pass.compute_sharded` as the evaluate flow calls it (the label index submitted
  to Ray first, `flows.runtime.label_index.submit_label_index`; the footers read, `window_footers`; the Gram form
  forced, ``CJE_MAX_DRIVER_TERMS_BYTES`` = 1 MiB, as at 100M rows) on a fresh local Ray of ``--cpus`` CPUs with the
  flow's worker environment (`flows.runtime.ray_fanout.ray_session`); the flow's modules imported first, as in the
  flow's process. Per run: the wall, this process's CPU, the Ray processes' CPU (`bench_flow_sharded.RayCpu`) per
  phase (`bench_flow_sharded.Phases`), the CPU of a radosgw's daemons when ``--rgw-pids`` names them (the logs on
  that gateway), the modules each fresh worker holds at the end, and a digest of the result's policies (equal in
  every run of both trees, or the run says so).

Usage (logs and label store of ``bench_sharded.py --stage write --sizes 2000000 --label-store``; for radosgw its env
file sourced)::

    PYTHONPATH=$PWD python benchmarks/bench_route_local.py --stage imports --base /tmp/base --pairs 8
    PYTHONPATH=$PWD python benchmarks/bench_route_local.py --stage route --base /tmp/base --pairs 5 \\
        --logs s3://r25/l10 --labels s3://r25/lab10 --rgw-pids /tmp/r25/rgw/pids

``--base``: the other tree (e.g. ``git archive <commit> | tar -x -C /tmp/base``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: What a reader's, the label index's and the passes' tasks import (`tests/unit/test_worker_imports.py`), and the
#: S3 storage of the readers.
WORKER_MODULES = ("cje_engine.pipeline.sharded", "flows.runtime.sharded_ray", "flows.pipelines.sharded_pass",
                  "flows.runtime.label_index", "flows.pipelines.preflight", "flows.storage.logs",
                  "flows.storage.labels", "flows.storage.s3")


def child_imports(code: str) -> dict:
    """A fresh worker's imports of `WORKER_MODULES` from ``code`` (CPU s), ``ray`` imported first."""
    import importlib

    import ray  # noqa: F401 - a Ray worker has it

    c = time.process_time()
    for m in WORKER_MODULES:
        importlib.import_module(m)
    cpu = time.process_time() - c
    import cje_engine

    assert cje_engine.__file__.startswith(code), cje_engine.__file__
    return {"code": code, "imports_cpu_s": round(cpu, 3),
            "scipy": any(m == "scipy" for m in sys.modules), "flows.config": "flows.config" in sys.modules}


def _rgw_cpu(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as fh:
                f = fh.read().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / tick
        except OSError:
            pass
    return total


def child_route(code: str, logs: str, labels: str, cpus: int, rgw_pids: str | None) -> dict:
    """The route once on a fresh local Ray (see the module docstring)."""
    import logging
    import types

    sys.path.insert(0, str(HERE))
    from bench_flow_sharded import Phases, RayCpu  # the measuring code: this script's tree

    sys.path[:0] = [code, os.path.join(code, "benchmarks")]  # (bench_flow_sharded put its own tree first)
    os.environ["PYTHONPATH"] = code
    os.environ.setdefault("CJE_MAX_DRIVER_TERMS_BYTES", str(2**20))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("cje_engine.pipeline.sharded").setLevel(logging.DEBUG)  # the phases' borders
    import bench_sharded
    import cje_engine
    import flows.pipelines.evaluate  # noqa: F401 - as the flow's process: its modules imported before the run
    from flows.pipelines.sharded_pass import compute_sharded, window_footers
    from flows.runtime import ray_fanout
    from flows.runtime.label_index import submit_label_index
    from flows.storage.labels import LabelStore
    from flows.storage.objects import Storage, StorageConfig

    assert cje_engine.__file__.startswith(code), cje_engine.__file__
    pids = [int(x.split()[-1]) for x in Path(rgw_pids).read_text().split("\n") if x.strip()] if rgw_pids else []
    cfg = StorageConfig.from_env()
    files = [{"key": k} for k in bench_sharded._keys(logs)]
    opts = bench_sharded._opts(types.SimpleNamespace(inference="analytic", seed=0, bootstrap=0))
    plan = types.SimpleNamespace(opts=opts, logs_uri=logs, read_policies=None, columns=None, covariates=[],
                                 extra_columns=[])

    def modules() -> tuple:
        time.sleep(0.5)  # hold the worker: the other task goes to the other one
        return os.getpid(), [m for m in ("scipy", "flows.config", "pandas") if m in sys.modules]

    with ray_fanout.ray_session(num_cpus=cpus):
        import ray

        with RayCpu(ray._private.worker._global_node.get_temp_dir_path()) as ray_cpu:
            phases = Phases(ray_cpu.threads)
            logging.getLogger().addHandler(phases)
            t1, c1, g1 = time.perf_counter(), time.process_time(), _rgw_cpu(pids)
            phases.start()
            footers = window_footers(logs, cfg, files, None)
            _, rows = LabelStore(Storage.for_uri(labels, cfg)).committed_rows()
            pending = submit_label_index(labels, cfg.to_dict(include_secrets=True), label_rows=rows)
            _, _, result = compute_sharded(plan, cfg, files, pending, "bench_route_local", footers=footers)
            pending.info()
            t2, c2, g2 = time.perf_counter(), time.process_time(), _rgw_cpu(pids)
            held = ray.get([ray.remote(modules).remote() for _ in range(cpus)])
            time.sleep(1.0)
        logging.getLogger().removeHandler(phases)
        table = phases.table(ray_cpu, t2, c2)
    d = result.to_dict()
    digest = hashlib.sha256(json.dumps({k: d.get(k) for k in ("policies", "comparisons", "calibration")},
                                       sort_keys=True, default=str).encode()).hexdigest()[:16]
    totals = ray_cpu.totals()
    return {"code": code, "wall_s": round(t2 - t1, 2), "driver_cpu_s": round(c2 - c1, 2),
            "ray_cpu_s": round(totals["worker"] + totals["other"], 2), "ray_workers_started": totals["started"],
            "rgw_cpu_s": round(g2 - g1, 2),
            "phases_ray_cpu_s": {r["phase"]: r["ray_cpu_s"] for r in table},
            "phases_driver_cpu_s": {r["phase"]: r["driver_cpu_s"] for r in table},
            "workers_hold": held, "digest": digest}


def main(argv: list[str] | None = None) -> int:
    """Alternate the two trees' children and print each run's JSON line and the means."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=["imports", "route"], required=True)
    p.add_argument("--base", required=True, help="the other tree (its root folder)")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--logs")
    p.add_argument("--labels")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--rgw-pids", help="a radosgw's pids file (infra/radosgw/start.sh): its daemons' CPU per run")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        out = (child_imports(args.child) if args.stage == "imports" else
               child_route(args.child, args.logs, args.labels, args.cpus, args.rgw_pids))
        print("CHILD_JSON " + json.dumps(out), flush=True)
        return 0
    trees = [str(Path(args.base).resolve()), str(HERE.parent)]
    runs: list[dict] = []
    for _ in range(args.pairs):
        for code in trees:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", args.stage, "--base", args.base,
                   "--child", code, "--cpus", str(args.cpus)]
            if args.stage == "route":
                cmd += ["--logs", args.logs, "--labels", args.labels] + (
                    ["--rgw-pids", args.rgw_pids] if args.rgw_pids else [])
            env = dict(os.environ, PYTHONPATH=code)
            proc = subprocess.run(cmd, env=env, cwd="/tmp", capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("CHILD_JSON ")]
            if not line:
                print(f"{code}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            run = json.loads(line[0].split(" ", 1)[1])
            run["load"] = os.getloadavg()[0]
            runs.append(run)
            print(json.dumps(run), flush=True)
    key = "imports_cpu_s" if args.stage == "imports" else None
    for code in trees:
        mine = [r for r in runs if r["code"] == code]
        if not mine:
            continue
        if key:
            vals = [r[key] for r in mine]
        else:
            vals = [r["driver_cpu_s"] + r["ray_cpu_s"] for r in mine]
        print(f"{code}: {len(vals)} runs, CPU mean {statistics.mean(vals):.3f} s, median {statistics.median(vals):.3f},"
              f" range {min(vals):.3f}-{max(vals):.3f}"
              + ("" if key else f"; digests {sorted({r['digest'] for r in mine})}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
