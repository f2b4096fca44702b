"""What moving objects between two Ray nodes costs the raylets (issue 29: the stack's CPU beside the flow's own).

Run against a stack of ``infra/stack/start.sh`` (two Ray nodes of 1 CPU on one machine; its env file sourced). A
task pinned to the first node returns ``--objects`` arrays of ``--mib`` MiB each; a task pinned to a node then takes
them all as arguments: on the same node (the comparator: read in place from the object store) or on the other node
(the raylets push and pull them in chunks). Per case: the CPU seconds of the raylets and the GCS over the second
task (`bench_flow_sharded.RayCpu`: from /proc, the stack's processes, ``--marker``), and its wall;
``--repeat`` times each, alternated. Prints a JSON table; the figure is the raylets' CPU per GiB moved.

    set -a; . $CJE_STACK_DIR/env; set +a
    .venv/bin/python benchmarks/bench_ray_transfer.py [--objects 20] [--mib 50] [--repeat 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_flow_sharded import RayCpu  # noqa: E402 - this script's folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ray", default=os.environ.get("CJE_STACK_RAY_GCS"), help="the cluster's GCS address")
    p.add_argument("--marker", default=os.environ.get("CJE_STACK_DIR", "/tmp/cje-stack"))
    p.add_argument("--objects", type=int, default=20)
    p.add_argument("--mib", type=int, default=50)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args(argv)
    if not args.ray:
        p.error("--ray (or CJE_STACK_RAY_GCS) is needed")

    import numpy as np
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=args.ray, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU"))
        if len(nodes) < 2:
            p.error(f"the cluster at {args.ray} has {len(nodes)} node(s) with CPUs; two are needed")
        words = args.mib * 2**20 // 8

        @ray.remote(num_returns=args.objects)
        def make():
            return [np.ones(words) for _ in range(args.objects)]

        @ray.remote
        def use(*arrays):
            return sum(a.nbytes for a in arrays)

        def on(node: str) -> dict:
            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

        ray.get(use.options(**on(nodes[1])).remote(*make.options(**on(nodes[0])).remote()))  # workers started
        runs: dict[str, list] = {"same node": [], "other node": []}
        for _ in range(args.repeat):
            for case, node in (("same node", nodes[0]), ("other node", nodes[1])):
                refs = make.options(**on(nodes[0])).remote()
                ray.wait(refs, num_returns=len(refs))
                time.sleep(1.0)
                with RayCpu(args.marker) as sampled:
                    t0 = time.perf_counter()
                    nbytes = ray.get(use.options(**on(node)).remote(*refs))
                    wall = time.perf_counter() - t0
                    time.sleep(1.0)  # the raylets' last chunks and frees
                by_program = sampled.totals()["other_by_program"]
                cpu = by_program.get("raylet", 0.0) + by_program.get("gcs_server", 0.0)
                runs[case].append({"gib": round(nbytes / 2**30, 3), "daemon_cpu_s": round(cpu, 2),
                                   "wall_s": round(wall, 2)})
                del refs
    finally:
        ray.shutdown()
    out = {"objects": args.objects, "mib": args.mib, "runs": runs,
           "daemon_cpu_s_per_gib": {case: round(statistics.median(r["daemon_cpu_s"] / r["gib"] for r in rs), 2)
                                    for case, rs in runs.items()}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
