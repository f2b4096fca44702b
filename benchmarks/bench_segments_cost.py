"""The cost of segments (issue 28: at most 1.5x an evaluation's time at 10M rows with 20 segments).

Beside the plain evaluation, in the same process on the same data: `cje_engine.evaluate(frame, ...)` and
`cje_engine.evaluate(frame, ..., segment_by=["segment"])` with 20 segments of equal expected size, 5 policies
(`cje_engine.simulate.segments`, 10% MCAR labels). Measured per size: CPU time of the process
(``time.process_time``, all threads) and wall time of each run (the simulation is not timed), and their ratio.
Routes: ``analytic`` (influence-function intervals: the whole evaluation), ``bootstrap`` with ``--replicates``
replicates in process (`cje_engine.evaluate`, the CLI: one chunk) and ``fanout``: the ``evaluate`` flow's single row
pass (the route it takes below 512 MiB of logs, so at 10M rows): ``prepare``, the replicate source the Ray tasks
receive (`Prepared.bootstrap_source`, pickled and unpickled as `map_ordered` ships it), its replicates in
``2 x 2`` chunks (the flow's ``2 * cluster_cpus`` on this 2-CPU machine, `flows.runtime.ray_fanout.chunk_ranges`)
and ``finalize``, all in this process (the workers' CPU counted, Ray's transport not); ``fanout_two_pass``: the
same with the run's view only shipped and the cells bootstrapped in ``finalize`` (the fan-out before the joint pass
reached the workers: the comparator). Per route and size the
omnibus calibration test's verdict over all labels (whether the cells refit a segment-covariate calibration in
every replicate) is printed too.

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
import pickle
import time

from cje_engine import evaluate
from cje_engine.direct.estimators import bootstrap_view
from cje_engine.pipeline.direct import prepare
from flows.runtime.ray_fanout import chunk_ranges
from cje_engine.simulate.segments import SegmentSpec, simulate_segments

POLICIES = ("p0", "p1", "p2", "p3", "p4")
N_SEGMENTS = 20


def frame_of(n_rows: int, seed: int = 0, scenario: str = "differ"):
    """``n_rows`` rows: ``n_rows / 5`` prompts x 5 policies over 20 segments, 10% labels. ``differ``: the policies'
    effects differ by segment (at 1M rows and more the omnibus calibration test fails: the pooled calibration
    misses the segment effects, so the cells refit a segment-covariate calibration in every replicate);
    ``null``: no segment effect (the omnibus test passes at the 5% level but for chance; the cells share the
    run's calibration)."""
    segs = tuple(f"s{j:02d}" for j in range(N_SEGMENTS))
    scale = 0.0 if scenario == "null" else 0.05
    mu = tuple(tuple(scale * k * ((j % 3) - 1) for j in range(N_SEGMENTS)) for k in range(len(POLICIES)))
    spec = SegmentSpec(n_prompts=n_rows // len(POLICIES), segments=segs, policies=POLICIES, mu=mu,
                       bias=(0.0,) * N_SEGMENTS, oracle_fraction=0.10, seed=seed)
    return simulate_segments(spec).frame.drop(columns=["label_probability"])


def fanout(frame, n_chunks: int = 4, two_pass: bool = False, **options):
    """The ``evaluate`` flow's single-row-pass computation in this process: prepare, the shipped replicate
    source (pickled and read back), its chunks, finalize. ``two_pass``: the run's view only is shipped (as before
    the joint pass reached the workers) and ``finalize`` bootstraps the segment cells in a second pass."""
    c0 = time.process_time()
    prep = prepare(frame, **options)
    chunks = []
    c1 = c15 = time.process_time()
    if prep.options.inference == "bootstrap":
        src = bootstrap_view(prep.design, prep.options.seed) if two_pass else prep.bootstrap_source()
        src = pickle.loads(pickle.dumps(src, protocol=5))
        c15 = time.process_time()
        chunks = [src.replicates(a, b) for a, b in chunk_ranges(prep.options.n_bootstrap, n_chunks)]
        del src
    c2 = time.process_time()
    res = prep.finalize(chunks)
    STEPS.update(prepare_s=round(c1 - c0, 2), source_s=round(c15 - c1, 2), replicates_s=round(c2 - c15, 2),
                 finalize_s=round(time.process_time() - c2, 2))
    return res


#: CPU seconds of the last fan-out run's steps: prepare; the replicate source (with segments: the segment pass,
#: i.e. plan, omnibus tests and the cells' calibration, computed once on the driver) shipped; its chunks (the
#: workers' part: ``replicates_s / B`` is the per-replicate cost); finalize
STEPS: dict = {}


def timed(frame, route: str = "bootstrap", **options) -> dict:
    """CPU and wall seconds of one evaluation (garbage collected before)."""
    gc.collect()
    STEPS.clear()
    c0, w0 = time.process_time(), time.perf_counter()
    if route.startswith("fanout"):
        res = fanout(frame, two_pass=route == "fanout_two_pass", **options)
    else:
        res = evaluate(frame, **options)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    d = res.to_dict()
    out_steps = dict(STEPS)
    seg = d.get("segments")
    out = {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
           "segments_shown": None if seg is None else sum(s["status"] == "shown" for s in seg["segments"])}
    out.update(out_steps)
    if seg is not None:
        omni = [t for t in seg["omnibus"] if t["policy"] == "*"]
        out["omnibus_p"] = omni[0]["p_value"] if omni else None
        out["recalibrated"] = (seg.get("recalibration") or {}).get("applied")
    return out


def main() -> int:
    """Time the plain and the segmented evaluation at each size and print the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1000000,3000000", help="comma-separated row counts (5 policies each)")
    ap.add_argument("--inference", default="analytic,bootstrap",
                    help="routes, comma-separated: analytic, bootstrap (in process), fanout (the flow's chunks), "
                         "fanout_two_pass (the comparator: the cells bootstrapped again in finalize)")
    ap.add_argument("--replicates", type=int, default=50, help="bootstrap replicates of the bootstrap route")
    ap.add_argument("--scenario", default="differ", choices=["differ", "null"],
                    help="segment effects (differ: the omnibus test fails from 1M rows) or none (null)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = []
    for n in (int(x) for x in args.rows.split(",")):
        frame = frame_of(n, scenario=args.scenario)
        for route in args.inference.split(","):
            base = {"baseline": POLICIES[0], "seed": 0, "n_bootstrap": max(args.replicates, 50),
                    "inference": "analytic" if route == "analytic" else "bootstrap"}
            plain = timed(frame, route, **base)
            segd = timed(frame, route, **base, segment_by=["segment"])
            rec = {"rows": n, "scenario": args.scenario, "segments": N_SEGMENTS, "policies": len(POLICIES), "inference": route,
                   "n_bootstrap": base["n_bootstrap"] if route != "analytic" else None, "plain": plain,
                   "segmented": segd, "cpu_ratio": round(segd["cpu_s"] / plain["cpu_s"], 3),
                   "wall_ratio": round(segd["wall_s"] / plain["wall_s"], 3)}
            print(f"{n:>10,d} rows {route:9s}: plain {plain['cpu_s']:8.1f} s CPU ({plain['wall_s']:.1f} s wall), "
                  f"segmented {segd['cpu_s']:8.1f} s CPU ({segd['wall_s']:.1f} s wall, {segd['segments_shown']} "
                  f"segments shown, segment covariate {segd.get('recalibrated')}): x{rec['cpu_ratio']:.2f} CPU, "
                  f"x{rec['wall_ratio']:.2f} wall", flush=True)
            if "replicates_s" in plain:
                B = base["n_bootstrap"]
                rec["ms_per_replicate"] = {"plain": round(1000 * plain["replicates_s"] / B, 2),
                                           "segmented": round(1000 * segd["replicates_s"] / B, 2)}
                print(f"{'':>10s}      steps (CPU s: prepare, source, replicates, finalize): plain {plain['prepare_s']}, "
                      f"{plain['source_s']}, {plain['replicates_s']}, {plain['finalize_s']}; segmented {segd['prepare_s']}, "
                      f"{segd['source_s']}, {segd['replicates_s']}, {segd['finalize_s']}; per replicate "
                      f"{rec['ms_per_replicate']['plain']} "
                      f"ms against {rec['ms_per_replicate']['segmented']} ms", flush=True)
            out.append(rec)
        del frame
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
