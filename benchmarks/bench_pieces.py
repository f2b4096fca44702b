"""The readers' pieces through Ray (issue 29, round 19): every reader returning a piece of every shard (the reference,
`flows.runtime.sharded_ray.read_shards`' ``every_piece``) against each reader returning the pieces of the shards its
file's prompt range touches only (the default), alternated in one driver on a running cluster, same files.

A third variant adds ``locality`` (the readers and the shards' tasks on the node of their shards, `read_shards`).
Per run: `read_shards` (sampling, readers, the response-id check) then pass 1 (`ray_mapper` of
`cje_engine.pipeline.sharded.reduce_shard` over the shards' pieces); the wall, this process's CPU
(`time.process_time`), the CPU of the cluster's Ray processes (`bench_flow_sharded.RayCpu`: raylets, GCS, agents,
workers) and the objects (pieces) per phase. No label store (the readers' work is the same in both; the objects
differ). Each run's pass-1 summaries are compared with the first run's (bit for bit).

Usage (on a stack of ``infra/stack/start.sh``, its env sourced; the logs of ``bench_sharded.py --stage write``)::

    PYTHONPATH=$PWD /work/main/.venv/bin/python benchmarks/bench_pieces.py --logs s3://p19/logs100 --files 30 \\
        --shards 26 --ray "$CJE_STACK_RAY_GCS" --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))


def _summary_bytes(s) -> bytes:
    """A pass-1 summary's arrays as bytes (for the comparison of runs)."""
    parts = [s.counts.tobytes(), s.n_prompts.tobytes(), s.score_sum.tobytes(), s.cell_score.tobytes()]
    parts += [v.tobytes() for _, v in sorted(s.labelled.items())]
    return b"".join(parts) + repr((s.n_rows, s.policies, s.n_ids, s.id_range)).encode()


def run(args: argparse.Namespace, keys: list[str], cfg: dict, every: bool, locality: bool = False
        ) -> tuple[dict, list[bytes]]:
    from bench_flow_sharded import RayCpu
    from cje_engine.pipeline import sharded
    from flows.pipelines.sharded_pass import shard_columns
    from flows.runtime import sharded_ray

    rows = args.files * args.rows_per_file
    out: dict = {"every_piece": every, "locality": locality}
    with RayCpu(args.marker) as ray_cpu:
        t0, c0 = time.perf_counter(), time.process_time()
        refs = sharded_ray.read_shards(args.logs, cfg, keys, args.shards, rows_hint=rows, keep=shard_columns(()),
                                       every_piece=every, locality=locality)
        t1, c1 = time.perf_counter(), time.process_time()
    out["read"] = {"wall_s": round(t1 - t0, 2), "driver_cpu_s": round(c1 - c0, 2),
                   "ray_cpu_s": round(sum(ray_cpu.per_node().values()), 2),
                   "pieces": sum(len(r.refs) for r in refs), "homed": sum(r.node is not None for r in refs)}
    mapper = sharded_ray.ray_mapper(memory=sharded_ray.task_memory(rows // args.shards))
    with RayCpu(args.marker) as ray_cpu:
        t0, c0 = time.perf_counter(), time.process_time()
        got = dict(mapper(sharded.reduce_shard, [(r,) for r in refs]))
        t1, c1 = time.perf_counter(), time.process_time()
    out["pass1"] = {"wall_s": round(t1 - t0, 2), "driver_cpu_s": round(c1 - c0, 2),
                    "ray_cpu_s": round(sum(ray_cpu.per_node().values()), 2)}
    sums = [_summary_bytes(got[i]) for i in range(len(refs))]
    del refs, got  # the pieces and pass 1's kept codes leave the object store with their references
    return out, sums


#: (every_piece, locality) of the runs, alternated: main's layout of objects, the pieces of the touched shards only,
#: and those with the shards' tasks on the node of their pieces.
VARIANTS = [(True, False), (False, False), (False, True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--logs", required=True)
    p.add_argument("--files", type=int, default=30, help="the window's first FILES files (<= 30M rows: no lock)")
    p.add_argument("--rows-per-file", type=int, default=1_000_000)
    p.add_argument("--shards", type=int, default=26, help="26: the shards of the 100M window")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ray", required=True, help="the cluster's GCS address")
    p.add_argument("--marker", default=os.environ.get("CJE_STACK_DIR", "/tmp/cje-stack"))
    args = p.parse_args()

    import ray

    from bench_sharded import _keys
    from flows.storage.objects import StorageConfig

    keys = _keys(args.logs)[:args.files]
    cfg = StorageConfig.from_env().to_dict(include_secrets=True)
    ray.init(address=args.ray, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    runs, first = [], None
    try:
        run(args, keys[:2], cfg, False)  # warm the workers (imports), not counted
        for r in range(args.repeat):
            for every, loc in VARIANTS:
                load = os.getloadavg()[0]
                out, sums = run(args, keys, cfg, every, loc)
                out["load"] = round(load, 2)
                out["same_as_first"] = first is None or sums == first
                first = first or sums
                runs.append(out)
                print(json.dumps(out), flush=True)
    finally:
        ray.shutdown()
    print(f"{'every_piece':>11} {'local':>5} {'homed':>5} {'pieces':>6} {'read wall':>9} {'read Ray CPU':>12} {'read driver':>11} "
          f"{'pass1 wall':>10} {'pass1 Ray CPU':>13} {'load':>5} same")
    for o in runs:
        print(f"{str(o['every_piece']):>11} {str(o['locality']):>5} {o['read']['homed']:>5} {o['read']['pieces']:>6} {o['read']['wall_s']:>9} "
              f"{o['read']['ray_cpu_s']:>12} {o['read']['driver_cpu_s']:>11} {o['pass1']['wall_s']:>10} "
              f"{o['pass1']['ray_cpu_s']:>13} {o['load']:>5} {o['same_as_first']}")
    for every, loc in VARIANTS:
        sel = [o for o in runs if o["every_piece"] == every and o["locality"] == loc]
        tot = [o["read"]["ray_cpu_s"] + o["pass1"]["ray_cpu_s"] + o["read"]["driver_cpu_s"]
               + o["pass1"]["driver_cpu_s"] for o in sel]
        print(f"every_piece={every} locality={loc}: read + pass 1, Ray + driver CPU: mean {sum(tot) / len(tot):.2f} s "
              f"(runs {', '.join(f'{t:.2f}' for t in tot)})")
    print("STAGE_JSON " + json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
