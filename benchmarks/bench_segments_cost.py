"""The cost of segments (issue 28: at most 1.5x an evaluation's time at 10M rows with 20 segments).

Beside the plain evaluation, in the same process on the same data: `cje_engine.evaluate(frame, ...)` and
`cje_engine.evaluate(frame, ..., segment_by=["segment"])` with 20 segments of equal expected size, 5 policies
(`cje_engine.simulate.segments`, 10% MCAR labels). Measured per size: CPU time of the process
(``time.process_time``, all threads) and wall time of each run (the simulation is not timed), and their ratio.
Two inference routes: ``analytic`` (influence-function intervals: the whole evaluation) and ``bootstrap`` with
``--replicates`` replicates (the bootstrap's cost is linear in B: the ratio at B=2000 is the ratio of the
per-replicate costs once the fixed part is small; printed as both runs' seconds and the per-replicate cost).

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_segments_cost.py --rows 1000000,3000000
    PYTHONPATH=. .venv/bin/python benchmarks/bench_segments_cost.py --rows 10000000 --inference analytic   # the issue's size

The last line is JSON (one record per size and route).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import time

from cje_engine import evaluate
from cje_engine.simulate.segments import SegmentSpec, simulate_segments

POLICIES = ("p0", "p1", "p2", "p3", "p4")
N_SEGMENTS = 20


def frame_of(n_rows: int, seed: int = 0):
    """``n_rows`` rows: ``n_rows / 5`` prompts x 5 policies over 20 segments, 10% labels."""
    segs = tuple(f"s{j:02d}" for j in range(N_SEGMENTS))
    mu = tuple(tuple(0.05 * k * ((j % 3) - 1) for j in range(N_SEGMENTS)) for k in range(len(POLICIES)))
    spec = SegmentSpec(n_prompts=n_rows // len(POLICIES), segments=segs, policies=POLICIES, mu=mu,
                       bias=(0.0,) * N_SEGMENTS, oracle_fraction=0.10, seed=seed)
    return simulate_segments(spec).frame.drop(columns=["label_probability"])


def timed(frame, **options) -> dict:
    """CPU and wall seconds of one evaluation (garbage collected before)."""
    gc.collect()
    c0, w0 = time.process_time(), time.perf_counter()
    res = evaluate(frame, **options)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    seg = res.to_dict().get("segments")
    return {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
            "segments_shown": None if seg is None else sum(s["status"] == "shown" for s in seg["segments"])}


def main() -> int:
    """Time the plain and the segmented evaluation at each size and print the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1000000,3000000", help="comma-separated row counts (5 policies each)")
    ap.add_argument("--inference", default="analytic,bootstrap", help="routes: analytic, bootstrap or both")
    ap.add_argument("--replicates", type=int, default=50, help="bootstrap replicates of the bootstrap route")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = []
    for n in (int(x) for x in args.rows.split(",")):
        frame = frame_of(n)
        for route in args.inference.split(","):
            base = {"baseline": POLICIES[0], "seed": 0, "inference": route, "n_bootstrap": max(args.replicates, 50)}
            plain = timed(frame, **base)
            segd = timed(frame, **base, segment_by=["segment"])
            rec = {"rows": n, "segments": N_SEGMENTS, "policies": len(POLICIES), "inference": route,
                   "n_bootstrap": base["n_bootstrap"] if route == "bootstrap" else None, "plain": plain,
                   "segmented": segd, "cpu_ratio": round(segd["cpu_s"] / plain["cpu_s"], 3),
                   "wall_ratio": round(segd["wall_s"] / plain["wall_s"], 3)}
            print(f"{n:>10,d} rows {route:9s}: plain {plain['cpu_s']:8.1f} s CPU ({plain['wall_s']:.1f} s wall), "
                  f"segmented {segd['cpu_s']:8.1f} s CPU ({segd['wall_s']:.1f} s wall, {segd['segments_shown']} "
                  f"segments shown): x{rec['cpu_ratio']:.2f} CPU, x{rec['wall_ratio']:.2f} wall", flush=True)
            out.append(rec)
        del frame
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
