"""CPU time of `DriftMonitor.update` on a fixed workload, this tree against an earlier commit.

Workload: 3 no-drift monitors x 50 looks of the panel generator (``tests/stats/drift_judge_data.py``,
200 anchors in 50 prompts, 30% of the noise shared within a prompt, clusters, replicate and labels
passed): the workload of the drift tests' fast tier. Each tree runs in its own interpreter
(``--worker``) so both import their own ``cje_engine``; the CPU time is ``time.process_time``.

Usage::

    .venv/bin/python benchmarks/bench_drift_speed.py --base <commit>   # prints base, this tree, ratio

Each tree runs ``--repeat`` times (alternating, default 3); the least CPU time of each is reported
(the machine is shared: the minimum is the least disturbed run).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def workload(n_monitors: int = 3, n_looks: int = 50) -> dict[str, object]:
    """Run the workload in this interpreter; CPU seconds and a checksum of the first alarms."""
    import numpy as np

    from tests.stats.drift_judge_data import PanelWorld, first_alarms

    seeds = np.random.SeedSequence(111).spawn(n_monitors)
    t0 = time.process_time()
    alarms = [first_alarms(PanelWorld(s, "none", shared=0.3), n_looks) for s in seeds]
    return {"cpu_s": time.process_time() - t0, "alarms": json.dumps(alarms, sort_keys=True)}


def _run_in(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker"], cwd=tree, env=env,
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _export(rev: str, dest: Path) -> Path:
    """The ``cje_engine`` and ``tests`` trees of ``rev`` extracted under ``dest``."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "cje_engine", "tests"], check=True,
                         capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as tf:
        tf.extractall(dest, filter="data")
    return dest


def main() -> None:
    """Time the workload in ``--base`` and in this tree; print both and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="git revision to compare with (omit: this tree only)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each tree (the least CPU time is kept)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(workload()))
        return
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = _export(args.base, Path(tmp)) if args.base else None
        runs: dict[str, list[dict]] = {"now": [], "base": []}
        for _ in range(max(args.repeat, 1)):
            runs["now"].append(_run_in(ROOT))
            if base_tree is not None:
                runs["base"].append(_run_in(base_tree))
    now = min(r["cpu_s"] for r in runs["now"])
    line: dict[str, object] = {"this_tree_cpu_s": round(now, 2)}
    if base_tree is not None:
        base = min(r["cpu_s"] for r in runs["base"])
        line.update({"base": args.base, "base_cpu_s": round(base, 2), "speed_up": round(base / now, 2),
                     "same_alarms": {r["alarms"] for r in runs["base"] + runs["now"]} == {runs["now"][0]["alarms"]}})
    print(json.dumps(line))


if __name__ == "__main__":
    main()
