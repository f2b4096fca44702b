"""A reader's pieces as one object a node (`cje_engine.pipeline.sharded.bundle_pieces`, session 33) against one
object a piece, on a running Ray cluster, alternated in one driver.

Files whose prompts span every shard (production logs of a day hold prompts of every range): each reader task
builds the same pieces (a simulated file of ``--rows-per-file`` rows split into ``--shards`` shards by range and
packed, `cje_engine.pipeline.sharded.pack_piece`) and returns them either as ``--shards`` objects (``pieces``) or
as one bundle a node (``bundles``: the shards cut into one run a node, `flows.runtime.sharded_ray.shard_nodes`).
Then one task a shard reads its piece of every file (`flows.runtime.sharded_ray._with_pieces`, as pass 1 gets
them) and counts its rows. Per variant: the CPU of the cluster's Ray processes (`bench_flow_sharded.RayCpu`:
workers, raylets, GCS) per file, readers and shard tasks apart, and the rows counted (the same in both).

Usage (on a stack of ``infra/stack/start.sh``, its env sourced)::

    benchmarks/bench_bundles.py --ray "$CJE_STACK_RAY_GCS" --files 40 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

log = logging.getLogger("bench_bundles")


def file_pieces(i: int, rows: int, n_shards: int, groups: list | None):
    """File ``i``'s pieces (its rows over every shard's range), one object each (``groups`` None) or bundled by
    group."""
    import numpy as np
    import pyarrow as pa

    from cje_engine.data.frame import LABEL, LABEL_PROB, POLICY, PROMPT, SCORE
    from cje_engine.pipeline import sharded
    from flows.runtime.sharded_ray import compact_policy

    rng = np.random.default_rng(i)
    prompt = np.sort(rng.integers(0, 20_000_000, rows))
    t = pa.table({PROMPT: pa.array(np.char.add("p", np.char.zfill(prompt.astype(str), 8))),
                  POLICY: pa.array(np.array(["base", "clone", "concise", "unhelpful", "verbose"])[
                      rng.integers(0, 5, rows)]),
                  SCORE: rng.integers(0, 11, rows) / 10.0,
                  LABEL: np.where(rng.random(rows) < 0.05, rng.random(rows), np.nan), LABEL_PROB: np.full(rows, 0.05)})
    cuts = [f"p{int(c):08d}" for c in np.linspace(0, 20_000_000, n_shards + 1)[1:-1]]
    parts = sharded.split_by_shard(compact_policy(t), n_shards, row_offset=i << 40, splitters=cuts)
    pieces = [sharded.pack_piece(p) for p in parts]
    if groups is None:
        return tuple(pieces)
    from flows.runtime.sharded_ray import bundle_places

    n_bundles, places = bundle_places(groups)  # as `split_file` bundles them
    return tuple(sharded.bundle_pieces([p for p, (b, _) in zip(pieces, places) if b == k]) for k in range(n_bundles))


def count_rows(shard) -> int:
    """Rows of a shard's pieces (as pass 1 gets them)."""
    return sum(p.num_rows for p in shard.pieces)


def _as_shard(*pieces):
    """The pieces as a `cje_engine.pipeline.sharded.PackedShard` (what pass 1's ``from_pieces`` gives it)."""
    from cje_engine.pipeline.sharded import packed_shard

    return packed_shard(*pieces)


count_rows.from_pieces = _as_shard


def run(args: argparse.Namespace, bundled: bool) -> dict:
    import ray

    from bench_flow_sharded import RayCpu
    from flows.runtime import sharded_ray

    nodes = sharded_ray._cluster_nodes()
    node_of = sharded_ray.shard_nodes(args.shards, nodes) if len(nodes) > 1 else [None] * args.shards
    groups = node_of if bundled else None
    n_bundles, places = sharded_ray.bundle_places(node_of)
    n_obj = n_bundles if bundled else args.shards
    reader = ray.remote(file_pieces).options(num_returns=n_obj)
    with RayCpu(args.marker) as cpu_read:
        t0 = time.perf_counter()
        outs = [reader.remote(i, args.rows_per_file, args.shards, groups) for i in range(args.files)]
        outs = [o if isinstance(o, list) else [o] for o in outs]
        ray.wait([r for o in outs for r in o], num_returns=sum(len(o) for o in outs), fetch_local=False)
        read_wall = time.perf_counter() - t0
    shards = []
    for s, (b, j) in enumerate(places):  # each shard's piece: its bundle's, or its own object
        if bundled:
            shards.append(sharded_ray.ShardPieces([o[b] for o in outs], node_of[s], [j] * len(outs)))
        else:
            shards.append(sharded_ray.ShardPieces([o[s] for o in outs], node_of[s]))
    with RayCpu(args.marker) as cpu_pass:
        t0 = time.perf_counter()
        counted = sum(r for _, r in sharded_ray.ray_mapper()(count_rows, [(sh,) for sh in shards]))
        pass_wall = time.perf_counter() - t0
    del outs, shards
    r, p = cpu_read.totals(), cpu_pass.totals()
    return {"variant": "bundles" if bundled else "pieces", "objects_per_file": n_obj, "rows": counted,
            "readers_cpu_per_file_ms": round((r["worker"] + r["other"]) / args.files * 1000, 1),
            "shard_tasks_cpu_per_file_ms": round((p["worker"] + p["other"]) / args.files * 1000, 1),
            "raylet_cpu_s": round(r["other_by_program"].get("raylet", 0) + p["other_by_program"].get("raylet", 0), 2),
            "read_wall_s": round(read_wall, 2), "pass_wall_s": round(pass_wall, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ray", required=True, help="the cluster's GCS address")
    p.add_argument("--files", type=int, default=40)
    p.add_argument("--rows-per-file", type=int, default=1_000_000)
    p.add_argument("--shards", type=int, default=26, help="26: the shards of the 100M window")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--marker", default=os.environ.get("CJE_STACK_DIR", "/tmp/cje-stack"))
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.chdir(ROOT)  # the workers import this tree
    from flows.runtime.ray_fanout import ray_session

    rows = []
    with ray_session(args.ray):
        run(args, True)  # the workers started and imports done, not counted
        for _ in range(args.repeat):
            for bundled in (False, True):
                rows.append(run(args, bundled))
                log.info("%s", rows[-1])
    for v in ("pieces", "bundles"):
        mine = [r for r in rows if r["variant"] == v]
        log.info("%s: readers %s ms a file, shard tasks %s ms a file", v,
                 [r["readers_cpu_per_file_ms"] for r in mine], [r["shard_tasks_cpu_per_file_ms"] for r in mine])
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
