"""Judge-drift monitor: family-wise false-alarm rates and detection power per scenario.

Two generators of judge re-scorings, each with 200 anchors in 50 prompts of 4 responses:

* ``panel`` - the independent generator of ``tests/stats/drift_judge_data.py`` (written apart from
  the engine's simulator, mimicking the judge data of issue 17: 0-100 in steps of 5, skewed to the
  top, test-retest tau ~0.60, 2% glitch scores). Scenarios: ``shift`` (+5 points), ``length``
  (long +10, short -10: a reorder by a covariate), ``compress`` (scores 30% closer to 50), ``slow``
  (+0.5 points per look).
* ``sim`` - `cje_engine.simulate.drift` (0-1 in steps of 0.1) with prompts and the scenarios
  ``shift``, ``reorder``, ``remap``, ``length``, ``compress``, ``slow`` at their default effects.

Default monitor (`cje_engine.drift.monitor.DriftMonitor()`), the reference judge scores the anchors
twice (reference and replicate), half the anchors labelled, the prompts passed as clusters.

* False alarms: share of no-drift monitors with any alarm within ``--looks`` (50) looks, per
  noise setting: independent noise; 30% of the judge noise variance shared within a prompt with
  the clusters passed; the same without clusters (what the guarantee needs is the middle one).
* Detection (independent noise, and ``length`` again with shared noise): the update takes over
  at look ``--change-at`` (10); power = share of monitors with a first alarm in looks
  change_at .. change_at + 4 and none before; "rank" = share whose tau_b metric (the rank metric
  itself) first alarms in that window.

Usage::

    .venv/bin/python benchmarks/bench_drift.py --reps 400 --json benchmarks/_work/drift.json
    .venv/bin/python benchmarks/bench_drift.py --reps 40            # smoke size

Prints one JSON document (the source of the tables in benchmarks/RESULTS.md) and a markdown table.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cje_engine.drift.monitor import METRICS  # noqa: E402 - after the path set-up
from cje_engine.simulate import drift as sim  # noqa: E402
from tests.stats.drift_judge_data import PanelWorld, first_alarms  # noqa: E402

PANEL_SCENARIOS = ("shift", "length", "compress", "slow")
SIM_SCENARIOS = ("shift", "reorder", "remap", "length", "compress", "slow")


class SimWorld:
    """`cje_engine.simulate.drift` behind the interface `first_alarms` expects."""

    def __init__(self, seed: Any, scenario: str = "none", *, change_at: int = 1, shared: float = 0.0,
                 pass_clusters: bool = True) -> None:
        rng = np.random.default_rng(seed)
        self.rng, self.scenario, self.change_at = rng, scenario, change_at
        self.anchors = sim.make_anchor_set(200, 0.5, rng=rng, anchors_per_prompt=4)
        self.ref_judge = sim.Judge(shared_noise=shared)
        self.new_judge = sim.drifted_judge(scenario, self.ref_judge, 200, None, rng)
        self.calibrate = sim.fit_calibration(self.ref_judge, rng=rng)
        self.reference = self.ref_judge.score(self.anchors, rng)
        self.replicate = self.ref_judge.score(self.anchors, rng)
        self.labels = self.anchors.labels()
        self.clusters = self.anchors.clusters() if pass_clusters else None

    def look(self, t: int) -> pd.Series:
        judge = sim.judge_at(self.scenario, self.ref_judge, self.new_judge, t, self.change_at, None)
        return judge.score(self.anchors, self.rng)


WORLDS = {"panel": PanelWorld, "sim": SimWorld}


def _se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-12) / n)


def false_alarm(generator: str, reps: int, looks: int, shared: float, clusters: bool, seed: int) -> dict:
    """Family-wise false-alarm rate over ``looks`` looks (and per metric)."""
    world = WORLDS[generator]
    any_alarm, by_metric = 0, {m: 0 for m in METRICS}
    t0 = time.process_time()
    for ss in np.random.SeedSequence(seed).spawn(reps):
        first = first_alarms(world(ss, "none", shared=shared, pass_clusters=clusters), looks)
        any_alarm += any(v is not None for v in first.values())
        for m in METRICS:
            by_metric[m] += first[m] is not None
    rate = any_alarm / reps
    return {"generator": generator, "study": "false_alarm", "shared_noise": shared, "clusters_passed": clusters,
            "reps": reps, "looks": looks, "rate": rate, "se": _se(rate, reps),
            "upper_3se": rate + 3 * _se(rate, reps), "by_metric": {m: c / reps for m, c in by_metric.items()},
            "cpu_s": round(time.process_time() - t0, 1)}


def detection(generator: str, scenario: str, reps: int, change_at: int, within: int, shared: float,
              seed: int) -> dict:
    """Power within ``within`` looks of the change: any metric, and the rank metric alone."""
    world = WORLDS[generator]
    hit = hit_rank = early = 0
    delays: list[int] = []
    first_by = {m: 0 for m in METRICS}
    t0 = time.process_time()
    for ss in np.random.SeedSequence(seed).spawn(reps):
        first = first_alarms(world(ss, scenario, change_at=change_at, shared=shared), change_at + within - 1)
        looks = [v for v in first.values() if v is not None]
        t_first = min(looks) if looks else None
        if t_first is not None and t_first < change_at:
            early += 1
        elif t_first is not None:
            hit += 1
            delays.append(t_first - change_at)
            for m in METRICS:
                first_by[m] += first[m] == t_first
        tau = first["tau_b"]
        hit_rank += tau is not None and tau >= change_at
    power, rank = hit / reps, hit_rank / reps
    return {"generator": generator, "study": "detection", "scenario": scenario, "shared_noise": shared,
            "reps": reps, "change_at": change_at, "within": within, "power": power, "se": _se(power, reps),
            "rank_power": rank, "rank_se": _se(rank, reps), "alarmed_before_change": early / reps,
            "delay_median": float(np.median(delays)) if delays else None,
            "delay_mean": float(np.mean(delays)) if delays else None,
            "first_alarm_by": {m: c / reps for m, c in first_by.items()},
            "cpu_s": round(time.process_time() - t0, 1)}


def _table(rows: list[dict]) -> str:
    out = ["| generator | study | setting | rate / power (SE) | rank metric power (SE) | per metric |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if r["study"] == "false_alarm":
            passed = "passed" if r["clusters_passed"] else "NOT passed"
            setting = f"no drift, shared noise {r['shared_noise']}, clusters {passed}"
            per = ", ".join(f"{m} {v:.3f}" for m, v in r["by_metric"].items())
            out.append(f"| {r['generator']} | FWER over {r['looks']} looks | {setting} | {r['rate']:.3f} "
                       f"({r['se']:.3f}) | | {per} |")
        else:
            per = ", ".join(f"{m} {v:.2f}" for m, v in r["first_alarm_by"].items() if v > 0)
            out.append(f"| {r['generator']} | power within {r['within']} looks | {r['scenario']}, change at "
                       f"{r['change_at']}, shared noise {r['shared_noise']} | {r['power']:.3f} ({r['se']:.3f}) | "
                       f"{r['rank_power']:.3f} ({r['rank_se']:.3f}) | first alarm by: {per} |")
    return "\n".join(out)


class _Rows(list):
    """Rows that are also logged to stderr as they complete (a long run shows its progress)."""

    def append(self, row: dict) -> None:
        super().append(row)
        sys.stderr.write(json.dumps(row) + "\n")
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=400, help="monitors per study")
    p.add_argument("--looks", type=int, default=50, help="looks of the false-alarm studies")
    p.add_argument("--change-at", type=int, default=10)
    p.add_argument("--within", type=int, default=5)
    p.add_argument("--generators", default="panel,sim")
    p.add_argument("--skip-false-alarm", action="store_true")
    p.add_argument("--skip-detection", action="store_true")
    p.add_argument("--scenarios", default=None, help="comma-separated subset of the detection scenarios")
    p.add_argument("--shared", default="0.0,0.3", help="shared-noise levels of the false-alarm studies")
    p.add_argument("--seed", type=int, default=1701, help="seed of the false-alarm studies (detection: +1, +2)")
    p.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    logging.disable(logging.WARNING)  # the monitor logs every alarm
    rows = _Rows()
    t0, c0 = time.perf_counter(), time.process_time()
    levels = [float(v) for v in args.shared.split(",")]
    for g in args.generators.split(","):
        scenarios = PANEL_SCENARIOS if g == "panel" else SIM_SCENARIOS
        if args.scenarios:
            scenarios = tuple(x for x in args.scenarios.split(",") if x in scenarios)
        if not args.skip_false_alarm:
            for shared, clusters in [(v, True) for v in levels] + [(v, False) for v in levels if v > 0]:
                rows.append(false_alarm(g, args.reps, args.looks, shared, clusters, seed=args.seed))
        if not args.skip_detection:
            for scenario in scenarios:
                rows.append(detection(g, scenario, args.reps, args.change_at, args.within, 0.0, seed=args.seed + 1))
            if "length" in scenarios and 0.3 in levels:
                rows.append(detection(g, "length", args.reps, args.change_at, args.within, 0.3, seed=args.seed + 2))
    doc = {"command": "benchmarks/bench_drift.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1), "rows": rows}
    text = json.dumps(doc, indent=1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    sys.stdout.write(text + "\n\n" + _table(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
