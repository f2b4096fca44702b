"""What a ``columns:`` mapping costs the service's log reads: mapped logs next to the same rows
with canonical names, read the same way in the same run.

The logs (simulated, ``--rows`` rows over 7 daily files, 5 policies, a 240-byte text column) are
written twice under ``benchmarks/_work/colmap/``: canonical names, and ``id / model / judge /
human_rating``. Each case runs in a fresh subprocess (so peak RSS and the Arrow pool's peak are
its own), canonical and mapped alternating, ``--repeat`` times; the best wall time is shown with
its CPU time:

* ``read``: `flows.storage.logs.read_window` of the evaluate flow's columns (prompt_id, policy,
  judge_score, response_id, oracle_label) with a two-policy filter pushed into the scan;
* ``filter``: the label-ingestion read (`response_id`, `dt` with an id filter on 1,000 ids) as the
  service does it, the filter built on each file's own names and pushed into the scan;
* ``filter-expr``: the same with the filter as an expression on canonical names, which a renamed
  file can only apply after reading the file whole;
* ``preflight``: `flows.pipelines.preflight.check_evaluation` (first footer; with a mapping every
  footer), timed on its second call (the first imports Prefect's flow machinery).

Usage::

    .venv/bin/python benchmarks/bench_column_mapping.py                 # 2,000,000 rows, 3 repeats
    .venv/bin/python benchmarks/bench_column_mapping.py --rows 200000 --repeat 1   # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

WORK = HERE / "_work" / "colmap"
MAPPING = {"prompt_id": "id", "policy": "model", "judge_score": "judge", "oracle_label": "human_rating"}
DAYS = [f"2025-03-0{d}" for d in range(1, 8)]
COLUMNS = ["prompt_id", "policy", "judge_score", "response_id", "oracle_label"]
CASES = ("read", "filter", "filter-expr", "preflight")


def write(rows: int) -> None:
    """The same simulated rows twice: canonical names and the team's names."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    policies = np.array(["base", "clone", "verbose", "concise", "unhelpful"])
    n_prompts = rows // len(policies)
    prompt = np.repeat(np.arange(n_prompts), len(policies))
    label = np.where(rng.random(rows) < 0.05, rng.random(rows), np.nan)
    text = pa.array(["x" * 240] * rows)
    table = pa.table({
        "prompt_id": pa.array(prompt.astype(str)), "policy": pa.array(np.tile(policies, n_prompts)),
        "judge_score": rng.random(rows), "response_id": pa.array([f"r{i}" for i in range(rows)]),
        "oracle_label": label, "response": text,
        "ts": pa.array(np.datetime64("2025-03-01", "us") + (prompt % 7).astype("timedelta64[D]")
                       + np.timedelta64(12, "h")).cast(pa.timestamp("us", tz="UTC")),
    })
    day = prompt % 7
    for kind, names in (("canon", table.column_names), ("mapped", [MAPPING.get(c, c) for c in table.column_names])):
        for d, name in enumerate(DAYS):
            out = WORK / kind / f"dt={name}" / "part-0.parquet"
            out.parent.mkdir(parents=True, exist_ok=True)
            part = table.filter(pa.array(day == d)).rename_columns(names)
            pq.write_table(part, out, compression="zstd", row_group_size=262_144)


def _vm_hwm_mb() -> float:
    """This process's peak RSS (``VmHWM``: reset by exec, unlike ``ru_maxrss``, which would carry the
    parent's peak from writing the logs)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def case(name: str, kind: str) -> dict:
    """One measurement in this (fresh) process."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from flows.pipelines.preflight import check_evaluation
    from flows.storage.logs import discover_partitions, read_window
    from flows.storage.objects import Storage

    mapping = MAPPING if kind == "mapped" else None
    root = WORK / kind
    params = {"logs_uri": str(root), "window": f"{DAYS[0]}..{DAYS[-1]}", "columns": mapping}
    if name == "preflight":
        check_evaluation(params)  # its imports (Prefect's flow machinery) once, outside the timing
    st = Storage.for_uri(str(root))
    files = discover_partitions(st, DAYS[0], DAYS[-1])
    ids = pa.array([f"r{i}" for i in range(0, 997_000, 997)], pa.string())  # 1,000 ids
    t0, c0 = time.perf_counter(), time.process_time()
    if name == "read":
        out = read_window(st, files, columns=COLUMNS, policies=["base", "clone"], mapping=mapping)
        rows = out.num_rows
    elif name == "filter":  # built on each file's names: pushed into the scan
        out = read_window(st, files, columns=["response_id", "dt"], mapping=mapping, check_unique=False,
                          row_filter=lambda field: field("response_id").isin(ids))
        rows = out.num_rows
    elif name == "filter-expr":  # an expression on canonical names: after a whole-file read when renamed
        out = read_window(st, files, columns=["response_id", "dt"], row_filter=pc.field("response_id").isin(ids),
                          mapping=mapping, check_unique=False)
        rows = out.num_rows
    else:
        check_evaluation(params)
        rows = 0
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall_s": wall, "cpu_s": cpu, "rows": rows, "peak_rss_mb": _vm_hwm_mb(),
            "arrow_peak_mb": pa.default_memory_pool().max_memory() / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--case", nargs=2, metavar=("NAME", "KIND"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.case:
        print(json.dumps(case(*args.case)))
        return
    t0 = time.perf_counter()
    write(args.rows)
    print(f"wrote {args.rows:,} rows x 2 in {time.perf_counter() - t0:.1f} s under {WORK}; "
          f"load {os.getloadavg()[0]:.1f}")
    best: dict[tuple[str, str], dict] = {}
    for _ in range(args.repeat):
        for name in CASES:
            for kind in ("canon", "mapped"):
                r = subprocess.run([sys.executable, __file__, "--case", name, kind], capture_output=True, text=True,
                                   check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
                got = json.loads(r.stdout.strip().splitlines()[-1])
                if (name, kind) not in best or got["wall_s"] < best[name, kind]["wall_s"]:
                    best[name, kind] = got
    print(f"{'case':<11} {'canonical wall / cpu':>22} {'mapped wall / cpu':>20} {'ratio':>6}  "
          f"{'peak RSS canon / mapped':>24}  {'Arrow peak canon / mapped':>26}  rows")
    for name in CASES:
        c, m = best[name, "canon"], best[name, "mapped"]
        print(f"{name:<11} {c['wall_s']:>10.3f} s / {c['cpu_s']:.3f} s {m['wall_s']:>8.3f} s / {m['cpu_s']:.3f} s "
              f"{m['wall_s'] / c['wall_s']:>6.2f}  {c['peak_rss_mb']:>10.0f} / {m['peak_rss_mb']:.0f} MB  "
              f"{c['arrow_peak_mb']:>12.0f} / {m['arrow_peak_mb']:.0f} MB  {c['rows']:,} / {m['rows']:,}")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k[0]}/{k[1]}": v for k, v in best.items()}, indent=1))


if __name__ == "__main__":
    main()
