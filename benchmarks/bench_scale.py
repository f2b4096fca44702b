"""Scale: 5 policies x 2,000,000 prompts (10M rows), 5% labels, full analytic inference.

Targets (issue 15): the full analytic inference within 8x of the comparator -- a pyarrow read
of the same Parquet file plus a group-by mean of the judge score per policy, measured first in
the same process -- and under 2 GiB peak memory. Both wall and CPU time are printed (pyarrow's
read is multi-threaded; the engine mostly runs on one thread).

Two child processes, each measured on its own (peak RSS = ``getrusage(RUSAGE_SELF).ru_maxrss``
of that process, plus a sampling thread reading ``/proc/self/statm`` every 20 ms for the
per-stage peaks):

1. ``simulate``: `cje_engine.simulate.direct.simulate` (default policies, MCAR labels) written to a
   Parquet file under ``benchmarks/_work/`` (reused on later runs unless ``--regenerate``);
2. ``evaluate``: the timed inference from that Parquet file, stage by stage:
   ``load_coded`` (read + validate: `load_frame` plus the prompt and policy codes it computes) ->
   ``EvalData.from_frame`` (codes, prompt folds; the two steps of ``prepare(path)``) ->
   ``prepare`` (mode selection, cross-fitted calibration, point estimates, influence
   functions, fold jackknife) -> ``finalize`` (analytic SEs / CIs, audits, gates, all pairwise
   comparisons, ranking) with ``inference="analytic"``; afterwards a few bootstrap replicates
   (``bootstrap_chunk``) are timed to give the cost per replicate at this size (reported
   separately; not part of the 60 s target).

3. ``ray`` (with ``--ray-nodes``): the bootstrap fanned out on a real Ray cluster on 127.0.0.1,
   once per cluster size (a head plus ``n - 1`` worker nodes, each ``ray start --num-cpus=1``,
   started and stopped by PID): ``prepare`` in the driver, then ``--ray-B`` replicates in chunks
   of the compact `BootstrapView` (what the flow ships), as the flow splits them (2 chunks per
   CPU, at least 50 replicates a chunk). Printed per cluster size: wall time of the fan-out,
   CPU time of every chunk (measured inside the task), the cores used, and the speed-up; the
   replicates of every cluster size must be bit-identical to each other and to
   ``bootstrap_chunk`` in the driver (checked on the first two).

Usage::

    .venv/bin/python benchmarks/bench_scale.py                          # 2,000,000 prompts
    .venv/bin/python benchmarks/bench_scale.py --prompts 100000 --replicates 2   # smoke run
    .venv/bin/python benchmarks/bench_scale.py --mode monotone --no-covariates
    .venv/bin/python benchmarks/bench_scale.py --ray-nodes 1,2 --ray-B 200    # Ray fan-out, 1 vs 2 nodes
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench_scale")
GiB = 1024**3
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemorySampler:
    """Samples this process's RSS in a thread; `mark` closes a stage and records its peak."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self._peak = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.stages: list[dict] = []
        self._t = time.perf_counter()
        self._c = time.process_time()

    @staticmethod
    def rss() -> int:
        try:
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * PAGE
        except OSError:  # not Linux: fall back to the high-water mark
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _run(self) -> None:
        while not self._stop.is_set():
            r = self.rss()
            with self._lock:
                self._peak = max(self._peak, r)
            time.sleep(self.interval)

    def __enter__(self) -> "MemorySampler":
        self._peak = self.rss()
        self._thread.start()
        self._t, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self, name: str) -> dict:
        now, cpu = time.perf_counter(), time.process_time()
        r = self.rss()
        with self._lock:
            peak = max(self._peak, r)
            self._peak = r
        st = {"stage": name, "seconds": now - self._t, "cpu_seconds": cpu - self._c, "peak_rss_gib": peak / GiB,
              "rss_after_gib": r / GiB}
        self.stages.append(st)
        log.info("%-28s %7.2f s (cpu %.2f s)  peak RSS %.2f GiB  (after %.2f GiB)", name, st["seconds"],
                 st["cpu_seconds"], st["peak_rss_gib"], st["rss_after_gib"])
        self._t, self._c = time.perf_counter(), time.process_time()
        return st


def _release_memory() -> None:
    """Hand freed memory back to the OS (Arrow's pool and glibc's heap keep it otherwise), so the
    next stage's peak is its own."""
    import ctypes
    import gc

    import pyarrow as pa

    gc.collect()
    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _maxrss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # ru_maxrss is KiB on Linux


def stage_simulate(args: argparse.Namespace) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cje_engine.simulate.direct import simulate

    with MemorySampler() as mem:
        extra = {} if args.judge_noise is None else {"judge_noise_sd": args.judge_noise}
        sim = simulate(args.prompts, oracle_fraction=args.fraction, seed=args.seed, **extra)
        mem.mark("simulate")
        table = pa.Table.from_pandas(sim.frame, preserve_index=False)
        del sim
        args.parquet.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.parquet.with_suffix(".tmp")
        pq.write_table(table, tmp, row_group_size=1 << 20)
        os.replace(tmp, args.parquet)
        mem.mark("write parquet")
    return {"stages": mem.stages, "max_rss_gib": _maxrss_gib(), "rows": table.num_rows,
            "bytes": args.parquet.stat().st_size}


def stage_evaluate(args: argparse.Namespace) -> dict:
    import numpy as np

    from cje_engine import bootstrap_chunk, finalize, prepare
    from cje_engine.data.frame import EvalData
    from cje_engine.data.io import load_coded

    import pyarrow.parquet as pq

    covs = [] if args.no_covariates else ["response_length"]
    opts = dict(covariates=covs, calibration_mode=args.mode, inference="analytic", seed=args.seed)
    t_c, c_c = time.perf_counter(), time.process_time()
    table = pq.read_table(args.parquet)
    means = table.group_by("policy").aggregate([("judge_score", "mean")])
    comparator = {"seconds": time.perf_counter() - t_c, "cpu_seconds": time.process_time() - c_c,
                  "groups": means.num_rows}
    del table, means
    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    log.info("comparator (pyarrow read + group-by mean): %.2f s (cpu %.2f s)", comparator["seconds"],
             comparator["cpu_seconds"])
    with MemorySampler() as mem:
        t0 = time.perf_counter()
        frame, codes = load_coded(args.parquet, covariates=covs)  # what prepare(path) does
        mem.mark("load + validate (load_frame)")
        ed = EvalData.from_frame(frame, covariates=covs, consume=True, codes=codes)  # takes the frame over
        del frame, codes
        _release_memory()
        mem.mark("EvalData build")
        prep = prepare(ed, **opts)
        mem.mark("prepare")
        res = finalize(prep, [])
        d = res.to_dict()
        json.dumps(d)
        mem.mark("finalize (+ to_dict)")
        total = time.perf_counter() - t0
        total_cpu = sum(st["cpu_seconds"] for st in mem.stages)
        max_rss_inference = _maxrss_gib()
        boot = None
        if args.replicates > 0:
            tb, cb = time.perf_counter(), time.process_time()
            reps = bootstrap_chunk(prep, 0, args.replicates)
            per = (time.perf_counter() - tb) / args.replicates
            assert np.isfinite(reps).all()
            boot = {"replicates": args.replicates, "seconds_per_replicate": per,
                    "cpu_seconds_per_replicate": (time.process_time() - cb) / args.replicates,
                    "projected_B2000_s": 2000 * per}
            mem.mark(f"bootstrap x{args.replicates} (extra)")
    pols = {p: {"estimate": e["estimate"], "se": e["se"], "ci": e["ci"], "basis": e["basis_code"],
                "level_claim": e["level_claim"], "audit": e["audit"]["verdict"]}
            for p, e in d["policies"].items()}
    return {"comparator": comparator, "stages": mem.stages, "total_inference_s": total, "total_inference_cpu_s": total_cpu, "max_rss_inference_gib": max_rss_inference,
            "max_rss_gib": _maxrss_gib(), "bootstrap": boot, "mode": d["calibration"]["mode"],
            "n_rows": d["data"]["n_rows"], "n_labelled": d["data"]["n_labelled"],
            "n_comparisons": len(d["comparisons"]), "policies": pols}


def _timed_chunk(view, start: int, stop: int) -> dict:
    """A bootstrap chunk on a Ray worker, with the task's own CPU and wall time and its node."""
    import ray

    from cje_engine.direct.estimators import bootstrap_replicates

    t0, c0, at = time.perf_counter(), time.process_time(), time.time()
    reps = bootstrap_replicates(view, start, stop)
    return {"reps": reps, "cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0,
            "start": at, "end": time.time(), "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(), "max_rss_gib": _maxrss_gib()}


def _ray_run(prep, view, nodes: int, B: int, log_dir: Path) -> dict:
    """One fan-out of B replicates on a fresh cluster of ``nodes`` one-CPU nodes; stopped after."""
    import numpy as np
    import ray

    from bench_flow import add_ray_node, start_ray_head
    from flows.runtime import ray_fanout

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PREFECT_"))}
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.environ["RAY_AUTH_TOKEN"], "RAY_USAGE_STATS_ENABLED": "0",
                "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])})
    t0 = time.perf_counter()
    cluster = start_ray_head(env, 2 * GiB, log_dir)
    try:
        for _ in range(nodes - 1):
            add_ray_node(cluster, 2 * GiB, log_dir)
        started = time.perf_counter() - t0
        n_chunks = max(1, min(2 * nodes, B // 50))  # as flows.pipelines.evaluate (MIN_CHUNK = 50)
        ranges = ray_fanout.chunk_ranges(B, n_chunks)
        load0 = os.getloadavg()
        with ray_fanout.ray_session(address=cluster.address):
            alive = sum(1 for n in ray.nodes() if n["Alive"])
            tw, tc = time.perf_counter(), time.process_time()
            parts = ray_fanout.map_ordered(_timed_chunk, ranges, shared=view, name="cje_bootstrap")
            wall, driver_cpu = time.perf_counter() - tw, time.process_time() - tc
        load1 = os.getloadavg()
    finally:
        cluster.stop()
    reps = np.vstack([p["reps"] for p in parts])
    first = min(p["start"] for p in parts)
    return {"nodes": nodes, "alive_nodes": alive, "cluster_start_s": started, "B": B, "chunks": ranges,
            "wall_s": wall, "driver_cpu_s": driver_cpu, "cpu_s": sum(p["cpu_s"] for p in parts),
            "node_ids": sorted({p["node"] for p in parts}), "load_before": load0, "load_after": load1,
            "tasks": [{k: v for k, v in p.items() if k != "reps"} | {"start": p["start"] - first,
                                                                      "end": p["end"] - first} for p in parts],
            "reps": reps}


def stage_ray(args: argparse.Namespace) -> dict:
    import pickle
    import secrets
    import tempfile

    # token auth for the clusters this stage starts: in the environment before Ray is imported
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})

    import numpy as np

    from cje_engine import bootstrap_chunk, prepare
    from cje_engine.data.frame import EvalData
    from cje_engine.data.io import load_coded
    from flows.runtime.ray_fanout import bootstrap_state

    covs = [] if args.no_covariates else ["response_length"]
    t0, c0 = time.perf_counter(), time.process_time()
    frame, codes = load_coded(args.parquet, covariates=covs)
    ed = EvalData.from_frame(frame, covariates=covs, consume=True, codes=codes)
    del frame, codes
    prep = prepare(ed, covariates=covs, calibration_mode=args.mode, inference="bootstrap",
                   n_bootstrap=max(50, args.ray_B), seed=args.seed)
    prepared = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
    view = bootstrap_state(prep)

    def pickled(obj) -> int:  # pickle-5 with out-of-band buffers: no copy of the arrays
        bufs: list = []
        return len(pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)) + sum(b.raw().nbytes for b in bufs)

    sizes = {"prepared_bytes": pickled(prep), "view_bytes": pickled(view), "rows": ed.n_rows}
    log.info("prepared in %.1f s; shipped state %.0f MB (the whole prepared state: %.0f MB)", prepared["wall_s"],
             sizes["view_bytes"] / 1e6, sizes["prepared_bytes"] / 1e6)
    tc = time.process_time()
    in_process = bootstrap_chunk(prep, 0, 2)
    in_process_cpu = (time.process_time() - tc) / 2
    runs = []
    with tempfile.TemporaryDirectory(prefix="cjebs") as log_dir:
        for nodes in args.ray_nodes:
            log.info("Ray: %d node(s), B=%d", nodes, args.ray_B)
            runs.append(_ray_run(prep, view, nodes, args.ray_B, Path(log_dir)))
            log.info("Ray: %d node(s): %.1f s wall, %.1f s CPU in the tasks", nodes, runs[-1]["wall_s"],
                     runs[-1]["cpu_s"])
    same = all(np.array_equal(r["reps"], runs[0]["reps"], equal_nan=True) for r in runs)
    same_in_process = all(np.array_equal(r["reps"][:2], in_process, equal_nan=True) for r in runs)
    for r in runs:
        del r["reps"]
    return {"prepare": prepared, "sizes": sizes, "in_process_cpu_s_per_replicate": in_process_cpu,
            "runs": runs, "identical_across_clusters": same, "identical_to_in_process": same_in_process,
            "cpus": os.cpu_count()}


def _child(stage: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", stage, "--prompts", str(args.prompts),
           "--fraction", str(args.fraction), "--seed", str(args.seed), "--mode", args.mode,
           "--replicates", str(args.replicates), "--parquet", str(args.parquet)]
    if args.no_covariates:
        cmd.append("--no-covariates")
    if args.judge_noise is not None:
        cmd += ["--judge-noise", str(args.judge_noise)]
    if stage == "ray":
        cmd += ["--ray-nodes", ",".join(map(str, args.ray_nodes)), "--ray-B", str(args.ray_B)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    sys.stderr.write(proc.stderr)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("STAGE_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"stage {stage} failed with exit code {proc.returncode}")
    out = json.loads(line[len("STAGE_JSON "):])
    out["process_wall_s"] = wall
    return out


def _report_ray(out: dict, args: argparse.Namespace) -> int:
    sz = out["sizes"]
    print(f"\n--- bootstrap on Ray: {sz['rows']:,} rows, B={args.ray_B}; machine: {out['cpus']} cores "
          f"(shared with other users: see the load averages) ---")
    print(f"prepare in the driver: {out['prepare']['wall_s']:.1f} s wall, {out['prepare']['cpu_s']:.1f} s CPU")
    print(f"shipped to the workers: BootstrapView {sz['view_bytes'] / 1e6:.0f} MB "
          f"(the whole prepared state would be {sz['prepared_bytes'] / 1e6:.0f} MB)")
    print(f"one replicate in the driver (bootstrap_chunk): {out['in_process_cpu_s_per_replicate']:.3f} s CPU")
    base = None
    for r in out["runs"]:
        per_cpu = r["cpu_s"] / r["B"]
        print(f"{r['nodes']} node(s) x 1 CPU ({r['alive_nodes']} alive, cores used: {r['nodes']}), "
              f"{len(r['chunks'])} chunks: fan-out {r['wall_s']:.1f} s wall, tasks {r['cpu_s']:.1f} s CPU "
              f"({per_cpu:.3f} s CPU a replicate), driver {r['driver_cpu_s']:.1f} s CPU; cluster start "
              f"{r['cluster_start_s']:.0f} s; load {r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f}")
        for t in r["tasks"]:
            print(f"    task on node {t['node'][:8]}: {t['start']:6.1f} -> {t['end']:6.1f} s, "
                  f"{t['cpu_s']:.1f} s CPU / {t['wall_s']:.1f} s wall, worker max RSS {t['max_rss_gib']:.2f} GiB")
        if base is None:
            base = r
        else:
            print(f"    speed-up {base['nodes']} -> {r['nodes']} nodes: {base['wall_s'] / r['wall_s']:.2f}x (wall)")
        print(f"    B=2000 at this rate: ~{r['wall_s'] * 2000 / r['B'] / 60:.1f} min wall "
              f"(extrapolated linearly from B={r['B']})")
    print(f"replicates identical across cluster sizes: {out['identical_across_clusters']}; "
          f"equal to bootstrap_chunk in the driver: {out['identical_to_in_process']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "ray": out}, indent=2))
    return 0 if out["identical_across_clusters"] and out["identical_to_in_process"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2_000_000, help="prompts per policy (5 policies)")
    ap.add_argument("--fraction", type=float, default=0.05, help="oracle (label) fraction, MCAR")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--judge-noise", type=float, default=None,
                    help="SimSpec.judge_noise_sd (default the simulator's 0.4; 0 makes the calibration transport "
                         "exactly to every non-adversarial policy, see bench_protocol.JUDGE_NOISE)")
    ap.add_argument("--mode", default="auto", choices=["auto", "monotone", "two_stage"])
    ap.add_argument("--no-covariates", action="store_true", help="no response_length covariate")
    ap.add_argument("--replicates", type=int, default=3, help="bootstrap replicates to time after inference")
    ap.add_argument("--parquet", type=Path, default=None, help="data file (default under benchmarks/_work)")
    ap.add_argument("--regenerate", action="store_true", help="simulate even if the Parquet file exists")
    ap.add_argument("--ray-nodes", type=lambda v: [int(x) for x in v.split(",")], default=None,
                    help="instead of the analytic run: the bootstrap on Ray clusters of these sizes, e.g. 1,2")
    ap.add_argument("--ray-B", type=int, default=200, help="replicates of each Ray run")
    ap.add_argument("--stage", choices=["simulate", "evaluate", "ray"], help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help="write all figures to this JSON file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("cje_engine").setLevel(logging.WARNING)
    if args.parquet is None:
        noise = "" if args.judge_noise is None else f"_j{args.judge_noise:g}"
        args.parquet = HERE / "_work" / f"scale_{args.prompts}x5_f{args.fraction}_s{args.seed}{noise}.parquet"

    if args.stage == "simulate":
        print("STAGE_JSON " + json.dumps(stage_simulate(args)))
        return 0
    if args.stage == "evaluate":
        print("STAGE_JSON " + json.dumps(stage_evaluate(args)))
        return 0
    if args.stage == "ray":
        print("STAGE_JSON " + json.dumps(stage_ray(args)))
        return 0

    sim = None
    if args.regenerate or not args.parquet.exists():
        log.info("simulating %d prompts x 5 policies -> %s", args.prompts, args.parquet)
        sim = _child("simulate", args)
    else:
        log.info("reusing %s (pass --regenerate to simulate again)", args.parquet)
    if args.ray_nodes:
        return _report_ray(_child("ray", args), args)
    ev = _child("evaluate", args)

    print()
    if sim:
        for st in sim["stages"]:
            print(f"{st['stage']:34s} {st['seconds']:7.2f} s  cpu {st['cpu_seconds']:7.2f} s   "
                  f"peak RSS {st['peak_rss_gib']:5.2f} GiB")
        print(f"{'(simulation process max RSS)':34s} {'':24s}     {sim['max_rss_gib']:5.2f} GiB; "
              f"{sim['rows']:,} rows, {sim['bytes'] / 2**20:.0f} MiB Parquet")
    print(f"--- inference on {ev['n_rows']:,} rows ({ev['n_labelled']:,} labelled), mode {ev['mode']}, analytic ---")
    for st in ev["stages"]:
        print(f"{st['stage']:34s} {st['seconds']:7.2f} s  cpu {st['cpu_seconds']:7.2f} s   "
              f"peak RSS {st['peak_rss_gib']:5.2f} GiB")
    cmp_ = ev["comparator"]
    ratio_w = ev["total_inference_s"] / cmp_["seconds"]
    ratio_c = ev["total_inference_cpu_s"] / cmp_["cpu_seconds"]
    ok_t = ratio_w <= 8 or ratio_c <= 8
    ok_m = ev["max_rss_inference_gib"] < 2
    print(f"{'TOTAL inference':34s} {ev['total_inference_s']:7.2f} s  cpu {ev['total_inference_cpu_s']:7.2f} s   max RSS {ev['max_rss_inference_gib']:5.2f} GiB")
    print(f"{'comparator: pyarrow read + group-by':34s} {cmp_['seconds']:7.2f} s  cpu {cmp_['cpu_seconds']:7.2f} s")
    print(f"{'ratio ours / comparator':34s} {ratio_w:7.1f}x wall, {ratio_c:.1f}x CPU   "
          f"[time {'OK' if ok_t else 'MISSED'} (<= 8x), memory {'OK' if ok_m else 'MISSED'} (< 2 GiB)]")
    if ev["bootstrap"]:
        b = ev["bootstrap"]
        print(f"bootstrap at this size: {b['seconds_per_replicate']:.2f} s per replicate "
              f"(cpu {b['cpu_seconds_per_replicate']:.2f} s; B=2000 would take ~{b['projected_B2000_s'] / 60:.0f} min on one "
              f"core, ~{b['projected_B2000_s'] / 120:.0f} min on two); process max RSS with "
              f"bootstrap {ev['max_rss_gib']:.2f} GiB")
    print(f"{ev['n_comparisons']} pairwise comparisons; policies:")
    for p, e in ev["policies"].items():
        print(f"  {p:10s} {e['estimate']:.4f} +/- {e['se']:.4f}  {e['basis']:12s} {e['level_claim']:7s} audit {e['audit']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "simulate": sim,
                                         "evaluate": ev}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
