"""Label requests at scale: `raise_requests_for_run` on a 1M- and a 10M-row window (issue 10).

For each size, one process (this one) does, on a local folder (``file://``: no S3 server, so
that storage latency does not hide the sampler's cost):

1. simulates the window with `benchmarks/bench_flow.py`'s generator (`cje_engine.simulate.direct`,
   5 policies, 5% MCAR labels in the label store, 7 daily Parquet partitions);
2. **comparator 1, the read**: a plain pyarrow read of the window's columns the requests need
   (``response_id, policy, prompt_id, judge_score``) plus a group-by of the policy (count and mean
   judge score) - the least any code that looks at the window must pay;
3. **comparator 2, the evaluation**: `cje_engine.evaluate` on the window (``--engine``: monotone
   calibration, analytic inference by default; the bootstrap run of RESULTS.md fires the same
   triggers) - what the requests are raised for;
4. the measured figures: `read_evaluated_logs` (the requests' read: window + label-store join),
   `plan_requests` on that table (triggers + sampling: the part that took 446 s at 10M), and
   `raise_requests_for_run` end to end from the logs URI (read, plan, budget ledger, manifests).

Each figure is printed as wall and CPU seconds and as a ratio to the read in the same run.
``--profile`` adds a cProfile of `plan_requests` (top functions by cumulative time).

Usage::

    nice -n 10 .venv/bin/python benchmarks/bench_label_requests.py --rows 1000000,10000000
    .venv/bin/python benchmarks/bench_label_requests.py --rows 200000 --profile     # smoke size
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import pyarrow as pa  # noqa: E402 - after the path set-up
import pyarrow.compute as pc  # noqa: E402
import pyarrow.dataset as ds  # noqa: E402

import bench_flow as bf  # noqa: E402
from cje_engine import evaluate  # noqa: E402
from flows.label_requests.planning import plan_requests  # noqa: E402
from flows.label_requests.raising import raise_requests_for_run, read_evaluated_logs  # noqa: E402

NOW = "2025-03-09T12:00:00+00:00"
ENGINES = {"analytic": {"calibration_mode": "monotone", "inference": "analytic", "seed": 0},
           "bootstrap": {"calibration_mode": "monotone", "inference": "bootstrap", "n_bootstrap": 50, "seed": 0}}


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def plain_read(logs_dir: Path) -> pa.Table:
    """Comparator: pyarrow read of the needed columns and a group-by of the policy."""
    table = ds.dataset(str(logs_dir), format="parquet", partitioning="hive").to_table(
        columns=["response_id", "policy", "prompt_id", "judge_score"])
    return table.group_by("policy").aggregate([("judge_score", "count"), ("judge_score", "mean")])


def run_size(rows: int, root: Path, engine: str, profile: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"labreq-{rows}-", dir=root))
    try:
        bf.LOGS_URI, bf.LABELS_URI = str(work / "logs"), str(work / "labelstore")
        gen = bf.child_generate(argparse.Namespace(rows=rows, policies=5, days=7, label_fraction=0.05, seed=0))
        window = bf.window_of(7).replace("..", "_")
        out: dict[str, Any] = {"rows": rows, "labels": gen["labels"], "bytes": gen["bytes"]}
        _, out["read_wall"], out["read_cpu"] = timed(lambda: plain_read(work / "logs"))
        table, out["req_read_wall"], out["req_read_cpu"] = timed(
            lambda: read_evaluated_logs(bf.LOGS_URI, window, bf.LABELS_URI, None))
        frame = table.to_pandas()
        result, out["eval_wall"], out["eval_cpu"] = timed(lambda: evaluate(frame, **ENGINES[engine]).to_dict())
        del frame
        cfg = {"labels_uri": bf.LABELS_URI}
        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        plan, out["plan_wall"], out["plan_cpu"] = timed(lambda: plan_requests(
            result, table, cfg, evaluation="bench", window=window, now=NOW))
        if prof:
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(15)
            out["profile"] = s.getvalue()
        out["requests"] = [(m["scope"], m["design"], m["n_labels"], m["pool_size"]) for m in plan["requests"]]
        out["triggers"] = sorted({t["trigger"] for t in plan["triggers"]})
        del table
        made, out["raise_wall"], out["raise_cpu"] = timed(lambda: raise_requests_for_run(
            None, str(work / "results"), "bench", window, result, bf.LOGS_URI, dict(cfg, notify=False), now=NOW))
        out["raised"] = len(made)
        out["raised_labels"] = sum(m["n_labels"] for m in made)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(res: list[dict]) -> str:
    lines = ["| rows | read + group-by (comparator) | evaluate (comparator) | requests' read (window + label join) "
             "| plan_requests (triggers + sampling) | raise_requests_for_run (all) | requests |",
             "|---|---|---|---|---|---|---|"]
    for r in res:
        base = r["read_wall"]

        def cell(k: str) -> str:
            return f"{r[k + '_wall']:.2f} s (cpu {r[k + '_cpu']:.2f}; {r[k + '_wall'] / base:.1f}x read)"
        lines.append(f"| {r['rows']:,} | {base:.2f} s (cpu {r['read_cpu']:.2f}) | {cell('eval')} | {cell('req_read')} "
                     f"| {cell('plan')} | {cell('raise')} | {r['raised']} ({r['raised_labels']} labels; "
                     f"{', '.join(r['triggers'])}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1000000,10000000", help="comma-separated window sizes")
    p.add_argument("--engine", choices=sorted(ENGINES), default="analytic")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    root = HERE / "_work"
    root.mkdir(exist_ok=True)
    res = []
    for n in (int(x) for x in args.rows.split(",")):
        r = run_size(n, root, args.engine, args.profile)
        res.append(r)
        if "profile" in r:
            print(r.pop("profile"))
        print(json.dumps(r), flush=True)
    print(report(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
