"""Why a slow judge drift (+0.5 points per look) is not caught within 5 looks, and what would catch it.

Generator: `tests/stats/drift_judge_data.py` (the independent ``panel`` generator of
`bench_drift.py`: 200 anchors in 50 prompts of 4, 0-100 in steps of 5, test-retest tau ~0.58).

Part A, noise (no drift, ``--reps`` monitors' worth of scorings, no monitor run): the per-look mean
shift ``d_t = mean(c_t - r)`` against the reference scoring ``r``; its SD, the correlation of two
looks' shifts (they share ``r``), and the SD of cumulative statistics over 5 looks: the mean of
``d_t`` (what a CUSUM of the per-look shift adds up) and ``d_t`` against the mean of the reference
and its replicate. Under a drift that grows by ``delta`` per look, 5 looks after its start the
last look's shift is ``5 delta``, the 5-look mean ``3 delta``: the signal-to-noise ratios follow.

Part B, power: share of monitors (default `DriftMonitor`, replicate, clusters) whose first alarm
falls within 5 looks of the start of the slow drift, for a start at look 10 (the benchmark's
setting), at look 1 (where the unbounded spending has most of its budget), and with a stated
horizon of 30 looks (even spending); for the start at look 10 the monitors run
20 looks past it (detection within 5, 10, 15, 20 looks), plus no-drift runs of the same settings for the false alarms.

Usage::

    nice -n 10 .venv/bin/python benchmarks/bench_drift_slow.py --reps 300
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.stats.drift_judge_data import PanelWorld, first_alarms  # noqa: E402 - after the path set-up

WITHIN = 5


def noise(reps: int, seed: int) -> dict:
    """SDs of per-look and cumulative mean-shift statistics under no drift."""
    d = np.empty((reps, WITHIN))
    d_pair = np.empty((reps, WITHIN))
    for k, ss in enumerate(np.random.SeedSequence(seed).spawn(reps)):
        w = PanelWorld(ss, "none")
        r, rep = w.reference.to_numpy(float), w.replicate.to_numpy(float)
        for t in range(WITHIN):
            c = w.look(t + 1).to_numpy(float)
            d[k, t] = np.mean(c - r)
            d_pair[k, t] = np.mean(c - 0.5 * (r + rep))
    sd1 = float(d[:, 0].std(ddof=1))
    return {"reps": reps, "sd_look": sd1, "corr_two_looks": float(np.corrcoef(d[:, 0], d[:, 1])[0, 1]),
            "sd_mean_5_looks": float(d.mean(axis=1).std(ddof=1)),
            "sd_look_vs_ref_and_replicate": float(d_pair[:, 0].std(ddof=1)),
            "sd_mean_5_looks_vs_ref_and_replicate": float(d_pair.mean(axis=1).std(ddof=1))}


def power(reps: int, seed: int, change_at: int, monitor_kwargs: dict | None, scenario: str = "slow",
          follow: int = WITHIN) -> dict:
    """Share of monitors whose first alarm falls within 5 (and ``follow``) looks of the change."""
    delays, early = [], 0
    t0 = time.process_time()
    for ss in np.random.SeedSequence(seed).spawn(reps):
        first = first_alarms(PanelWorld(ss, scenario, change_at=change_at), change_at + follow - 1, monitor_kwargs)
        looks = [v for v in first.values() if v is not None]
        t = min(looks) if looks else None
        early += t is not None and t < change_at
        delays.append(t - change_at if t is not None and t >= change_at else None)
    within = {k: sum(d is not None and d < k for d in delays) / reps for k in (5, 10, 15, 20) if k <= follow}
    p5 = within[WITHIN]
    return {"scenario": scenario, "change_at": change_at, "monitor": monitor_kwargs or {}, "reps": reps,
            "power_within": within, "se_5": float(np.sqrt(p5 * (1 - p5) / reps)),
            "alarmed_before": early / reps, "cpu_s": round(time.process_time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    logging.disable(logging.WARNING)  # the monitors log every alarm
    out = {"noise": noise(args.reps, args.seed)}
    print(json.dumps(out["noise"]), flush=True)
    runs = []
    for change_at, kw, follow in ((10, None, 20), (1, None, WITHIN), (10, {"horizon": 30}, 20)):
        r = power(args.reps, args.seed + 1 + change_at, change_at, kw, follow=follow)
        print(json.dumps(r), flush=True)
        runs.append(r)
    out["power"] = runs
    n = out["noise"]
    print(f"| statistic (no drift) | SD (points) | SNR after 5 looks of +0.5/look |\n|---|---|---|\n"
          f"| last look's shift d_t | {n['sd_look']:.3f} | {2.5 / n['sd_look']:.2f} |\n"
          f"| mean of 5 looks' shifts (CUSUM / 5) | {n['sd_mean_5_looks']:.3f} | {1.5 / n['sd_mean_5_looks']:.2f} |\n"
          f"| last look vs mean(reference, replicate) | {n['sd_look_vs_ref_and_replicate']:.3f} | "
          f"{2.5 / n['sd_look_vs_ref_and_replicate']:.2f} |\n"
          f"| mean of 5 looks vs mean(reference, replicate) | {n['sd_mean_5_looks_vs_ref_and_replicate']:.3f} | "
          f"{1.5 / n['sd_mean_5_looks_vs_ref_and_replicate']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
