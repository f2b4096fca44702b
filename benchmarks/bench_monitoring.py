"""False-alarm rate and detection delay of the regression alarms across windows (cje_engine.inference.changes).

Two levels, each printed beside its comparator measured in the same run:

1. Engine level: sequences of simulated daily windows (``--prompts`` prompts per window, two policies, labels on
   the logger plus ``--audit`` own labels of the candidate), each window evaluated by the real engine (analytic
   route), no change. Family-wise false-alarm rate over ``--windows`` windows, per policy, next to the naive rule
   (alarm when any window's two-sided p < alpha, no spending).
2. Normal level: many more sequences with the per-window SE measured at level 1, no change and with a step change
   of 0.02 and 0.05 at window ``--change-at``: false-alarm rate and detection delay (windows from the change to the
   first alarm) for the unbounded spending 1/(t(t+1)) and for a stated horizon (= the number of windows).

Full run:  .venv/bin/python benchmarks/bench_monitoring.py
Smoke run: .venv/bin/python benchmarks/bench_monitoring.py --sequences 2 --windows 10 --normal-sequences 200
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy: one thread per process, comparable CPU figures

import argparse  # noqa: E402
import json
import math  # noqa: E402
import time  # noqa: E402
from statistics import NormalDist

import numpy as np

from cje_engine import evaluate
from cje_engine.inference.changes import WindowValue, series_from_results, window_changes
from cje_engine.simulate.direct import PolicySpec, simulate

N = NormalDist()


def engine_sequences(n_seq: int, n_win: int, prompts: int, audit: int, alpha: float) -> dict:
    """Level 1: no change, the real engine per window."""
    alarms = {"spending": 0, "naive": 0}
    ses = []
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(n_seq):
        results = []
        for w in range(n_win):
            sim = simulate(prompts, [PolicySpec("base", 0.8), PolicySpec("cand", 0.8)], label_design="calibration_policy",
                           oracle_fraction=0.25, audit_labels=audit, seed=10_000 * s + w)
            res = evaluate(sim.frame, inference="analytic", calibration_policies=["base"], seed=0).to_dict()
            results.append((f"w{w:03d}", res))
        series = series_from_results(results)
        vals = series["cand"]
        ses += [v.se for v in vals if v.se is not None]
        alarms["spending"] += bool(window_changes(vals, policy="cand", alpha=alpha).alarms)
        alarms["naive"] += _naive_alarm(vals, alpha)
    return {"sequences": n_seq, "windows": n_win, "prompts": prompts, "audit_labels": audit,
            "false_alarm_spending": alarms["spending"] / n_seq, "false_alarm_naive": alarms["naive"] / n_seq,
            "binomial_se": math.sqrt(alpha * (1 - alpha) / n_seq), "mean_se": float(np.mean(ses)),
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def _naive_alarm(vals: list[WindowValue], alpha: float) -> bool:
    """Any window's drop against the previous or the first window with p < alpha (no spending)."""
    z = N.inv_cdf(1 - alpha / 2)
    for i in range(1, len(vals)):
        for ref in (vals[i - 1], vals[0]):
            d = vals[i].estimate - ref.estimate
            if d < 0 and abs(d) / math.hypot(vals[i].se, ref.se) > z:
                return True
    return False


def normal_sequences(n_seq: int, n_win: int, se: float, change: float, change_at: int, alpha: float,
                     horizon: int | None, rng: np.random.Generator, baseline_windows: int = 1) -> dict:
    """Level 2: estimates ~ N(value, se^2) per window; returns false-alarm / delay figures."""
    early, delays, never = 0, [], 0
    for _ in range(n_seq):
        est = 0.7 + se * rng.standard_normal(n_win)
        est[change_at:] -= change
        vals = [WindowValue(f"w{i:03d}", float(v), se) for i, v in enumerate(est)]
        first = window_changes(vals, alpha=alpha, horizon=horizon, baseline_windows=baseline_windows).first_alarm
        idx = None if first is None else int(first[1:])
        if idx is not None and idx < change_at:
            early += 1
        elif idx is None:
            never += 1
        else:
            delays.append(idx - change_at)
    d = np.array(delays, dtype=float)
    return {"change": change, "horizon": horizon, "baseline_windows": baseline_windows,
            "false_alarm_before_change": early / n_seq,
            "detected": len(delays) / n_seq, "never": never / n_seq,
            "delay_median": float(np.median(d)) if delays else float("nan"),
            "delay_p90": float(np.percentile(d, 90)) if delays else float("nan"),
            "within_0": float(np.mean(d == 0)) * len(delays) / n_seq if delays else 0.0,
            "within_2": float(np.mean(d <= 2)) * len(delays) / n_seq if delays else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=30, help="engine-level sequences (default 20)")
    ap.add_argument("--windows", type=int, default=50, help="windows per sequence (default 50)")
    ap.add_argument("--prompts", type=int, default=1000, help="prompts per window and policy (default 1000)")
    ap.add_argument("--audit", type=int, default=100, help="own labels of the candidate per window (default 100)")
    ap.add_argument("--normal-sequences", type=int, default=2000, help="normal-level sequences (default 2000)")
    ap.add_argument("--change-at", type=int, default=10, help="window index of the step change (default 10); the "
                    "baseline period must end before it")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--baseline-windows", type=int, default=8, help="baseline period of the second set of rows")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    eng = engine_sequences(args.sequences, args.windows, args.prompts, args.audit, args.alpha)
    print(f"[engine] {eng['sequences']} sequences x {eng['windows']} windows, {eng['prompts']} prompts, "
          f"{eng['audit_labels']} own labels; no change; mean SE of a window {eng['mean_se']:.4f}")
    print(f"[engine] family-wise false-alarm rate: alpha spending {eng['false_alarm_spending']:.3f} vs naive "
          f"{eng['false_alarm_naive']:.3f} (binomial SE at alpha {eng['binomial_se']:.3f}); "
          f"{eng['wall_s']:.0f} s wall, {eng['cpu_s']:.0f} s CPU")
    rng = np.random.default_rng(0)
    rows = []
    for horizon, m in ((None, 1), (args.windows, 1), (None, args.baseline_windows), (args.windows, args.baseline_windows)):
        for change in (0.0, 0.02, 0.05):
            r = normal_sequences(args.normal_sequences, args.windows, eng["mean_se"], change, args.change_at,
                                 args.alpha, horizon, rng, m)
            rows.append(r)
            spend = ("1/(t(t+1))" if horizon is None else f"horizon {horizon}") + f", baseline {m} window(s)"
            if change == 0:
                print(f"[normal] {spend:>34}: no change, false-alarm rate over {args.windows} windows "
                      f"{r['false_alarm_before_change'] + r['detected']:.3f}")
            else:
                print(f"[normal] {spend:>34}: change {change:.2f} at window {args.change_at}: false alarm before "
                      f"{r['false_alarm_before_change']:.3f}, detected {r['detected']:.3f} (at the change "
                      f"{r['within_0']:.3f}, within 2 windows {r['within_2']:.3f}), delay median "
                      f"{r['delay_median']:.0f}, p90 {r['delay_p90']:.0f} windows, never {r['never']:.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"engine": eng, "normal": rows, "args": vars(args)}, fh, indent=1)


if __name__ == "__main__":
    main()
